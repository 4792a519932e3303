"""`serve-bench --suite` and `eval --suite`: one row per benchmark suite (and per MT-Bench category).

The suites and their prompt formats are `eval/suites.py`'s. Both commands decode every turn of
every item of the chosen suites, MT-Bench's second turns after the target's own greedy first
answers, and report per group of prompts:

* in vLLM (`engine/suite_serving.py`, `serve_suites`): each method served once over all the suites' prompts (one engine start
  each, plus one plain engine for MT-Bench's first answers); a row's tau, tokens per draft and
  tok/s come from the per-prompt engine counters and times of its prompts; tau is also our replay
  of the same drafter on plain vLLM's outputs (greedy only: sampled outputs are not replayable);
* in our decoding (`eval_suites`): `evaluate_tau` on each prompt, pooled per group (tau from the
  pooled acceptance histograms, tok/s from the summed tokens and seconds).

The printed layout ends with z-lab's table: speedup / tau per suite, one line per method.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import torch
from rich.console import Console
from rich.table import Table

from dflash_train.config import RunConfig
from dflash_train.eval.specdec import plain_generate
from dflash_train.eval.suites import Group, SuitePrompt, all_turns, describe, groups_of, load_suite
from dflash_train.eval.tau import evaluate_tau
from dflash_train.results import Figures, fmt, group_figures, lossless_of
from dflash_train.targets.chat_template import prompt_format

Log = Callable[[str], None]


def suite_items(names: Sequence[str], num_prompts: int):
    """The first `num_prompts` items of each suite (z-lab's order)."""
    return [it for name in names for it in load_suite(name, num_prompts)]


# ----------------------------------------------------------------- served by vLLM


def group_head(g: Group) -> dict[str, Any]:
    return {"suite": g.suite, "category": g.category, "label": g.label, "num_prompts": len(g.indices)}


def target_answers(target, max_new_tokens: int,
                   run_cfg: RunConfig | None = None) -> Callable[[list[SuitePrompt]], list[str]]:
    """`all_turns`' answerer by our own plain decoding of a loaded target: greedy, whatever the
    temperature measured (the target's own answer), asked in the run's chat format. The demo uses
    it too: its target is loaded, and a vLLM run for the answers would be one more engine start."""
    def answer(prompts: list[SuitePrompt]) -> list[str]:
        chat = prompt_format(target, run_cfg)
        out = []
        for p in prompts:
            ids = torch.tensor([chat.prompt_ids(list(p.messages))], device=target.device)
            seq = plain_generate(target, ids, max_new_tokens, chat.stop_token_ids())[0, ids.shape[1]:]
            out.append(target.tokenizer.decode(seq.tolist(), skip_special_tokens=True))
        return out

    return answer


def eval_suites(drafter, target, names: Sequence[str], num_prompts: int, max_new_tokens: int, temperature: float,
                seed: int, progress: Callable[[int, int], None] | None = None,
                run_cfg: RunConfig | None = None) -> dict[str, Any]:
    """`evaluate_tau` over the suites' prompts with our decoding, pooled per group; the prompts in
    the chat format of the run `run_cfg` (`prompt_format`)."""
    chat = prompt_format(target, run_cfg)
    stops = chat.stop_token_ids()
    prompts = all_turns(suite_items(names, num_prompts), target_answers(target, max_new_tokens, run_cfg))
    per_prompt = []
    for i, p in enumerate(prompts):
        # one prompt per call (seed + i: the sampling seed of prompt i), pooled per group below
        per_prompt.append(evaluate_tau(drafter, target, [], max_new_tokens, temperature, seed + i,
                                       prompt_ids=[chat.prompt_ids(list(p.messages))], stop_token_ids=stops))
        if progress is not None:
            progress(i + 1, len(prompts))
    groups = [{**group_head(g), **pool_eval([per_prompt[i] for i in g.indices], g.indices)}
              for g in groups_of(prompts)]
    return {"measured_by": "dflash-train", "suites": list(names), "k": drafter.cfg.block_size - 1,
            "temperature": float(temperature), "max_new_tokens": int(max_new_tokens),
            "num_prompts_per_suite": int(num_prompts), "groups": groups, "prompts": describe(prompts)}


def pool_eval(results: Sequence[dict], indices: Sequence[int]) -> dict[str, Any]:
    """Per-prompt `evaluate_tau` results pooled: tau from the summed histograms, tok/s from summed
    tokens and seconds, lossless only if every prompt's output equalled plain decoding's."""
    def tau(hist_key: str) -> float | None:
        hists = [r[hist_key] for r in results if r.get(hist_key)]
        steps = sum(v for h in hists for v in h.values())
        return sum(int(k) * v for h in hists for k, v in h.items()) / steps if steps else None

    def rate(tokens_key: str, seconds_key: str) -> float | None:
        if any(r.get(seconds_key) is None for r in results):
            return None
        seconds = sum(r[seconds_key] for r in results)
        return sum(r[tokens_key] for r in results) / seconds if seconds > 0 else None

    def lossless(key: str) -> tuple[bool | None, list[int]]:
        flags = [r.get(key) for r in results]
        if any(f is None for f in flags):
            return None, []
        bad = [i for i, f in zip(indices, flags) if not f]
        return not bad, bad

    spec, plain = rate("new_tokens", "seconds_spec"), rate("new_tokens_plain", "seconds_plain")
    ngram = rate("new_tokens_ngram", "seconds_ngram")
    ok, bad = lossless("outputs_match")
    ok_ng, bad_ng = lossless("outputs_match_ngram")
    dflash = Figures(tau("histogram"), None, spec, spec / plain if spec and plain else None, ok, tuple(bad))
    lookup = Figures(tau("histogram_ngram"), None, ngram, ngram / plain if ngram and plain else None, ok_ng,
                     tuple(bad_ng))
    return {"tau_replay": None, **group_figures(dflash, lookup, plain)}


# ----------------------------------------------------------------- the tables


def print_suite_tables(res: dict[str, Any], title: str) -> None:
    """One row per suite and MT-Bench category, then z-lab's layout (speedup / tau per suite)."""
    engine = res["measured_by"] == "vllm"
    sampled = res.get("temperature", 0.0) > 0
    t = Table(title=title)
    cols = ["suite", "prompts", "tau", "tau (replay)", "tokens/draft", "tok/s", "vs plain",
            "n-gram tau", "n-gram vs plain", "plain tok/s", "lossless"]
    if not engine:  # our decoding: tau is measured by decoding itself, and it has no per-draft counter
        cols = [c for c in cols if c not in ("tau (replay)", "tokens/draft")]
    for c in cols:
        t.add_column(c, justify="left" if c == "suite" else "right")
    for g in res["groups"]:
        cells = {"suite": g["label"], "prompts": str(g["num_prompts"]), "tau": fmt(g["tau"], ".3f", "-"),
                 "tau (replay)": fmt(g["tau_replay"], ".3f", "-"), "tokens/draft": fmt(g["tokens_per_draft"], ".3f", "-"),
                 "tok/s": fmt(g["tokens_per_s"], ".2f", "-"), "vs plain": fmt(g["speedup"], ".2f", "-", "x"),
                 "n-gram tau": fmt(g["tau_ngram"], ".3f", "-"), "n-gram vs plain": fmt(g["speedup_ngram"], ".2f", "-", "x"),
                 "plain tok/s": fmt(g["tokens_per_s_plain"], ".2f", "-"), "lossless": group_lossless(g, sampled)}
        t.add_row(*(cells[c] for c in cols))
    # eleven columns: piped into a file or a log, do not wrap them at rich's default 80 columns
    con = Console() if sys.stdout.isatty() else Console(width=160)
    con.print(t)

    z = Table(title="speedup / tau per suite (z-lab's layout)")
    z.add_column("method")
    suites = [g for g in res["groups"] if g["category"] is None]
    for g in suites:
        z.add_column(g["suite"], justify="right")
    ngram_label = "vLLM n-gram" if engine else f"prompt lookup (k={res['k']})"
    drafter_label = "DFlash (vLLM)" if engine else "DFlash (ours)"
    for label, sfx in ((ngram_label, "_ngram"), (drafter_label, "")):
        z.add_row(label, *(f"{fmt(g['speedup' + sfx], '.2f', '-', 'x')} / {fmt(g['tau' + sfx], '.2f', '-')}"
                           for g in suites))
    con.print(z)
    where = f"vLLM {res['vllm_version']}, {res['dtype']}" if engine else "our decoding (dflash-train eval)"
    sampling = (f"temperature {res['temperature']:g}" + (f", top-p {res['top_p']:g}" if "top_p" in res else "")
                if sampled else "greedy")
    con.print(f"{where}, k {res['k']}, <= {res['num_prompts_per_suite']} items per suite (z-lab's order), "
              f"<= {res['max_new_tokens']} new tokens, {sampling}, batch 1; MT-Bench: both turns, the second after "
              "the target's own greedy first answer. tau = tokens per target forward"
              + (" (engine counters; replay = our drafter on plain vLLM's outputs)" if engine else "")
              + (". Lossless n/a under sampling: the acceptance rule's test is the check "
                 "(tests/test_eval_specdec.py)." if sampled else "."))


def group_lossless(g: dict[str, Any], sampled: bool) -> str:
    """A group's lossless cell: DFlash's and n-gram's verdicts pooled (results.lossless_of)."""
    if sampled:
        return "n/a (sampling)"
    return lossless_of([("DFlash", g.get("lossless")), ("n-gram", g.get("lossless_ngram"))])


def stderr_log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
