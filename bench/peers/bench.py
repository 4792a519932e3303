"""The side-by-side table: dflash-train and the peer trainers on the same work, judged in vLLM.

    .venv/bin/python bench/peers/bench.py --out runs/peers [--budget-tokens N] [--budget-seconds S]
        [--trainers dflash-train,speculators,specforge,modelopt] [--seeds 0] [--peer-defaults]

(`make peers-bench` runs it with the recorded budgets.) Steps, each skipped when its output exists:
1. data: `make demo`'s data step (`dflash-train regenerate`, the target's own answers through
   vLLM) into OUT/data, then bench/peers/data.py (the same documents as train.jsonl, the held-out
   prompts);
2. per trainer (and seed, and defaults): a calibration run of a few steps gives its supervised
   predictions per step; the same-tokens budget is then that many steps; the same-seconds budget
   is the trainer's own wall-clock limit (or steps at its measured speed where it has none);
3. bench/peers/judge.py: every export served by vLLM at k 3 and k 7 beside plain and n-gram;
4. OUT/table.md + OUT/table.json: one row per (trainer, budget, defaults, seed).
Each trainer runs alone (never two at once): the seconds and the speeds are comparable.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
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
CALIBRATION_STEPS = 20


def sh(cmd: list[str], log: Path, env: dict | None = None) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    with log.open("w") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode


def ensure_data(out: Path) -> Path:
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    if not (data / "regenerated.complete").is_file():
        rc = sh([str(REPO / ".venv" / "bin" / "dflash-train"), "regenerate", "-c", str(REPO / "configs" / "cpu-demo.yaml"),
                 "--out", str(data / "regenerated.jsonl"), "--max-new-tokens", "128", "--engine", "vllm"], data / "regenerate.log")
        if rc != 0:
            raise SystemExit(f"data step failed: {data / 'regenerate.log'}")
        (data / "regenerated.complete").write_text("")
    if not (data / "train.jsonl").is_file():
        rc = sh([str(PY), str(HERE / "data.py"), "--regenerated", str(data / "regenerated.jsonl"), "--out", str(data)],
                data / "data.log")
        if rc != 0:
            raise SystemExit(f"peer data failed: {data / 'data.log'}")
    return data


def train(name: str, data: Path, run: Path, steps: int | None, seconds: float | None, seed: int,
          peer_defaults: bool, threads: int) -> dict:
    if (run / "result.json").is_file():
        return json.loads((run / "result.json").read_text())
    cmd = TRAINERS[name] + [str(data), str(run), "--seed", str(seed)]
    if steps:
        cmd += ["--steps", str(steps)]
    if seconds:
        cmd += ["--seconds", str(seconds)]
    if peer_defaults:
        cmd += ["--peer-defaults"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    rc = sh(cmd, run.with_suffix(".log"), env)
    if (run / "result.json").is_file():
        return json.loads((run / "result.json").read_text())
    return {"peer": name, "error": f"exit {rc}, no result.json (see {run.with_suffix('.log')})"}


def per_step(name: str, data: Path, out: Path, peer_defaults: bool, threads: int) -> float | None:
    tag = "peer" if peer_defaults else "common"
    r = train(name, data, out / "calibration" / f"{name}-{tag}", CALIBRATION_STEPS, None, 0, peer_defaults, threads)
    if r.get("error") or not r.get("steps") or not r.get("supervised_tokens"):
        return None
    return r["supervised_tokens"] / r["steps"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "peers")
    ap.add_argument("--trainers", default=",".join(TRAINERS))
    ap.add_argument("--budget-tokens", type=float, default=0, help="supervised predictions per trainer (0: skip)")
    ap.add_argument("--budget-seconds", type=float, default=0, help="training wall-clock per trainer (0: skip)")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--peer-defaults", action="store_true", help="also run every peer with its own defaults")
    ap.add_argument("--threads", type=int, default=2)
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
    data = ensure_data(a.out)
    runs: dict[str, dict] = {}
    for seed in [int(s) for s in a.seeds.split(",")]:
        for n in names:
            for peer_defaults in ([False, True] if a.peer_defaults and n != "dflash-train" else [False]):
                tag = f"{n}{'-peerdefaults' if peer_defaults else ''}"
                if a.budget_tokens:
                    ps = per_step(n, data, a.out, peer_defaults, a.threads)
                    key = f"{tag}/tokens/seed{seed}"
                    if ps is None:
                        runs[key] = {"peer": n, "error": "calibration run failed (see OUT/calibration)"}
                    else:
                        steps = max(1, math.ceil(a.budget_tokens / ps))
                        runs[key] = train(n, data, a.out / "tokens" / f"{tag}-seed{seed}", steps, None, seed, peer_defaults, a.threads)
                if a.budget_seconds:
                    key = f"{tag}/seconds/seed{seed}"
                    runs[key] = train(n, data, a.out / "seconds" / f"{tag}-seed{seed}", 10**7, a.budget_seconds, seed,
                                      peer_defaults, a.threads)
    exports = {key: a.out / key.split("/")[1] / (key.split("/")[0] + "-" + key.split("/")[2]) / "export"
               for key, r in runs.items() if not r.get("error")}
    exports = {k: p for k, p in exports.items() if p.is_dir()}
    judged_file = a.out / "judge.json"
    sys.path.insert(0, str(HERE))
    from judge import judge  # noqa: E402 - the trainer venv's dflash_train

    judged = judge(data, exports, a.k, a.num_prompts, a.max_new_tokens, log=lambda m: print(m, file=sys.stderr, flush=True))
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
        js = [by.get((key, k), {}) for k in ks]
        err = r.get("error") or next((j.get("error") for j in js if j.get("error")), None)
        sup_s = (r["supervised_tokens"] / r["train_seconds"]) if r.get("supervised_tokens") and r.get("train_seconds") else None
        cells = [key] + [_f(j.get("tau")) for j in js] + [_f(j.get("speedup"), 2) for j in js] + [
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
