"""The side-by-side table: dflash-train and the peer trainers on the same work, judged in vLLM.

    .venv/bin/python bench/peers/bench.py --out runs/peers [--limit 800] [--seconds 600] [--seed 0]
        [--trainers dflash-train,speculators,specforge,modelopt] [--parallel 2] [--peer-defaults]

(`make peers-bench` runs it with the recorded budget.) Steps, each skipped when its output exists:
1. data: `make demo`'s data step (`dflash-train regenerate`, the target's own answers through
   vLLM) into OUT/data, then bench/peers/data.py: the documents of the first --limit
   conversations as train.jsonl (every trainer gets the same; dflash-train gets data.limit);
2. the same wall-clock: every trainer trains --seconds seconds (its LR schedule over the steps
   it reaches in that time at the speed measured here, STEP_SECONDS), --parallel trainers at a
   time, each on 1 thread (never more threads than cores);
3. the same supervised tokens: the fewest (anchor, block position) predictions any trainer made
   in step 2 is the budget; every other trainer trains again for the steps that give it that many
   (its features reused), so the slowest trainer's run of step 2 is its run here;
4. bench/peers/judge.py: every export served by vLLM at k 3 and k 7 beside plain and n-gram;
5. OUT/table.md + OUT/table.json: one row per (trainer, budget, defaults, seed).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PY = REPO / ".venv" / "bin" / "python"
# how each trainer is started: the peers' own scripts install and use their own venvs
TRAINERS = {
    "dflash-train": [str(PY), str(HERE / "ours" / "run.py")],
    "speculators": ["bash", str(HERE / "speculators" / "run.sh")],
    "specforge": ["bash", str(HERE / "specforge" / "run.sh")],
    "modelopt": ["bash", str(HERE / "modelopt" / "run.sh")],
}
INSTALL = {name: HERE / name / "install.sh" for name in ("speculators", "specforge", "modelopt")}
# seconds per optimizer step with the common settings, 1 thread, two trainers at a time on 2 cores,
# measured here (docs/benchmarks.md): the LR schedule's horizon for the wall-clock budget, so that a
# schedule ends about when the --seconds cap does (dflash-train: the first pass over the rows runs
# the target, later ones read cached features)
STEP_SECONDS = {"dflash-train": 0.46, "speculators": 2.45, "specforge": 2.24, "modelopt": 5.4}
# the same with each peer's own defaults (--peer-defaults), measured here the same way; None: the
# peer keeps its own horizon (speculators: 20 epochs). ModelOpt runs them at sequence length 192:
# at its own 4,096 a step pads ~150 real tokens to 4,096 (~60 s, all of 600 s inside its warmup)
PEER_DEFAULT_STEP_SECONDS = {"speculators": None, "specforge": 2.28, "modelopt": 2.92}
PEER_DEFAULT_FLAGS = {"modelopt": ["--seq-len", "192"]}


def sh(cmd: list[str], log: Path, env: dict | None = None) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    with log.open("w") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode


def ensure_data(out: Path, limit: int) -> Path:
    full = out / "data"
    full.mkdir(parents=True, exist_ok=True)
    if not (full / "regenerated.complete").is_file():
        rc = sh([str(REPO / ".venv" / "bin" / "dflash-train"), "regenerate", "-c", str(REPO / "configs" / "cpu-demo.yaml"),
                 "--out", str(full / "regenerated.jsonl"), "--max-new-tokens", "128", "--engine", "vllm"], full / "regenerate.log")
        if rc != 0:
            raise SystemExit(f"data step failed: {full / 'regenerate.log'}")
        (full / "regenerated.complete").write_text("")
    data = out / f"d{limit}"
    if not (data / "data.json").is_file():
        rc = sh([str(PY), str(HERE / "data.py"), "--regenerated", str(full / "regenerated.jsonl"), "--out", str(data),
                 "--limit", str(limit)], out / f"d{limit}.log")
        if rc != 0:
            raise SystemExit(f"peer data failed: {out / f'd{limit}.log'}")
    return data


def train(name: str, data: Path, run: Path, steps: int | None, seconds: float | None, seed: int, peer_defaults: bool,
          reuse: list[str] | None = None) -> dict:
    """One trainer run on 1 thread; its result.json (an "error" row when it failed)."""
    if (run / "result.json").is_file():
        return json.loads((run / "result.json").read_text())
    cmd = TRAINERS[name] + [str(data), str(run), "--seed", str(seed), "--threads", "1"]
    cmd += ["--steps", str(steps)] if steps else []
    cmd += (["--seconds", str(seconds)] if seconds else [])
    cmd += (["--peer-defaults"] + PEER_DEFAULT_FLAGS.get(name, []) if peer_defaults else []) + (reuse or [])
    rc = sh(cmd, run.parent / f"{run.name}.log", {**os.environ, "OMP_NUM_THREADS": "1"})
    if (run / "result.json").is_file():
        return json.loads((run / "result.json").read_text())
    return {"peer": name, "error": f"exit {rc}, no result.json (see {run.parent / (run.name + '.log')})"}


def reuse_features(name: str, first_run: Path) -> list[str]:
    """Flags that let a second run of a trainer skip its data prep and feature dump."""
    if name == "speculators":
        return ["--reuse-data", str(first_run / "data")]
    if name == "specforge":
        return ["--features", str(first_run / "features")]
    return []


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "peers")
    ap.add_argument("--trainers", default=",".join(TRAINERS))
    ap.add_argument("--limit", type=int, default=800, help="conversations of the demo's data every trainer reads")
    ap.add_argument("--seconds", type=float, default=600, help="the wall-clock budget per trainer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parallel", type=int, default=2, help="trainers at a time (1 thread each)")
    ap.add_argument("--peer-defaults", action="store_true", help="also each peer with its own defaults (same seconds)")
    ap.add_argument("--k", type=int, nargs="+", default=[3, 7])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    a = ap.parse_args()
    names = [n.strip() for n in a.trainers.split(",") if n.strip()]
    bad = [n for n in names if n not in TRAINERS]
    if bad:
        raise SystemExit(f"--trainers: unknown {bad}; choose from {', '.join(TRAINERS)}")
    for n in names:
        if n in INSTALL and sh(["bash", str(INSTALL[n])], a.out / "install" / f"{n}.log") != 0:
            print(f"{n}: install failed ({a.out / 'install' / f'{n}.log'})", file=sys.stderr)
    data = ensure_data(a.out, a.limit)
    sec_dir, tok_dir = a.out / f"s{a.seconds:g}", a.out / f"s{a.seconds:g}-tokens"
    jobs = [(n, False) for n in names] + ([(n, True) for n in names if n != "dflash-train"] if a.peer_defaults else [])
    tag = {job: job[0] + ("-peerdefaults" if job[1] else "") for job in jobs}

    def seconds_run(job):
        n, pd = job
        per_step = PEER_DEFAULT_STEP_SECONDS[n] if pd else STEP_SECONDS[n]
        steps = max(1, round(a.seconds / per_step)) if per_step else None
        return f"{tag[job]}/seconds", train(n, data, sec_dir / tag[job], steps, a.seconds, a.seed, pd)

    with ThreadPoolExecutor(max(1, a.parallel)) as pool:
        runs = dict(pool.map(seconds_run, jobs))
    common = {k: r for k, r in runs.items() if "-peerdefaults" not in k and not r.get("error") and r.get("supervised_tokens")}
    if common:
        budget = min(r["supervised_tokens"] for r in common.values())

        def tokens_run(job):
            n, _ = job
            first = runs[f"{n}/seconds"]
            if first["supervised_tokens"] <= budget * 1.05:  # the slowest: its seconds run is its tokens run
                return f"{n}/tokens", dict(first, reused=f"{n}/seconds")
            steps = max(1, round(budget / (first["supervised_tokens"] / first["steps"])))
            return f"{n}/tokens", train(n, data, tok_dir / n, steps, None, a.seed, False, reuse_features(n, sec_dir / n))

        with ThreadPoolExecutor(max(1, a.parallel)) as pool:
            runs.update(dict(pool.map(tokens_run, [j for j in jobs if not j[1] and f"{j[0]}/seconds" in common])))
    exports = {}
    for key, r in runs.items():
        name, budget_kind = key.split("/")
        run_dir = (sec_dir if budget_kind == "seconds" else tok_dir) / name
        if not r.get("error") and not r.get("reused") and (run_dir / "export").is_dir():
            exports[key] = run_dir / "export"
    sys.path.insert(0, str(HERE))
    from judge import judge  # noqa: E402 - the trainer venv's dflash_train

    judged_file = a.out / f"judge-s{a.seconds:g}.json"
    if judged_file.is_file() and set(json.loads(judged_file.read_text()).get("exports", [])) >= set(exports):
        judged = json.loads(judged_file.read_text())
    else:
        judged = judge(data, exports, a.k, a.num_prompts, a.max_new_tokens, log=lambda m: print(m, file=sys.stderr, flush=True))
        judged["exports"] = sorted(exports)
        judged_file.write_text(json.dumps(judged, indent=1) + "\n")
    table = build_table(runs, judged)
    (a.out / "table.json").write_text(json.dumps({"runs": runs, "judge": judged}, indent=1) + "\n")
    (a.out / "table.md").write_text(table)
    print(table)
    return 0


def build_table(runs: dict[str, dict], judged: dict) -> str:
    by = {}
    for r in judged["rows"]:
        by[(r["trainer"], r["k"])] = r
    ks = judged["ks"]
    head = ["trainer / budget / seed"] + [f"tau k{k}" for k in ks] + [f"x plain k{k}" for k in ks] + [
        "lossless", "sup. tok/s", "train s", "sup. tokens", "peak RSS MB", "data prep s", "features s", "error"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in ("plain vLLM", "vLLM n-gram"):
        cells = [label] + [_f(by.get((label, 0 if label == "plain vLLM" else k), {}).get("tau")) for k in ks]
        cells += [_f(by.get((label, 0 if label == "plain vLLM" else k), {}).get("speedup"), 2) for k in ks]
        lines.append("| " + " | ".join(cells + [""] * (len(head) - len(cells))) + " |")
    for key, r in runs.items():
        js = [by.get((r.get("reused", key), k), {}) for k in ks]  # a reused run was judged under its first key
        err = r.get("error") or next((j.get("error") for j in js if j.get("error")), None)
        sup_s = (r["supervised_tokens"] / r["train_seconds"]) if r.get("supervised_tokens") and r.get("train_seconds") else None
        cells = [key + (f" (= {r['reused']})" if r.get("reused") else "")] + [_f(j.get("tau")) for j in js] + [_f(j.get("speedup"), 2) for j in js] + [
            "yes" if js and all(j.get("lossless") for j in js) else ("NO" if any(j.get("lossless") is False for j in js) else ""),
            _f(sup_s, 0), _f(r.get("train_seconds"), 0), _f(r.get("supervised_tokens"), 0), _f(r.get("peak_rss_mb"), 0),
            _f(r.get("data_prep_seconds"), 0), _f(r.get("feature_dump_seconds"), 0), (err or "").replace("|", "/")[:200]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _f(v, nd: int = 3) -> str:
    if v is None:
        return ""
    return f"{v:,.{nd}f}" if isinstance(v, (int, float)) else str(v)


if __name__ == "__main__":
    sys.exit(main())
