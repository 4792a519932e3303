"""RUN_DIR/metrics.jsonl: one JSON object per logged step (eval lines carry "eval": true).
Standard library only."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .layout import METRICS_FILE


def read_metrics(path: Path, tail_bytes: int | None = None) -> list[dict[str, Any]]:
    """The JSON-object lines of a metrics.jsonl (a run dir's, or the file itself), oldest
    first; lines that do not parse (one being written, the cut first line of a tail) are
    skipped. tail_bytes: read only the file's last bytes (status on a long run)."""
    p = Path(path)
    if p.is_dir():
        p = p / METRICS_FILE
    try:
        with open(p, "rb") as f:
            if tail_bytes is not None:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - tail_bytes))
            chunk = f.read()
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for line in chunk.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def last_metrics(run_dir: Path, n: int = 2, max_bytes: int = 1 << 20, evals: bool = True) -> list[dict[str, Any]]:
    """The last `n` lines of RUN_DIR/metrics.jsonl (oldest first); evals=False skips eval lines."""
    lines = read_metrics(run_dir, tail_bytes=max_bytes)
    if not evals:
        lines = [m for m in lines if not m.get("eval")]
    return lines[-n:] if n > 0 else []


_TPS_KEYS = ("tokens_per_s", "tok_per_s", "tokens_per_sec", "tok_s")


def metrics_summary(run_dir: Path) -> dict[str, Any]:
    """{step, loss, tokens_per_s, time} from the last logged interval (missing -> None); tok/s
    from ``tokens_per_s`` (or an older key), else from cumulative tokens/time of the last two lines."""
    lines = last_metrics(run_dir, 2)
    if not lines:
        return {"step": None, "loss": None, "tokens_per_s": None, "time": None}
    last = lines[-1]
    tps = next((last[k] for k in _TPS_KEYS if isinstance(last.get(k), (int, float))), None)
    if tps is None and len(lines) == 2:
        a, b = lines
        for tkey in ("time", "elapsed", "wall_time"):
            if all(isinstance(x.get(k), (int, float)) for x in (a, b) for k in ("tokens", tkey)):
                dt = b[tkey] - a[tkey]
                if dt > 0:
                    tps = (b["tokens"] - a["tokens"]) / dt
                break
    return {"step": last.get("step"), "loss": last.get("loss"), "tokens_per_s": tps, "time": last.get("time")}


def recorded_taus(metrics_path: Path | None) -> dict[int, float]:
    """step -> tau of the eval lines of metrics.jsonl (the last one per step)."""
    out: dict[int, float] = {}
    if metrics_path is None:
        return out
    for rec in read_metrics(metrics_path):
        if rec.get("eval") and isinstance(rec.get("tau"), (int, float)):
            out[int(rec.get("step", 0))] = float(rec["tau"])
    return out
