"""`dflash-train status` and `dflash-train stop`.

Local logic lives in functions taking a run_dir (`status_info`, `stop_run`).
With ``--via`` hops cli.py runs the same subcommand on the far host through
`dflash_train.deploy.remote.remote_call` (the far side runs this module
locally) and passes its output and exit code through unchanged: control never
imports deploy.

status exit codes: 0 live (pid verified against the recorded start time),
3 not live (no run.json, process gone, pid reused, run released), 2 usage
error (run dir missing). ``--json`` prints one JSON object (see `status_info`).

stop exit codes:
  0  the process exited and a verified checkpoint exists at its final step
     (run.json ``step`` after exit == step of ``checkpoints/latest``);
     prints ``stopped at step N, checkpoint step-NNNNNNNN``
  1  not confirmed: still running after --timeout (``still running after T s``;
     with --force it is then SIGKILLed and that is said), or it exited but no
     valid checkpoint exists at its final step
  2  refused: no run.json, the run is not live, the pid was reused by another
     process, the record is from another host, or a bad --signal
The trainer is never SIGKILLed unless force=True.

Contract with the trainer: on exit it calls
``RunRecord.release(last_checkpoint=<committed dir>, step=<final step>)`` after
``CheckpointManager.wait()``.
"""
from __future__ import annotations

import json
import socket
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from dflash_train.rundir import (LATEST, RunDir, liveness, metrics_summary, parse_signal, parse_step, read_link, read_record,
                                 stop_and_confirm)

EXIT_LIVE = 0
EXIT_NOT_LIVE = 3
EXIT_USAGE = 2
STOP_OK, STOP_NOT_CONFIRMED, STOP_REFUSED = 0, 1, 2


def _err(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- status


def status_info(run_dir: Path) -> dict[str, Any]:
    """Everything `status` shows, as a JSON-able dict.

    Keys: run_dir, live, reason, pid, hostname, started_at, updated_at,
    ended_at, step, loss, tokens_per_s (last logged interval; from
    metrics.jsonl, else run.json), last_checkpoint (run.json),
    latest_checkpoint (checkpoints/latest target) + latest_checkpoint_step,
    code_version, config_hash, argv, checked_on (this hostname).
    """
    run_dir = Path(run_dir)
    rec = read_record(run_dir) or {}
    live, reason = liveness(rec or None)
    ms = metrics_summary(run_dir)
    steps = [s for s in (rec.get("step"), ms.get("step")) if isinstance(s, int)]
    latest = read_link(RunDir(run_dir).checkpoints, LATEST)
    tps = ms.get("tokens_per_s")
    if tps is None:
        tps = rec.get("tokens_per_s")
    return {
        "run_dir": str(run_dir),
        "live": live,
        "reason": reason,
        "pid": rec.get("pid"),
        "hostname": rec.get("hostname"),
        "started_at": rec.get("started_at"),
        "updated_at": rec.get("updated_at"),
        "ended_at": rec.get("ended_at"),
        "step": max(steps) if steps else None,
        "loss": ms.get("loss"),
        "tokens_per_s": tps,
        "last_checkpoint": rec.get("last_checkpoint"),
        "latest_checkpoint": str(latest) if latest else None,
        "latest_checkpoint_step": parse_step(latest.name) if latest else None,
        "code_version": rec.get("code_version"),
        "config_hash": rec.get("config_hash"),
        "argv": rec.get("argv"),
        "checked_on": socket.gethostname(),
    }


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.4g}"
    if isinstance(v, list):
        return " ".join(map(str, v))
    return str(v)


def status_command(run_dir: Path, as_json: bool) -> int:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        _err(f"run dir not found: {run_dir}")
        return EXIT_USAGE
    info = status_info(run_dir)
    code = EXIT_LIVE if info["live"] else EXIT_NOT_LIVE
    if as_json:
        print(json.dumps(info, sort_keys=True), flush=True)
        return code
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"dflash-train run {run_dir}", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    state = "[green]LIVE[/green]" if info["live"] else "[red]not live[/red]"
    t.add_row("state", f"{state} ({info['reason']})")
    for key, label in [
        ("pid", "pid"), ("hostname", "host"), ("step", "step"), ("tokens_per_s", "tokens/s (last interval)"),
        ("loss", "loss"), ("last_checkpoint", "last checkpoint"), ("latest_checkpoint", "checkpoints/latest"),
        ("code_version", "code version"), ("config_hash", "config hash"), ("started_at", "started"),
        ("updated_at", "updated"), ("ended_at", "ended"), ("argv", "argv"),
    ]:
        if key == "ended_at" and info[key] is None:
            continue
        t.add_row(label, _fmt(info[key]))
    Console(soft_wrap=True).print(t)
    return code


# --------------------------------------------------------------------------- stop


