"""RUN_DIR/report.md with PNG plots drawn from metrics.jsonl: loss, per-position
accuracy, tau over steps, stage utilisation; and the side-by-side comparison
(trained drafter, untrained drafter, prompt lookup, plain decoding) that the
demo also prints at the end."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_train import rundir
from dflash_train.model.dflash2 import SERVING_NOTE
from dflash_train.model.drafter_config import DrafterConfig
from dflash_train.serving_check import embedding_scale_warning, launch_commands
from dflash_train.results import (
    ENGINE_COLUMNS,
    MethodRow,
    engine_cells,
    engine_rows,
    fmt,
    lossless_cell,
    lossless_of,
    plain_row,
)


EXPLANATION = [
    "tau = tokens produced per forward pass of the target model (the accepted draft tokens + 1); "
    "plain decoding produces exactly 1, so higher is better.",
    "tokens/s = generated tokens per second of wall time on this machine; "
    "speedup = tokens/s divided by plain decoding's: above 1 means faster than plain decoding, below 1 slower.",
    "prompt lookup = free n-gram drafting (what vLLM `ngram` and SGLang `NGRAM` do): the draft copies the tokens "
    "that followed the most recent earlier occurrence of the last 3, 2 or 1 tokens; no model, no training. "
    "A trained drafter earns its keep where it beats prompt lookup.",
    "All methods decode greedily, so they produce the same text as plain decoding; only the speed differs.",
]

SEEDED_NOTE = [
    "blocks seeded by prompt lookup (model.block_seeds) = the drafter gets prompt lookup's proposal in its "
    "input and learns, from the target's hidden states, which of it to keep, where to correct it and how to "
    "fill slots it leaves empty; engines that do not seed (SGLang, vLLM today) run it from masks only.",
]


ENGINE_EXPLANATION = [
    "Served by vLLM (its CPU build here, as users serve on GPUs): the same held-out prompts through plain "
    "vLLM, vLLM's n-gram drafting (`method: ngram`, lookup 1-3 tokens) and the exported DFlash drafter "
    "(`method: dflash`), one after the other, greedy, batch 1.",
    "tau = tokens per target decode step from the engine's own counters: (generated - prompts) / "
    "(generated - prompts - accepted drafts); plain vLLM is 1. tokens/draft counts only the steps that had "
    "a draft. tok/s = wall clock over the prompts; vs plain = over plain vLLM's tok/s.",
    "lossless = every output equals plain vLLM's token for token (greedy).",
    "our replay tau = the same drafter's masks-only tau by our own replay on plain vLLM's outputs: "
    "the engine's figure and ours should agree.",
]
LOOKUP_NOTE = [
    "DFlash + lookup = the same export with our vLLM plugin (plugins/vllm_dflash_lookup): prompt lookup's "
    "continuation where its match with earlier text is long enough (the gate), the drafter's block elsewhere; "
    "verification stays vLLM's, so it is lossless like the rest.",
]


def explanation(summary: dict[str, Any]) -> list[str]:
    """The plain-words notes under the comparison (the seeding note only for a seeded drafter)."""
    if summary.get("judge") == "engine":
        served = any(str(r.get("method", "")).startswith("dflash+lookup")
                     for r in (summary.get("engine") or {}).get("rows", []))
        return ENGINE_EXPLANATION + (LOOKUP_NOTE if served else [])
    seeded = (summary.get("eval_trained") or {}).get("tau_unseeded") is not None
    return EXPLANATION + (SEEDED_NOTE if seeded else [])


def comparison_rows(summary: dict[str, Any]) -> list[MethodRow]:
    """The trained drafter, the untrained drafter, prompt lookup and plain decoding, from the
    demo's summary (rows whose evaluation is missing are left out): `results.MethodRow`s."""
    tr = summary.get("eval_trained") or {}
    un = summary.get("eval_untrained") or {}
    plain = summary.get("tokens_per_s_plain", tr.get("tokens_per_s_plain"))
    rows: list[MethodRow] = []
    if tr:
        seeded = tr.get("tau_unseeded") is not None
        name = "trained DFlash drafter" + (" (blocks seeded by prompt lookup)" if seeded else "")
        rows.append(MethodRow(name, tr.get("tau"), tr.get("tokens_per_s_spec"), tr.get("speedup"),
                              tr.get("outputs_match")))
        if seeded:
            rows.append(MethodRow("  same drafter from masks only (as SGLang / vLLM run it; tau by replay)",
                                  tr.get("tau_unseeded"), decoded=False))
    if un:
        rows.append(MethodRow("untrained DFlash drafter (same shape, random weights)", un.get("tau"),
                              un.get("tokens_per_s_spec"), un.get("speedup")))
    tau_ng = summary.get("tau_ngram", tr.get("tau_ngram"))
    if tau_ng is not None:
        rows.append(MethodRow("prompt lookup (n-gram drafting, no training)", tau_ng,
                              summary.get("tokens_per_s_ngram", tr.get("tokens_per_s_ngram")),
                              summary.get("speedup_ngram", tr.get("speedup_ngram")), tr.get("outputs_match_ngram")))
    if plain is not None:
        rows.append(plain_row(plain, "plain decoding (the target alone)"))
    return rows


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(training lines, eval lines) of RUN_DIR/metrics.jsonl."""
    train, evals = [], []
    for rec in rundir.read_metrics(run_dir):
        (evals if rec.get("eval") else train).append(rec)
    return train, evals


def _pyplot():
    """matplotlib, imported when a plot is drawn (export's model card does not need it)."""
    import matplotlib

    matplotlib.use("Agg")  # headless: files only
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> str:
    plt = _pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def plot_all(run_dir: Path, out_dir: Path) -> dict[str, str]:
    plt = _pyplot()
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

    tau_points = [(r["step"], r["tau"]) for r in evals if isinstance(r.get("tau"), (int, float))]
    exp_tau = [(r["step"], r["expected_tau"]) for r in train if "expected_tau" in r]
    tau_ngram = [r["tau_ngram"] for r in evals if isinstance(r.get("tau_ngram"), (int, float))]
    if tau_points or exp_tau:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        if exp_tau:
            ax.plot(*zip(*exp_tau), label="expected tau (from training accuracy)", alpha=0.7)
        if tau_points:
            ax.plot(*zip(*tau_points), "o-", label="tau (speculative decoding)")
        if tau_ngram:
            ax.axhline(tau_ngram[-1], color="gray", linestyle=":", label="prompt lookup tau (no training)")
        ax.set_xlabel("step"); ax.set_ylabel("tokens per verify step"); ax.grid(alpha=0.3); ax.legend()
        plots["tau"] = _save(fig, out_dir / "tau.png")
    return plots


def suite_lines(suites: dict[str, Any] | None) -> list[str]:
    """report.md's per-suite table (the demo's `demo.suite_prompts`, served in the same engine runs):
    one row per suite, its MT-Bench categories left to summary.json (one or two prompts each)."""
    if not suites:
        return []

    def lossless(g: dict[str, Any]) -> str:
        return lossless_of([("DFlash", g.get("lossless")), ("n-gram", g.get("lossless_ngram")),
                            ("DFlash + lookup", g.get("lossless_lookup"))], "n/a")

    # DFlash + lookup's columns when it was served (engine/suite_serving.py: the `_lookup` figures);
    # MT-Bench's categories too, where lookup's copies differ most (the second turns, extraction)
    lk = any("tau_lookup" in g for g in suites.get("groups", []))
    head = "| suite | prompts | DFlash tau (engine) | n-gram tau | DFlash vs plain | n-gram vs plain |"
    head += " DFlash + lookup tau | DFlash + lookup vs plain |" if lk else ""
    lines = ["", f"### Per benchmark suite (same engines, k {suites.get('k')})", "", head + " lossless |",
             "|" + "---|" * head.count("|")]
    for g in suites.get("groups", []):
        if g.get("category") is None or lk:
            cells = (f"| {g['label'] if lk else g['suite']} | {g['num_prompts']} | {fmt(g.get('tau'), '.3f')} | "
                     f"{fmt(g.get('tau_ngram'), '.3f')} | {fmt(g.get('speedup'), '.2f', suffix='x')} | "
                     f"{fmt(g.get('speedup_ngram'), '.2f', suffix='x')} |")
            if lk:
                cells += f" {fmt(g.get('tau_lookup'), '.3f')} | {fmt(g.get('speedup_lookup'), '.2f', suffix='x')} |"
            lines.append(f"{cells} {lossless(g)} |")
    return lines + ["", f"{suites.get('num_prompts_per_suite')} items per suite (z-lab's order; MT-Bench: both turns, "
                        "the second after the target's own greedy first answer), <= "
                        f"{suites.get('max_new_tokens')} new tokens: a few prompts, a rough reading per domain."]


def sweep_lines(sweep: dict[str, Any] | None) -> list[str]:
    """report.md's k sweep (`demo.serve_k: auto`): the rows, the chosen k marked."""
    if not sweep:
        return []
    lines = ["", f"### k chosen by a short sweep: {sweep['k']}", "", "| k | tau | tok/s | vs plain | lossless |",
             "|---|---|---|---|---|"]
    for r in sweep["rows"]:
        ok = lossless_cell(r.get("lossless"), "n/a")
        lines.append(f"| {r['k']}{' (chosen)' if r['k'] == sweep['k'] else ''} | {fmt(r.get('tau'), '.3f')} | "
                     f"{fmt(r.get('tokens_per_s'), '.2f')} | {fmt(r.get('speedup'), '.2f', suffix='x')} | {ok} |")
    return lines + ["", f"{sweep['num_prompts']} prompts x <= {sweep['max_new_tokens']} tokens per k, one engine start "
                        "each; the fastest by tok/s (ties: the smaller k). Short: differences of a few % are noise."]


def write_report(run_dir: Path, summary: dict[str, Any]) -> Path:
    plots = plot_all(run_dir, run_dir / "plots")
    train, evals = read_metrics(run_dir)
    last = train[-1] if train else {}
    lines = [f"# dflash-train report: {run_dir.name}", ""]
    if summary.get("judge") == "engine":
        eng = summary.get("engine") or {}
        lines += [f"## Served by vLLM {eng.get('vllm_version', '')} ({eng.get('dtype', '')}): "
                  + " vs ".join(r.method for r in engine_rows(eng)[::-1]),
                  "", "| " + " | ".join(ENGINE_COLUMNS) + " |", "|" + "---|" * len(ENGINE_COLUMNS)]
        for row in engine_rows(eng):
            lines.append("| " + " | ".join(engine_cells(row, missing="n/a", speedup_suffix="x")) + " |")
        lines += ["", f"Our replay tau of the same drafter on plain vLLM's outputs: "
                      f"{fmt(summary.get('tau_replay_dflash'), '.3f')} (engine: "
                      f"{fmt(summary.get('tau_engine_dflash'), '.3f')})."]
        lines += suite_lines(summary.get("suites")) + sweep_lines(summary.get("k_sweep"))
    else:
        lines += ["## Speed: trained drafter vs untrained drafter vs prompt lookup vs plain decoding", "",
                  "| method | tau | tokens/s | speedup vs plain |", "|---|---|---|---|"]
        for r in comparison_rows(summary):
            lines.append(f"| {r.method} | {fmt(r.tau, '.3f')} | {fmt(r.tokens_per_s, '.2f')} | "
                         f"{fmt(r.speedup, '.2f', suffix='x')} |")
    lines += [""] + [f"- {line}" for line in explanation(summary)] + [
        "",
        f"Prompts: {summary.get('eval_prompts', '?')} held-out ShareGPT first turns, "
        f"{summary.get('eval_max_new_tokens', '?')} new tokens each.",
        "",
        "## Training",
        "",
        f"- steps: {last.get('step', 0)}, trained tokens: {last.get('tokens', 0):,}, "
        f"wall time: {summary.get('train_seconds', 0):.0f} s",
        f"- final loss (interval mean): {fmt(last.get('loss_mean'), '.4f')}; "
        f"position-1 accuracy {fmt(last.get('acc_1'), '.3f')}; "
        f"expected tau from accuracies {fmt(last.get('expected_tau'), '.3f')}",
        f"- throughput (last interval): {last.get('tokens_per_s', 0):.0f} tok/s",
        f"- export: `{summary.get('export_dir', '')}`",
        "",
    ]
    captions = {"loss": "Loss", "accuracy": "Per-position accuracy", "tau": "Tau over steps",
                "stages": "Stage utilisation"}
    for key, cap in captions.items():
        if key in plots:
            lines += [f"### {cap}", "", f"![{cap}](plots/{plots[key]})", ""]
    path = rundir.RunDir(run_dir).report
    path.write_text("\n".join(lines))
    return path


# --------------------------------------------------------------------------- export's model card


def run_summary(run_dir: Path | None, step: int | None, meta: dict[str, Any]) -> dict[str, Any]:
    """steps, tokens, final loss, measured tau (if any) from RUN_DIR/summary.json and metrics.jsonl."""
    s: dict[str, Any] = {"step": step, "tokens": meta.get("tokens")}
    if run_dir is None:
        return s
    summ = {}
    sf = run_dir / "summary.json"
    if sf.is_file():
        try:
            summ = json.loads(sf.read_text())
        except ValueError:
            summ = {}
    recs = rundir.read_metrics(run_dir)
    if step is not None:
        recs = [r for r in recs if not isinstance(r.get("step"), (int, float)) or r["step"] <= step]
    train = [r for r in recs if not r.get("eval") and "loss" in r]
    evals = [r for r in recs if r.get("eval") and "tau" in r]
    if train:
        last = train[-1]
        s["final_loss"] = last.get("loss_mean", last.get("loss"))
        s["tokens"] = s.get("tokens") or last.get("tokens")
        if "acc_1" in last:
            s["acc_1"] = last["acc_1"]
    if evals:
        s["tau"] = evals[-1]["tau"]
        s["tau_step"] = evals[-1].get("step")
        s["best_tau"] = max(r["tau"] for r in evals if isinstance(r["tau"], (int, float)))
    if isinstance(summ, dict):
        # the demo's summary.json names the trained drafter's tau "tau_trained"
        if summ.get("tau_trained") is not None:
            s["tau"] = summ["tau_trained"]
            s.pop("tau_step", None)
        for k in ("tau", "tau_untrained", "final_loss", "tokens", "steps", "speedup"):
            if summ.get(k) is not None and s.get(k) is None:
                s[k] = summ[k]
    return s


def model_card(cfg: DrafterConfig, summary: dict[str, Any], target_path: str | None, name: str) -> str:
    bs = int(cfg.block_size)
    tgt = target_path or "<the target model>"
    lines = [
        f"# {name}",
        "",
        "A DFlash block-diffusion drafter for speculative decoding, trained with dflash-train.",
        "",
        "## Drafter",
        "",
        f"- target: `{tgt}` ({cfg.num_target_layers} layers; context features from layers {list(cfg.target_layer_ids)})",
        f"- {cfg.num_layers} Qwen3-layout layer(s), hidden {cfg.hidden_size}, {cfg.num_heads} heads / "
        f"{cfg.num_kv_heads} KV heads, head_dim {cfg.head_dim}, intermediate {cfg.intermediate_size}",
        f"- block size {bs} (drafts {bs - 1} tokens per step), mask token id {cfg.mask_token_id}, "
        f"layer types {list(cfg.layer_types)}",
        "- uses the target's embedding and lm_head (not included here)",
        "",
        "## Training summary",
        "",
        f"- steps: {fmt(summary.get('step') or summary.get('steps'))}",
        f"- tokens trained: {fmt(summary.get('tokens'))}",
        f"- final loss: {fmt(summary.get('final_loss'), '.4f')}",
        f"- measured acceptance length (tau, real speculative decoding): {fmt(summary.get('tau'), '.3f')}"
        + (f" at step {summary['tau_step']}" if summary.get("tau_step") is not None else ""),
    ]
    if summary.get("tau_untrained") is not None:
        lines.append(f"- tau of an untrained drafter of the same shape: {fmt(summary['tau_untrained'], '.3f')}")

    warning = embedding_scale_warning(float(cfg.input_embedding_scale))
    if warning:
        lines += ["", "## WARNING: engine compatibility", "", f"- **{warning}**"]
    if cfg.block_seeds != "none":
        lines += ["", "## Prompt-lookup seeds", "",
                  "- trained to draft from blocks whose masked slots hold prompt lookup's proposal "
                  "(`dflash_config.block_seeds`); `dflash-train eval` decodes that way.",
                  "- SGLang, vLLM and the reference package do not seed DFlash blocks: there it drafts from "
                  "masks only, at the lower masks-only acceptance (`tau_unseeded` in `dflash-train eval --json`)."]
    reference_class = "DFlashDraftModel"
    if cfg.architecture == "dflash2":
        reference_class = "DFlash2DraftModel"
        lines += ["", "## DFlash 2", "", *SERVING_NOTE]
    lines += [
        "",
        "## Serving",
        "",
        *launch_commands(bs, list(cfg.layer_types), cfg.serving_dtype, tgt),
        "",
        "Reference implementation (PyPI `dflash`):",
        "",
        "```python",
        f"from dflash import {reference_class}",
        f"draft = {reference_class}.from_pretrained('./THIS_DIR')",
        "out = draft.spec_generate(target_model, input_ids, max_new_tokens=256, stop_token_ids=[eos_id])",
        "```",
        "",
    ]
    return "\n".join(lines)
