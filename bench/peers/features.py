"""The one HF feature dumper of the peer comparison: target hidden states per training row.

Peers that train from features on disk (speculators, SpecForge) get them from here, each writing
its own file format in its own folder; ModelOpt runs the target in its own process. One forward
of the HF target per row, float32 on CPU, the same target directory vLLM serves.

The forward STOPS after the deepest decoder layer asked for (issue 48: the dump is charged to the
trainer, so it must not run layers nobody reads): hooks on the decoder layers keep their outputs
and the deepest one ends the forward; the final norm and the lm_head never run. Only
``prenorm_last`` (speculators: its loss takes its labels from the target's logits over the last
layer) runs every layer. dflash-train's own capture stops the same way (targets/model.py).

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


class _Stop(Exception):
    """Raised by the deepest hook: the layers after it are never run."""


def hf_layers_needed(hf_indices: list[int], prenorm_last: bool, num_layers: int) -> int:
    """Decoder layers one forward must run: index i of HF's tuple is the output of layer i - 1."""
    if any(not 1 <= i < num_layers for i in hf_indices):
        raise ValueError(f"hf_indices {hf_indices}: only 1..{num_layers - 1} (0 is the embedding, "
                         f"{num_layers} HF's post-norm state; ask prenorm_last for the last layer)")
    return num_layers if prenorm_last else max(hf_indices)


@torch.inference_mode()
def iter_hidden_states(target_dir: str | Path, rows: Iterable[dict], hf_indices: list[int],
                       prenorm_last: bool = False, dtype: torch.dtype = torch.float32,
                       model=None, batch_tokens: int = 4096, window: int = 64,
                       stats: dict | None = None) -> Iterator[tuple[dict, torch.Tensor]]:
    """Yields (row, features [seq, len(hf_indices) (+1), hidden]) for each row, in the rows' order.

    Rows are batched for speed (one forward per row ran at ~60 tok/s on 2 loaded cores): each
    `window` rows are sorted by length, right-padded into batches of <= `batch_tokens` tokens with
    an attention mask (causal attention: a real position never sees the padding after it), and
    yielded in their original order, each cut to its own length. `stats` (a dict) gets
    "layers_run" (decoder layers each forward ran) and "num_layers"."""
    model = model if model is not None else load_target(target_dir, dtype)
    layers = _decoder_layers(model)
    need = hf_layers_needed(hf_indices, prenorm_last, len(layers))
    if stats is not None:
        stats.update(layers_run=need, num_layers=len(layers))
    keep = sorted(set(i - 1 for i in hf_indices) | ({len(layers) - 1} if prenorm_last else set()))
    captured: dict[int, torch.Tensor] = {}
    deepest = need - 1

    def hook_for(li: int):
        def hook(_mod, _inp, out):
            captured[li] = out[0] if isinstance(out, tuple) else out
            if li == deepest:
                raise _Stop
        return hook

    hooks = [layers[li].register_forward_hook(hook_for(li)) for li in keep]
    try:
        chunk: list[dict] = []
        for row in rows:
            chunk.append(row)
            if len(chunk) == window:
                yield from _window(model, chunk, hf_indices, prenorm_last, dtype, batch_tokens, captured, len(layers))
                chunk = []
        if chunk:
            yield from _window(model, chunk, hf_indices, prenorm_last, dtype, batch_tokens, captured, len(layers))
    finally:
        for h in hooks:
            h.remove()


def _window(model, chunk, hf_indices, prenorm_last, dtype, batch_tokens, captured, num_layers):
    order = sorted(range(len(chunk)), key=lambda i: len(chunk[i]["input_ids"]))
    feats: dict[int, torch.Tensor] = {}
    batch: list[int] = []

    def run(batch: list[int]) -> None:
        T = max(len(chunk[i]["input_ids"]) for i in batch)
        ids = torch.zeros((len(batch), T), dtype=torch.long)
        att = torch.zeros((len(batch), T), dtype=torch.long)
        for b, i in enumerate(batch):
            n = len(chunk[i]["input_ids"])
            ids[b, :n] = torch.tensor(chunk[i]["input_ids"], dtype=torch.long)
            att[b, :n] = 1
        captured.clear()
        try:  # the decoder only (no lm_head); the deepest hook raises _Stop
            model.model(input_ids=ids, attention_mask=att, use_cache=False)
        except _Stop:
            pass
        got = [captured[i - 1] for i in hf_indices] + ([captured[num_layers - 1]] if prenorm_last else [])
        stacked = torch.stack(got, dim=2).to(dtype)  # [B, T, K, H]
        for b, i in enumerate(batch):
            feats[i] = stacked[b, :len(chunk[i]["input_ids"])].contiguous()

    for i in order:
        n = len(chunk[i]["input_ids"])
        if batch and (len(batch) + 1) * max(n, len(chunk[batch[-1]]["input_ids"])) > batch_tokens:
            run(batch)
            batch = []
        batch.append(i)
    if batch:
        run(batch)
    for i, row in enumerate(chunk):
        yield row, feats.pop(i)


def timed(fn, *args, **kwargs) -> tuple[object, float]:
    t0 = time.perf_counter()
    res = fn(*args, **kwargs)
    return res, time.perf_counter() - t0
