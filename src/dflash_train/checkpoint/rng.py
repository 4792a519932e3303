"""RNG state capture/restore for exact resume.

`capture_rng_state(extra_generators)` returns a plain dict (loadable with
torch.load(weights_only=True), so it can go straight into the `objects` of
CheckpointManager.save)::

    {"python": random.getstate(), "numpy": {...}, "torch": ByteTensor,
     "cuda": [ByteTensor per device] | None, "generators": {name: ByteTensor}}

`restore_rng_state(state, extra_generators)` puts every stream back. Named
generators (e.g. the anchor-sampling torch.Generator, CPU or CUDA) must be
passed under the same names; a name in the state without a generator passed
(or vice versa) raises KeyError so a silent mismatch cannot happen. CUDA
states are restored only when CUDA is available (with the same device count;
otherwise the first min(n, m) devices).
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng_state(extra_generators: dict[str, torch.Generator] | None = None) -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": [s.clone() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else None,
        "generators": {name: g.get_state().clone() for name, g in (extra_generators or {}).items()},
    }
    return state


def restore_rng_state(state: dict[str, Any], extra_generators: dict[str, torch.Generator] | None = None) -> None:
    extra_generators = extra_generators or {}
    saved = state.get("generators", {})
    if set(saved) != set(extra_generators):
        raise KeyError(
            f"rng state has generators {sorted(saved)} but {sorted(extra_generators)} were passed to restore"
        )
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), int(n["pos"]), int(n["has_gauss"]), float(n["cached_gaussian"]))
    )
    torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        for i, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.cpu(), i)
    for name, g in extra_generators.items():
        g.set_state(saved[name].cpu())
