"""DFlash + lookup in vLLM (issue 46): which plugin mode, and which gate threshold, serves best.

Serves one export with `serve-bench`'s machinery (engine/serve_bench.py): plain vLLM, vLLM's n-gram,
DFlash alone, seeded blocks (`dflash+lookup:seed`), and the gate (`dflash+lookup:gate@N`) and seeds +
gate (`dflash+lookup:seed+gate@N`) at every threshold N asked for, one engine start each, on the
export's run's held-out prompts (or a prompts file, or `--suite`). Prints serve-bench's tables, then
the lookup rows ranked by engine tok/s (tau beside it), and writes everything as JSON (`--out`).

    .venv/bin/python bench/lookup_gate.py runs/demo/export --min-match 1,2,3,4,6,8 --num-prompts 8 \
        --out bench/results/lookup_gate.json
    .venv/bin/python bench/lookup_gate.py runs/demo/export --suite mtbench,humaneval --num-prompts 4 --k 3

What a threshold trades: a low one hands more steps to lookup (a 1-token match copies whatever followed
any earlier occurrence of the last token, often wrong), a high one keeps the drafter's block unless the
text really repeats. Both are lossless (vLLM verifies), so tok/s and tau decide.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash_train.engine.measure import LOOKUP, label_of
from dflash_train.engine.serve_bench import serve_bench_command
from dflash_train.errors import UserError
from dflash_train.results import fmt, jsonable


def methods_for(min_match: list[int], modes: list[str]) -> list[str]:
    out = ["plain", "ngram", "dflash"]
    if "seed" in modes:
        out.append(f"{LOOKUP}:seed")
    for mode in ("gate", "seed+gate"):
        if mode in modes:
            out += [f"{LOOKUP}:{mode}@{n}" for n in min_match]
    return out


def ranked(res: dict) -> list[dict]:
    """The lookup rows (held-out rows, or every suite row pooled per method) by engine tok/s."""
    if "rows" in res:
        rows = res["rows"]
    else:  # --suite: one row per method over all suites' prompts (the groups' suite rows summed)
        rows = []
        suites = [g for g in res["groups"] if g["category"] is None]
        for r in suites[0]["rows"]:
            same = [next(x for x in g["rows"] if x["method"] == r["method"]) for g in suites]
            n = sum(x["new_tokens"] for x in same)
            secs = sum(x["seconds"] for x in same)
            prompts = sum(g["num_prompts"] for g in suites)
            # tau from the accepted tokens the outputs kept (the raw counter also counts drafts cut at
            # max_tokens: docs/benchmarks.md "The engine's tau"), as serve-bench's own rows
            kept = [x.get("accepted_in_output") for x in same]
            acc = sum(kept) if all(v is not None for v in kept) else sum(x["accepted_tokens"] for x in same)
            rows.append({**r, "new_tokens": n, "seconds": secs, "accepted_in_output": acc,
                         "accepted_tokens": sum(x["accepted_tokens"] for x in same),
                         "tokens_per_s": n / secs if secs else None,
                         "tau": (n - prompts) / (n - prompts - acc) if n - prompts - acc > 0 else None,
                         "lossless": all(x["lossless"] is not False for x in same)})
        plain = next(r for r in rows if r["method"] == "plain")
        for r in rows:
            r["speedup"] = r["tokens_per_s"] / plain["tokens_per_s"] if plain["tokens_per_s"] else None
    return sorted((r for r in rows if r["method"] != "plain"), key=lambda r: -(r["tokens_per_s"] or 0))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("export", type=Path, help="an export dir (or run dir / checkpoint)")
    p.add_argument("--target", default=None)
    p.add_argument("--prompts", default=None, help="heldout (default) or a prompts .jsonl")
    p.add_argument("--suite", default=None)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", default=None)
    p.add_argument("--min-match", default="2,3,4,6", help="gate thresholds, comma-separated")
    p.add_argument("--modes", default="seed,gate,seed+gate")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    a = p.parse_args(argv)
    try:
        min_match = sorted({int(x) for x in a.min_match.split(",") if x.strip()})
        modes = [m.strip() for m in a.modes.split(",") if m.strip()]
        if not min_match or min(min_match) < 1:
            raise ValueError
    except ValueError:
        print(f"error: --min-match {a.min_match}: thresholds are numbers of tokens >= 1, comma-separated",
              file=sys.stderr)
        return 2
    try:
        res = serve_bench_command(a.export, a.target, a.prompts, a.num_prompts, a.max_new_tokens,
                                  methods_for(min_match, modes), as_json=False, k=a.k, suite=a.suite)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\nlookup modes by engine tok/s (tau beside it):")
    for r in ranked(res):
        print(f"  {label_of(r['method']):48s} k {r['k']}  tau {fmt(r['tau'], '.3f')}  "
              f"{fmt(r['tokens_per_s'], '.2f')} tok/s  {fmt(r['speedup'], '.2f', suffix='x')}  "
              f"lossless {r['lossless']}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(jsonable(res), allow_nan=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
