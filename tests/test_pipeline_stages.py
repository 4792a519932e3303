"""The threaded pipeline against the synchronous path: same batches bit for bit,
bounded queues of any depth, and failures that stop both sides cleanly."""
import threading
import time

import pytest
import torch

from dflash_train.pipeline.batch import TrainBatch
from dflash_train.pipeline.stages import Pipeline, PipelineError, StageStats, synchronous_batches


class FakeSource:
    """A deterministic source: batch k's contents depend only on the data order."""

    device = torch.device("cpu")

    def __init__(self, fail_at: int | None = None, delay: float = 0.0):
        self.pos = 0
        self.fail_at = fail_at
        self.delay = delay

    def next_positions(self):
        positions = [self.pos, self.pos + 1]
        self.pos += 2
        return positions, {"position": self.pos}

    def make_batch(self, positions, state):
        if self.fail_at is not None and positions[0] // 2 == self.fail_at:
            raise ValueError("target exploded")
        if self.delay:
            time.sleep(self.delay)
        g = torch.Generator().manual_seed(positions[0])
        ids = torch.randint(0, 100, (2, 16), generator=g)
        feats = torch.randn(2, 16, 8, generator=g)
        return TrainBatch(ids, ids % 2 == 0, torch.zeros(2, 16, dtype=torch.int32), feats, positions, state)


def _same(a: TrainBatch, b: TrainBatch):
    assert a.positions == b.positions and a.order_state == b.order_state
    for x, y in [(a.input_ids, b.input_ids), (a.loss_mask, b.loss_mask), (a.features, b.features)]:
        assert torch.equal(x, y)


@pytest.mark.parametrize("depth,workers", [(1, 1), (60, 1), (3, 3)])
def test_pipeline_matches_sync_with_slow_consumer(depth, workers):
    ref = synchronous_batches(FakeSource(), 12)
    got = []
    with Pipeline(FakeSource(delay=0.001), depth, torch.device("cpu"), num_workers=workers, max_batches=12) as p:
        for b in p:
            time.sleep(0.01)  # a slow consumer: producers must block, never overwrite
            got.append(b)
    assert len(got) == 12
    for a, b in zip(ref, got):
        _same(a, b)


def _pipeline_threads():
    return [t for t in threading.enumerate() if t.name.startswith(("target-worker", "postprocess"))]


def test_producer_exception_reaches_consumer_and_threads_end():
    p = Pipeline(FakeSource(fail_at=3), 2, torch.device("cpu")).start()
    with pytest.raises(PipelineError, match="target exploded"):
        for _ in range(10):
            p.get()
    p.close()
    assert not _pipeline_threads()


def test_consumer_exception_stops_producers():
    p = Pipeline(FakeSource(), 1, torch.device("cpu"), num_workers=2).start()
    with pytest.raises(RuntimeError, match="trainer failed"):
        try:
            p.get()
            raise RuntimeError("trainer failed")
        finally:
            p.close()
    assert not _pipeline_threads()


def test_stage_stats_and_thread_names():
    stats = StageStats()
    with Pipeline(FakeSource(delay=0.002), 4, torch.device("cpu"), stats=stats, max_batches=5) as p:
        names = {t.name for t in _pipeline_threads()}
        assert {"target-worker-0", "postprocess-0"} <= names
        list(p)
    snap = stats.snapshot_and_reset()
    assert snap["target_busy"] > 0 and 0 <= snap["queue_occupancy"] <= 1
    assert "postprocess_busy" in snap and "trainer_wait" in snap


def test_a_stage_idle_for_a_whole_interval_is_reported_as_zero():
    # the target blocked on a full queue for an interval: its keys stay in the record (0.0),
    # so every metrics.jsonl line carries the same per-stage fields
    stats = StageStats()
    stats.add("target", busy=0.5)
    stats.add("trainer", busy=0.2, wait=0.1)
    first = stats.snapshot_and_reset()
    assert first["target_busy"] > 0 and first["trainer_wait"] > 0
    stats.add("trainer", busy=0.3)
    second = stats.snapshot_and_reset()
    assert second["target_busy"] == 0.0 and second["target_wait"] == 0.0 and second["trainer_busy"] > 0
