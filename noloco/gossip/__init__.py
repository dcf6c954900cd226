"""Group formation: who averages with whom each round (DESIGN §2, §3.1)."""

from noloco.gossip.schedule import GroupSchedule, random_groups, round_seed

__all__ = ["GroupSchedule", "random_groups", "round_seed"]
