"""Who averages with whom: seeded random subgroups, identical on every worker with no messages.

Implements the group draw of NoLoCo (arXiv 2506.10911, docs/design.md §3.1): in a fixed world of ``W``
workers, round ``r`` draws a permutation of the ranks from a generator seeded with
``(run seed, r)`` and cuts it into consecutive groups of ``group_size``. Every worker computes the
same groups, and regrouping every round spreads information through the swarm like gossip.
"""

from __future__ import annotations

import hashlib

import torch


def round_seed(seed: int, round_index: int, purpose: str = "groups") -> int:
    """A 63-bit seed derived from ``(seed, round_index, purpose)``; stable across platforms."""
    digest = hashlib.blake2b(f"{purpose}:{seed}:{round_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def random_groups(world_size: int, group_size: int, seed: int, round_index: int) -> list[list[int]]:
    """Partition ``range(world_size)`` into groups of ``group_size`` for round ``round_index``.

    Raises ValueError if ``group_size`` does not divide ``world_size``. Members of each group are
    sorted ascending; groups are ordered by their smallest member.
    """
    if group_size < 1 or world_size < 1:
        raise ValueError(f"world_size and group_size must be >= 1 (got {world_size}, {group_size})")
    if world_size % group_size:
        raise ValueError(f"outer.group_size={group_size} does not divide workers={world_size}")
    generator = torch.Generator().manual_seed(round_seed(seed, round_index))
    perm = torch.randperm(world_size, generator=generator).tolist()
    groups = [sorted(perm[i : i + group_size]) for i in range(0, world_size, group_size)]
    return sorted(groups)


class GroupSchedule:
    """The group of each rank in each round, for a fixed world.

    ``group_size=None`` (or equal to the world size) means everyone, every round.
    """

    def __init__(self, world_size: int, group_size: int | None, seed: int):
        self.world_size = world_size
        self.group_size = world_size if group_size is None else group_size
        self.seed = seed
        if self.world_size % self.group_size:
            raise ValueError(f"outer.group_size={self.group_size} does not divide workers={world_size}")

    def groups(self, round_index: int) -> list[list[int]]:
        if self.group_size == self.world_size:
            return [list(range(self.world_size))]
        return random_groups(self.world_size, self.group_size, self.seed, round_index)

    def group_of(self, rank: int, round_index: int) -> list[int]:
        for group in self.groups(round_index):
            if rank in group:
                return group
        raise ValueError(f"rank {rank} is not in a world of {self.world_size}")
