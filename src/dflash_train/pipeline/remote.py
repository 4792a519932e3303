"""Batches under torchrun: `trainer_pipeline` picks this rank's stream of batches (the in-process
pipeline of a single process or a colocated rank, or a split trainer's `RemotePipeline`), the
split layout's target ranks' serving loop (`serve_target_rank`), and the target a trainer loads.
Process groups and roles come from train/distributed.py's DistContext, passed in.

Wire protocol of the split layout (point-to-point on `ctx.wire_group`, a gloo group: host tensors,
so an NCCL world never sees them; the target's postprocess thread copies features to pinned host
memory off the target's path, and the trainer receives into pinned buffers that reach its GPU
with a non-blocking copy):
  trainer -> target  request: int64[2] = [cmd (1 next, 0 stop), n] + uint8[n] JSON
                     (the first request carries the data-order state to resume from)
  target -> trainer  header: int64[4] = [B, T, F, n] then input_ids int64[B,T],
                     loss_mask uint8[B,T], document_ids int32[B,T], features[B,T,F]
                     (target dtype), uint8[n] JSON {positions, order_state}
Rows have a fixed length, so every message has a known size. Each target rank keeps its own
data order over its rows (seed + 7919 * t). A tensor-parallel target group's leader broadcasts
each capture to its group and stop at the end (targets/sharded.py GroupLeaderTarget).
"""
from __future__ import annotations

import json
import logging
import queue
import signal
import threading
import time

import torch
import torch.distributed as dist

from dflash_train.data import DataOrder, RankSlice, load_prepared
from dflash_train.model.drafter import DrafterConfig
from dflash_train.model.objectives import Objective, capture_layer_ids
from dflash_train.pipeline.batch import TrainBatch
from dflash_train.pipeline.precomputed import PrecomputedBatchSource
from dflash_train.pipeline.source import TargetBatchSource
from dflash_train.pipeline.stages import Pipeline, PipelineError, StageStats
from dflash_train.targets import load_target
from dflash_train.targets.head_only import load_head_only_target
from dflash_train.targets.sharded import GroupLeaderTarget, follow_group_leader, load_sharded_target
from dflash_train.utils import resolve_device

log = logging.getLogger("dflash_train")


def capture_ids(cfg, layer_ids, target) -> list[int]:
    """The drafter's target layers, plus the final hidden state when the objective reads it."""
    return capture_layer_ids(layer_ids, target.num_layers, Objective.from_train_config(cfg.train))


def load_trainer_target(ctx, cfg, device: torch.device, tokenizer):
    """The target a trainer rank needs: the whole model where it captures (a single process or a
    colocated rank on an online source) or runs the in-training eval (speculative decoding needs
    the whole target); otherwise the embedding, lm_head and final norm only (a split layout's
    trainer, or precomputed features)."""
    offline = cfg.data.parsed_source.kind == "precomputed"
    captures = ctx.colocated and not offline
    if not captures and not (ctx.is_leader and cfg.eval.every_steps):
        return load_head_only_target(cfg.target, device, tokenizer)
    return load_target(cfg.target, device=device, tokenizer=tokenizer)


def trainer_pipeline(ctx, cfg, data, target, drafter_layer_ids, order_state: dict, device: torch.device):
    """The trainer's stream of batches: the in-process pipeline over `data` (pipeline/training_data.py:
    captured by `target`, or its precomputed features) - a colocated rank over its slice of every
    global batch -, or, in the split layout, its target rank's batches."""
    if ctx.colocated:
        order = DataOrder(len(data.rows[0]), cfg.train.seed)
        if ctx.distributed:
            order = RankSlice(order, ctx.trainer_index, ctx.num_trainers)
        if order_state:
            order.load_state_dict(order_state)
        if data.precomputed is not None:
            source = PrecomputedBatchSource(data.precomputed, order, cfg.train.batch_size, target.dtype)
        else:
            source = TargetBatchSource(data.rows, order, target, capture_ids(cfg, drafter_layer_ids, target),
                                       cfg.train.batch_size, cfg.pipeline.cache_features)
        return Pipeline(source, cfg.pipeline.queue_depth, device, num_workers=cfg.pipeline.num_target_workers).start()
    states = order_state.get("per_target") if order_state else None
    resume_state = states.get(str(ctx.target_for(ctx.trainer_index))) if states else None
    return RemotePipeline(ctx, device, target.dtype, resume_state).start()


