"""Runs inside the vLLM environment (`.venv-vllm`, never the trainer's): serves one target with
each method of a job in turn (plain, n-gram, DFlash) and writes what vLLM measured.

Standard library + vllm only: this file is executed by the vLLM venv's interpreter as a script
(`python vllm_worker.py JOB.json RESULT.json`); `dflash_train.engine.vllm_process.run_worker` writes
the job and reads the result. A job with ``"mode": "generate"`` is batched greedy generation instead. One engine at a time: each method is a fresh `vllm.LLM` (a speculative
config cannot change on a live engine), shut down before the next starts.

Per method: one warm-up generation, then every prompt alone (batch 1: the latency regime
speculative decoding is for), greedy unless the job sets a temperature (then top-p and one seed
per prompt), timed by wall clock. The engine's own counters (`vllm:spec_decode_num_drafts`,
`..._num_draft_tokens`, `..._num_accepted_tokens`) are read before and after each timed prompt
(per prompt and in total); what the warm-up counted is not included.
"""
from __future__ import annotations

import gc
import json
import sys
import time
import traceback

_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens")


def _counters(llm) -> dict[str, float]:
    out = dict.fromkeys(_COUNTERS, 0.0)
    for m in llm.get_metrics():
        if m.name in out and hasattr(m, "value"):
            out[m.name] += float(m.value)
    return out


def _speculative_config(method: dict) -> dict | None:
    if method["name"] == "plain":
        return None
    if method["name"] == "ngram":
        return {"method": "ngram", "num_speculative_tokens": method["k"],
                "prompt_lookup_min": method.get("lookup_min", 1), "prompt_lookup_max": method.get("lookup_max", 3)}
    return {"method": "dflash", "model": method["model"], "num_speculative_tokens": method["k"]}


class Refused(Exception):
    """vLLM cannot serve this pair (said before any engine starts)."""


def check_pair(job: dict) -> None:
    """A DFlash drafter reads auxiliary hidden states of the target's layers: vLLM's model class
    for the target's architecture must expose them (SupportsEagle3). Gemma 3's does not in 0.32."""
    import vllm
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    with open(f"{job['target']}/config.json") as f:
        archs = json.load(f).get("architectures") or ["?"]
    cls = ModelRegistry._try_load_model_cls(archs[0])
    if cls is None:
        raise Refused(f"vLLM {vllm.__version__} has no model class for the target architecture {archs[0]}")
    if not supports_eagle3(cls):
        raise Refused(f"vLLM {vllm.__version__}'s {archs[0]} exposes no auxiliary hidden states "
                      "(it does not implement SupportsEagle3), so it cannot feed a DFlash drafter")


def run_method(job: dict, method: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=job["target"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=0,
              speculative_config=_speculative_config(method), disable_log_stats=False,
              max_num_seqs=1, enable_prefix_caching=False, enforce_eager=job.get("enforce_eager", True))
    load_s = time.perf_counter() - t0
    try:
        llm.generate([TokensPrompt(prompt_token_ids=job["prompts"][0])],
                     SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        before = _counters(llm)
        outputs, seconds, per_prompt = [], 0.0, []
        for i, ids in enumerate(job["prompts"]):
            # under sampling each prompt has its own seed, the same for every method
            sampled = job.get("temperature", 0.0) > 0
            params = SamplingParams(temperature=job.get("temperature", 0.0), top_p=job.get("top_p", 1.0),
                                    seed=job.get("seed", 0) + i if sampled else None, max_tokens=job["max_new_tokens"],
                                    stop_token_ids=job.get("stop_token_ids") or None)
            c0 = _counters(llm)
            t1 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
            dt = time.perf_counter() - t1
            c1 = _counters(llm)
            seconds += dt
            outputs.append(list(out.outputs[0].token_ids))
            # per prompt: a caller reports groups of prompts (suites, categories) from one engine run
            per_prompt.append({"seconds": dt, **{k.split(":", 1)[1]: c1[k] - c0[k] for k in _COUNTERS}})
        after = _counters(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return {"name": method["name"], "k": method.get("k", 0), "load_seconds": load_s, "seconds": seconds,
            "outputs": outputs, "per_prompt": per_prompt,
            **{k.split(":", 1)[1]: after[k] - before[k] for k in _COUNTERS}}


def generate(job: dict) -> dict:
    """Batched greedy generation (target-written training answers): all prompts in one call,
    up to `max_num_seqs` sequences at a time."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["target"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=0,
              max_num_seqs=job.get("max_num_seqs", 64), enable_prefix_caching=False,
              enforce_eager=job.get("enforce_eager", True))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"],
                                stop_token_ids=job.get("stop_token_ids") or None)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return {"outputs": [list(o.outputs[0].token_ids) for o in outs],
            "finished": [o.outputs[0].finish_reason == "stop" for o in outs], "seconds": seconds}


def main(job_path: str, result_path: str) -> int:
    with open(job_path) as f:
        job = json.load(f)
    result: dict = {"methods": []}
    try:
        import vllm

        result["vllm_version"] = vllm.__version__
        if job.get("mode") == "generate":
            result.update(generate(job))
        else:
            if any(m["name"] == "dflash" for m in job["methods"]):
                check_pair(job)
            for method in job["methods"]:
                result["methods"].append(run_method(job, method))
    except BaseException as e:  # noqa: BLE001 - reported to the caller as one line + the traceback
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
