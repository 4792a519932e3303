"""Acceptance length (tau) by real speculative decoding: `evaluate_tau` and
`dflash-train eval`.

Prompts are user messages; each is formatted as ONE user turn with the
target's chat format (`dflash_train.data.template.ChatFormat`: the tokenizer's
chat_template, or Gemma's ``<start_of_turn>user\\n...<end_of_turn>\\n<start_of_turn>model\\n``)
and generated until the format's stop tokens or max_new_tokens.

tau = total tokens produced / total verify steps over all prompts (the pooled
mean of the per-step acceptance lengths, each = accepted drafts + 1 bonus).

Every evaluation also runs the free baseline, prompt lookup (n-gram drafting,
`dflash_train.eval.ngram`), on the same prompts with the same number of draft
tokens (block_size - 1), and plain decoding of the target: the drafter is
worth its training only where it beats both.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from dflash_train.config import TargetConfig, read_run_config
from dflash_train.data.sources import DataError
from dflash_train.errors import UserError
from dflash_train.eval.ngram import ngram_generate
from dflash_train.eval.prompts import encode_prompts, eval_prompts, read_prompts_file
from dflash_train.eval.replay import replay_acceptance
from dflash_train.eval.specdec import acceptance_histogram, plain_generate, speculative_generate, tau_of
from dflash_train.eval.suites import suite_names
from dflash_train.export import resolve_drafter_source
from dflash_train.model.dflash2 import build_drafter
from dflash_train.results import cells, eval_rows
from dflash_train.targets import load_target


def _err(msg: str) -> Exception:
    return UserError(msg)


def _jsonable(v: Any) -> Any:
    """NaN/inf -> None (strict JSON), recursively."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


