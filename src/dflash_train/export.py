"""Serving format: ``config.json`` + ``model.safetensors`` (+ ``README.md``).

What SGLang (``--speculative-algorithm DFLASH``), vLLM (method ``"dflash"``)
and the reference package (``dflash.DFlashDraftModel.from_pretrained``) load,
see /work/shared/dflash-method.md "Export":

* config.json: a Qwen3Config (model_type ``qwen3``, architectures
  ``["DFlashDraftModel"]``) plus ``num_target_layers``, ``block_size`` and a
  ``dflash_config`` table (mask_token_id, target_layer_ids and, where the
  target needs them, input_embedding_scale / output_multiplier /
  final_logit_softcapping). A ``dflash_train`` table records provenance
  (target path, step, code version); serving engines ignore it.
* model.safetensors: the drafter's state dict under its export names
  (``layers.{i}....``, ``fc.weight``, ``hidden_norm.weight``, ``norm.weight``):
  no ``model.`` prefix, no embed_tokens, no lm_head. A drafter with a draft vocabulary
  (trained with ``train.vocab_subset``) adds what vLLM's DFlash loader reads for one:
  ``lm_head.weight`` (the target's rows of those ids, in that order) and ``d2t`` (int64
  offsets: target id = draft id + d2t[draft id]), with ``draft_vocab_size`` in config.json.

Here: the writer only (``write_export`` into a directory ``check_out_dir`` allows;
config.json's keys are mapped in ONE place, `model/hf_config.py`), and `export_checkpoint`,
which joins the pieces: the drafter of a run or checkpoint, the run summary and model card
README.md (report.py), the files. Reading an export (or a checkpoint) is checkpoint/source.py's
(`resolve_drafter_source`, `load_export`).
"""
from __future__ import annotations

import dataclasses
import json
import secrets
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from dflash_train.checkpoint.source import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    clean_state_dict,
    load_export,
    resolve_drafter_source,
)
from dflash_train.config import TargetConfig
from dflash_train.errors import UserError
from dflash_train.model.dflash2 import export_shapes, to_export_names
from dflash_train.model.hf_config import hf_config_dict
from dflash_train.report import model_card, run_summary
from dflash_train.rundir import holds_checkpoints, is_checkpoint_dir, is_run_dir
from dflash_train.serving_check import D2T, check_config, check_export, draft_vocab_shapes, target_facts
from dflash_train.storage import writing
from dflash_train.targets.head_only import load_head_only_target
from dflash_train.utils import save_safetensors

README_FILE = "README.md"


def _err(msg: str) -> Exception:
    """An error the CLI prints as one line (UserError) without a traceback."""
    return UserError(msg)


# --------------------------------------------------------------------------- export


EXPORT_FILES = (CONFIG_FILE, WEIGHTS_FILE, README_FILE)


def is_previous_export(path: Path) -> bool:
    """A directory `--force` may replace: only regular files, all of them named
    config.json / model.safetensors / README.md, config.json and the weights
    present, and config.json a DFlash drafter config (``dflash_config`` table or
    ``DFlashDraftModel`` architecture). Anything else there (a checkpoint, a run,
    a target model, a file of the user's) makes it not an export."""
    path = Path(path)
    try:
        entries = list(path.iterdir())
    except OSError:
        return False
    names = {e.name for e in entries}
    if not {CONFIG_FILE, WEIGHTS_FILE} <= names or not names <= set(EXPORT_FILES):
        return False
    if any(e.is_symlink() or not e.is_file() for e in entries):
        return False
    try:
        d = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and ("dflash_config" in d or "DFlashDraftModel" in (d.get("architectures") or []))


def _run_or_checkpoint_inside(path: Path, depth: int = 2, budget: int = 2000) -> str | None:
    """'the run dir X' / 'the checkpoint X' within `path` (a bounded look, for the error message only)."""
    level = [path]
    for _ in range(depth):
        nxt = []
        for d in level:
            try:
                kids = [c for c in d.iterdir() if c.is_dir() and not c.is_symlink()]
            except OSError:
                continue
            for c in kids:
                budget -= 1
                if budget < 0:
                    return None
                if is_run_dir(c):
                    return f"the run dir {c}"
                if is_checkpoint_dir(c) or holds_checkpoints(c):
                    return f"the checkpoint{'' if is_checkpoint_dir(c) else 's'} {c}"
                nxt.append(c)
        level = nxt
    return None


