"""`dflash-train serve-bench`: an export served by vLLM, the engine's own figures.

Engines one after the other, on the same prompts: plain vLLM, vLLM's n-gram drafting
(``method: ngram``), the DFlash export (``method: dflash``) and, asked for with ``--method
dflash+lookup``, the export with our vLLM plugin's prompt lookup (engine/measure.py), each with k draft tokens per step
(``--k``, default block_size - 1; ``--k auto``: the fastest k of a short sweep first,
engine/k_sweep.py), on a run's held-out prompts, a prompts file or benchmark suites (``--suite``,
engine/suite_serving.py), or both: ``--prompts FILE --suite NAMES`` serves the prompts and the suites'
in the same engine runs (the prompts' rows as without ``--suite``, the suites' under "suites"). What a
row holds (tau, tokens per draft, tok/s, speedup, lossless) is engine/measure.py's; vLLM runs in its own
environment (engine/vllm_process.py). This module is the command: the drafter and its prompts, the
measurement, the printed table.

A pair vLLM cannot serve (a target architecture without auxiliary hidden states such as Gemma 3,
vLLM not installed, an engine that fails to start or runs out of memory) is one line (exit 2).
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.table import Table

from dflash_train.engine.k_sweep import AUTO, SWEEP_PROMPTS, check_k, parse_k, print_sweep, sweep_k
from dflash_train.engine.measure import is_lookup, measure_in_vllm, method_spec
from dflash_train.engine.suite_serving import print_lookup_suites, serve_suites, serve_with_suites
from dflash_train.engine.vllm_process import lookup_plugin_missing, vllm_python
from dflash_train.errors import UserError
from dflash_train.eval.prompts import encode_prompts, read_prompts_file
from dflash_train.eval.source import open_drafter
from dflash_train.eval.suite_bench import print_suite_tables, suite_items
from dflash_train.eval.suites import parse_suites
from dflash_train.export import export_checkpoint
from dflash_train.results import ENGINE_COLUMNS, engine_cells, engine_rows, jsonable
from dflash_train.targets import TokenizerOnly, load_tokenizer, served_target_dir


def print_engine_table(res: dict[str, Any], title: str) -> None:
    t = Table(title=title)
    for c in ENGINE_COLUMNS:
        t.add_column(c, justify="left" if c == "method" else "right")
    unchecked = "n/a (sampling)" if res.get("temperature", 0.0) > 0 else "-"
    for row in engine_rows(res):
        t.add_row(*engine_cells(row, unchecked=unchecked if not row.reference else "-"))
    con = Console()
    con.print(t)
    con.print(f"vLLM {res['vllm_version']}, {res['dtype']}, {res['num_prompts']} prompts x <= {res['max_new_tokens']} "
              f"tokens, {sampling_text(res)}, batch 1. tau = tokens per target decode step (engine counters); "
              + LOSSLESS_NOTE[res.get("temperature", 0.0) > 0])


def sampling_text(res: dict[str, Any]) -> str:
    t = res.get("temperature", 0.0)
    return f"temperature {t:g}, top-p {res.get('top_p', 1.0):g}" if t > 0 else "greedy"


LOSSLESS_NOTE = {False: "lossless = every output equals plain vLLM's.",
                 True: "lossless n/a under sampling: outputs differ by chance; the check is the acceptance rule's "
                       "test (tests/test_eval_specdec.py)."}


def serve_bench_command(drafter: Path, target: str | None, prompts: str | None, num_prompts: int, max_new_tokens: int,
                        methods: Sequence[str], as_json: bool, dtype: str | None = None,
                        k: int | str | None = None, suite: str | None = None, temperature: float = 0.0,
                        top_p: float = 1.0, suite_prompts: int | None = None) -> dict[str, Any]:
    """`dflash-train serve-bench`: the export (or a run's / checkpoint's drafter, exported to a
    temporary dir first) served by vLLM on held-out prompts, a prompts file, or benchmark suites
    (`--suite`: one row per suite, engine/suite_serving.py), or `prompts` and the suites in the same
    engine runs (`suite_prompts` items of each suite, default `num_prompts`); `k` "auto": chosen by a
    short sweep first (engine/k_sweep.py)."""
    suites = parse_suites(suite) if suite is not None else None  # a bad name: one line before anything loads
    both = bool(suites) and prompts is not None  # --prompts and --suite: both, in the same engines
    per_suite = num_prompts if suite_prompts is None else suite_prompts
    k = parse_k(k, "--k")
    check_sampling(temperature, top_p)
    for m in methods:
        method_spec(m)  # an unknown method or lookup mode: one line
    if len(set(methods)) != len(methods):
        raise UserError(f"--method: each method once (got {', '.join(methods)})")
    if num_prompts < 1 or max_new_tokens < 1 or per_suite < 1:
        raise UserError("--num-prompts, --suite-prompts and --max-new-tokens must be >= 1")
    py = vllm_python()  # not installed: say so before any work
    if any(is_lookup(m) for m in methods) and (why := lookup_plugin_missing(py)):
        raise UserError(why)
    prompts = prompts or "heldout"
    d = open_drafter(drafter, target)  # the drafter, its run config (one rule) and its target
    src, target_path = d.src, d.target_path
    if k != AUTO:
        check_k(k, src.config.block_size, "--k")
    file_prompts = prompts not in (None, "heldout") and (not suites or both)
    prompt_list = read_prompts_file(prompts, num_prompts) if file_prompts else None
    tok, family = load_tokenizer(d.target)
    shim = TokenizerOnly(tok, family)
    log = None if as_json else (lambda m: print(m, file=sys.stderr, flush=True))
    sweep = None
    with tempfile.TemporaryDirectory(prefix="dflash-export-") as tmp:
        export_dir = src.path
        if src.kind != "export":
            export_dir = export_checkpoint(src.path, Path(tmp) / "export")
        if (not suites or both) and prompt_list is None:
            prompt_list = d.heldout(shim, num_prompts)
        if k == AUTO:  # on the first few prompts the measurement serves (a suite's: its first turns)
            ids, stops = encode_prompts(shim, prompt_list or _first_turns(suites, per_suite), d.run_cfg)
            sweep = sweep_k(export_dir, served_target_dir(target_path), ids, stops, max_new_tokens, dtype, log,
                            temperature, top_p, lookup=[m for m in methods if is_lookup(m)])
            k = sweep["ks"]
        if both:  # the prompts first, then the suites', each method once over all of them
            ids, _ = encode_prompts(shim, prompt_list, d.run_cfg)
            res, per_suite_res = serve_with_suites(
                export_dir, target_path, shim, suites, per_suite, max_new_tokens, methods, lead_ids=ids, k=k,
                dtype=dtype, temperature=temperature, top_p=top_p, log=log, run_cfg=d.run_cfg)
            res["suites"] = per_suite_res
        elif suites:
            res = serve_suites(export_dir, target_path, shim, suites, per_suite, max_new_tokens, methods, k=k,
                               dtype=dtype, temperature=temperature, top_p=top_p, log=log, run_cfg=d.run_cfg)
        else:
            ids, stops = encode_prompts(shim, prompt_list, d.run_cfg)
            res = measure_in_vllm(export_dir, served_target_dir(target_path), ids, stops, max_new_tokens, methods,
                                  k=k, dtype=dtype, log=log, temperature=temperature, top_p=top_p)
    res.update({"drafter": str(src.path), "target": target_path})
    if sweep is not None:
        res["k_sweep"] = sweep
    if not suites or both:  # with --suite alone, "prompts" lists the suites' prompts (suite, item, category, turn)
        res["prompts"] = prompts
    _print_result(res, as_json, suites, sweep, f"{src.path} on {target_path}", both)
    return res


def _first_turns(suites: Sequence[str], num_prompts: int) -> list[str]:
    return [it.turns[0] for it in suite_items(suites, num_prompts)][:SWEEP_PROMPTS]


def _print_result(res: dict[str, Any], as_json: bool, suites, sweep, what: str, both: bool = False) -> None:
    if as_json:  # with every method's output token ids (plain's are what the others must equal)
        print(json.dumps(jsonable(res), allow_nan=False))
        return
    if sweep is not None:
        print_sweep(sweep)
    if not suites or both:
        print_engine_table(res, f"served by vLLM: {what}")
    if suites:
        per_suite = res["suites"] if both else res
        print_suite_tables(per_suite, f"served by vLLM{' in the same engine runs' if both else ''}, per suite: {what}")
        print_lookup_suites(per_suite)


def check_sampling(temperature: float, top_p: float) -> None:
    if not temperature >= 0:  # also refuses nan
        raise UserError(f"--temperature must be >= 0 (got {temperature}); 0 = greedy")
    if not 0 < top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1] (got {top_p})")

