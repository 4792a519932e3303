"""Runs inside the vLLM environment (`.venv-vllm`, never the trainer's): serves one target with
each method of a job in turn (plain, n-gram, DFlash, DFlash + lookup) and writes what vLLM measured.

Standard library + vllm only: this file is executed by the vLLM venv's interpreter as a script
(`python vllm_worker.py JOB.json RESULT.json`); `dflash_train.engine.vllm_process.run_worker` writes
the job and reads the result. A job with ``"mode": "generate"`` is batched greedy generation instead. One engine at a time: each method is a fresh `vllm.LLM` (a speculative
config cannot change on a live engine), shut down before the next starts.

Per method: one warm-up generation, then every prompt alone (batch 1: the latency regime
speculative decoding is for), greedy unless the job sets a temperature (then top-p and one seed
per prompt), timed by wall clock. The engine's own counters (`vllm:spec_decode_num_drafts`,
`..._num_draft_tokens`, `..._num_accepted_tokens`) are read before and after each timed prompt
(per prompt and in total); what the warm-up counted is not included.

DFlash + lookup (a method with ``"lookup": MODE``): the DFlash engine with our vLLM plugin
(plugins/vllm_dflash_lookup) acting in that engine only. The plugin reads DFLASH_LOOKUP when vLLM loads
it in a process, and vLLM loads general plugins once per process (a latch a forked engine core
inherits), so a job with such a method starts every engine core by spawn, with DFLASH_LOOKUP set for
that method (and removed for every other one, whatever the caller's environment says). The plugin
records every process it patched (DFLASH_LOOKUP_RECORD); an engine it did not act in is an error.

Engine processes: vLLM's own VLLM_ENABLE_V1_MULTIPROCESSING=0 (set by the caller) keeps the engine core
and its model in this process: no two spawned interpreters importing vLLM per engine start (a tiny
model's start: 6 s instead of 55 s on 2 busy cores). The tests use it; the figures in docs/ are the
default's (separate processes, as `vllm serve` runs). Lookup methods and a second n-gram engine still
get processes of their own (`engine_plan`).
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import sys
import tempfile
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


def produced_per_step(accepted_per_step, new_tokens: int) -> list[int]:
    """Tokens each verify step put in an output of `new_tokens` tokens: its accepted drafts + 1, the
    step that crosses the output's end (max_tokens, a stop token) clipped there. The first new token
    came from the prefill, not a verify step; our replay's acceptance lengths are these."""
    room, made, out = int(new_tokens) - 1, 0, []
    for accepted in accepted_per_step:
        if made >= room:
            break
        out.append(min(int(accepted) + 1, room - made))
        made += out[-1]
    return out


def kept_accepted(completion) -> int | None:
    """Accepted draft tokens the output kept. The engine's counter counts every token a verify step
    accepted, also those the request's end (max_tokens, a stop token) then cut from the output: up to
    k at the last step, enough to move tau on short outputs (measured: 3.17 counted vs 2.49 kept at
    k 3 on 24-token answers). Walks the request's own per-step record (vLLM's detailed per-request
    spec-decode metrics), clipped at the output's end; None without the record."""
    steps = per_step(completion)
    return None if steps is None else sum(p - 1 for p in produced_per_step(steps, len(completion.token_ids)))


def per_step(completion) -> list[int] | None:
    """The engine's accepted drafts at each verify step of a request (None without the record)."""
    m = getattr(completion, "spec_decode_metrics", None)
    return None if m is None else [int(a) for a in m.per_step_accepted]


def kept_total(per_prompt: list[dict]) -> int | None:
    kept = [p["accepted_in_output"] for p in per_prompt]
    return None if any(k is None for k in kept) else sum(kept)


def grouped_rms_norm_ignores_groups() -> bool:
    """Whether this build's `rms_norm` kernel norms every row of an [L, ..., D] input with the first
    row of an [L, D] weight. vLLM's DFlash model norms its context keys of all layers in one call with
    the layers' k_norm weights stacked (qwen3_dflash `_normalize_context_k`); the CPU kernel of 0.32
    reads weight[0] only (measured), so every layer after the first attends to context keys normed
    with the first layer's k_norm: drafts other than the export's (logits off by 0.05-1.3 on a tiny
    drafter; 2 of 36 drafts at k 3 flipped, tau 2.56 vs 2.49 for the export's own drafts)."""
    import torch
    from vllm import _custom_ops as ops

    x = torch.ones(2, 1, 64)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, torch.stack([torch.ones(64), torch.full((64,), 2.0)]), 1e-6)
    return not torch.allclose(out[1], torch.full_like(out[1], 2.0))