def check_out_dir(out: Path, force: bool) -> Path:
    """Where `export --out` may write; raises the one-line UserError otherwise. Returns `out` resolved.

    The rule (README "What export and train never delete"):
    * `out` may not be a run dir (rundir.is_run_dir), a checkpoint,
      a directory checkpoints live in (RUN/checkpoints, a set-aside
      RUN/checkpoints.*), or lie inside a checkpoint or such a directory;
      `--force` does not change this.
    * Inside a run dir but outside its checkpoints is fine: RUN/export (what
      the demo writes) or any other new or empty directory there.
    * An existing non-empty `out` is replaced only with `--force` and only if
      it is a previous export (`is_previous_export`); a directory holding
      anything else (which covers one containing a run dir or checkpoint) is
      refused, `--force` or not.
    """
    given = Path(out)
    real = given.resolve()
    if real.exists() and not real.is_dir():
        raise _err(f"--out {given}: exists and is not a directory; export writes a directory")
    for a in (real, *real.parents):
        if is_checkpoint_dir(a):
            where = "is" if a == real else f"lies inside the checkpoint {a}, it is"
            raise _err(f"--out {given}: {where} a checkpoint; export never writes into or over one, "
                       f"--force or not (choose a new directory, e.g. RUN_DIR/export)")
        if holds_checkpoints(a):
            what = "is" if a == real else f"lies inside {a}, which is"
            raise _err(f"--out {given}: {what} a directory of checkpoints; export never writes there, "
                       f"--force or not (choose a new directory, e.g. RUN_DIR/export)")
    if not real.is_dir():
        return real
    if is_run_dir(real):
        raise _err(f"--out {given}: is a run dir (it holds run.json, config.yaml or checkpoints/); export never "
                   f"replaces one, --force or not (choose a new directory, e.g. {given}/export)")
    try:
        empty = not any(real.iterdir())
    except OSError as e:
        raise _err(f"--out {given}: cannot read the directory: {e}") from None
    if empty:
        return real
    if is_previous_export(real):
        if not force:
            raise _err(f"--out {given}: holds a previous export and is not empty; use --force to replace it")
        return real
    inside = _run_or_checkpoint_inside(real)
    why = (f"it contains {inside}" if inside is not None
           else f"it is not a previous export (only {', '.join(EXPORT_FILES)})")
    raise _err(f"--out {given}: directory is not empty and {why}; export replaces nothing else, "
               f"--force or not (choose a new or empty directory)")


