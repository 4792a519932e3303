"""`serve-bench --suite` in vLLM: each method served once over all the chosen suites' prompts (one
engine start each, plus one plain engine for MT-Bench's first answers); a row's tau, tokens per draft
and tok/s come from the per-prompt engine counters and times of its prompts; tau is also our replay
of the same drafter on plain vLLM's outputs (greedy only: sampled outputs are not replayable).
The suites, the grouping and the printed tables are eval/'s (`eval/suites.py`, `eval/suite_bench.py`);
DFlash + lookup (`dflash+lookup`, our vLLM plugin), when served, gets its figures per group under the
``_lookup`` suffix and a table of its own (`print_lookup_suites`). Other prompts (`serve-bench --prompts
FILE --suite ...`: `lead_ids`) are served first in the same engine runs, as the demo serves its held-out
prompts beside the suites': their rows are engine/measure.py's `measurement` of those prompts alone."""
from __future__ import annotations

import sys
import time
from typing import Any, Sequence

from rich.console import Console
from rich.table import Table

from dflash_train.checkpoint.source import resolve_drafter_source
from dflash_train.config import RunConfig, TargetConfig
from dflash_train.engine.measure import (DEFAULT_DTYPE, is_lookup, label_of, measurement, methods_over,
                                         serve_methods, summarise)
from dflash_train.engine.vllm_process import generate_in_vllm
from dflash_train.eval.replay import replay_acceptance
from dflash_train.eval.source import load_drafter
from dflash_train.eval.suite_bench import Log, group_head, suite_items
from dflash_train.eval.suites import SuitePrompt, all_turns, describe, groups_of
from dflash_train.results import Figures, fmt, group_figures, lossless_cell
from dflash_train.targets import load_target, served_target_dir
from dflash_train.targets.chat_template import prompt_format


def serve_suites(export_dir, target_path: str, tokenizer_target, names: Sequence[str], num_prompts: int,
                 max_new_tokens: int, methods: Sequence[str], k: int | dict[str, int] | None = None,
                 dtype: str | None = None,
                 temperature: float = 0.0, top_p: float = 1.0, log: Log | None = None,
                 run_cfg: RunConfig | None = None) -> dict[str, Any]:
    """The export served by vLLM over the suites; `tokenizer_target`: anything with .tokenizer and
    .family, whose prompts are rendered in the chat format of the run `run_cfg` (`prompt_format`:
    its template and data.chat_template_kwargs). Rows per group (module docstring)."""
    _, suites = serve_with_suites(export_dir, target_path, tokenizer_target, names, num_prompts, max_new_tokens,
                                  methods, k=k, dtype=dtype, temperature=temperature, top_p=top_p, log=log,
                                  run_cfg=run_cfg)
    return suites


def serve_with_suites(export_dir, target_path: str, tokenizer_target, names: Sequence[str], num_prompts: int,
                      max_new_tokens: int, methods: Sequence[str], lead_ids: Sequence[Sequence[int]] = (),
                      k: int | dict[str, int] | None = None, dtype: str | None = None, temperature: float = 0.0,
                      top_p: float = 1.0, log: Log | None = None,
                      run_cfg: RunConfig | None = None) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """`lead_ids` (token ids in the same chat format, or none) and then the suites' prompts, each method
    served once over all of them: (`measurement` of the lead prompts, None without any; the suites'
    result as `serve_suites` returns it, of the suites' prompts alone)."""
    fmt = prompt_format(tokenizer_target, run_cfg)
    stops = fmt.stop_token_ids()
    target_dir = served_target_dir(target_path)
    dtype = dtype or DEFAULT_DTYPE
    answered: list[list[int]] = []  # the token ids of those answers, in prompt order (--json shows them)

    def first_answers(prompts: list[SuitePrompt]) -> list[str]:
        # greedy, batch 1, the dtype measured: the answers plain vLLM gives these prompts in the bench
        if log:
            log(f"vLLM: the target's own greedy answers to {len(prompts)} first turns (the second turns follow them)")
        ids = [fmt.prompt_ids(list(p.messages)) for p in prompts]
        answers, _ = generate_in_vllm(target_dir, ids, stops, max_new_tokens, dtype, max_num_seqs=1)
        answered.extend(a for a, _ in answers)
        return [fmt.tokenizer.decode(a, skip_special_tokens=True) for a, _ in answers]

    prompts = all_turns(suite_items(names, num_prompts), first_answers)
    ids = [fmt.prompt_ids(list(p.messages)) for p in prompts]
    lead = [list(p) for p in lead_ids]
    t0 = time.perf_counter()
    raw, job = serve_methods(export_dir, target_dir, lead + ids, stops, max_new_tokens, methods, k, dtype, log,
                             temperature=temperature, top_p=top_p)
    seconds = time.perf_counter() - t0
    k = job["methods"][0]["k"]
    mine = range(len(lead), len(lead) + len(ids))
    outputs = {m["name"]: [m["outputs"][i] for i in mine] for m in raw["methods"]}
    replayed = None
    if temperature <= 0 and "dflash" in outputs and "plain" in outputs:
        replayed = replay_per_prompt(export_dir, target_path, ids, outputs["plain"], k, log)
    res = suite_result(raw, job, prompts, names, num_prompts, offset=len(lead), replayed=replayed)
    measured = measurement(raw, job, range(len(lead)), seconds) if lead else None
    return measured, {**res, "answers_followed": answered, "outputs": outputs}


