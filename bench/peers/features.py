"""The one HF feature dumper of the peer comparison: target hidden states per training row.

Peers that train from features on disk (speculators, SpecForge) get them from here, each writing
its own file format in its own folder; ModelOpt runs the target in its own process. One forward
of the HF target per row, float32 on CPU, the same target directory vLLM serves.

Layer convention (the source of most cross-trainer mistakes): `hf_indices` are indices of HF's
``output_hidden_states`` tuple, so index i + 1 is the OUTPUT of decoder layer i (z-lab / SGLang /
dflash-train id i; vLLM / speculators aux id i + 1). In transformers 5.x the last entry of that
tuple is the state AFTER the final norm; ``prenorm_last=True`` appends the last decoder layer's
raw output (before the norm), which speculators expects as its final feature, read by a hook.

Run with the trainer's venv: ``.venv/bin/python`` (torch + transformers + safetensors only).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterable, Iterator

import torch

DATA_DIR = Path(__file__).resolve().parents[2] / "runs" / "peers" / "data"


def read_rows(path: str | Path) -> list[dict]:
    """train.jsonl rows: {"id", "input_ids", "loss_mask", "messages"}."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_target(target_dir: str | Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype)
    model.eval()
    return model


def _decoder_layers(model):
    return model.model.layers


@torch.inference_mode()
def iter_hidden_states(target_dir: str | Path, rows: Iterable[dict], hf_indices: list[int],
                       prenorm_last: bool = False, dtype: torch.dtype = torch.float32,
                       model=None) -> Iterator[tuple[dict, torch.Tensor]]:
    """Yields (row, features [seq, len(hf_indices) (+1), hidden]) for each row, one forward each."""
    model = model if model is not None else load_target(target_dir, dtype)
    captured: dict[str, torch.Tensor] = {}
    hook = None
    if prenorm_last:
        def keep(_mod, _inp, out):
            captured["last"] = out[0] if isinstance(out, tuple) else out
        hook = _decoder_layers(model)[-1].register_forward_hook(keep)
    try:
        for row in rows:
            ids = torch.tensor([row["input_ids"]], dtype=torch.long)
            out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
            feats = [out.hidden_states[i][0] for i in hf_indices]
            if prenorm_last:
                feats.append(captured.pop("last")[0])
            yield row, torch.stack(feats, dim=1).to(dtype).contiguous()
    finally:
        if hook is not None:
            hook.remove()


def timed(fn, *args, **kwargs) -> tuple[object, float]:
    t0 = time.perf_counter()
    res = fn(*args, **kwargs)
    return res, time.perf_counter() - t0
