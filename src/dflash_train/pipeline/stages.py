"""Target workers -> post-process -> bounded queue -> trainer.

One process, threads with names that `top -H` and py-spy show:
  target-worker-N  runs the frozen target on packed rows (capture only)
  postprocess-0    puts batches in order, moves them to the trainer's device
                   (pinned host buffers / its own CUDA stream), enqueues them
  trainer          the caller of `Pipeline.get()`

Tensor lifetimes across threads and streams are correct by construction: a
batch is never reused after it is handed on (every batch owns fresh tensors),
and on CUDA the consumer waits on an event recorded after the producer's
kernels, with `record_stream` telling the caching allocator who still reads.

Errors travel both ways: a producer exception is re-raised in the consumer's
`get()`; `close()` (called by the consumer on any exit) stops and joins every
thread, so nothing hangs and no thread is orphaned.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from dflash_train.pipeline.batch import TrainBatch


class BatchSource(Protocol):
    """What the pipeline pulls from: the data order + the target."""

    def next_positions(self) -> tuple[list[int], dict]:
        """Advance the data order by one batch: (positions, order state after them)."""

    def make_batch(self, positions: list[int], order_state: dict) -> TrainBatch:
        """Rows for `positions` with captured target features (on the target device)."""


class StageStats:
    """Busy / wait seconds per stage and queue occupancy samples; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # every stage seen so far: an interval in which a stage did nothing (the target blocked on a
        # full queue) reports it as 0.0, so each record carries the same keys
        self._stages: set[str] = set()
        self.reset()

    def reset(self) -> None:
        with getattr(self, "_lock", threading.Lock()):
            self.busy: dict[str, float] = {}
            self.wait: dict[str, float] = {}
            self.occupancy_sum = 0.0
            self.occupancy_n = 0
            self.started = time.perf_counter()

    def add(self, stage: str, busy: float = 0.0, wait: float = 0.0) -> None:
        with self._lock:
            self._stages.add(stage)
            self.busy[stage] = self.busy.get(stage, 0.0) + busy
            self.wait[stage] = self.wait.get(stage, 0.0) + wait

    def sample_queue(self, size: int, depth: int) -> None:
        with self._lock:
            self.occupancy_sum += size / max(depth, 1)
            self.occupancy_n += 1

    def snapshot_and_reset(self) -> dict[str, float]:
        """Fractions of wall time since the last snapshot, per stage."""
        with self._lock:
            wall = max(time.perf_counter() - self.started, 1e-9)
            out: dict[str, float] = {}
            for stage in sorted(self._stages | set(self.busy) | set(self.wait)):
                out[f"{stage}_busy"] = self.busy.get(stage, 0.0) / wall
                out[f"{stage}_wait"] = self.wait.get(stage, 0.0) / wall
            out["queue_occupancy"] = self.occupancy_sum / self.occupancy_n if self.occupancy_n else 0.0
        self.reset()
        return out


