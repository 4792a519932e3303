"""dflash-train on the peers' common work, in the peers' interface:

    .venv/bin/python bench/peers/ours/run.py DATA_DIR OUT_DIR [--steps N] [--seconds S] [--seed K] [--threads T]
                                             [--offline]

trains with `dflash-train train` on the target-written answers and data.limit DATA_DIR/data.json
names (the documents the peers read as DATA_DIR/train.jsonl), configs/cpu-demo.yaml's
recipe with the common settings (1 layer, block 8, target layer [15], mask 16, full attention,
float32), exports to OUT_DIR/export and writes OUT_DIR/result.json. Our trainer captures the
target's features online in the same process (cached after their first use), so the training
time includes the target forward and feature_dump_seconds is 0. --offline: as the peers do,
`dflash-train precompute` (float32) first, its time as feature_dump_seconds (its peak RSS as
feature_dump_peak_rss_mb), then training from the features, which loads the target's head only.
Our precompute stops after the deepest captured layer (layer 15 of 30), as the shared dumper
bench/peers/features.py does for the peers (issue 48: the harness runs every trainer offline).

Exports: OUT_DIR/export as `dflash-train export` writes it (a subset-trained drafter carries its
draft vocabulary: draft_vocab_size + lm_head rows + d2t) and, for such a drafter, OUT_DIR/export-full,
the same drafter over the whole vocabulary (`--full-vocab`): the two servings of one training.
CPU seconds (user + system) of the precompute and of the training process come from
/usr/bin/time beside their wall clock.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
BIN = REPO / ".venv" / "bin"


def train_overrides(data: dict, steps: int, seed: int, seconds: float, extra: list[str]) -> list[str]:
    """Our run's overrides on configs/cpu-demo.yaml: the documents bench/peers/data.py wrote for the
    peers (its data.json: the regenerated file and data.limit; tests/test_peers_harness.py checks
    that our trainer builds the same documents from them), the common settings, the budget."""
    return [f"data.regenerated={data['regenerated']}", f"data.limit={data['limit']}", "model.target_layer_ids=[15]",
            "model.mask_token_id=16", f"train.max_steps={steps}", f"train.seed={seed}",
            f"train.max_seconds={seconds if seconds > 0 else 1e9}", "checkpoint.every_steps=100000",
            # every step logged: the supervised predictions are counted, not extrapolated, and a short
            # run (a calibration, a slow variant) has its figures before its first 10 steps
            "checkpoint.keep_last=1", "logging.every_steps=1",
            "data.domain_prompts={}",  # the peers' documents only (the demo adds the suites' domains)
            *extra]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("data_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--steps", type=int, default=9000)
    ap.add_argument("--seconds", type=float, default=0.0, help="training wall-clock budget (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peer-defaults", action="store_true", help="accepted for the common interface; ours are ours")
    ap.add_argument("--offline", action="store_true", help="precompute the features first, train from disk")
    ap.add_argument("--features", type=Path, default=None,
                    help="with --offline: a finished precompute (OUT_DIR/features of an earlier run on the same "
                         "data) to train from; its dump time is reported as this run's (reused)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a dflash-train override on top (to A/B one of our defaults against a peer's)")
    a = ap.parse_args()
    out = a.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / "run"
    data = json.loads((a.data_dir / "data.json").read_text())  # bench/peers/data.py: the same documents
    overrides = train_overrides(data, a.steps, a.seed, a.seconds, a.set)
    cmd = [str(BIN / "dflash-train"), "train", "--config", str(REPO / "configs" / "cpu-demo.yaml"),
           "--run-dir", str(run_dir), "--resume", "never", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    dump_seconds, dump_rss, dump_cpu = 0.0, None, None
    dump_reused = None
    if a.offline and a.features is not None:
        features = a.features.resolve()
        info = json.loads((features.parent / "features.json").read_text())
        dump_seconds, dump_rss, dump_cpu, dump_reused = info["seconds"], info["peak_rss_mb"], info["cpu_s"], str(features)
    elif a.offline:
        features = out / "features"
        pre = [str(BIN / "dflash-train"), "precompute", "--config", str(REPO / "configs" / "cpu-demo.yaml"),
               "--out", str(features), "--dtype", "float32", *overrides]
        t0 = time.perf_counter()
        proc = subprocess.run(["/usr/bin/time", "-f", TIME_FORMAT, "-o", str(out / "dump_rss_kb.txt"), *pre], env=env,
                              capture_output=True, text=True)
        dump_seconds, dump_rss = time.perf_counter() - t0, _rss_mb(out / "dump_rss_kb.txt")
        dump_cpu = _cpu_s(out / "dump_rss_kb.txt")
        (out / "precompute.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            sys.exit("precompute failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1])
        (out / "features.json").write_text(json.dumps({"seconds": dump_seconds, "cpu_s": dump_cpu,
                                                       "peak_rss_mb": dump_rss}) + "\n")
    if a.offline:
        # the features hold the documents: the conversations are not read again
        overrides = [o for o in overrides if not o.startswith("data.regenerated=")] + [f"data.source=precomputed:{features}"]
        cmd = cmd[:cmd.index("--resume") + 2] + overrides
    t0 = time.perf_counter()
    timed = ["/usr/bin/time", "-f", TIME_FORMAT, "-o", str(out / "rss_kb.txt")]
    proc = subprocess.run(timed + cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (out / "train.log").write_text(proc.stdout + proc.stderr)
    result: dict = {"peer": "dflash-train" + (" offline" if a.offline else ""), "peer_version": _version(),
                    "command": " ".join(cmd),
                    "threads": a.threads, "seed": a.seed, "error": None}
    metrics = run_dir / "metrics.jsonl"
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.is_file() else []
    steps = [r for r in recs if "supervised" in r]
    if proc.returncode != 0:
        result["error"] = (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1]
    elif not steps:
        result["error"] = f"no step logged in {metrics} (the run ended before its first logged step)"
    else:
        last_step = _last_step(run_dir, recs[-1]["step"])
        result.update({
            "steps": last_step,
            # the loop's own clock: the logging intervals' durations added up (the target's
            # forward for uncached rows included, the start-up and the data step not), the steps
            # after the last logged one at the run's mean pace
            "train_seconds": _train_seconds(steps, last_step),
            "process_seconds": wall,
            "data_prep_seconds": _data_prep_seconds(run_dir),
            "feature_dump_seconds": dump_seconds,
            "feature_dump_peak_rss_mb": dump_rss,
            "feature_dump_cpu_seconds": dump_cpu,
            "feature_dump_reused": dump_reused,
            "train_process_cpu_seconds": _cpu_s(out / "rss_kb.txt"),
            "stopped_by": _stopped_by(run_dir),
            "supervised_tokens": _supervised_total(steps, last_step),
            "supervised_tokens_how": "sum over logging intervals of (anchor, block position) pairs that carried "
                                     "loss (metrics.jsonl 'supervised'), the last interval extrapolated if unlogged",
            "peak_rss_mb": _rss_mb(out / "rss_kb.txt"),
            "settings": {"loss": "dpace (D-PACE position weights, alpha 0.5), CE to the data tokens",
                         "anchors": "24 per 192-token packed row, random among supervised positions",
                         "batching": "4 packed rows x 192 tokens (first-fit packing of whole documents)",
                         "lr": "AdamW 1e-3, 2 % warmup, cosine to 0.1x",
                         "loss_vocab": next((o.split("=", 1)[1] + " (train.vocab_subset)" for o in a.set
                                             if o.startswith("train.vocab_subset=")), "8,192 most frequent")},
        })
        exp = subprocess.run([str(BIN / "dflash-train"), "export", str(run_dir), "--out", str(out / "export"), "--force"],
                             env=env, capture_output=True, text=True)
        if exp.returncode != 0:
            result["error"] = "export: " + (exp.stderr.strip().splitlines() or ["?"])[-1]
        elif json.loads((out / "export" / "config.json").read_text()).get("draft_vocab_size"):
            # the same drafter over the whole vocabulary: the serving without the draft vocabulary
            exp = subprocess.run([str(BIN / "dflash-train"), "export", str(run_dir), "--out", str(out / "export-full"),
                                  "--force", "--full-vocab"], env=env, capture_output=True, text=True)
            if exp.returncode != 0:
                result["error"] = "export --full-vocab: " + (exp.stderr.strip().splitlines() or ["?"])[-1]
            result["export_full"] = str(out / "export-full")
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0 if result["error"] is None else 1


def _supervised_total(recs: list[dict], last_step: int) -> int:
    total, prev = 0, 0
    for r in recs:
        total += r["supervised"]
        prev = r["step"]
    if recs and prev < last_step:
        total += int(total / prev * (last_step - prev))
    return int(total)


def _train_seconds(recs: list[dict], last_step: int) -> float:
    seconds = sum(r["supervised"] / r["supervised_per_s"] for r in recs if r["supervised_per_s"])
    logged = recs[-1]["step"] if recs else last_step
    return seconds * last_step / logged if logged else seconds


def _last_step(run_dir: Path, logged: int) -> int:
    """The step the run stopped at (train.log's "stopping at step N"); the last logged one otherwise."""
    import re

    log = run_dir / "logs" / "train.log"
    m = re.findall(r"stopping at step (\d+)", log.read_text()) if log.is_file() else []
    return int(m[-1]) if m else logged


def _data_prep_seconds(run_dir: Path) -> float | None:
    """The data step's seconds (train.log's "data: {..., 'seconds': N}": read, format, cut, pack)."""
    import re

    log = run_dir / "logs" / "train.log"
    if not log.is_file():
        return None
    m = re.search(r"INFO data: \{.*'seconds': ([0-9.]+)", log.read_text())
    return float(m.group(1)) if m else None


TIME_FORMAT = "%U %S %e %M"  # /usr/bin/time: user s, system s, wall s, peak RSS kB (one line)


def _time_fields(path: Path) -> list[str]:
    try:
        return path.read_text().strip().splitlines()[-1].split()
    except (OSError, IndexError):
        return []


def _rss_mb(path: Path) -> float | None:
    try:
        return int(_time_fields(path)[-1]) / 1024
    except (ValueError, IndexError):
        return None


def _cpu_s(path: Path) -> float | None:
    f = _time_fields(path)
    try:
        return float(f[0]) + float(f[1]) if len(f) == 4 else None
    except ValueError:
        return None


def _stopped_by(run_dir: Path) -> str | None:
    """"seconds" when train.max_seconds ended the run, "steps" when train.max_steps did (train.log's
    "stopping at step N (REASON)"), else the reason as logged."""
    import re

    log = run_dir / "logs" / "train.log"
    m = re.findall(r"stopping at step \d+ \(([^)]*)\)", log.read_text()) if log.is_file() else []
    return {"time budget": "seconds", "max_steps": "steps"}.get(m[-1], m[-1]) if m else None


def _version() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
