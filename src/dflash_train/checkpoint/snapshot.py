"""What a checkpoint save copies before returning: tensors cloned to CPU, and "plain"
objects (dict / list / tuple / set of str, int, float, bool, None, bytes, tensors,
dtypes, devices, sizes; numpy scalars become Python numbers) copied recursively, because
state.pt is loaded with torch.load(weights_only=True). Anything else is a TypeError
naming the key path."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch

_PLAIN_LEAVES = (str, int, float, bool, bytes, complex, type(None), torch.dtype, torch.device, torch.Size)


def snapshot_obj(obj: Any, where: str) -> Any:
    """Deep copy of a plain object tree, tensors detached and cloned to CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, _PLAIN_LEAVES):
        return obj
    if isinstance(obj, dict):
        items = {k: snapshot_obj(v, f"{where}[{k!r}]") for k, v in obj.items()}
        return type(obj)(items) if type(obj) is not dict and _rebuildable(obj) else items
    if isinstance(obj, (list, tuple, set, frozenset)):
        vals = [snapshot_obj(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            raise TypeError(f"checkpoint object {where}: namedtuple {type(obj).__name__} is not loadable with weights_only; use a dict")
        return type(obj)(vals) if type(obj) in (list, tuple, set, frozenset) else list(vals)
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(
        f"checkpoint object {where} has type {type(obj).__module__}.{type(obj).__qualname__}; "
        "state.pt only holds plain data (dict/list/tuple of str/int/float/bool/None/tensor) "
        "so that it loads with torch.load(weights_only=True)"
    )


def _rebuildable(obj: dict) -> bool:
    return type(obj) is OrderedDict


def snapshot_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"checkpoint tensor {k!r} is a {type(t).__name__}, not a torch.Tensor")
        out[k] = t.detach().to("cpu", copy=True).contiguous()
    return out