def write_export(cfg, state_dict: dict[str, torch.Tensor], out_dir: str | Path, force: bool = False,
                 provenance: dict[str, Any] | None = None, readme: str | None = None,
                 target: dict[str, Any] | None = None, lm_head_weight: torch.Tensor | None = None) -> Path:
    """Write config.json + model.safetensors (+ README.md) for a DrafterConfig and its weights.

    `out_dir` is checked by `check_out_dir` (a previous export is replaced only
    with `force`). The files get the usual umask-respecting permissions.
    Weights are stored in ``cfg.serving_dtype``. The written files pass
    `serving_check.check_export` (against `target`, see `serving_check.target_facts`)
    before they replace anything; a problem raises the one-line UserError.
    `lm_head_weight`: the target's [V, H] lm_head, needed for a drafter with a draft vocabulary.
    """
    given = Path(out_dir)
    out = check_out_dir(given, force)
    sd = to_export_names(clean_state_dict(state_dict))
    draft_vocab = sd.pop("draft_vocab", None)
    dtype = getattr(torch, cfg.serving_dtype)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in sd.items()}
    if cfg.draft_vocab_size:
        tensors.update(_draft_vocab_tensors(cfg, draft_vocab, lm_head_weight, dtype))
    _validate_tensors(cfg, tensors)
    # a refused write (full disk, read-only directory) is one line naming the file; the export is
    # written beside --out and renamed into place, so nothing at --out has changed then
    unchanged = f"nothing at {given} was changed"
    with writing(given, "creating", hint=unchanged):
        out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-export-{secrets.token_hex(4)}"
    old = None
    with writing(given, "creating", hint=unchanged):
        tmp.mkdir()
    try:
        with writing(given / CONFIG_FILE, hint=unchanged):
            (tmp / CONFIG_FILE).write_text(json.dumps(hf_config_dict(cfg, provenance), indent=2) + "\n")
        with writing(given / WEIGHTS_FILE, hint=unchanged):
            save_safetensors(tensors, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
        if readme is not None:
            with writing(given / README_FILE, hint=unchanged):
                (tmp / README_FILE).write_text(readme)
        problems, _ = check_export(tmp, target)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise _err(f"export to {given} fails the SGLang/vLLM loader check: {problems[0]}{more}")
        check_out_dir(given, force)  # again, right before replacing anything
        with writing(given, "moving the export into", hint=unchanged):
            if out.exists():
                old = out.parent / f".{out.name}.old-export-{secrets.token_hex(4)}"
                out.rename(old)  # a previous export (checked above); removed once the new one is in place
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out.exists():
            old.rename(out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return given


def _draft_vocab_tensors(cfg, draft_vocab: torch.Tensor | None, lm_head_weight: torch.Tensor | None,
                         dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The draft vocabulary as vLLM loads it: its lm_head rows and the d2t offsets."""
    if draft_vocab is None or lm_head_weight is None:
        raise _err(f"a drafter with a draft vocabulary of {cfg.draft_vocab_size} ids exports its ids and the target's "
                   "lm_head rows: " + ("its draft_vocab tensor is missing" if draft_vocab is None
                                       else "the target's lm_head could not be read"))
    ids = draft_vocab.detach().to("cpu", torch.long)
    if ids.numel() != cfg.draft_vocab_size or not bool((ids[1:] > ids[:-1]).all()) \
            or int(ids[0]) < 0 or int(ids[-1]) >= lm_head_weight.shape[0]:
        raise _err(f"draft_vocab holds {ids.numel()} ids; expected {cfg.draft_vocab_size} distinct sorted target ids "
                   f"below {lm_head_weight.shape[0]}")
    return {"lm_head.weight": lm_head_weight.detach().to("cpu")[ids].to(dtype).contiguous(),
            D2T: (ids - torch.arange(ids.numel())).contiguous()}


def expected_tensor_names(cfg) -> list[str]:
    names = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    c = hf_config_dict(cfg)
    return names + ["fc.weight", "hidden_norm.weight", "norm.weight"] + list(export_shapes(c)) + list(draft_vocab_shapes(c))


def _validate_tensors(cfg, tensors: dict[str, torch.Tensor]) -> None:
    want = set(expected_tensor_names(cfg))
    have = set(tensors)
    if want != have:
        missing, extra = sorted(want - have), sorted(have - want)
        raise _err(f"drafter weights do not match the export layout: missing {missing[:5]}, unexpected {extra[:5]}")
    fc = tensors["fc.weight"]
    K = len(cfg.target_layer_ids)
    if tuple(fc.shape) != (cfg.hidden_size, K * cfg.hidden_size):
        raise _err(f"fc.weight has shape {tuple(fc.shape)}, expected {(cfg.hidden_size, K * cfg.hidden_size)}")


def export_checkpoint(ckpt_or_run_dir: str | Path, out_dir: str | Path, force: bool = False,
                      full_vocab: bool = False) -> Path:
    """Export a checkpoint (or a run's latest) to `out_dir`; refuses a non-empty dir without force.
    full_vocab: a drafter with a draft vocabulary drafts over the target's whole one instead."""
    out = Path(out_dir)
    check_out_dir(out, force)  # before the (possibly slow) load
    src = resolve_drafter_source(ckpt_or_run_dir)
    if full_vocab and src.config.draft_vocab_size:
        src = dataclasses.replace(src, config=dataclasses.replace(src.config, draft_vocab_size=0),
                                  state_dict={k: v for k, v in src.state_dict.items() if k != "draft_vocab"})
    summary = run_summary(src.run_dir, src.step, src.meta)
    name = (src.run_dir.name if src.run_dir is not None else out.name) + "-dflash"
    prov = {
        "target_path": src.target_path,
        "step": src.step,
        "source": str(src.path),
        "code_version": src.meta.get("code_version"),
    }
    if summary.get("tau") is not None:
        prov["tau"] = summary["tau"]
    facts = target_facts(src.target_path)
    cfg = follow_target(src.config, facts)
    readme = model_card(cfg, summary, src.target_path, name)
    head = _target_lm_head(src.target_path) if cfg.draft_vocab_size else None
    return write_export(cfg, src.state_dict, out, force=force, provenance=prov, readme=readme, target=facts,
                        lm_head_weight=head)


def _target_lm_head(target_path: str | None) -> torch.Tensor | None:
    """The target's lm_head (its embedding and head only are read: targets/head_only.py), for the rows
    of a draft vocabulary; None when the run names no target."""
    if not target_path:
        return None
    try:
        return load_head_only_target(TargetConfig(path=target_path, device="cpu", dtype="float32"), "cpu").lm_head_weight
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - name the target
        raise _err(f"target {target_path}: cannot read its lm_head for the draft vocabulary: {e}") from None


def follow_target(cfg, facts: dict[str, Any] | None):
    """The DrafterConfig to export: serving dtype and context length of the target as it is on disk
    now (`serving_check.target_facts`), when readable; else what training recorded."""
    if not facts:
        return cfg
    kw: dict[str, Any] = {}
    if facts.get("dtype"):
        kw["serving_dtype"] = facts["dtype"]
    tmax = facts.get("max_position_embeddings")
    if isinstance(tmax, int) and tmax > cfg.max_position_embeddings:
        kw["max_position_embeddings"] = tmax
    return dataclasses.replace(cfg, **kw) if kw else cfg


def serving_warnings(cfg) -> list[str]:
    return check_config(hf_config_dict(cfg), None)[1]


def export_command(source: Path, out: Path, force: bool, full_vocab: bool = False) -> None:
    path = export_checkpoint(source, out, force, full_vocab)
    cfg, sd = load_export(path)
    for w in serving_warnings(cfg):
        print(f"WARNING: {w}", file=sys.stderr)
    n = sum(int(t.numel()) for k, t in sd.items() if k != "draft_vocab")
    print(f"exported {source} -> {path} ({len(sd)} tensors, {n / 1e6:.2f}M parameters, "
          f"block_size {cfg.block_size}, target layers {cfg.target_layer_ids}"
          + (f", drafting over {cfg.draft_vocab_size} ids (draft_vocab_size + d2t: vLLM; --full-vocab for SGLang)"
             if cfg.draft_vocab_size else "") + ")")