@dataclass
class StopResult:
    code: int  # 0 confirmed, 1 not confirmed, 2 refused
    message: str
    pid: int | None = None
    step: int | None = None
    checkpoint: str | None = None
    exited: bool = False
    forced: bool = False
    waited_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def stop_run(
    run_dir: Path,
    timeout: float = 120.0,
    signal_name: str = "INT",
    force: bool = False,
    log: Callable[[str], None] | None = None,
    poll_s: float = 0.1,
) -> StopResult:
    """Signal the verified trainer of `run_dir`, wait, confirm its checkpoint (rundir's
    stop-and-confirm, the one deploy's agent runs too)."""
    log = log or (lambda m: print(m, flush=True))
    run_dir = Path(run_dir)
    sig = parse_signal(signal_name)
    if sig is None:
        return StopResult(STOP_REFUSED, f"unknown --signal {signal_name!r}; use INT or TERM")
    rec = read_record(run_dir)
    if rec is None:
        return StopResult(STOP_REFUSED, f"no run.json in {run_dir}: nothing to stop (is this a run dir?)")
    live, why = liveness(rec)
    pid = rec.get("pid")
    last = rec.get("last_checkpoint")
    if not live:
        return StopResult(STOP_REFUSED, f"refusing to stop: the run is not live ({why}); last checkpoint: {last or 'none'}", pid=pid)
    if rec.get("hostname") not in (None, socket.gethostname()):
        return StopResult(STOP_REFUSED, f"refusing to stop: the run is on host {rec.get('hostname')}, not this one "
                                        f"({socket.gethostname()}); use --via to reach it", pid=pid)
    rd = RunDir(run_dir)

    def note(waited: float) -> None:
        cur = read_record(run_dir) or {}
        log(f"  still waiting after {waited:.0f}s (step {cur.get('step')}, "
            f"checkpoints/latest {getattr(read_link(rd.checkpoints, LATEST), 'name', None)})")

    def sent() -> None:
        log(f"sent {sig.name} to pid {pid} (step {rec.get('step')}); waiting up to {timeout:g}s for it to checkpoint "
            "and exit")

    res = stop_and_confirm(run_dir, pid, rec.get("create_time"), sig, timeout, force=force, poll_s=poll_s,
                           on_wait=note, on_sent=sent)
    if res.refused:
        hint = f"; last checkpoint: {last or 'none'}" if res.already_exited else ""
        if "permission" in res.refused:
            hint = " (run stop as the trainer's user or root)"
        return StopResult(STOP_REFUSED, f"refusing to stop: {res.refused}{hint}", pid=pid)
    step, latest, waited = res.step, res.checkpoint, res.waited_s
    if res.timed_out:
        if not force:
            return StopResult(STOP_NOT_CONFIRMED, f"still running after {timeout:g} s (pid {pid}, step {step}); not killed "
                                                  "(use --force to SIGKILL after the timeout)", pid=pid, step=step, waited_s=waited)
        return StopResult(STOP_NOT_CONFIRMED, f"still running after {timeout:g} s; sent SIGKILL (--force) to pid {pid}; "
                                              f"a resume will use the last committed checkpoint: {latest.name if latest else 'none'}",
                          pid=pid, step=step, checkpoint=str(latest) if latest else None, exited=res.exited, forced=True,
                          waited_s=waited)
    crashed = " (it exited without releasing run.json: crash?)" if res.record_live else ""
    if latest is None:
        return StopResult(STOP_NOT_CONFIRMED, f"process exited at step {step} but no checkpoint was committed{crashed}",
                          pid=pid, step=step, exited=True, waited_s=waited)
    if step is None or res.checkpoint_step != step:
        return StopResult(STOP_NOT_CONFIRMED, f"process exited at step {step} but checkpoints/latest is {latest.name} "
                                              f"(no checkpoint at the stop step){crashed}",
                          pid=pid, step=step, checkpoint=str(latest), exited=True, waited_s=waited)
    if not res.confirmed:
        return StopResult(STOP_NOT_CONFIRMED, f"process exited at step {step} but {latest.name} "
                                              + ("fails verification: " if not res.record_live else "is not confirmed: ")
                                              + "; ".join(res.problems[:3]), pid=pid, step=step, checkpoint=str(latest),
                          exited=True, waited_s=waited)
    return StopResult(STOP_OK, f"stopped at step {step}, checkpoint {latest.name}", pid=pid, step=step,
                      checkpoint=str(latest), exited=True, waited_s=waited)


def stop_command(run_dir: Path, timeout: float, signal_name: str, force: bool) -> int:
    res = stop_run(Path(run_dir), timeout, signal_name, force)
    if res.code == STOP_REFUSED:
        _err(res.message)
    else:
        print(res.message, flush=True)
    return res.code
