"""Group formation: who averages with whom each round (DESIGN §2, §3.1)."""

from noloco.gossip.base import Group, GroupSource, ScheduledGroups
from noloco.gossip.matchmaking import PeerRegistry, SwarmMatchmaking
from noloco.gossip.schedule import GroupSchedule, random_groups, round_seed

__all__ = [
    "Group",
    "GroupSchedule",
    "GroupSource",
    "PeerRegistry",
    "ScheduledGroups",
    "SwarmMatchmaking",
    "random_groups",
    "round_seed",
]
