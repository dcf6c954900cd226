"""Groups: the members one outer round averages with, and the transport that reaches them.

A :class:`GroupSource` forms the group of a round. In a fixed world (in-process fabric,
torch.distributed) :class:`ScheduledGroups` reads it off a seeded :class:`GroupSchedule` with no
messages. In an open swarm a matchmaking source forms groups among the peers that are ready and
hands back a transport whose ranks are the group's members. Either way the outer optimizer runs the
same :func:`noloco.collectives.allreduce` over ``group.transport`` and ``group.members``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from noloco.comm.base import ByteCounter, Transport
from noloco.gossip.schedule import GroupSchedule


@dataclass
class Group:
    """One round's group, seen from one member.

    Attributes:
        transport: reaches every member; ``transport.rank`` is this member.
        members: ranks (in ``transport``) taking part, identical and identically ordered on every member.
        round: the outer round this group was formed for.
        peer_ids: optional stable identities of the members (e.g. swarm peer IDs), for logging.
    """

    transport: Transport
    members: list[int]
    round: int
    peer_ids: list[str] = field(default_factory=list)


class GroupSource(ABC):
    """Forms each round's group. ``counter`` counts every byte this member moved for the exchange."""

    counter: ByteCounter

    @abstractmethod
    def form(self, round_index: int, timeout: float) -> Group | None:
        """The group of ``round_index``, or ``None`` when no partner could be found in ``timeout`` s."""

    def release(self, group: Group) -> None:  # noqa: B027 - optional hook
        """Called once the round's exchange is over (successful or not)."""

    def why_none(self, round_index: int) -> str:
        """Why :meth:`form` of ``round_index`` gave ``None``, in a few words (the metrics line's ``outer_skipped``)."""
        del round_index
        return "no partner"

    def retry(self, group: Group, error: BaseException) -> Group | None:
        """After ``group``'s exchange failed with ``error``: a group of the members that delivered, identical on
        each of them, to run the round's exchange again (released like any group), or ``None`` to skip the round
        (the default)."""
        del group, error
        return None


class ScheduledGroups(GroupSource):
    """Groups of a fixed world, drawn from a seeded schedule: every member computes the same ones."""

    def __init__(self, transport: Transport, group_size: int | None, seed: int):
        self.transport = transport
        self.schedule = GroupSchedule(transport.world_size, group_size, seed)
        self.counter = transport.counter

    def form(self, round_index: int, timeout: float) -> Group:
        return Group(self.transport, self.schedule.group_of(self.transport.rank, round_index), round_index)
