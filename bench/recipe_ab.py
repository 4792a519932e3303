"""A/B of drafter recipes on one base config, scored by greedy acceptance on held-out prompts.

    .venv/bin/python bench/recipe_ab.py --config configs/cpu-demo.yaml \
        --regenerated runs/cpu-demo/regenerated.jsonl \
        --variant base: --variant 2-layers:model.num_layers=2 \
        --out bench/results/recipe_ab.json

Each variant is a real `dflash-train train` run (subprocess, fresh run dir, the
base config plus its `section.key=value` overrides). It is then scored on:

* the demo's held-out prompts (same `pick_eval_prompts`, `--num-prompts`,
  `--max-new-tokens`): tau of greedy speculative decoding, computed by replay
  (eval/replay.py: drafts from one training-path forward, walked along the
  target's greedy output; tests/test_eval_replay.py holds it equal to real
  speculative decoding). The target's greedy outputs are decoded once and
  cached next to --out;
* the first `--num-prompts` training answers (regenerated file): the same, which
  separates memorisation from learning;
* prompt lookup (n = 3..1, k = block_size - 1 draft tokens) on the same outputs.

Replay skips the verify forwards, so a variant costs its training time plus a few
seconds. Confirm a winner with `dflash-train eval` (real decoding, wall-clock).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from dflash_train.config import load_config
from dflash_train.data import load_prepared
from dflash_train.data.sources import read_conversations
from dflash_train.eval.prompts import encode_prompts
from dflash_train.eval.ngram import propose
from dflash_train.eval.replay import replay_acceptance, walk_acceptance
from dflash_train.eval.prompts import pick_eval_prompts
from dflash_train.eval.specdec import plain_generate
from dflash_train.export import resolve_drafter_source
from dflash_train.model.dflash2 import build_drafter
from dflash_train.targets import load_target


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def greedy_outputs(target, prompts, max_new_tokens, cache: Path) -> list[tuple[list[int], int]]:
    """(prompt + greedy new tokens, prompt length) per prompt; cached by prompt text and length."""
    key = hashlib.sha256(json.dumps([prompts, max_new_tokens]).encode()).hexdigest()[:16]
    f = cache / f"greedy-{key}.json"
    if f.exists():
        return [tuple(x) for x in json.loads(f.read_text())]
    ids, stops = encode_prompts(target, prompts)
    out = []
    for p in ids:
        seq = plain_generate(target, torch.tensor([p]), max_new_tokens, stops)[0].tolist()
        out.append((seq, len(p)))
    f.write_text(json.dumps(out))
    return out


def training_outputs(tokenizer_target, regenerated: Path, n: int) -> list[tuple[list[int], int]]:
    """The first n regenerated conversations as (prompt + answer ids, prompt length)."""
    convs, _ = read_conversations(f"jsonl:{regenerated}", n)
    convs = convs[:n]
    ids, _ = encode_prompts(tokenizer_target, [c.prompt for c in convs])
    out = []
    for c, p in zip(convs, ids):
        answer = tokenizer_target.tokenizer(c.reference, add_special_tokens=False).input_ids
        out.append((p + answer, len(p)))
    return out


def ngram_tau(outputs, k: int) -> float:
    acc = []
    for seq, n in outputs:
        acc += walk_acceptance(seq, n, lambda s, seq=seq: propose(seq[: s + 1], k))
    return mean(acc)


def drafter_tau(drafter, target, outputs) -> float:
    acc = []
    for seq, n in outputs:
        acc += replay_acceptance(drafter, target, seq, n)
    return mean(acc)


def train_variant(config: Path, regenerated: Path, run_dir: Path, overrides: list[str]) -> dict:
    cmd = [str(Path(sys.executable).parent / "dflash-train"), "train", "--config", str(config), "--run-dir", str(run_dir),
           "--resume", "never", f"data.regenerated={regenerated}", *overrides]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=dict(os.environ))
    wall = time.perf_counter() - t0
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in recs if "loss" in r]
    last = steps[-1] if steps else {}
    return {"wall_s": wall, "steps": last.get("step"), "train_s": (last["time"] - steps[0]["time"]) if steps else None,
            "tok_s": mean([r["tokens_per_s"] for r in steps[len(steps) // 2:]]) if steps else None,
            "expected_tau_train": last.get("expected_tau"),
            "acc": {k: round(v, 3) for k, v in last.items() if k.startswith("acc_")},
            # DFlash 2 runs: the selector's training metrics of the last logged step
            "selector": {k: round(v, 3) for k, v in last.items() if k.startswith(("selector_", "argmax_path"))}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--regenerated", type=Path, required=True)
    ap.add_argument("--variant", action="append", required=True, help="NAME:key=val,key=val (NAME: = base)")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=Path, default=Path("runs/recipe-ab"))
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    cfg = load_config(a.config, [])
    target = load_target(cfg.target)
    base = load_prepared(cfg, target.tokenizer, target.family)
    prompts = pick_eval_prompts(base.heldout, a.num_prompts, target, cfg.data.max_tokens)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    held = greedy_outputs(target, prompts, a.max_new_tokens, a.out.parent)
    seen = training_outputs(target, a.regenerated, a.num_prompts)
    results = json.loads(a.out.read_text()) if a.out.exists() else {}
    for spec in a.variant:
        name, _, ov = spec.partition(":")
        overrides = [x for x in ov.split(",") if x]
        run_dir = a.runs / name
        row = train_variant(a.config, a.regenerated, run_dir, overrides)
        src = resolve_drafter_source(run_dir)
        drafter = build_drafter(src.config)
        drafter.load_state_dict(src.state_dict)
        drafter.eval()
        k = int(src.config.block_size) - 1
        row.update(overrides=overrides, tau_heldout=drafter_tau(drafter, target, held),
                   tau_ngram_heldout=ngram_tau(held, k), tau_train_answers=drafter_tau(drafter, target, seen),
                   tau_ngram_train_answers=ngram_tau(seen, k), num_prompts=len(held))
        results[name] = row
        a.out.write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps({name: row}), flush=True)
    print(f"\n{'variant':<22}{'steps':>6}{'train s':>9}{'tok/s':>8}{'tau held-out':>14}{'ngram':>7}"
          f"{'tau train ans':>15}{'ngram':>7}")
    for name, r in results.items():
        print(f"{name:<22}{r['steps'] or 0:>6}{r['wall_s']:>9.0f}{(r['tok_s'] or 0):>8.0f}{r['tau_heldout']:>14.2f}"
              f"{r['tau_ngram_heldout']:>7.2f}{r['tau_train_answers']:>15.2f}{r['tau_ngram_train_answers']:>7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