# --------------------------------------------------------------------------- evaluation


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def evaluate_tau(
    drafter,
    target,
    prompts: Sequence[str],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    measure_plain: bool = True,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    progress: Callable[[int, int], None] | None = None,
    measure_ngram: bool = True,
) -> dict[str, Any]:
    """Real speculative decoding over `prompts` (user messages, formatted here).

    Returns tau, histogram {"k": steps that produced k tokens} (k = 1..block_size),
    tokens_per_s_spec, tokens_per_s_plain, speedup, num_prompts, outputs_match
    (greedy: every speculative output equals plain greedy; None when not
    checked), plus tau_per_prompt, steps, new_tokens, block_size, temperature,
    max_new_tokens. Pass `prompt_ids` (+ `stop_token_ids`) to skip formatting.
    measure_plain=False skips the plain baseline (in-training eval).

    A drafter with ``block_seeds: prompt_lookup`` also gets tau_unseeded: its greedy tau with
    masks only (no seeds: how SGLang / vLLM, which do not seed, would run it), by replay on
    the same outputs; None otherwise.

    The prompt-lookup baseline (k = block_size - 1 draft tokens) adds tau_ngram,
    histogram_ngram, tokens_per_s_ngram, speedup_ngram (vs plain), outputs_match_ngram,
    mismatched_prompts_ngram, steps_ngram, new_tokens_ngram, ngram_k. It is greedy
    only: with temperature > 0, or measure_ngram=False, those are None.
    """
    if prompt_ids is None:
        prompt_ids, stops = encode_prompts(target, prompts)
    else:
        stops = []
    if stop_token_ids is not None:
        stops = list(stop_token_ids)
    if not prompt_ids:
        raise _err("no prompts to evaluate")
    cfg = drafter.cfg
    bs = int(cfg.block_size)
    device = target.device
    all_acc: list[int] = []
    per_prompt: list[float] = []
    t_spec = t_plain = t_ngram = 0.0
    n_spec = n_plain = n_ngram = 0
    match: bool | None = True if (measure_plain and temperature <= 0) else None
    mismatches: list[int] = []
    do_ngram = bool(measure_ngram) and temperature <= 0 and bs >= 2
    ngram_k = bs - 1
    ngram_acc: list[int] = []
    match_ngram: bool | None = True if (do_ngram and measure_plain) else None
    mismatches_ngram: list[int] = []
    # a prompt-lookup-seeded drafter: also its tau from masks only, what SGLang / vLLM give it
    seeded = cfg.block_seeds != "none"
    unseeded_acc: list[int] | None = [] if (seeded and temperature <= 0) else None
    for i, ids in enumerate(prompt_ids):
        x = torch.tensor([list(ids)], dtype=torch.long, device=device)
        gen = None
        if temperature > 0:
            gen = torch.Generator(device=device).manual_seed(int(seed) + i)
        _sync(device)
        t0 = time.perf_counter()
        out, acc = speculative_generate(drafter, target, x, max_new_tokens, stops, temperature, gen)
        _sync(device)
        t_spec += time.perf_counter() - t0
        n_spec += out.shape[1] - x.shape[1]
        all_acc.extend(acc)
        per_prompt.append(tau_of(acc))
        if unseeded_acc is not None:  # greedy: replay walks the same output (tests/test_eval_seeded.py)
            unseeded_acc.extend(replay_acceptance(drafter, target, out[0].tolist(), x.shape[1], seeded=False))
        if do_ngram:
            _sync(device)
            t0 = time.perf_counter()
            out_ng, acc_ng = ngram_generate(target, x, max_new_tokens, stops, ngram_k)
            _sync(device)
            t_ngram += time.perf_counter() - t0
            n_ngram += out_ng.shape[1] - x.shape[1]
            ngram_acc.extend(acc_ng)
        if measure_plain:
            gen = torch.Generator(device=device).manual_seed(int(seed) + i) if temperature > 0 else None
            _sync(device)
            t0 = time.perf_counter()
            plain = plain_generate(target, x, max_new_tokens, stops, temperature, gen)
            _sync(device)
            t_plain += time.perf_counter() - t0
            n_plain += plain.shape[1] - x.shape[1]
            if temperature <= 0 and not torch.equal(plain, out):
                match = False
                mismatches.append(i)
            if do_ngram and not torch.equal(plain, out_ng):
                match_ngram = False
                mismatches_ngram.append(i)
        if progress is not None:
            progress(i + 1, len(prompt_ids))
    tps_spec = n_spec / t_spec if t_spec > 0 else float("nan")
    tps_plain = n_plain / t_plain if measure_plain and t_plain > 0 else None
    tps_ngram = (n_ngram / t_ngram if t_ngram > 0 else float("nan")) if do_ngram else None
    hist = acceptance_histogram(all_acc, bs)
    hist_ngram = acceptance_histogram(ngram_acc, bs) if do_ngram else None
    return {
        "tau": tau_of(all_acc),
        "histogram": {str(k): v for k, v in sorted(hist.items())},
        "tokens_per_s_spec": tps_spec,
        "tokens_per_s_plain": tps_plain,
        "speedup": (tps_spec / tps_plain) if tps_plain else None,
        "num_prompts": len(prompt_ids),
        "outputs_match": match,
        "mismatched_prompts": mismatches,
        "tau_per_prompt": per_prompt,
        "steps": len(all_acc),
        "new_tokens": n_spec,
        "block_size": bs,
        "temperature": float(temperature),
        "max_new_tokens": int(max_new_tokens),
        "tau_ngram": tau_of(ngram_acc) if do_ngram else None,
        "histogram_ngram": {str(k): v for k, v in sorted(hist_ngram.items())} if hist_ngram is not None else None,
        "tokens_per_s_ngram": tps_ngram,
        "speedup_ngram": (tps_ngram / tps_plain) if (tps_ngram is not None and tps_plain) else None,
        "outputs_match_ngram": match_ngram,
        "mismatched_prompts_ngram": mismatches_ngram,
        "steps_ngram": len(ngram_acc) if do_ngram else None,
        "new_tokens_ngram": n_ngram if do_ngram else None,
        "ngram_k": ngram_k if do_ngram else None,
        # the raw sums behind the rates, so results over several prompt sets pool exactly (eval --suite)
        "seconds_spec": t_spec, "seconds_plain": t_plain if measure_plain else None,
        "seconds_ngram": t_ngram if do_ngram else None, "new_tokens_plain": n_plain if measure_plain else None,
        "block_seeds": cfg.block_seeds,
        "tau_unseeded": tau_of(unseeded_acc) if unseeded_acc is not None else None,
    }


# --------------------------------------------------------------------------- command


def _run_config(run_dir: Path | None):
    return read_run_config(run_dir)


def _heldout_from_run(run_cfg, target, num_prompts: int) -> list[str]:
    """`eval_prompts` of the run: the prompts the in-training eval, the demo and compare score."""
    if run_cfg is None:
        raise _err("--prompts heldout needs the run's config.yaml (give --drafter RUN_DIR or a checkpoint "
                   "inside one), or pass --prompts FILE.jsonl")
    d = run_cfg.data
    try:
        prompts = eval_prompts(run_cfg, target, num_prompts)
    except DataError as e:
        raise _err(f"cannot read held-out conversations: {e}; pass --prompts FILE.jsonl") from None
    if not prompts:
        raise _err(f"the run's data ({d.source}, heldout_fraction={d.heldout_fraction}) has no held-out "
                   f"conversation whose prompt fits data.max_tokens={d.max_tokens}; pass --prompts FILE.jsonl")
    return prompts


