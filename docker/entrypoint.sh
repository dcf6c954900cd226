#!/bin/sh
# Container entry point: every check and the final exec are in noloco/fleet/entrypoint.py
# (role from NOLOCO_ROLE=bootstrap|worker; see docs/docker.md). Exits 2 with one line on a bad variable.
set -eu
exec python -m noloco.fleet.entrypoint "$@"
