"""What every check returns, and the helpers they share."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class Result:
    ok: bool
    figure: str  # the one-line figure printed after ok / FAILED
    details: dict = field(default_factory=dict)  # everything measured, for the JSON


def device(smoke: bool) -> torch.device:
    if smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device (run with --smoke on a CPU machine)")
    return torch.device("cuda")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device):
    """(fn(), seconds), with the device synchronised on both sides."""
    sync(dev)
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    return out, time.perf_counter() - t0


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|, in fp32, over every element: one wrong element shows
    (no mean over ~1e6 outputs that would hide it)."""
    got, ref = got.float(), ref.float()
    scale = ref.abs().max().item()
    if not torch.isfinite(got).all():
        return float("inf")
    return (got - ref).abs().max().item() / max(scale, 1e-30)
