"""Throttled multi-host fleets on one machine (docs/design.md §5) and a link model for users without root.

* :mod:`noloco.fleet.netns` — namespaces, a bridge, veth links, ``tc tbf`` shaping (egress and, via
  an ifb, ingress), cleanup by name prefix.
* :mod:`noloco.fleet.launcher` — ``noloco-fleet``: one worker per namespace, logs, teardown.
* :mod:`noloco.fleet.linkmodel` — a token-bucket model of the same links that predicts a run's
  communication time from the bytes its metrics record.
"""

from noloco.fleet.netns import Fleet, FleetError, parse_duration, parse_rate

__all__ = ["Fleet", "FleetError", "parse_duration", "parse_rate"]
