"""The draft vocabulary as a serving choice for ANY DFlash export (issue 48, item 2).

A draft vocabulary restricts what a drafter may propose to a set of target ids: vLLM's DFlash
loader (`vllm/model_executor/models/qwen3_dflash.py`, `DFlashQwen3ForCausalLM`) reads
``draft_vocab_size`` from config.json, builds an lm_head of that many rows and, when the export
ships them, loads ``lm_head.weight`` (those rows) and ``d2t`` (int64 offsets: target id = draft id +
d2t[draft id]); its draft logits are -inf outside the set. dflash-train's exports write exactly
that when trained with ``train.vocab_subset`` (src/dflash_train/export.py `_draft_vocab_tensors`).

Here the harness adds the SAME restriction to an export that has none (ours at
``train.vocab_subset=0``, speculators', SpecForge's, ModelOpt's), so that every trainer's drafter is
served both over the whole vocabulary and over one id set, and the table separates what training
gives from what serving gives:

    .venv/bin/python bench/peers/draft_vocab.py EXPORT OUT --ids-from OUR_DRAFT_VOCAB_EXPORT --target HF_DIR

* the ids: `draft_vocab_ids(export)` of a dflash-train export trained with the subset (its d2t),
  so every row shares one set (the recipe's 8,192 most frequent answer tokens);
* the rows: the target's lm_head rows of those ids (`target_lm_head`), in the dtype of the
  export's other floating tensors; an export that ships its own full lm_head gets ITS rows;
* config.json: a top-level ``draft_vocab_size`` (z-lab layout: vLLM reads it from the HF config;
  speculators layout: vLLM's `update_dflash` copies the top-level key too); nothing else changes.
  A ``harness_draft_vocab`` table records where the ids and rows came from (engines ignore it).
Every other file and tensor is copied unchanged (the drafter is the same bit for bit).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

CONFIG, WEIGHTS, D2T, HEAD = "config.json", "model.safetensors", "d2t", "lm_head.weight"


def _tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def draft_vocab_ids(export: str | Path) -> torch.Tensor:
    """The sorted target ids an export drafts over (its d2t + arange); raises when it has none."""
    export = Path(export)
    cfg = json.loads((export / CONFIG).read_text())
    n = cfg.get("draft_vocab_size")
    with safe_open(str(export / WEIGHTS), "pt") as f:
        if D2T not in f.keys():
            raise ValueError(f"{export}: no {D2T} tensor (not a draft-vocabulary export)")
        d2t = f.get_tensor(D2T).to(torch.long)
    if n != d2t.numel():
        raise ValueError(f"{export}: draft_vocab_size {n} but d2t has {d2t.numel()} entries")
    return d2t + torch.arange(d2t.numel())


def target_lm_head(target_dir: str | Path) -> torch.Tensor:
    """The target's [V, H] lm_head (tied: its embedding), float32, read with dflash-train's
    head-only loader (the same rows dflash-train's own export writes)."""
    from dflash_train.config import TargetConfig
    from dflash_train.targets.head_only import load_head_only_target

    return load_head_only_target(TargetConfig(path=str(target_dir), device="cpu", dtype="float32"),
                                 "cpu").lm_head_weight


def _vocab_size(cfg: dict) -> int | None:
    for c in (cfg, cfg.get("transformer_layer_config") or {}, cfg.get("text_config") or {}):
        if isinstance(c.get("vocab_size"), int):
            return int(c["vocab_size"])
    return None


def add_draft_vocab(export: str | Path, out: str | Path, ids: torch.Tensor, lm_head: torch.Tensor | None,
                    ids_from: str = "", force: bool = False) -> Path:
    """A copy of `export` at `out` that drafts over `ids` only (module docstring). `lm_head`: the
    target's [V, H] head (unused when the export ships its own full head). Refuses an export that
    already drafts over a subset (its d2t) and ids that are not distinct, sorted and inside V."""
    export, out = Path(export), Path(out)
    cfg = json.loads((export / CONFIG).read_text())
    if cfg.get("draft_vocab_size") not in (None, _vocab_size(cfg)):
        raise ValueError(f"{export}: already drafts over {cfg['draft_vocab_size']} ids")
    tensors, meta = _tensors(export / WEIGHTS)
    if D2T in tensors or "t2d" in tensors:
        raise ValueError(f"{export}: already has a d2t/t2d map")
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    own = tensors.get(HEAD)
    head = own if own is not None else lm_head
    if head is None:
        raise ValueError(f"{export}: ships no lm_head; give the target's")
    V = _vocab_size(cfg) or head.shape[0]
    if head.shape[0] != V:
        raise ValueError(f"lm_head has {head.shape[0]} rows, the export's vocab_size is {V}")
    if ids.numel() == 0 or not bool((ids[1:] > ids[:-1]).all()) or int(ids[0]) < 0 or int(ids[-1]) >= V:
        raise ValueError(f"ids: {ids.numel()} ids, expected distinct sorted ids inside 0..{V - 1}")
    floats = [t.dtype for k, t in tensors.items() if t.is_floating_point() and k != HEAD]
    dtype = max(set(floats), key=floats.count) if floats else head.dtype
    new = dict(tensors)
    new[HEAD] = head.detach().to("cpu")[ids].to(dtype).contiguous()
    new[D2T] = (ids - torch.arange(ids.numel())).contiguous()
    if out.exists():
        if not force:
            raise FileExistsError(f"{out}: exists")
        shutil.rmtree(out)
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for p in export.iterdir():
        if p.is_file() and p.name not in (CONFIG, WEIGHTS):
            shutil.copy2(p, tmp / p.name)
    cfg = dict(cfg, draft_vocab_size=int(ids.numel()),
               harness_draft_vocab={"source_export": str(export.resolve()), "ids_from": ids_from,
                                    "lm_head_rows": "the export's own lm_head" if own is not None else "the target's lm_head"})
    (tmp / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(new, str(tmp / WEIGHTS), metadata=meta or {"format": "pt"})
    tmp.rename(out)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--ids-from", type=Path, required=True, help="a draft-vocabulary export whose ids to use")
    ap.add_argument("--target", type=Path, required=True, help="the target's HF directory (its lm_head rows)")
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args()
    ids = draft_vocab_ids(a.ids_from)
    add_draft_vocab(a.export, a.out, ids, target_lm_head(a.target), ids_from=str(a.ids_from), force=a.force)
    print(f"{a.out}: drafts over {ids.numel()} ids of {a.ids_from}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
