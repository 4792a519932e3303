"""Which layout for which target and GPU (`pipeline.layout`): the rule, from measured stage rates.

Per GPU: the target alone captures `target` tok/s, the trainer alone trains `trainer` tok/s, and
one GPU doing both (a colocated rank) `colocated` tok/s. On a node of G GPUs:
  colocated: G * colocated                      (needs the target + a drafter replica per GPU)
  split:     max over t of min(t * target, (G - t) * trainer)   (t target ranks feed G - t trainers)
Our H200 figures at the 8B shape (docs/benchmarks.md "GPU"): target 28,369, trainer 13,181, both
11,234 -> colocated 89.9K, best split 3 target + 5 trainer ranks = min(85.1K, 65.9K) = 65.9K tok/s. The trainer logs the rule with its own
measured rates once (`advice`), and refuses at start-up what cannot run (`check_layout`).
"""
from __future__ import annotations

from dataclasses import dataclass

from dflash_train.config import ConfigError

ADAMW_BYTES_PER_PARAM = 16  # fp32 weights + fp32 gradients + AdamW's two fp32 moments


@dataclass(frozen=True)
class StageRates:
    target: float     # tok/s of the target's capture alone on one GPU
    trainer: float    # tok/s of the drafter's training step alone on one GPU
    colocated: float  # tok/s of one GPU running both

    def node(self, gpus: int) -> dict[str, float | int]:
        """Expected tok/s of a node of `gpus` GPUs in each layout (the module doc's rule)."""
        best_t, best = 0, 0.0
        for t in range(1, gpus):
            tok = min(t * self.target, (gpus - t) * self.trainer)
            if tok > best:
                best_t, best = t, tok
        return {"colocated": gpus * self.colocated, "split": best, "split_target_ranks": best_t}

    def describe(self, gpus: int) -> str:
        n = self.node(gpus)
        faster = "colocated" if n["colocated"] >= n["split"] else "split"
        return (f"per GPU target {self.target:,.0f}, trainer {self.trainer:,.0f}, both {self.colocated:,.0f} tok/s; "
                f"{gpus} GPUs: colocated ~{n['colocated']:,.0f} tok/s, best split {n['split_target_ranks']} target + "
                f"{gpus - n['split_target_ranks']} trainer ranks ~{n['split']:,.0f} tok/s: {faster} is faster")


def rates_from_interval(tokens_per_s: float, target_busy: float, trainer_busy: float) -> StageRates | None:
    """A colocated rank's rates from one logging interval: it trained `tokens_per_s`, its stages busy these
    fractions of the interval (StageStats). Each stage alone is at least as fast as its share here."""
    if tokens_per_s <= 0 or target_busy <= 0 or trainer_busy <= 0:
        return None
    return StageRates(tokens_per_s / target_busy, tokens_per_s / trainer_busy, tokens_per_s)


def check_layout(cfg, world_size: int) -> None:
    """Start-up refusals, one line each, before anything loads: what would otherwise fail later."""
    p, t = cfg.pipeline, cfg.train
    sharded = world_size > 1 and t.sharding == "fsdp2" and (
        p.layout == "colocated" or world_size - p.target_ranks > 1)
    if sharded and cfg.eval.every_steps:
        # the leader alone would run the sharded drafter's forward: its collectives would hang
        raise ConfigError("eval.every_steps with train.sharding=fsdp2 is not supported: set eval.every_steps=0 and "
                          "run `dflash-train eval` on the checkpoints, or train.sharding=ddp")


def memory_line(ctx, target_bytes: int, drafter_params: int) -> str:
    """The start-up line of what each rank holds (the rates' half of the rule follows at the second
    logging interval, `advice`)."""
    where = (f"colocated on {ctx.world_size} rank(s): each holds" if ctx.colocated and ctx.distributed
             else "split: each trainer holds" if not ctx.colocated else "one process holds")
    return (f"layout {where} the target's {target_bytes / 1e6:,.1f} MB of weights and a drafter of "
            f"{drafter_params / 1e6:,.2f}M params, {drafter_params * ADAMW_BYTES_PER_PARAM / 1e6:,.1f} MB with its "
            "gradients and AdamW state")


def check_memory(free_bytes: int, drafter_params: int, device: str) -> None:
    """The drafter's weights, gradients and AdamW state must fit beside what is already on the GPU
    (the target, loaded first); activations come on top (train.activation_checkpointing bounds them)."""
    need = drafter_params * ADAMW_BYTES_PER_PARAM
    if need > free_bytes:
        raise ConfigError(f"{device}: the drafter's {drafter_params / 1e9:.2f}B parameters need "
                          f"{need / 2**30:.1f} GiB (weights, gradients, AdamW) but {free_bytes / 2**30:.1f} GiB are "
                          "free after the target: use train.sharding=fsdp2, pipeline.layout=split or fewer "
                          "model.num_layers")


def advice(rec: dict, colocated: bool, num_trainers: int, node_gpus: int) -> str | None:
    """One log line from a logging interval's record (metrics.jsonl: tokens_per_s over every trainer
    rank, the stages' busy / wait fractions): the rule with this run's rates, or a starving split."""
    if colocated:
        rates = rates_from_interval(rec["tokens_per_s"] / max(num_trainers, 1), rec.get("target_busy", 0.0),
                                    rec.get("trainer_busy", 0.0))
        return f"layout colocated, measured {rates.describe(node_gpus)}" if rates else None
    wait = rec.get("trainer_wait", 0.0)
    if wait > 0.5:
        return (f"layout split: the trainers waited {wait:.0%} of the time for batches: the target ranks cannot "
                "feed them; raise pipeline.target_ranks, or pipeline.layout=colocated if the target fits beside "
                "the drafter")
    return None