def fix_dflash_context_k_norm() -> bool:
    """Norm each layer's context keys with its own k_norm where the grouped kernel cannot (above),
    so the engine drafts with the drafter the export holds. Applied in this process (the spawned
    engine core imports this script as __mp_main__, which applies it there: bottom of the file).
    Returns whether the fix was needed."""
    try:
        import torch
        from vllm import _custom_ops as ops
        from vllm.model_executor.models import qwen3_dflash
    except ImportError:  # a vLLM without this model: nothing to fix
        return False
    fixed = getattr(qwen3_dflash.DFlashQwen3Model, "_dflash_train_fixed", False)
    try:
        if fixed or not grouped_rms_norm_ignores_groups():
            return fixed
    except RuntimeError:  # a kernel that refuses the check's shape: left as it is (engine_fixes says so)
        return False

    def _normalize_context_k(self, all_k: torch.Tensor) -> torch.Tensor:
        normed = torch.empty_like(all_k)
        for i in range(all_k.shape[0]):  # [L, num_ctx, nkv, hd]: one layer's keys, its own weight
            ops.rms_norm(normed[i], all_k[i], self._k_norm_weights[i].contiguous(), self._rms_norm_eps)
        return normed

    qwen3_dflash.DFlashQwen3Model._normalize_context_k = _normalize_context_k
    qwen3_dflash.DFlashQwen3Model._dflash_train_fixed = True
    return True


class Refused(Exception):
    """vLLM cannot serve this pair (said before any engine starts)."""


_LOOKUP_VARS = ("DFLASH_LOOKUP", "DFLASH_LOOKUP_MIN_MATCH", "DFLASH_LOOKUP_RECORD")


@contextlib.contextmanager
def lookup_env(method: dict, record: str):
    """os.environ as the plugin must read it for `method`'s engine (off for any method without
    "lookup"), restored afterwards."""
    saved = {v: os.environ.get(v) for v in _LOOKUP_VARS}
    for v in _LOOKUP_VARS:
        os.environ.pop(v, None)
    if method.get("lookup"):
        os.environ.update({"DFLASH_LOOKUP": method["lookup"], "DFLASH_LOOKUP_RECORD": record,
                           "DFLASH_LOOKUP_MIN_MATCH": str(method.get("min_match", 3))})
    try:
        yield
    finally:
        for v, val in saved.items():
            if val is None:
                os.environ.pop(v, None)
            else:
                os.environ[v] = val


def check_lookup_plugin() -> None:
    """Before any engine starts: the plugin is installed in this vLLM environment and accepts its version."""
    import importlib
    import importlib.metadata

    import vllm

    eps = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "dflash_lookup"]
    if not eps:
        raise Refused(f"dflash+lookup needs the vllm-dflash-lookup plugin in the vLLM environment ({sys.executable}): "
                      "`make vllm` installs it, or `pip install --no-deps plugins/vllm_dflash_lookup`")
    plugin = importlib.import_module(eps[0].module)
    if not plugin.supported(vllm.__version__):
        raise Refused(f"dflash+lookup: the vllm-dflash-lookup plugin {plugin.__version__} was tested with vLLM "
                      f"{', '.join(plugin.TESTED_VLLM)}, not {vllm.__version__}")


