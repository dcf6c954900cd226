"""Group formation: who averages with whom each round (docs/design.md §2, §3.1).

Transport-agnostic: :class:`GroupSource` is the interface, :class:`ScheduledGroups` the seeded
schedule of a fixed world. Open-swarm matchmaking implements the same interface in
:mod:`noloco.swarm.matchmaking`.
"""

from noloco.gossip.base import Group, GroupSource, ScheduledGroups
from noloco.gossip.schedule import GroupSchedule, random_groups, round_seed

__all__ = [
    "Group",
    "GroupSchedule",
    "GroupSource",
    "ScheduledGroups",
    "random_groups",
    "round_seed",
]