def _print_table(res: dict[str, Any], title: str, drafter_label: str = "DFlash drafter") -> None:
    from rich.console import Console
    from rich.table import Table

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
    src = resolve_drafter_source(drafter)
    prompt_list = None if (suites or prompts == "heldout") else read_prompts_file(prompts, num_prompts)
    run_cfg = _run_config(src.run_dir)
    target_path = target or src.target_path or (run_cfg.target.path if run_cfg else None)
    if not target_path:
        raise _err(f"{src.path}: no target recorded; pass --target")
    tcfg = TargetConfig(path=target_path)
    if run_cfg is not None and run_cfg.target.path == target_path:
        tcfg = run_cfg.target
    tgt = load_target(tcfg)
    if src.config.vocab_size and src.config.vocab_size != tgt.vocab_size:
        raise _err(f"drafter {src.path} was made for a vocabulary of {src.config.vocab_size}, "
                   f"target {target_path} has {tgt.vocab_size}")
    if src.config.hidden_size != tgt.hidden_size or max(src.config.target_layer_ids) >= tgt.num_layers:
        raise _err(f"drafter {src.path} (hidden {src.config.hidden_size}, target layers "
                   f"{src.config.target_layer_ids}) does not fit target {target_path} "
                   f"(hidden {tgt.hidden_size}, {tgt.num_layers} layers)")
    model = build_drafter(src.config, seed=seed)
    if not untrained:
        missing, unexpected = model.load_state_dict(src.state_dict, strict=False)
        if missing or unexpected:
            raise _err(f"{src.path}: weights do not fit the drafter config: missing {missing[:4]}, "
                       f"unexpected {unexpected[:4]}")
    model.to(tgt.device).eval()
    if suites:
        return _eval_suites(model, tgt, suites, src, target_path, num_prompts, max_new_tokens, temperature, seed,
                            untrained, as_json)
    if prompt_list is None:
        prompt_list = _heldout_from_run(run_cfg, tgt, num_prompts)
    progress = None
    if not as_json:
        import sys

        def progress(i: int, n: int) -> None:
            print(f"  prompt {i}/{n}", file=sys.stderr, flush=True)

    if len(prompt_list) < num_prompts:
        import sys

        where = "held-out prompts that fit data.max_tokens" if prompts == "heldout" else f"prompts in {prompts}"
        print(f"note: evaluating {len(prompt_list)} prompts, not the {num_prompts} asked for: there are only "
              f"{len(prompt_list)} {where}", file=sys.stderr, flush=True)
    res = evaluate_tau(model, tgt, prompt_list, max_new_tokens, temperature, seed, progress=progress)
    res.update({
        "drafter": str(src.path),
        "step": src.step,
        "target": target_path,
        "untrained": bool(untrained),
        "prompts": prompts,
        "num_prompts_requested": num_prompts,  # num_prompts (evaluated) is lower when fewer were available
    })
    if as_json:
        print(json.dumps(_jsonable(res), allow_nan=False))
    else:
        kind = "untrained drafter (random init)" if untrained else f"{src.kind} {src.path}"
        label = "DFlash drafter (untrained)" if untrained else "DFlash drafter (trained)"
        _print_table(res, f"DFlash eval: {kind} vs {target_path}, T={temperature}", label)
    return res


def _eval_suites(model, tgt, suites, src, target_path: str, num_prompts: int, max_new_tokens: int, temperature: float,
                 seed: int, untrained: bool, as_json: bool) -> dict[str, Any]:
    from dflash_train.eval.suite_bench import eval_suites, print_suite_tables, stderr_log

    progress = None if as_json else (lambda i, n: stderr_log(f"  prompt {i}/{n}"))
    res = eval_suites(model, tgt, suites, num_prompts, max_new_tokens, temperature, seed, progress)
    res.update({"drafter": str(src.path), "step": src.step, "target": target_path, "untrained": bool(untrained)})
    if as_json:
        print(json.dumps(_jsonable(res), allow_nan=False))
    else:
        print_suite_tables(res, f"DFlash eval per suite: {src.kind} {src.path} vs {target_path}, T={temperature}")
    return res