def _send_bytes(obj, dst: int, cmd: int, group) -> None:
    data = json.dumps(obj).encode() if obj is not None else b""
    dist.send(torch.tensor([cmd, len(data)], dtype=torch.int64), dst, group=group)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, group=group)


def _recv_bytes(src: int, n: int, group):
    buf = torch.empty(n, dtype=torch.uint8)
    dist.recv(buf, src, group=group)
    return json.loads(bytes(buf.tolist()).decode())


class RemotePipeline:
    """Trainer-side stand-in for `Pipeline`: a thread requests batches from the target rank
    and keeps up to queue_depth of them ready, in pinned host memory when the trainer is on a GPU."""

    def __init__(self, ctx, device: torch.device, feature_dtype: torch.dtype, resume_state) -> None:
        self.ctx = ctx
        self.wire = ctx.wire_group
        self.src = ctx.leader_of(ctx.target_for(ctx.trainer_index))
        self.device = device
        self.pin = device.type == "cuda"
        self.feature_dtype = feature_dtype
        self.stats = StageStats()
        self.q: queue.Queue = queue.Queue(maxsize=ctx.cfg.pipeline.queue_depth)
        self._stop = threading.Event()
        self._resume_state = resume_state
        self._thread = threading.Thread(target=self._loop, name="postprocess-0", daemon=True)
        self._error: BaseException | None = None

    def start(self) -> "RemotePipeline":
        self._thread.start()
        return self

    def _recv(self, *shape, dtype) -> torch.Tensor:
        buf = torch.empty(*shape, dtype=dtype, pin_memory=self.pin)
        dist.recv(buf, self.src, group=self.wire)
        return buf

    def _loop(self) -> None:
        first = True
        try:
            while not self._stop.is_set():
                _send_bytes({"resume": self._resume_state} if first else None, self.src, 1, self.wire)
                first = False
                b, t, f, n = self._recv(4, dtype=torch.int64).tolist()
                ids = self._recv(b, t, dtype=torch.int64)
                mask = self._recv(b, t, dtype=torch.uint8)
                docs = self._recv(b, t, dtype=torch.int32)
                feats = self._recv(b, t, f, dtype=self.feature_dtype)
                meta = _recv_bytes(self.src, n, self.wire)
                batch = TrainBatch(ids, mask.bool(), docs, feats, meta["positions"], meta["order_state"])
                while not self._stop.is_set():
                    try:
                        self.q.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # noqa: BLE001
            self._error = e
        finally:
            try:
                _send_bytes(None, self.src, 0, self.wire)  # tell the target rank this trainer is done
            except Exception:  # noqa: BLE001
                pass

    def get(self) -> TrainBatch:
        t0 = time.perf_counter()
        while True:
            if self._error is not None:
                raise PipelineError(f"receiving from target rank {self.src} failed: {self._error!r}")
            try:
                batch = self.q.get(timeout=0.1)
                break
            except queue.Empty:
                continue
        self.stats.sample_queue(self.q.qsize(), self.q.maxsize)
        self.stats.add("trainer", wait=time.perf_counter() - t0)
        return batch

    def close(self) -> None:
        self._stop.set()
        try:
            while True:
                self.q.get_nowait()
        except queue.Empty:
            pass
        self._thread.join(timeout=60)


# ---------------------------------------------------------------------- target side