def suite_result(raw: dict[str, Any], job: dict[str, Any], prompts: Sequence[SuitePrompt], names: Sequence[str],
                 num_prompts: int, offset: int = 0, replayed: Sequence[Sequence[int]] | None = None) -> dict[str, Any]:
    """The per-suite (and MT-Bench category) rows of the suites' prompts, which sit at `offset` in
    the job's prompts (the demo serves its held-out prompts first, in the same engine runs);
    `replayed`: our acceptance lengths per suite prompt, or None."""
    greedy = job["temperature"] <= 0
    groups = []
    for g in groups_of(prompts):
        rows = summarise(methods_over(raw["methods"], [offset + i for i in g.indices]), len(g.indices),
                         compare_outputs=greedy)
        groups.append({**group_head(g), **engine_figures(rows),
                       "tau_replay": pooled_tau([replayed[i] for i in g.indices]) if replayed else None,
                       "rows": rows})
    return {"measured_by": "vllm", "vllm_version": raw.get("vllm_version"), "suites": list(names),
            "k": job["methods"][0]["k"], "dtype": job["dtype"], "temperature": job["temperature"],
            "top_p": job["top_p"], "max_new_tokens": job["max_new_tokens"], "num_prompts_per_suite": int(num_prompts),
            "groups": groups, "prompts": describe(prompts)}


def replay_per_prompt(export_dir, target_path: str, prompt_ids, outputs, k: int, log: Log | None) -> list[list[int]]:
    """Our acceptance lengths of the export's drafter on plain vLLM's outputs, prompt by prompt
    (masks only, k drafts from a block of k + 1: as the engine drafts them)."""
    if log:
        log(f"replay: the drafter on plain vLLM's {len(outputs)} outputs (our tau of the same drafter)")
    target = load_target(TargetConfig(path=target_path))
    drafter = load_drafter(resolve_drafter_source(export_dir), target.device)
    return [replay_acceptance(drafter, target, list(p) + list(out), len(p), seeded=False, k=k)
            for p, out in zip(prompt_ids, outputs)]


def pooled_tau(acceptance: Sequence[Sequence[int]]) -> float | None:
    steps = [a for per in acceptance for a in per]
    return sum(steps) / len(steps) if steps else None


def engine_figures(rows: Sequence[dict]) -> dict[str, Any]:
    """A group's flat figures from its engine rows: DFlash's, n-gram's beside them, plain's tok/s;
    DFlash + lookup's (the first such row) under the ``_lookup`` suffix when it was served."""
    by = {r["method"]: r for r in rows}
    out = group_figures(Figures.of_engine(by.get("dflash", {})), Figures.of_engine(by.get("ngram", {})),
                        by.get("plain", {}).get("tokens_per_s"))
    lookup = next((r for r in rows if is_lookup(r["method"])), None)
    if lookup is not None:
        out.update({f"{key}_lookup": lookup.get(key) for key in LOOKUP_KEYS})
        out["method_lookup"] = lookup["method"]
    return out


LOOKUP_KEYS = ("tau", "tokens_per_draft", "tokens_per_s", "speedup", "lossless", "k")


def print_lookup_suites(res: dict[str, Any], console: Console | None = None) -> None:
    """DFlash + lookup per suite and MT-Bench category, beside DFlash alone and n-gram (the suite
    table of eval/suite_bench.py knows those two only); nothing when it was not served."""
    groups = [g for g in res.get("groups", []) if "tau_lookup" in g]
    if not groups:
        return
    t = Table(title=f"{label_of(groups[0]['method_lookup'])} per suite (the same engine runs)")
    cols = ("suite", "prompts", "k", "tau", "tokens/draft", "tok/s", "vs plain", "DFlash tau", "DFlash vs plain",
            "n-gram tau", "n-gram vs plain", "lossless")
    for c in cols:
        t.add_column(c, justify="left" if c == "suite" else "right")
    unchecked = "n/a (sampling)" if res.get("temperature", 0.0) > 0 else "-"
    for g in groups:
        t.add_row(g["label"], str(g["num_prompts"]), str(g.get("k_lookup") or "-"), fmt(g["tau_lookup"], ".3f", "-"),
                  fmt(g["tokens_per_draft_lookup"], ".3f", "-"), fmt(g["tokens_per_s_lookup"], ".2f", "-"),
                  fmt(g["speedup_lookup"], ".2f", "-", "x"), fmt(g["tau"], ".3f", "-"),
                  fmt(g["speedup"], ".2f", "-", "x"), fmt(g["tau_ngram"], ".3f", "-"),
                  fmt(g["speedup_ngram"], ".2f", "-", "x"), lossless_cell(g["lossless_lookup"], unchecked))
    con = console or (Console() if sys.stdout.isatty() else Console(width=160))
    con.print(t)


# ----------------------------------------------------------------- our decoding
