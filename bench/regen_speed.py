"""Regeneration speed (`dflash-train regenerate`'s batched greedy generation) on the embedded target.

    .venv/bin/python bench/regen_speed.py --prompts 32 --new-tokens 32 --batch 16
    DFLASH_TRAIN_PACKED_LM_HEAD=0 .venv/bin/python bench/regen_speed.py ...   # the plain F.linear head

Prints tokens/s and writes the answers to --out so two runs can be compared token for token.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from dflash_train.config import load_config
from dflash_train.data.regenerate import generate_answers
from dflash_train.data.sources import read_conversations
from dflash_train.data.template import ChatFormat
from dflash_train.targets import load_target


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/cpu-demo.yaml")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = load_config(a.config, [])
    target = load_target(cfg.target)
    fmt = ChatFormat(target.tokenizer, target.family)
    convs, _ = read_conversations(cfg.data.source, 8 * a.prompts)
    prompts = []
    for c in convs:
        first = [m for m in c.messages if m["role"] == "user"][:1]
        if first and len(ids := fmt.prompt_ids(first)) < cfg.data.max_tokens:
            prompts.append(ids)
    prompts = sorted(prompts, key=len)[: a.prompts]  # as regenerate does: similar lengths per batch
    t0 = time.perf_counter()
    answers = []
    for b in range(0, len(prompts), a.batch):
        answers += [new for new, _ in generate_answers(target, fmt, prompts[b:b + a.batch], a.new_tokens, 0.0)]
    dt = time.perf_counter() - t0
    n = sum(map(len, answers))
    print(f"{len(prompts)} prompts, batch {a.batch}: {n} new tokens in {dt:.1f} s = {n / dt:.1f} tok/s")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(answers, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
