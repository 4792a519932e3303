"""The measurement of methods in vLLM: plain vLLM, vLLM's n-gram drafting and a DFlash export,
served one engine at a time on the same prompts by one worker job (engine/vllm_process.py), and
the rows made of the engine's own counters. `serve-bench` (engine/serve_bench.py), its k sweep
(engine/k_sweep.py), its suites (engine/suite_serving.py), `compare --engine` and the demo all
measure through here.

Prompts are token ids in the target's chat format, greedy (or sampled), batch 1, the chat
format's stop tokens; n-gram (lookup 1-3 tokens) and DFlash draft k tokens per step (default
block_size - 1; a DFlash block is then the anchor and k masks). Per method:

* tau = tokens per target decode step = (n - P) / (n - P - A) over n generated tokens of P
  prompts with A accepted draft tokens (the engine's ``spec_decode_num_accepted_tokens``):
  each prompt's first token comes from the prefill, every decode step produces its accepted
  drafts plus one token of the target, and a step without a draft (n-gram found no match)
  produces one. This is our `eval`'s tau (its verify steps exclude the prefill too).
* tokens per draft = 1 + A / drafts (steps that had a draft only);
* tok/s by wall clock over the prompts (after one warm-up generation), speedup over plain vLLM;
* lossless: every output equals plain vLLM's token for token.

`dflash+lookup` is the DFlash export with our vLLM plugin (plugins/vllm_dflash_lookup) acting in
its engine: prompt lookup's continuation where its match is long enough (the gate), and/or lookup's
proposal in the block's mask slots (seeds). `dflash+lookup` alone serves the measured default
(`LOOKUP_MODE`, match >= `LOOKUP_MIN_MATCH`, docs/benchmarks.md); `dflash+lookup:MODE@N` another
mode (gate, seed, seed+gate) or threshold, e.g. `dflash+lookup:seed+gate@4`.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from dflash_train.engine.vllm_process import max_model_len, one_line, run_worker
from dflash_train.errors import UserError

# float32 by default: in bfloat16 the verify forward (k + 1 query tokens) and plain decoding
# (1 token) run different GEMM shapes whose rounding flips near-tied greedy tokens, so outputs
# drift from plain vLLM's even with no draft accepted (measured: 3 prompts x 32 tokens, lossless
# NO in bf16, yes in fp32); fp32 also matches our `eval`, which runs the target in fp32 on CPU
DEFAULT_DTYPE = "float32"
COUNTER_KEYS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
LOOKUP = "dflash+lookup"
LABELS = {"plain": "plain vLLM", "ngram": "vLLM n-gram", "dflash": "DFlash (vLLM)", LOOKUP: "DFlash + lookup (vLLM)"}
# the plugin's mode and gate threshold `dflash+lookup` serves: measured, docs/benchmarks.md "DFlash + lookup
# in vLLM (issue 46)"
LOOKUP_MODE = "gate"
LOOKUP_MIN_MATCH = 3
LOOKUP_MODES = ("gate", "seed", "seed+gate")


def method_spec(text: str) -> dict[str, Any]:
    """A method as the user names it -> the worker's method fields (name; for DFlash + lookup the
    plugin's mode and gate threshold: `dflash+lookup[:MODE][@N]`). Unknown: one line."""
    text = str(text)
    if text in LABELS and text != LOOKUP:
        return {"name": text}
    rest = text[len(LOOKUP):] if text.startswith(LOOKUP) else None
    if rest is None or (rest and rest[0] not in ":@"):
        raise UserError(f"--method {text!r}: choose from {', '.join(LABELS)} ({LOOKUP}:MODE@N for another mode "
                        f"or gate threshold)")
    mode, _, n = rest.lstrip(":").partition("@")
    if mode and mode not in LOOKUP_MODES:
        raise UserError(f"--method {text!r}: the lookup mode is one of {', '.join(LOOKUP_MODES)}")
    if n and not (n.isdigit() and int(n) >= 1):
        raise UserError(f"--method {text!r}: the gate's minimum match (after @) is a number of tokens >= 1")
    return {"name": text, "lookup": mode or LOOKUP_MODE, "min_match": int(n) if n else LOOKUP_MIN_MATCH}


def is_lookup(method: str) -> bool:
    return str(method).startswith(LOOKUP)


