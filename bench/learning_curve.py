"""Learning curve of one run: masks-only tau of every checkpoint against training tokens and
CPU-seconds, beside prompt lookup on the same outputs (issue 26 item 2).

    .venv/bin/python bench/learning_curve.py runs/curve --num-prompts 12 --max-new-tokens 64

tau is by replay on the target's greedy outputs of the run's held-out prompts (eval/replay.py;
tests/test_engine_vllm.py holds it equal to vLLM's in-engine tau within 5 %); training tokens and
seconds come from metrics.jsonl at each checkpoint's step. Writes RUN/learning_curve.json and
RUN/plots/learning_curve.png with a fit tau - 1 = a * log(tokens) + b.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from dflash_train import rundir
from dflash_train.compare import drafter_tau, greedy_outputs, ngram_tau
from dflash_train.config import load_config
from dflash_train.eval.prompts import eval_prompts
from dflash_train.export import resolve_drafter_source
from dflash_train.model.dflash2 import build_drafter
from dflash_train.targets import load_target


def log_fit(xy: list[tuple[float, float]]) -> dict | None:
    """Least squares tau - 1 = a * ln(x) + b."""
    if len(xy) < 2:
        return None
    xs, ys = [math.log(x) for x, _ in xy], [t - 1 for _, t in xy]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return {"a": a, "b": my - a * mx, "form": "tau - 1 = a * ln(x) + b"}


def plot(points: list[dict], fits: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, key, label, scale in ((axes[0], "tokens", "training tokens", 1.0),
                                  (axes[1], "seconds", "training CPU-minutes (1 thread)", 60.0)):
        xs = [p[key] / scale for p in points]
        ax.plot(xs, [p["tau"] for p in points], "o-", label="DFlash, masks only (replay = vLLM)")
        ax.axhline(points[-1]["tau_ngram"] if points else 1.0, color="gray", ls=":", label="prompt lookup")
        if fits.get(key):
            f = fits[key]
            ax.plot(sorted(xs), [1 + f["a"] * math.log(x * scale) + f["b"] for x in sorted(xs)], "--", label="fit")
        ax.set_xscale("log"); ax.set_xlabel(label); ax.grid(alpha=.3)
    axes[0].set_ylabel("tau (held out)"); axes[0].legend(fontsize=8)
    out.parent.mkdir(exist_ok=True)
    fig.tight_layout(); fig.savefig(out, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.run_dir / "config.yaml")
    target = load_target(cfg.target)
    prompts = eval_prompts(cfg, target, args.num_prompts)
    held = greedy_outputs(target, prompts, args.max_new_tokens, args.run_dir)
    metrics = {r["step"]: r for r in rundir.read_metrics(args.run_dir) if not r.get("eval")}
    # training seconds: the sum of each logged interval's own time (tokens / tok/s), so a stop
    # and resume (the gap between processes) does not count; the time to recompute the
    # features the stopped process had cached does, as it would for any resumed run
    elapsed, prev = {}, 0
    total = 0.0
    for step in sorted(metrics):
        r = metrics[step]
        total += (r["tokens"] - prev) / r["tokens_per_s"]
        prev, elapsed[step] = r["tokens"], total
    out_file = args.run_dir / "learning_curve.json"
    # incremental: a rerun (the run still training) scores only the checkpoints not scored yet
    points = json.loads(out_file.read_text())["points"] if out_file.exists() else []
    scored = {p["step"] for p in points}
    for ckpt in sorted((args.run_dir / "checkpoints").glob("step-*")):
        if int(ckpt.name.split("-")[1]) in scored:
            continue
        src = resolve_drafter_source(ckpt)
        drafter = build_drafter(src.config)
        drafter.load_state_dict(src.state_dict)
        drafter.eval()
        m = metrics.get(src.step) or max((r for s, r in metrics.items() if s <= src.step), key=lambda r: r["step"])
        k = int(src.config.block_size) - 1
        with torch.no_grad():
            tau = drafter_tau(drafter, target, held, seeded=False)
        points.append({"step": src.step, "tokens": m.get("tokens"), "seconds": elapsed[m["step"]],
                       "tau": tau, "tau_ngram": ngram_tau(held, k)})
        print(json.dumps(points[-1]), flush=True)
        points.sort(key=lambda p: p["step"])
        out_file.write_text(json.dumps({"points": points}, indent=2) + "\n")
    for p in points:  # seconds of every point by the rule above (also those scored by an earlier run)
        p["seconds"] = elapsed[max(s for s in elapsed if s <= p["step"])]
    fits = {x: log_fit([(p[x], p["tau"]) for p in points if p.get(x)]) for x in ("tokens", "seconds")}
    out = {"points": points, "fit": fits["tokens"], "fit_seconds": fits["seconds"], "num_prompts": len(held),
           "max_new_tokens": args.max_new_tokens}
    out_file.write_text(json.dumps(out, indent=2) + "\n")
    plot(points, fits, args.run_dir / "plots" / "learning_curve.png")
    print(json.dumps({"fit": fits}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
