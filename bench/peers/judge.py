"""Every trainer's export served by vLLM on the same held-out prompts, beside plain vLLM and
vLLM's n-gram, at each k:

    .venv/bin/python bench/peers/judge.py DATA_DIR --export NAME=EXPORT_DIR ... [--k 3 7] --out judge.json

The prompts are `make demo`'s held-out ones (`eval_prompts` of configs/cpu-demo.yaml on the
regenerated file DATA_DIR/data.json names: the first held-out prompts that fit a training row). One engine start
per (method, k), one after the other (dflash-train's vLLM worker: greedy, batch 1, float32,
one warm-up generation, the engine's own counters). Every output is compared with plain
vLLM's token for token (lossless), and every export's engine job serves plain
vLLM again first, so its speedup is against plain tok/s measured minutes apart. An export vLLM
cannot load is a row with its error, not the end of the run.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash_train.config import load_config
from dflash_train.engine.measure import DEFAULT_DTYPE, summarise
from dflash_train.engine.vllm_process import max_model_len, run_worker
from dflash_train.eval.prompts import encode_prompts, eval_prompts
from dflash_train.targets import TokenizerOnly, load_tokenizer, served_target_dir

REPO = Path(__file__).resolve().parents[2]


def heldout_prompt_ids(data_dir: Path, num_prompts: int, config: Path = REPO / "configs" / "cpu-demo.yaml"):
    # the held-out prompts of the whole regenerated file (make demo's), whatever data.limit trained
    regenerated = json.loads((data_dir / "data.json").read_text())["regenerated"]
    cfg = load_config(config, [f"data.regenerated={regenerated}"])
    tok, family = load_tokenizer(cfg.target)
    shim = TokenizerOnly(tok, family)
    prompts = eval_prompts(cfg, shim, num_prompts)
    ids, stops = encode_prompts(shim, prompts)
    return cfg, ids, stops


def serve(target_dir: Path, ids, stops, max_new_tokens: int, methods: list[dict], timeout_s: float = 7200) -> dict:
    job = {"target": str(target_dir), "dtype": DEFAULT_DTYPE, "max_model_len": max_model_len(target_dir),
           "max_new_tokens": max_new_tokens, "prompts": ids, "stop_token_ids": stops, "methods": methods}
    return run_worker(job, timeout_s)


def judge(data_dir: Path, exports: dict[str, Path], ks: list[int], num_prompts: int, max_new_tokens: int,
          log=print) -> dict:
    cfg, ids, stops = heldout_prompt_ids(data_dir, num_prompts)
    target_dir = served_target_dir(cfg.target.path)
    base = serve(target_dir, ids, stops, max_new_tokens,
                 [{"name": "plain"}] + [{"name": "ngram", "k": k} for k in ks])
    if "error" in base:
        raise SystemExit(f"plain / n-gram vLLM failed: {base['error']}")
    plain = base["methods"][0]
    rows = [dict(r, trainer=r["label"]) for r in summarise(base["methods"], len(ids))]
    log(json.dumps({r["trainer"] + f" k{r['k']}": round(r["tau"], 3) for r in rows}))
    for name, export in exports.items():
        # plain again in the same engine job: the speedup compares tok/s measured minutes apart on
        # the same machine state (the machine may be shared), and lossless compares with it too
        res = serve(target_dir, ids, stops, max_new_tokens,
                    [{"name": "plain"}] + [{"name": "dflash", "k": k, "model": str(Path(export).resolve())} for k in ks])
        if "error" in res:
            rows += [{"trainer": name, "method": "dflash", "k": k, "error": res["error"].splitlines()[0][:300]} for k in ks]
        else:
            job_rows = summarise(res["methods"], len(ids))
            same_as_first_plain = res["methods"][0]["outputs"] == plain["outputs"]
            for row in job_rows[1:]:
                rows.append(dict(row, trainer=name, plain_tokens_per_s=job_rows[0]["tokens_per_s"],
                                 lossless=bool(row["lossless"] and same_as_first_plain)))
        for r in rows[-len(ks):]:
            log(json.dumps({kk: r.get(kk) for kk in ("trainer", "k", "tau", "speedup", "lossless", "error")}))
    return {"num_prompts": len(ids), "max_new_tokens": max_new_tokens, "ks": ks, "rows": rows,
            "vllm_version": base.get("vllm_version"), "dtype": DEFAULT_DTYPE}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("data_dir", type=Path)
    ap.add_argument("--export", action="append", default=[], help="NAME=DIR")
    ap.add_argument("--k", type=int, nargs="+", default=[3, 7])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    exports = dict(e.split("=", 1) for e in a.export)
    res = judge(a.data_dir, {n: Path(p) for n, p in exports.items()}, a.k, a.num_prompts, a.max_new_tokens,
                log=lambda m: print(m, file=sys.stderr, flush=True))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