def label_of(method: str) -> str:
    """The printed name of a method: `dflash+lookup` at its default as "DFlash + lookup (vLLM)",
    another mode or threshold named in it."""
    if not is_lookup(method) or method == LOOKUP:
        return LABELS.get(method, method)
    spec = method_spec(method)
    gate = f", match >= {spec['min_match']}" if "gate" in spec["lookup"] else ""
    return f"DFlash + lookup (vLLM, {spec['lookup']}{gate})"


def measure_in_vllm(export_dir: Path, target_dir: Path, prompt_ids: Sequence[Sequence[int]],
                    stop_token_ids: Sequence[int], max_new_tokens: int, methods: Sequence[str] = ("plain", "ngram", "dflash"),
                    k: int | dict[str, int] | None = None, dtype: str | None = None,
                    log: Callable[[str], None] | None = None, timeout_s: float = 3600.0, temperature: float = 0.0,
                    top_p: float = 1.0) -> dict[str, Any]:
    """Serve `target_dir` with each method in vLLM; returns {"vllm_version", "rows": [...], ...}
    (module docstring). Raises UserError (one line) when vLLM cannot serve the pair."""
    t0 = time.perf_counter()
    res, job = serve_methods(export_dir, target_dir, prompt_ids, stop_token_ids, max_new_tokens, methods, k, dtype,
                             log, timeout_s, temperature, top_p)
    return measurement(res, job, range(len(job["prompts"])), time.perf_counter() - t0)


def measurement(res: dict[str, Any], job: dict[str, Any], indices: Sequence[int], seconds: float) -> dict[str, Any]:
    """`measure_in_vllm`'s result for some of a job's prompts (the demo serves its held-out prompts and
    the suites' in one job): rows from those prompts' own times and counters, their outputs."""
    indices = list(indices)
    greedy = job["temperature"] <= 0
    methods = methods_over(res["methods"], indices)
    # engine_fixes: what the worker corrected in this vLLM build (vllm_worker.fix_dflash_context_k_norm)
    return {"vllm_version": res.get("vllm_version"), "engine_fixes": res.get("engine_fixes", []),
            "rows": summarise(methods, len(indices), compare_outputs=greedy),
            "k": job["methods"][0]["k"], "dtype": job["dtype"], "num_prompts": len(indices),
            "max_new_tokens": job["max_new_tokens"], "temperature": job["temperature"], "top_p": job["top_p"],
            "seconds": seconds, "outputs": {m["name"]: m["outputs"] for m in methods}}


