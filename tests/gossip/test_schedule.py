import pytest

from noloco.gossip import GroupSchedule, random_groups


@pytest.mark.parametrize("world,size", [(4, 2), (8, 2), (8, 4), (6, 3), (16, 2)])
def test_every_rank_lands_in_exactly_one_group_per_round(world, size):
    for r in range(20):
        groups = random_groups(world, size, seed=0, round_index=r)
        members = sorted(m for g in groups for m in g)
        assert members == list(range(world))
        assert all(len(g) == size for g in groups)


def test_groups_change_between_rounds_and_repeat_for_same_seed():
    rounds = [tuple(map(tuple, random_groups(8, 2, seed=3, round_index=r))) for r in range(30)]
    assert len(set(rounds)) > 10
    assert rounds == [tuple(map(tuple, random_groups(8, 2, seed=3, round_index=r))) for r in range(30)]
    assert rounds != [tuple(map(tuple, random_groups(8, 2, seed=4, round_index=r))) for r in range(30)]


def test_every_worker_computes_the_same_groups():
    schedules = [GroupSchedule(8, 2, seed=11) for _ in range(8)]
    for r in range(10):
        seen = {tuple(s.group_of(rank, r)) for rank, s in enumerate(schedules)}
        assert sorted(m for g in seen for m in g) == list(range(8))


def test_everyone_meets_everyone_eventually():
    pairs = {tuple(g) for r in range(200) for g in random_groups(6, 2, seed=0, round_index=r)}
    assert len(pairs) == 15


def test_group_size_must_divide_world():
    with pytest.raises(ValueError, match="does not divide"):
        GroupSchedule(6, 4, seed=0)


def test_full_group_is_everyone():
    assert GroupSchedule(5, None, seed=0).group_of(3, 7) == [0, 1, 2, 3, 4]
