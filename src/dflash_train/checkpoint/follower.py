"""The checkpoints of a trainer rank other than the leader: it takes part in the collectives of a
save (train/state.py gathers under FSDP2) but writes nothing."""
from __future__ import annotations


class FollowerCheckpoints:
    last_committed_step = None
    last_stats = None

    def save(self, *a, **k) -> None:
        pass

    def wait(self, *a, **k) -> bool:
        return True

    def raise_failure(self) -> None:
        pass

    def abandon(self, *a, **k) -> None:
        pass

    def mark_best(self, step: int) -> None:
        pass
