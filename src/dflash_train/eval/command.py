"""`dflash-train eval`: a drafter (run dir, checkpoint or export) and its target loaded, tau
measured by `evaluate_tau` (eval/tau.py: real speculative decoding beside prompt lookup and plain
decoding) on the run's held-out prompts, a prompts file or benchmark suites (eval/suite_bench.py),
printed as a table or one JSON object.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from dflash_train.errors import UserError
from dflash_train.eval.prompts import read_prompts_file
from dflash_train.eval.source import OpenedDrafter, open_drafter
from dflash_train.eval.suite_bench import eval_suites, print_suite_tables, stderr_log
from dflash_train.eval.suites import suite_names
from dflash_train.eval.tau import evaluate_tau
from dflash_train.results import cells, eval_rows, jsonable
from dflash_train.targets import load_target


def _err(msg: str) -> Exception:
    return UserError(msg)


def _print_table(res: dict[str, Any], title: str, drafter_label: str = "DFlash drafter") -> None:
    con = Console()
    t = Table(title=title, show_header=True)
    t.add_column("method")
    t.add_column("tau", justify="right")
    t.add_column("tokens/s", justify="right")
    t.add_column("speedup", justify="right")
    t.add_column("same as plain", justify="right")
    for row in eval_rows(res, drafter_label):
        t.add_row(*cells(row))
    ngram = res.get("tau_ngram") is not None
    con.print(t)
    if not ngram and res.get("temperature", 0) > 0:
        con.print("prompt lookup (n-gram) baseline: greedy only, not measured at temperature > 0")
    steps = f"{res['steps']}" + (f" (prompt lookup {res['steps_ngram']})" if ngram else "")
    con.print(f"prompts {res['num_prompts']}, verify steps {steps}, new tokens {res['new_tokens']}")
    con.print("tau = tokens produced per target forward (plain decoding: 1).\n"
              "prompt lookup = free n-gram drafting: copies what followed the last 1-3\n"
              "  tokens earlier in the prompt or output; no model, no training.\n"
              "speedup = tokens/s over plain decoding's; above 1 = faster than plain.")
    h = Table(title="tokens produced per verify step", show_header=True)
    h.add_column("k")
    h.add_column("drafter steps", justify="right")
    h.add_column("share", justify="right")
    if ngram:
        h.add_column("prompt lookup steps", justify="right")
        h.add_column("share", justify="right")
    total = max(res["steps"], 1)
    total_ng = max(res.get("steps_ngram") or 0, 1)
    for k, v in res["histogram"].items():
        row = [k, str(v), f"{100.0 * v / total:.1f}%"]
        if ngram:
            w = res["histogram_ngram"].get(k, 0)
            row += [str(w), f"{100.0 * w / total_ng:.1f}%"]
        h.add_row(*row)
    con.print(h)


def eval_command(
    drafter: Path,
    target: str | None,
    prompts: str,
    num_prompts: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    untrained: bool,
    as_json: bool,
    suite: str | None = None,
) -> dict[str, Any]:
    """`dflash-train eval`: load drafter + target, run `evaluate_tau`, print a table or one JSON object.
    suite: benchmark suites ("mtbench,humaneval") instead of prompts, one row each (eval/suite_bench.py)."""
    suites = suite_names(suite, prompts)  # a bad name: one line before any model loads
    if num_prompts < 1:
        raise _err("--num-prompts must be >= 1")
    if max_new_tokens < 1:
        raise _err("--max-new-tokens must be >= 1")
    if temperature < 0:
        raise _err("--temperature must be >= 0")
    # cheap checks first: the drafter and a prompts file before loading any model
    d = open_drafter(drafter, target)  # the drafter, its run config (one rule) and its target
    src, target_path = d.src, d.target_path
    prompt_list = None if (suites or prompts == "heldout") else read_prompts_file(prompts, num_prompts)
    tgt = load_target(d.target)
    d.check_fits(tgt)
    model = d.drafter(tgt.device, seed=seed, untrained=untrained)
    if suites:
        return _eval_suites(model, tgt, suites, d, num_prompts, max_new_tokens, temperature, seed, untrained,
                            as_json)
    if prompt_list is None:
        prompt_list = d.heldout(tgt, num_prompts)
    progress = None
    if not as_json:
        def progress(i: int, n: int) -> None:
            print(f"  prompt {i}/{n}", file=sys.stderr, flush=True)

    if len(prompt_list) < num_prompts:
        where = "held-out prompts that fit data.max_tokens" if prompts == "heldout" else f"prompts in {prompts}"
        print(f"note: evaluating {len(prompt_list)} prompts, not the {num_prompts} asked for: there are only "
              f"{len(prompt_list)} {where}", file=sys.stderr, flush=True)
    res = evaluate_tau(model, tgt, prompt_list, max_new_tokens, temperature, seed, progress=progress,
                       run_cfg=d.run_cfg)
    res.update({
        "drafter": str(src.path),
        "step": src.step,
        "target": target_path,
        "untrained": bool(untrained),
        "prompts": prompts,
        "num_prompts_requested": num_prompts,  # num_prompts (evaluated) is lower when fewer were available
    })
    if as_json:
        print(json.dumps(jsonable(res), allow_nan=False))
    else:
        kind = "untrained drafter (random init)" if untrained else f"{src.kind} {src.path}"
        label = "DFlash drafter (untrained)" if untrained else "DFlash drafter (trained)"
        _print_table(res, f"DFlash eval: {kind} vs {target_path}, T={temperature}", label)
    return res


def _eval_suites(model, tgt, suites, d: OpenedDrafter, num_prompts: int, max_new_tokens: int, temperature: float,
                 seed: int, untrained: bool, as_json: bool) -> dict[str, Any]:
    src, target_path = d.src, d.target_path
    progress = None if as_json else (lambda i, n: stderr_log(f"  prompt {i}/{n}"))
    res = eval_suites(model, tgt, suites, num_prompts, max_new_tokens, temperature, seed, progress, run_cfg=d.run_cfg)
    res.update({"drafter": str(src.path), "step": src.step, "target": target_path, "untrained": bool(untrained)})
    if as_json:
        print(json.dumps(jsonable(res), allow_nan=False))
    else:
        print_suite_tables(res, f"DFlash eval per suite: {src.kind} {src.path} vs {target_path}, T={temperature}")
    return res
