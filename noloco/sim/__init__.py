"""Simulation at scale: N ≫ machines (docs/design.md §2, §10; docs/sim.md).

``stacked.py``: N workers of a small model stepped together in one process (``torch.func`` vmap over a
worker dimension) with the library's own outer rules and seeded groups; ``consensus.py``: the study of
held-out loss and consensus distance against outer rounds for NoLoCo and DiLoCo, and the pure random-group
averaging model; ``wan.py``: a WAN time model of sync time and idle fraction built on
:mod:`noloco.fleet.linkmodel`. ``python -m noloco.sim consensus|time`` runs the studies.
"""