def serve_target_rank(cfg, ctx) -> int:
    """A target rank: run the in-process pipeline over this rank's rows and
    answer trainer requests round robin until every trainer said stop."""
    # shutdown is owned by the trainers: they agree on a step and tell us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    device = ctx.trainer_device(resolve_device(cfg.train.device))
    group = ctx.target_group  # None: this rank holds the whole target
    if group is None:
        target = load_target(cfg.target, device=device)
    else:
        target = load_sharded_target(cfg.target, group, ctx.target_self_group, device)
        leader = ctx.leader_of(ctx.rank // ctx.target_tp_size)
        if ctx.rank != leader:
            n = follow_group_leader(target, group, leader)
            log.info("target rank %d: %d captures for group leader %d, done", ctx.rank, n, leader)
            return 0
    layer_ids = DrafterConfig.from_target(cfg.model, target).target_layer_ids
    data = load_prepared(cfg, target.tokenizer, target.family)
    # the target (group) index and count: a group of target_tp_size ranks is ONE target here
    t, T = ctx.rank // ctx.target_tp_size, ctx.num_target_groups
    rows = tuple(x[t::T] for x in (data.input_ids, data.loss_mask, data.document_ids))
    my_trainers = [r for i, r in enumerate(ctx.trainer_ranks) if i % T == t]
    log.info("target rank %d: %d rows, serving trainer ranks %s", ctx.rank, len(rows[0]), my_trainers)

    # the first request of the first trainer carries the resume state
    wire = ctx.wire_group
    pending_first: dict[int, tuple[int, int]] = {}
    for r in my_trainers:
        hdr = torch.empty(2, dtype=torch.int64)
        dist.recv(hdr, r, group=wire)
        pending_first[r] = (int(hdr[0]), int(hdr[1]))
    first_n = pending_first[my_trainers[0]][1]
    first_meta = _recv_bytes(my_trainers[0], first_n, wire) if first_n else {}
    for r in my_trainers[1:]:
        if pending_first[r][1]:
            _recv_bytes(r, pending_first[r][1], wire)
    order = DataOrder(len(rows[0]), cfg.train.seed + 7919 * t)
    if first_meta.get("resume"):
        order.load_state_dict(first_meta["resume"])
    ids = capture_ids(cfg, layer_ids, target)
    if group is not None:
        target = GroupLeaderTarget(target, group, ctx.rank)
    source = TargetBatchSource(rows, order, target, ids, cfg.train.batch_size, cfg.pipeline.cache_features)
    # the queue holds batches on the host: the wire is gloo (pinned copies, pipeline/stages.py)
    pipe = Pipeline(source, cfg.pipeline.queue_depth, torch.device("cpu"),
                    num_workers=cfg.pipeline.num_target_workers).start()
    active = {r: pending_first[r][0] == 1 for r in my_trainers}
    first_round = True
    try:
        while any(active.values()):
            for r in my_trainers:
                if not active[r]:
                    continue
                if not first_round:
                    hdr = torch.empty(2, dtype=torch.int64)
                    dist.recv(hdr, r, group=wire)
                    if int(hdr[1]):
                        _recv_bytes(r, int(hdr[1]), wire)
                    if int(hdr[0]) == 0:
                        active[r] = False
                        continue
                batch = pipe.get()
                b, tt = batch.input_ids.shape
                meta = json.dumps({"positions": batch.positions, "order_state": batch.order_state}).encode()
                for part in (torch.tensor([b, tt, batch.features.shape[-1], len(meta)], dtype=torch.int64),
                             batch.input_ids, batch.loss_mask.to(torch.uint8), batch.document_ids.to(torch.int32),
                             batch.features, torch.frombuffer(bytearray(meta), dtype=torch.uint8)):
                    dist.send(part.contiguous(), r, group=wire)
            first_round = False
    finally:
        pipe.close()
        if group is not None:
            target.stop()  # the group's other ranks leave follow_group_leader
    log.info("target rank %d: all trainers done", ctx.rank)
    return 0
