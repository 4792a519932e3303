"""DataOrder: deterministic per-epoch permutations, resumable state."""
from __future__ import annotations

import pytest

from dflash_train.data import DataOrder


def test_epochs_are_permutations_and_deterministic():
    a, b = DataOrder(10, seed=3), DataOrder(10, seed=3)
    pa = a.rows_for(a.next_positions(30))
    assert pa == b.rows_for(b.next_positions(30))
    for e in range(3):
        assert sorted(pa[e * 10:(e + 1) * 10]) == list(range(10))
    assert pa[:10] != pa[10:20]  # a new order every epoch
    c = DataOrder(10, seed=4)
    assert c.rows_for(c.next_positions(10)) != pa[:10]


@pytest.mark.parametrize("stop", [0, 3, 10, 17, 29])
def test_resume_gives_the_same_next_items(stop):
    full = DataOrder(7, seed=11)
    ref = full.rows_for(full.next_positions(35))
    a = DataOrder(7, seed=11)
    got = a.rows_for(a.next_positions(stop))
    state = a.state_dict()
    assert set(state) == {"seed", "epoch", "position", "num_rows"}
    assert state["epoch"] == stop // 7 and state["position"] == stop % 7
    b = DataOrder(7, seed=0)
    b.load_state_dict(dict(state))
    pos = b.next_positions(35 - stop)
    assert pos[0] == stop
    assert got + b.rows_for(pos) == ref


def test_positions_cross_epochs_and_rows_for_any_position():
    o = DataOrder(4, seed=0)
    assert o.next_positions(3) == [0, 1, 2]
    assert o.next_positions(3) == [3, 4, 5]
    assert o.epoch == 1 and o.position == 6
    # rows_for works for any position (e.g. batches produced earlier)
    assert o.rows_for([0, 1, 2, 3]) == o.permutation(0)
    assert o.rows_for([5])[0] == o.permutation(1)[1]


def test_state_for_other_dataset_is_rejected():
    o = DataOrder(5)
    with pytest.raises(ValueError, match="rows"):
        o.load_state_dict({"seed": 0, "epoch": 0, "position": 1, "num_rows": 6})
    with pytest.raises(ValueError):
        DataOrder(0)
