"""RUN_DIR/report.md with PNG plots drawn from metrics.jsonl: loss, per-position
accuracy, tau over steps, stage utilisation."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: files only
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    train, evals = [], []
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return train, evals
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        (evals if rec.get("eval") else train).append(rec)
    return train, evals


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def plot_all(run_dir: Path, out_dir: Path) -> dict[str, str]:
    train, evals = read_metrics(run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots: dict[str, str] = {}
    if train:
        steps = [r["step"] for r in train]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, [r.get("loss_mean", r["loss"]) for r in train], label="loss (interval mean)")
        ax.set_xlabel("step"); ax.set_ylabel("loss"); ax.grid(alpha=0.3); ax.legend()
        plots["loss"] = _save(fig, out_dir / "loss.png")

        ks = sorted(int(k.split("_")[1]) for k in train[0] if k.startswith("acc_") and k[4:].isdigit())
        if ks:
            fig, ax = plt.subplots(figsize=(6, 3.5))
            for k in ks:
                ax.plot(steps, [r.get(f"acc_{k}", 0.0) for r in train], label=f"k={k}", alpha=0.8)
            ax.set_xlabel("step"); ax.set_ylabel("accuracy at block position k"); ax.grid(alpha=0.3)
            ax.legend(fontsize=6, ncol=3)
            plots["accuracy"] = _save(fig, out_dir / "accuracy.png")

        stages = [s for s in ("target", "postprocess", "trainer") if f"{s}_busy" in train[-1]]
        if stages:
            fig, ax = plt.subplots(figsize=(6, 3.5))
            for s in stages:
                ax.plot(steps, [r.get(f"{s}_busy", 0.0) for r in train], label=f"{s} busy")
            ax.plot(steps, [r.get("queue_occupancy", 0.0) for r in train], "--", label="queue occupancy")
            ax.set_xlabel("step"); ax.set_ylabel("fraction of wall time"); ax.set_ylim(0, 1.05)
            ax.grid(alpha=0.3); ax.legend(fontsize=7)
            plots["stages"] = _save(fig, out_dir / "stages.png")

    tau_points = [(r["step"], r["tau"]) for r in evals if "tau" in r]
    exp_tau = [(r["step"], r["expected_tau"]) for r in train if "expected_tau" in r]
    if tau_points or exp_tau:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        if exp_tau:
            ax.plot(*zip(*exp_tau), label="expected tau (from training accuracy)", alpha=0.7)
        if tau_points:
            ax.plot(*zip(*tau_points), "o-", label="tau (speculative decoding)")
        ax.set_xlabel("step"); ax.set_ylabel("tokens per verify step"); ax.grid(alpha=0.3); ax.legend()
        plots["tau"] = _save(fig, out_dir / "tau.png")
    return plots


def write_report(run_dir: Path, summary: dict[str, Any]) -> Path:
    plots = plot_all(run_dir, run_dir / "plots")
    train, evals = read_metrics(run_dir)
    last = train[-1] if train else {}
    lines = [
        f"# dflash-train report: {run_dir.name}",
        "",
        "## Acceptance length (real speculative decoding, greedy)",
        "",
        "| drafter | tau | tokens/s (spec) | speedup vs plain |",
        "|---|---|---|---|",
    ]
    for name in ("untrained", "trained"):
        ev = summary.get(f"eval_{name}", {})
        if ev:
            lines.append(f"| {name} | {ev.get('tau', float('nan')):.3f} | {ev.get('tokens_per_s_spec', 0):.2f} | "
                         f"{ev.get('speedup', 0):.2f}x |")
    lines += [
        "",
        f"Plain greedy decoding of the target: {summary.get('eval_trained', {}).get('tokens_per_s_plain', 0):.2f} tok/s. "
        f"Prompts: {summary.get('eval_prompts', '?')} held-out ShareGPT first turns, "
        f"{summary.get('eval_max_new_tokens', '?')} new tokens each.",
        "",
        "## Training",
        "",
        f"- steps: {last.get('step', 0)}, trained tokens: {last.get('tokens', 0):,}, "
        f"wall time: {summary.get('train_seconds', 0):.0f} s",
        f"- final loss (interval mean): {last.get('loss_mean', float('nan')):.4f}; "
        f"position-1 accuracy {last.get('acc_1', float('nan')):.3f}; "
        f"expected tau from accuracies {last.get('expected_tau', float('nan')):.3f}",
        f"- throughput (last interval): {last.get('tokens_per_s', 0):.0f} tok/s",
        f"- export: `{summary.get('export_dir', '')}`",
        "",
    ]
    captions = {"loss": "Loss", "accuracy": "Per-position accuracy", "tau": "Tau over steps",
                "stages": "Stage utilisation"}
    for key, cap in captions.items():
        if key in plots:
            lines += [f"### {cap}", "", f"![{cap}](plots/{plots[key]})", ""]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
