"""Every trainer's export served by vLLM on the same prompts, beside plain vLLM and vLLM's n-gram,
at each k (issue 48, item 3: a judge a reader trusts):

    .venv/bin/python bench/peers/judge.py DATA_DIR --out judge.json [--export NAME=EXPORT_DIR ...]
        [--k 3 7] [--num-prompts 64] [--mtbench 8] [--humaneval 8] [--max-new-tokens 64]
        [--base BASE.json]

The prompts, in three groups served in one engine job (one engine start per (method, k)):
* ``heldout``: `make demo`'s held-out prompts (`eval_prompts` of configs/cpu-demo.yaml on the
  regenerated file DATA_DIR/data.json names: the first held-out prompts that fit a training row),
  --num-prompts of them (64 by default; fewer available is recorded, never padded);
* ``mtbench``: the first turns of the first --mtbench MT-Bench questions in z-lab's order
  (eval/suites.py; first turns only: a second turn would follow plain vLLM's own answer);
* ``humaneval``: the first --humaneval HumanEval problems in z-lab's wrapping and order.
All in the target's chat format (`prompt_format`), greedy, batch 1, float32 (dflash-train's
vLLM worker, the engine's own counters). tau per group and over all prompts
(`methods_over` + `summarise`).

--base BASE.json: plain + n-gram are served once into BASE.json (its plain outputs are what every
export's outputs are compared with, token for token: lossless) and reused by every later call, so
bench.py can judge exports in parallel processes, each engine on its own core
(VLLM_CPU_OMP_THREADS_BIND). Speedups are against that plain run (tok/s of the same prompts on
the same engine settings; loaded machines move them, taus are exact). An export vLLM cannot
load is a row with its error, not the end of the run.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash_train.config import load_config
from dflash_train.engine.measure import DEFAULT_DTYPE, methods_over, summarise
from dflash_train.engine.vllm_process import max_model_len, run_worker
from dflash_train.eval.prompts import encode_prompts, eval_prompts
from dflash_train.targets import TokenizerOnly, load_tokenizer, served_target_dir

REPO = Path(__file__).resolve().parents[2]
GROUPS = ("heldout", "mtbench", "humaneval")


def judge_prompts(data_dir: Path, num_prompts: int, mtbench: int = 8, humaneval: int = 8,
                  config: Path = REPO / "configs" / "cpu-demo.yaml") -> tuple[object, dict]:
    """(run config, {"ids": [...], "groups": [name per prompt], "stops": [...], "counts": {...}})."""
    from dflash_train.eval.suites import first_turns, load_suite
    from dflash_train.targets.chat_template import prompt_format

    # the held-out prompts of the whole regenerated file (make demo's), whatever data.limit trained
    regenerated = json.loads((data_dir / "data.json").read_text())["regenerated"]
    cfg = load_config(config, [f"data.regenerated={regenerated}"])
    tok, family = load_tokenizer(cfg.target)
    shim = TokenizerOnly(tok, family)
    ids, stops = encode_prompts(shim, eval_prompts(cfg, shim, num_prompts), cfg)
    groups = ["heldout"] * len(ids)
    fmt = prompt_format(shim, cfg)
    for name, n in (("mtbench", mtbench), ("humaneval", humaneval)):
        if n:
            for p in first_turns(load_suite(name, n)):
                ids.append(fmt.prompt_ids(list(p.messages)))
                groups.append(name)
    stops = sorted(set(stops) | set(fmt.stop_token_ids()))
    counts = {g: groups.count(g) for g in GROUPS}
    return cfg, {"ids": ids, "groups": groups, "stops": stops, "counts": counts,
                 "asked": {"heldout": num_prompts, "mtbench": mtbench, "humaneval": humaneval}}


def serve(target_dir: Path, ids, stops, max_new_tokens: int, methods: list[dict], timeout_s: float = 14400) -> dict:
    job = {"target": str(target_dir), "dtype": DEFAULT_DTYPE, "max_model_len": max_model_len(target_dir),
           "max_new_tokens": max_new_tokens, "prompts": ids, "stop_token_ids": stops, "methods": methods}
    return run_worker(job, timeout_s)


def group_rows(methods: list[dict], groups: list[str], plain_outputs: list | None, extra: dict) -> list[dict]:
    """One row per (method, group) and per method over all prompts ("all"); lossless against
    `plain_outputs` (the base plain run's) where given."""
    rows = []
    for g in ("all",) + GROUPS:
        idx = [i for i, x in enumerate(groups) if g == "all" or x == g]
        if not idx:
            continue
        sub = methods_over(methods, idx) if g != "all" else methods
        for m, r in zip(sub, summarise(sub, len(idx), compare_outputs=False)):
            row = dict(r, group=g, prompts=len(idx), **extra)
            row.pop("accepted_per_step", None)
            if plain_outputs is not None:
                row["lossless"] = m["outputs"] == [plain_outputs[i] for i in idx]
            rows.append(row)
    return rows


def base_run(data_dir: Path, ks: list[int], num_prompts: int, mtbench: int, humaneval: int, max_new_tokens: int,
             base_file: Path | None, log=print) -> tuple[dict, dict, Path]:
    """(prompts, base result with plain outputs and the plain / n-gram rows, target dir), served
    once and kept in `base_file` (reused when its prompts and settings match)."""
    cfg, prompts = judge_prompts(data_dir, num_prompts, mtbench, humaneval)
    target_dir = served_target_dir(cfg.target.path)
    key = {"ids": prompts["ids"], "stops": prompts["stops"], "ks": ks, "max_new_tokens": max_new_tokens}
    if base_file is not None and base_file.is_file():
        base = json.loads(base_file.read_text())
        if base.get("key") == key:
            return prompts, base, target_dir
    res = serve(target_dir, prompts["ids"], prompts["stops"], max_new_tokens,
                [{"name": "plain"}] + [{"name": "ngram", "k": k} for k in ks])
    if "error" in res:
        raise SystemExit(f"plain / n-gram vLLM failed: {res['error']}")
    plain = res["methods"][0]
    rows = []
    for r in group_rows(res["methods"], prompts["groups"], plain["outputs"], {}):
        rows.append(dict(r, trainer=r["label"]))
    base = {"key": key, "plain_outputs": plain["outputs"], "plain_tokens_per_s": plain_tps(rows),
            "rows": rows, "vllm_version": res.get("vllm_version"), "counts": prompts["counts"]}
    log(json.dumps({r["trainer"] + f" k{r['k']}": round(r["tau"], 3) for r in rows if r["group"] == "all"}))
    if base_file is not None:
        base_file.parent.mkdir(parents=True, exist_ok=True)
        base_file.write_text(json.dumps(base) + "\n")
    return prompts, base, target_dir


def plain_tps(rows: list[dict]) -> dict:
    return {r["group"]: r["tokens_per_s"] for r in rows if r["method"] == "plain"}


def judge(data_dir: Path, exports: dict[str, Path], ks: list[int], num_prompts: int, max_new_tokens: int,
          log=print, mtbench: int = 8, humaneval: int = 8, base_file: Path | None = None,
          with_base_rows: bool = True) -> dict:
    prompts, base, target_dir = base_run(data_dir, ks, num_prompts, mtbench, humaneval, max_new_tokens, base_file, log)
    rows = list(base["rows"]) if with_base_rows else []
    for name, export in exports.items():
        res = serve(target_dir, prompts["ids"], prompts["stops"], max_new_tokens,
                    [{"name": "dflash", "k": k, "model": str(Path(export).resolve())} for k in ks])
        if "error" in res:
            rows += [{"trainer": name, "method": "dflash", "k": k, "group": "all", "export": str(export),
                      "error": res["error"].splitlines()[0][:300]} for k in ks]
        else:
            new = group_rows(res["methods"], prompts["groups"], base["plain_outputs"], {"trainer": name, "export": str(export)})
            for r in new:
                tps = base["plain_tokens_per_s"].get(r["group"])
                r["speedup"] = r["tokens_per_s"] / tps if tps else None
            rows += new
        for r in rows[-len(ks) * 4:]:
            if r.get("group") == "all":
                log(json.dumps({kk: r.get(kk) for kk in ("trainer", "k", "tau", "speedup", "lossless", "error")}))
    return {"num_prompts": len(prompts["ids"]), "counts": prompts["counts"], "asked": prompts["asked"],
            "max_new_tokens": max_new_tokens, "ks": ks, "rows": rows, "vllm_version": base.get("vllm_version"),
            "dtype": DEFAULT_DTYPE}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("data_dir", type=Path)
    ap.add_argument("--export", action="append", default=[], help="NAME=DIR")
    ap.add_argument("--k", type=int, nargs="+", default=[3, 7])
    ap.add_argument("--num-prompts", type=int, default=64, help="held-out prompts")
    ap.add_argument("--mtbench", type=int, default=8, help="MT-Bench first turns")
    ap.add_argument("--humaneval", type=int, default=8, help="HumanEval problems")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--base", type=Path, default=None, help="plain + n-gram served once into / read from this file")
    ap.add_argument("--no-base-rows", action="store_true", help="the exports' rows only (bench.py's parallel judge)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    exports = dict(e.split("=", 1) for e in a.export)
    res = judge(a.data_dir, {n: Path(p) for n, p in exports.items()}, a.k, a.num_prompts, a.max_new_tokens,
                log=lambda m: print(m, file=sys.stderr, flush=True), mtbench=a.mtbench, humaneval=a.humaneval,
                base_file=a.base, with_base_rows=not a.no_base_rows)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
