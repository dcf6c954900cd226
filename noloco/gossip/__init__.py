"""Group formation: who averages with whom each round (DESIGN §2, §3.1)."""

from noloco.gossip.base import Group, GroupSource, ScheduledGroups
from noloco.gossip.schedule import GroupSchedule, random_groups, round_seed

__all__ = ["Group", "GroupSchedule", "GroupSource", "ScheduledGroups", "random_groups", "round_seed"]