def serve_methods(export_dir: Path, target_dir: Path, prompt_ids: Sequence[Sequence[int]],
                  stop_token_ids: Sequence[int], max_new_tokens: int, methods: Sequence[str],
                  k: int | dict[str, int] | None = None, dtype: str | None = None,
                  log: Callable[[str], None] | None = None, timeout_s: float = 3600.0, temperature: float = 0.0,
                  top_p: float = 1.0, ks: Sequence[int] | None = None,
                  exports: Sequence[Path] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The worker's raw result (each method's outputs, seconds and counters, in total and per prompt)
    and the job it ran; `k`: one for all methods, or {method: k} (DFlash's for methods it does not name);
    `ks`: a k per method in order (the k sweep); `exports`: the export each method serves, in order
    (`compare` serves its variants in one job; None: `export_dir` for all). Raises UserError
    (one line) when vLLM cannot serve the pair."""
    export_dir = Path(export_dir).resolve()
    if isinstance(k, dict):  # a k per method (`--k auto` picks one for DFlash and one for DFlash + lookup)
        ks = ks or [k.get(m, k.get("dflash")) for m in methods]
        k = k.get("dflash")
    k = int(k or export_block_size(export_dir) - 1)
    ks = [int(x or k) for x in ks] if ks is not None else [k] * len(methods)
    job = {
        "target": str(target_dir), "dtype": dtype or DEFAULT_DTYPE,
        "max_model_len": max_model_len(target_dir),
        "max_new_tokens": int(max_new_tokens), "prompts": [list(map(int, p)) for p in prompt_ids],
        "stop_token_ids": [int(s) for s in stop_token_ids],
        "temperature": float(temperature), "top_p": float(top_p),
        "methods": [{**method_spec(m), "k": mk, **({"model": str(Path(e).resolve())} if m == "dflash" or is_lookup(m) else {})}
                    for m, mk, e in zip(methods, ks, exports or [export_dir] * len(methods))],
    }
    if log:
        sampling = f"temperature {temperature:g}, top-p {top_p:g}" if temperature > 0 else "greedy"
        what = ", ".join(methods) if len(set(ks)) == 1 else ", ".join(
            m if m == "plain" else f"{m} k {mk}" for m, mk in zip(methods, ks))
        k_text = f", k {k}" if len(set(ks)) == 1 else ""
        log(f"vLLM: serving {target_dir} with {what} ({len(job['prompts'])} prompts, "
            f"<= {max_new_tokens} new tokens{k_text}, {job['dtype']}, {sampling}); one engine start each")
    res = run_worker(job, timeout_s)
    if "error" in res:
        raise UserError(f"vLLM cannot serve {export_dir.name} on {target_dir}: {one_line(res['error'])}")
    return res, job


def export_block_size(export_dir: Path) -> int:
    """The block size an export's config.json records (ours and the public DFlash layout)."""
    cfg = json.loads((Path(export_dir) / "config.json").read_text())
    return int(cfg.get("block_size") or cfg.get("dflash_config", {}).get("block_size", 16))


def summarise(methods: Sequence[dict], num_prompts: int, compare_outputs: bool = True) -> list[dict[str, Any]]:
    """One row per method: tau, tokens per draft, tok/s, speedup and lossless vs plain.
    compare_outputs=False (sampling): outputs differ by chance, lossless is None (the acceptance
    rule's own test is the check there)."""
    plain = next((m for m in methods if m["name"] == "plain"), None)
    rows = []
    for m in methods:
        n = sum(len(o) for o in m["outputs"])
        acc = float(m.get("spec_decode_num_accepted_tokens", 0.0))
        drafts = float(m.get("spec_decode_num_drafts", 0.0))
        # tau over the tokens the outputs hold: the counter also counts what the request's end cut
        # (vllm_worker.kept_accepted); without the per-request record, the counter
        kept = m.get("accepted_in_output")
        kept = acc if kept is None else float(kept)
        decode_tokens = n - num_prompts
        steps = decode_tokens - kept
        tps = n / m["seconds"] if m["seconds"] > 0 else float("nan")
        rows.append({
            "method": m["name"], "label": label_of(m["name"]), "k": m.get("k", 0) if m["name"] != "plain" else 0,
            "tau": decode_tokens / steps if steps > 0 else float("nan"),
            "tokens_per_draft": 1.0 + acc / drafts if drafts else None,
            "drafts": drafts, "accepted_tokens": acc, "accepted_in_output": kept,
            "draft_tokens": float(m.get("spec_decode_num_draft_tokens", 0.0)),
            "new_tokens": n, "seconds": m["seconds"], "load_seconds": m["load_seconds"], "tokens_per_s": tps,
            "speedup": None, "lossless": None,
            # per prompt, the engine's accepted drafts at each verify step (raw: the last step's may
            # exceed what the output kept; vllm_worker.produced_per_step clips it), for step-by-step checks
            "accepted_per_step": [p.get("accepted_per_step") for p in m.get("per_prompt", [])],
            **({"lookup": m["lookup"]} if m.get("lookup") else {}),
        })
    if plain is not None:
        base = next(r for r in rows if r["method"] == "plain")
        for r, m in zip(rows, methods):
            r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else None
            if compare_outputs:
                r["lossless"] = m["outputs"] == plain["outputs"]
    return rows


def methods_over(methods: Sequence[dict], indices: Sequence[int]) -> list[dict]:
    """The worker's methods restricted to some of the prompts (a suite, a category): their outputs,
    and seconds and counters summed from the per-prompt figures."""
    out = []
    for m in methods:
        per = [m["per_prompt"][i] for i in indices]
        out.append({**m, "outputs": [m["outputs"][i] for i in indices], "per_prompt": per,
                    "seconds": sum(p["seconds"] for p in per),
                    **{c: sum(p[c] for p in per) for c in COUNTER_KEYS},
                    "accepted_in_output": (None if any(p.get("accepted_in_output") is None for p in per)
                                           else sum(p["accepted_in_output"] for p in per))})
    return out
