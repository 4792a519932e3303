"""The part of a target a trainer rank uses: embedding, lm_head, final norm, soft-cap, tokenizer.

Under torchrun the trainer ranks never run the target's decoder (the target ranks
capture the features); they embed the block tokens and apply the lm_head in the loss.
`load_head_only_target` builds the HF model with ZERO decoder layers from the target's
own config, then reads only the tensors that model has (``embed_tokens``, ``lm_head``
unless tied, final ``norm``) from the safetensors files, one tensor at a time with
``safe_open`` (the index says which file holds which tensor), so the decoder's weights
are never read. The result is a normal `Target` (same `embed`, `logits`, soft-cap,
embed scale, mask token, hf_config: ``num_layers`` is the real layer count) whose
``layers`` is an empty ModuleList; `capture` is not available on it.

Targets whose files are not a HF safetensors directory (GGUF not yet converted,
VLM checkpoints whose tensor names differ from the text model's) fall back to the
full `load_target`, with one log line saying so.
"""
from __future__ import annotations

import copy
import json
import logging
import time
from pathlib import Path

import torch

from dflash_train.config import TargetConfig
from dflash_train.errors import first_line
from dflash_train.targets.gguf import converted_dir, gguf_path_of
from dflash_train.targets.loading import load_target, load_tokenizer, resolve_dtype, serving_dtype_of
from dflash_train.targets.model import Target, TargetError

log = logging.getLogger(__name__)


def _weights_dir(cfg: TargetConfig) -> Path | None:
    """The HF directory holding the target's safetensors, or None (then: full load)."""
    spec = cfg.path
    if gguf_path_of(spec) is not None:
        return converted_dir(spec)  # the de-quantised copy load_target writes once
    return Path(spec).expanduser()


def _tensor_files(d: Path) -> dict[str, Path]:
    """tensor name -> safetensors file, from the index when there is one."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        return {k: d / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for fp in sorted(d.glob("*.safetensors")):
        with safe_open(str(fp), framework="pt") as f:
            out.update({k: fp for k in f.keys()})
    return out


def _buffer_twin(cfg0, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every buffer's real value (rotary inv_freq, Gemma's embed scale: computed in __init__, so meta
    on the meta-built model), from a CPU twin with no layer and a 1-row vocabulary."""
    from transformers import AutoModelForCausalLM

    tiny = copy.deepcopy(cfg0)
    for c in {id(tiny): tiny, id(tiny.get_text_config()): tiny.get_text_config()}.values():
        c.vocab_size, c.pad_token_id = 1, None
    return dict(AutoModelForCausalLM.from_config(tiny, dtype=dtype).named_buffers())


def head_only_model(d: Path, dtype: torch.dtype, device: torch.device):
    """(HF causal LM with no decoder layer and the target's head weights, bytes read) or None when the
    files do not hold every tensor such a model has."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    full_cfg = AutoConfig.from_pretrained(str(d))
    try:
        full_cfg._attn_implementation = "sdpa"
    except Exception:  # noqa: BLE001 - only a default for the (never run) attention
        pass
    cfg0 = copy.deepcopy(full_cfg)
    text0 = cfg0.get_text_config() if hasattr(cfg0, "get_text_config") else cfg0
    text0.num_hidden_layers = 0
    if getattr(text0, "layer_types", None) is not None:
        text0.layer_types = []
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg0, dtype=dtype)
    except ValueError:
        return None  # not a causal LM class (VLM): the caller loads it whole
    files = _tensor_files(d)
    wanted = [k for k, _ in model.named_parameters()]
    missing = [k for k in wanted if k not in files]
    tied = bool(getattr(text0, "tie_word_embeddings", getattr(cfg0, "tie_word_embeddings", False)))
    if tied and missing == ["lm_head.weight"]:
        missing = []
    if missing:
        log.info("head-only load: %s has no tensors %s; loading the whole target", d, missing[:3])
        return None
    # the head as real tensors, read one by one
    state: dict[str, torch.Tensor] = {}
    nbytes = 0
    for k in wanted:
        if k not in files:
            continue
        with safe_open(str(files[k]), framework="pt", device="cpu") as f:
            t = f.get_tensor(k).to(dtype)
        state[k] = t.to(device)
        nbytes += t.numel() * t.element_size()
    model.load_state_dict(state, strict=False, assign=True)
    if any(b.is_meta for b in model.buffers()):
        twin = _buffer_twin(cfg0, dtype)
        for name, buf in list(model.named_buffers()):
            if buf.is_meta:
                mod_name, _, attr = name.rpartition(".")
                (model.get_submodule(mod_name) if mod_name else model)._buffers[attr] = twin[name].to(device)
    if tied:
        model.lm_head.weight = model.get_input_embeddings().weight
    still_meta = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if still_meta:
        raise TargetError(f"{d}: head-only load left tensors unread: {still_meta[:4]}")
    model.config = full_cfg  # Target reads the real layer count, layer types, RoPE, soft-cap from it
    return model, nbytes


def load_head_only_target(cfg: TargetConfig, device: torch.device | str, tokenizer=None) -> Target:
    """A `Target` with the embedding, lm_head and final norm only (see the module docstring)."""
    dev = torch.device(device)
    dtype = resolve_dtype(cfg.dtype, dev)
    t0 = time.perf_counter()
    d = _weights_dir(cfg)
    built = None
    if d is not None:
        try:
            built = head_only_model(d, dtype, dev)
        except TargetError:
            raise
        except Exception as e:  # noqa: BLE001 - a user's broken file: one line naming it
            raise TargetError(f"{d}: cannot read the target's embedding / lm_head ({first_line(e)})") from None
    if built is None:
        log.info("head-only load not possible for %s: loading the whole target", cfg.path)
        return load_target(cfg, device=dev, tokenizer=tokenizer)
    model, nbytes = built
    if tokenizer is None:
        tokenizer, _ = load_tokenizer(cfg)
    model.eval()
    model.requires_grad_(False)
    target = Target(model, tokenizer, source=str(cfg.path))
    target.serving_dtype = serving_dtype_of(cfg)
    target.head_only = True
    log.info("target head only (no decoder layer loaded): embedding, lm_head, final norm, %.1f MB read in %.1fs; %r",
             nbytes / 1e6, time.perf_counter() - t0, target)
    return target