def name_os_thread(name: str) -> None:
    """Give the calling thread its name at the OS level too, so `top -H` shows
    target-worker-N / postprocess-N (Python names alone only reach py-spy)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


class _Failure:
    def __init__(self, exc: BaseException, where: str) -> None:
        self.exc, self.where = exc, where


class PipelineError(RuntimeError):
    pass


@dataclass
class _Raw:
    seq: int
    batch: TrainBatch
    ready: "torch.cuda.Event | None"


class Pipeline:
    """Bounded, ordered producer/consumer pipeline over a `BatchSource`."""

    def __init__(
        self,
        source: BatchSource,
        queue_depth: int,
        trainer_device: torch.device,
        num_workers: int = 1,
        stats: StageStats | None = None,
        max_batches: int | None = None,
    ) -> None:
        self.source = source
        self.depth = queue_depth
        self.trainer_device = trainer_device
        self.stats = stats or StageStats()
        self.max_batches = max_batches
        self.out: queue.Queue = queue.Queue(maxsize=queue_depth)
        # worker -> postprocess handoff: small, so workers never run far ahead of the queue
        self._raw: queue.Queue = queue.Queue(maxsize=max(2, num_workers + 1))
        self._stop = threading.Event()
        self._order_lock = threading.Lock()
        self._next_seq = 0
        self._workers_left = num_workers
        self._workers_lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._worker_loop, name=f"target-worker-{i}", daemon=True)
            for i in range(num_workers)
        ]
        self._threads.append(threading.Thread(target=self._post_loop, name="postprocess-0", daemon=True))
        self._started = False

    # -------------------------------------------------------------- lifecycle
    def start(self) -> "Pipeline":
        for t in self._threads:
            t.start()
        self._started = True
        return self

    def close(self, timeout: float = 30.0) -> None:
        self._stop.set()
        # unblock producers waiting on full queues
        for q in (self.out, self._raw):
            try:
                while True:
                    q.get_nowait()
            except queue.Empty:
                pass
        for t in self._threads:
            if t.is_alive():
                t.join(timeout)

    def __enter__(self) -> "Pipeline":
        return self.start() if not self._started else self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------------- consumer
    def get(self, timeout: float | None = None) -> TrainBatch:
        t0 = time.perf_counter()
        self.stats.sample_queue(self.out.qsize(), self.depth)
        while True:
            try:
                item = self.out.get(timeout=0.1 if timeout is None else timeout)
                break
            except queue.Empty:
                if timeout is not None:
                    raise PipelineError("timed out waiting for a batch") from None
                if not any(t.is_alive() for t in self._threads) and self.out.empty():
                    raise PipelineError("pipeline threads exited without delivering a batch")
        self.stats.add("trainer", wait=time.perf_counter() - t0)
        if isinstance(item, _Failure):
            self._stop.set()
            raise PipelineError(f"{item.where} failed: {item.exc!r}") from item.exc
        if item is None:
            raise StopIteration
        batch, ready = item
        if ready is not None:  # CUDA: make the trainer's stream wait for the copy
            torch.cuda.current_stream(self.trainer_device).wait_event(ready)
            for t in (batch.input_ids, batch.loss_mask, batch.document_ids, batch.features):
                t.record_stream(torch.cuda.current_stream(self.trainer_device))
        return batch

    def __iter__(self):
        while True:
            try:
                yield self.get()
            except StopIteration:
                return

    # -------------------------------------------------------------- producers
    def _put(self, q: queue.Queue, item) -> bool:
        while not self._stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _source_device(self) -> torch.device:
        """Where the source's batches appear (a test's source may not say: the host)."""
        dev = getattr(self.source, "device", None)
        return dev if isinstance(dev, torch.device) else torch.device("cpu")

    def _worker_loop(self) -> None:
        name = threading.current_thread().name
        name_os_thread(name)
        stream = None
        try:
            src_dev = self._source_device()
            if src_dev.type == "cuda":
                stream = torch.cuda.Stream(src_dev)
            while not self._stop.is_set():
                t0 = time.perf_counter()
                with self._order_lock:  # sequence numbers follow the data order exactly
                    if self.max_batches is not None and self._next_seq >= self.max_batches:
                        break
                    seq = self._next_seq
                    positions, state = self.source.next_positions()
                    self._next_seq += 1
                t1 = time.perf_counter()
                if stream is not None:
                    with torch.cuda.stream(stream):
                        batch = self.source.make_batch(positions, state)
                        ready = torch.cuda.Event()
                        ready.record(stream)
                else:
                    batch, ready = self.source.make_batch(positions, state), None
                t2 = time.perf_counter()
                self.stats.add("target", busy=t2 - t1, wait=t1 - t0)
                if not self._put(self._raw, _Raw(seq, batch, ready)):
                    return
                self.stats.add("target", wait=time.perf_counter() - t2)
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            self._put(self._raw, _Failure(e, name))
            return
        finally:
            with self._workers_lock:
                self._workers_left -= 1
                last = self._workers_left == 0
            if last:
                self._put(self._raw, None)

    def _post_loop(self) -> None:
        name_os_thread(threading.current_thread().name)
        pending: dict[int, _Raw] = {}
        want = 0
        copy_stream = None
        for dev in (self.trainer_device, self._source_device()):
            if dev.type == "cuda":
                copy_stream = torch.cuda.Stream(dev)
                break
        try:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    item = self._raw.get(timeout=0.1)
                except queue.Empty:
                    continue
                t1 = time.perf_counter()
                if isinstance(item, _Failure):
                    self._put(self.out, item)
                    return
                if item is None:
                    self._put(self.out, None)
                    return
                pending[item.seq] = item
                while want in pending:  # deliver in data order whatever worker finished first
                    raw = pending.pop(want)
                    want += 1
                    out = self._to_trainer(raw, copy_stream)
                    t2 = time.perf_counter()
                    self.stats.add("postprocess", busy=t2 - t1, wait=t1 - t0)
                    if not self._put(self.out, out):
                        return
                    self.stats.add("postprocess", wait=time.perf_counter() - t2)
                    t0 = t1 = time.perf_counter()
        except BaseException as e:  # noqa: BLE001
            self._put(self.out, _Failure(e, "postprocess-0"))

    def _to_trainer(self, raw: _Raw, copy_stream) -> tuple[TrainBatch, "torch.cuda.Event | None"]:
        batch = raw.batch
        src = batch.features.device
        dst = self.trainer_device
        if src == dst and raw.ready is None:
            return batch, None
        if dst.type == "cuda":
            with torch.cuda.stream(copy_stream):
                if raw.ready is not None:
                    copy_stream.wait_event(raw.ready)
                moved = _move(batch, dst, pin=src.type == "cpu")
                # the source's CUDA tensors are read on the copy stream (ids may stay on the host)
                for t in (batch.input_ids, batch.loss_mask, batch.document_ids, batch.features):
                    if t.is_cuda:
                        t.record_stream(copy_stream)
                ready = torch.cuda.Event()
                ready.record(copy_stream)
            return moved, ready
        # trainer (or the split layout's gloo wire) on the host: the device-to-host copy, into pinned
        # memory, finished on this thread (off the target's path) before anyone reads the batch
        if raw.ready is not None:
            raw.ready.synchronize()
        if src.type != "cuda":
            return _move(batch, dst, pin=False), None
        with torch.cuda.stream(copy_stream):
            moved = _move(batch, dst, pin=True)
        copy_stream.synchronize()
        return moved, None


def _move(batch: TrainBatch, device: torch.device, pin: bool) -> TrainBatch:
    """`pin`: host tensors go through pinned memory (host to device), or land in it (device to host)."""
    def mv(t: torch.Tensor) -> torch.Tensor:
        if pin and t.is_cuda and device.type == "cpu":
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return out.copy_(t, non_blocking=True)
        if pin and t.device.type == "cpu":
            t = t.pin_memory()
        return t.to(device, non_blocking=True)

    return TrainBatch(mv(batch.input_ids), mv(batch.loss_mask), mv(batch.document_ids), mv(batch.features),
                      list(batch.positions), dict(batch.order_state))


def synchronous_batches(source: BatchSource, n: int) -> list[TrainBatch]:
    """The reference path the pipeline must match bit for bit."""
    out = []
    for _ in range(n):
        positions, state = source.next_positions()
        out.append(source.make_batch(positions, state))
    return out