def acted(method: dict, record: str) -> list[dict]:
    """The plugin's records for `method`'s engine: the processes it patched with the method's mode."""
    want = sorted(set(method["lookup"].split("+")))
    try:
        with open(record) as f:
            lines = [json.loads(ln) for ln in f if ln.strip()]
    except FileNotFoundError:
        lines = []
    # with the engine core in a process of its own (vLLM's default), this process's record is not the engine's
    others = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0"
    found = [r for r in lines if r["modes"] == want and r["min_match"] == int(method.get("min_match", 3))
             and not (others and r["pid"] == os.getpid())]
    if not found:
        raise RuntimeError(f"the dflash-lookup plugin did not act in vLLM's engine for {method['name']} "
                           f"(DFLASH_LOOKUP={method['lookup']}; records: {lines})")
    return found


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
    with tempfile.TemporaryDirectory(prefix="dflash-lookup-") as tmp:
        record = os.path.join(tmp, "record.jsonl")
        with lookup_env(method, record):  # the engine core reads it when it starts (spawned: module docstring)
            llm = LLM(model=job["target"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=0,
                      speculative_config=_speculative_config(method), disable_log_stats=False,
                      max_num_seqs=1, enable_prefix_caching=False, enforce_eager=job.get("enforce_eager", True),
                      # each verify step's accepted count, per request: what the output kept (kept_accepted)
                      per_request_spec_decode_metrics="detailed" if method["name"] != "plain" else "none")
        try:
            lookup = {"mode": method["lookup"], "min_match": int(method.get("min_match", 3)),
                      "processes": len(acted(method, record))} if method.get("lookup") else None
        except BaseException:
            llm.llm_engine.engine_core.shutdown()
            raise
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
            per_prompt.append({"seconds": dt, **{k.split(":", 1)[1]: c1[k] - c0[k] for k in _COUNTERS},
                               "accepted_in_output": kept_accepted(out.outputs[0]),
                               # the engine's accepted drafts at each verify step (None without the record):
                               # what a replay of the same drafter is compared with step by step
                               "accepted_per_step": per_step(out.outputs[0])})
        after = _counters(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return {"name": method["name"], "k": method.get("k", 0), "load_seconds": load_s, "seconds": seconds,
            "lookup": lookup,
            "outputs": outputs, "per_prompt": per_prompt,
            **{k.split(":", 1)[1]: after[k] - before[k] for k in _COUNTERS},
            "accepted_in_output": kept_total(per_prompt)}


def generate(job: dict) -> dict:
    """Batched greedy generation (target-written training answers): all prompts in one call,
    up to `max_num_seqs` sequences at a time."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    for var in _LOOKUP_VARS:  # the target alone: a user's DFLASH_LOOKUP is for their served DFlash engines
        os.environ.pop(var, None)
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


def engine_plan(methods: list[dict]) -> list[tuple[int, bool]]:
    """(method index, in this process) in the order the job's engines start; the results keep the job's
    order. With the caller's VLLM_ENABLE_V1_MULTIPROCESSING=0 (vLLM's own switch) a method's engine core
    and model run in this process first, except:
    * a lookup method: the plugin is set up once per process (module docstring), so its engines get
      processes of their own, after the others;
    * a second n-gram engine: vLLM 0.32 cannot start an engine in a process where one drafted n-grams
      (their numba import leaves llvmlite's library wrapper in sys.modules, which answers every
      attribute, and the next engine's kernel registration trips on it: triton_utils/dispatcher.py
      _rebind_kernels, "'_lib_fn_wrapper' object has no attribute 'get'"), so the one n-gram engine
      here starts last of this process's, and any other gets a process of its own."""
    allowed = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
    here, apart, ngram_here = [], [], False
    for i, m in enumerate(methods):
        fits = allowed and not m.get("lookup") and not (m["name"] == "ngram" and ngram_here)
        ngram_here |= fits and m["name"] == "ngram"
        (here if fits else apart).append(i)
    here.sort(key=lambda i: methods[i]["name"] == "ngram")
    return [(i, True) for i in here] + [(i, False) for i in apart]


def engines_apart() -> None:
    """The engines from now on in processes of their own (vLLM's default). vLLM caches its environment
    once an engine core has run in this process; the cache is dropped so that the switch is read."""
    import vllm.envs

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    vllm.envs.disable_envs_cache()


def main(job_path: str, result_path: str) -> int:
    with open(job_path) as f:
        job = json.load(f)
    result: dict = {"methods": []}
    try:
        import vllm

        result["vllm_version"] = vllm.__version__
        # engines start after this: a forked process inherits the fix, a spawned one applies it on import
        result["engine_fixes"] = ["dflash_context_k_norm"] if fix_dflash_context_k_norm() else []
        if job.get("mode") == "generate":
            result.update(generate(job))
        else:
            if any(m["name"] != "plain" and "model" in m for m in job["methods"]):
                check_pair(job)
            if any(m.get("lookup") for m in job["methods"]):
                check_lookup_plugin()
                # a fresh interpreter per engine core: loads the plugin with its method's DFLASH_LOOKUP
                os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
            served = {}
            for i, here in engine_plan(job["methods"]):
                if not here:
                    engines_apart()
                served[i] = run_method(job, job["methods"][i])
            result["methods"] = [served[i] for i in range(len(job["methods"]))]
    except BaseException as e:  # noqa: BLE001 - reported to the caller as one line + the traceback
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0 if "error" not in result else 1


def _take_the_group_down(signum, frame) -> None:
    """SIGTERM / SIGHUP (the caller stopped, or died: it starts us with PR_SET_PDEATHSIG): the engine
    core and model workers vLLM forked or spawned share our process group (the caller starts us in a
    session of our own); without this they outlive us and keep every core busy (seen: a demo stopped
    in its data stage left two engine processes spinning for 17 minutes)."""
    os.killpg(os.getpgrp(), signal.SIGKILL)


if __name__ == "__main__":
    if os.getpgrp() == os.getpid():  # our own group (run_worker's start_new_session): never a caller's
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _take_the_group_down)
    sys.exit(main(sys.argv[1], sys.argv[2]))
elif __name__ == "__mp_main__":  # vLLM's engine core, spawned (the CPU platform spawns): its model is built here
    fix_dflash_context_k_norm()
