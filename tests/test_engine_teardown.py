"""A command that dies while vLLM generates for it takes the engine down with it (engine/vllm_process.py
run_worker, engine/vllm_worker.py): the worker runs in a session of its own, so a Ctrl-C or a `kill`
aimed at the user's command never reaches vLLM's engine core and model workers; before this they kept
both cores busy after the command was gone (a demo stopped in its data stage: 17 minutes).

The harshest case, driven for real: the caller is SIGKILLed (no handler of ours runs) while a batched
generation is under way in the real vLLM environment; every process of the engine's group must be gone
within seconds. And the batched generation's engine is bound to every core the caller may use.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from dflash_train.engine.vllm_process import REPO_VENV, all_cores_bind

VLLM_PY = Path(os.environ.get("DFLASH_TRAIN_VLLM_PYTHON") or REPO_VENV / "bin" / "python")
if not VLLM_PY.is_file() and os.environ.get("CI"):
    raise RuntimeError("CI must have vLLM installed (make test installs .venv-vllm)")


def test_generation_binds_every_core_unless_the_caller_chose(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    cores = sorted(os.sched_getaffinity(0))
    assert all_cores_bind() == {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")  # a user's (or a test worker's) own placement
    assert all_cores_bind() == {}


def test_engines_share_the_worker_process_only_where_vllm_can(monkeypatch):
    """VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine tests set it: tests/engine_fixtures.py) keeps a job's
    engines in the worker's process, first, n-gram's last of them; lookup methods and a second n-gram engine
    start after them in processes of their own. Driven in vLLM by the engine tests: `served_accepting`
    (plain, n-gram and DFlash alone in the worker's process, whose drafts must stay the replay's, then the
    lookup methods apart) and `compare --engine` (plain, n-gram, DFlash)."""
    from dflash_train.engine.vllm_worker import engine_plan

    plain, ngram, dflash = {"name": "plain"}, {"name": "ngram", "k": 3}, {"name": "dflash"}
    lookup = {"name": "dflash+lookup", "lookup": "gate"}
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)  # vLLM's default: a process per engine
    assert engine_plan([plain, ngram, dflash]) == [(0, False), (1, False), (2, False)]
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert engine_plan([plain, ngram, dflash]) == [(0, True), (2, True), (1, True)]
    assert engine_plan([lookup, plain, ngram, dflash]) == [(1, True), (3, True), (2, True), (0, False)]
    assert engine_plan([ngram, {**ngram, "k": 2}, plain]) == [(2, True), (0, True), (1, False)]


def _engine_processes(caller: psutil.Process) -> list[psutil.Process]:
    """The caller's descendants that vLLM started (the worker script's own group and below)."""
    with_children = []
    try:
        with_children = caller.children(recursive=True)
    except psutil.NoSuchProcess:
        pass
    return [p for p in with_children if _alive(p)]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.skipif(not VLLM_PY.is_file(), reason="vLLM not installed: run `make vllm`")
def test_a_killed_caller_takes_the_engine_down(speaking_llama, tmp_path):
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(f"""
        from dflash_train.engine.vllm_process import generate_in_vllm
        # far more work than the test waits for: the caller is killed mid-generation
        generate_in_vllm({str(speaking_llama)!r}, [[1, 2, 3, 4]] * 64, [], 2000, dtype="float32")
    """))
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc = psutil.Process(caller.pid)
    engine: list[psutil.Process] = []
    try:
        deadline = time.time() + 300
        # the engine is up once vLLM's engine core runs beside the worker script
        while time.time() < deadline and caller.poll() is None:
            engine = _engine_processes(proc)
            if any("EngineCore" in " ".join(_name(p)) for p in engine):
                break
            time.sleep(0.5)
        assert caller.poll() is None, "the caller ended before vLLM's engine started"
        assert any("EngineCore" in " ".join(_name(p)) for p in engine), [(_name(p)) for p in engine]
        time.sleep(2)  # generating
        engine = _engine_processes(proc)
        os.kill(caller.pid, signal.SIGKILL)
        caller.wait()
        gone, alive = psutil.wait_procs(engine, timeout=30)
        assert not [p for p in alive if _alive(p)], f"left running after the caller died: {alive}"
    finally:
        if caller.poll() is None:
            caller.kill()
        for p in engine:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def _name(p: psutil.Process) -> list[str]:
    try:
        return [p.name(), *p.cmdline()]
    except psutil.NoSuchProcess:
        return []
