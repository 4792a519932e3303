"""Acceptance length (tau) by real speculative decoding: `evaluate_tau`, what `dflash-train eval`,
its suites (eval/suite_bench.py), the in-training eval, compare and the demo all measure with.

Prompts are user messages; each is formatted as ONE user turn in the run's chat format
(`targets.chat_template.prompt_format`: the target's chat_template with the run's
``data.chat_template_kwargs``, or Gemma's ``<start_of_turn>user\\n...<end_of_turn>\\n<start_of_turn>model\\n``)
and generated until the format's stop tokens or max_new_tokens.

tau = total tokens produced / total verify steps over all prompts (the pooled
mean of the per-step acceptance lengths, each = accepted drafts + 1 bonus).

Every evaluation also runs the free baseline, prompt lookup (n-gram drafting,
`dflash_train.eval.ngram`), on the same prompts with the same number of draft
tokens (block_size - 1), and plain decoding of the target: the drafter is
worth its training only where it beats both.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from dflash_train.config import RunConfig
from dflash_train.errors import UserError
from dflash_train.eval.ngram import ngram_generate
from dflash_train.eval.prompts import encode_prompts
from dflash_train.eval.replay import replay_acceptance
from dflash_train.eval.specdec import acceptance_histogram, plain_generate, speculative_generate, tau_of


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
    run_cfg: RunConfig | None = None,
) -> dict[str, Any]:
    """Real speculative decoding over `prompts` (user messages, formatted here).

    Returns tau, histogram {"k": steps that produced k tokens} (k = 1..block_size),
    tokens_per_s_spec, tokens_per_s_plain, speedup, num_prompts, outputs_match
    (greedy: every speculative output equals plain greedy; None when not
    checked), plus tau_per_prompt, steps, new_tokens, block_size, temperature,
    max_new_tokens. Pass `prompt_ids` (+ `stop_token_ids`) to skip formatting; `run_cfg`: the run
    whose chat format renders `prompts` (None: the template without variables).
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
        prompt_ids, stops = encode_prompts(target, prompts, run_cfg)
    else:
        stops = []
    if stop_token_ids is not None:
        stops = list(stop_token_ids)
    if not prompt_ids:
        raise UserError("no prompts to evaluate")
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
