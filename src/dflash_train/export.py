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
  no ``model.`` prefix, no embed_tokens, no lm_head.

Sources: a checkpoint dir (``step-NNNNNNNN`` with manifest.json whose meta
holds ``drafter_config``), a run dir (its ``checkpoints/latest``), or an
existing export dir (``load_export``; used by ``dflash-train eval``).
"""
from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_train.rundir import read_metrics

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
README_FILE = "README.md"

# tensors the drafter never owns (the target's); dropped from checkpoints defensively
_FOREIGN = ("embed_tokens", "lm_head")


def _err(msg: str) -> Exception:
    """An error the CLI prints as one line (UserError) without a traceback."""
    from dflash_train.errors import UserError

    return UserError(msg)


# --------------------------------------------------------------------------- config mapping


def hf_config_dict(cfg, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The exported config.json for a `DrafterConfig` (transformers 5.x Qwen3Config + DFlash keys)."""
    sliding = "sliding_attention" in cfg.layer_types
    dflash: dict[str, Any] = {
        "mask_token_id": int(cfg.mask_token_id),
        "target_layer_ids": [int(i) for i in cfg.target_layer_ids],
    }
    if float(cfg.input_embedding_scale) != 1.0:
        dflash["input_embedding_scale"] = float(cfg.input_embedding_scale)
    if float(cfg.output_multiplier) != 1.0:
        dflash["output_multiplier"] = float(cfg.output_multiplier)
    if cfg.final_logit_softcapping is not None:
        dflash["final_logit_softcapping"] = float(cfg.final_logit_softcapping)
    rope_theta = float(cfg.rope_theta)
    out: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "num_hidden_layers": int(cfg.num_layers),
        "hidden_size": int(cfg.hidden_size),
        "intermediate_size": int(cfg.intermediate_size),
        "num_attention_heads": int(cfg.num_heads),
        "num_key_value_heads": int(cfg.num_kv_heads),
        "head_dim": int(cfg.head_dim),
        "hidden_act": "silu",
        "rms_norm_eps": float(cfg.rms_norm_eps),
        # transformers 5.x reads rope_parameters; 4.x-based engines read rope_theta
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "vocab_size": int(cfg.vocab_size),
        "max_position_embeddings": int(cfg.max_position_embeddings),
        "initializer_range": float(cfg.init_std),
        "num_target_layers": int(cfg.num_target_layers),
        "block_size": int(cfg.block_size),
        "layer_types": list(cfg.layer_types),
        # Qwen3Config drops sliding_window unless use_sliding_window is true
        "use_sliding_window": bool(sliding),
        "sliding_window": int(cfg.sliding_window) if sliding else None,
        "max_window_layers": int(cfg.num_layers),
        "tie_word_embeddings": False,
        "use_cache": True,
        "dtype": "float32",
        "dflash_config": dflash,
    }
    if extra:
        out["dflash_train"] = extra
    return out


def drafter_config_from_hf(d: dict[str, Any], where: str = CONFIG_FILE):
    """`DrafterConfig` from an exported config.json dict (ours, or the public DFlash layout)."""
    from dflash_train.model.drafter import DrafterConfig, default_target_layer_ids

    dfc = d.get("dflash_config") or {}

    def pick(name, default=None):
        return dfc.get(name, d.get(name, default))

    try:
        n_layers = int(d["num_hidden_layers"])
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        num_target_layers = int(d["num_target_layers"])
        layer_types = d.get("layer_types") or ["full_attention"] * n_layers
        rope = d.get("rope_parameters") or {}
        rope_theta = float(rope.get("rope_theta", d.get("rope_theta", 1_000_000.0)))
        layer_ids = pick("target_layer_ids") or default_target_layer_ids(num_target_layers, n_layers)
        mask_id = pick("mask_token_id")
        if mask_id is None:
            raise KeyError("dflash_config.mask_token_id")
        softcap = pick("final_logit_softcapping")
        sliding = "sliding_attention" in layer_types
        return DrafterConfig(
            hidden_size=hidden,
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            intermediate_size=int(d["intermediate_size"]),
            layer_types=list(layer_types),
            sliding_window=int(d["sliding_window"]) if sliding and d.get("sliding_window") else None,
            block_size=int(pick("block_size", 16)),
            mask_token_id=int(mask_id),
            target_layer_ids=[int(i) for i in layer_ids],
            num_target_layers=num_target_layers,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            vocab_size=int(d.get("vocab_size", 0)),
            input_embedding_scale=float(pick("input_embedding_scale", 1.0)),
            output_multiplier=float(pick("output_multiplier", 1.0)),
            final_logit_softcapping=None if softcap is None else float(softcap),
            init_std=float(d.get("initializer_range", 0.02)),
        )
    except KeyError as e:
        raise _err(f"{where}: missing key {e.args[0]!r}; not a DFlash drafter config") from None
    except (TypeError, ValueError) as e:
        raise _err(f"{where}: invalid DFlash drafter config: {e}") from None


# --------------------------------------------------------------------------- sources


@dataclass
class DrafterSource:
    """A drafter found on disk: its config, weights and where it came from."""

    kind: str  # "checkpoint" | "export"
    path: Path  # the checkpoint dir or export dir actually read
    config: Any  # DrafterConfig
    state_dict: dict[str, torch.Tensor]
    run_dir: Path | None = None
    step: int | None = None
    target_path: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def is_export_dir(path: Path) -> bool:
    path = Path(path)
    return (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file() and not (path / "manifest.json").exists()


def load_export(path: str | Path):
    """(DrafterConfig, state_dict) of an export dir (config.json + model.safetensors)."""
    src = _load_export_source(Path(path))
    return src.config, src.state_dict


def _load_export_source(path: Path) -> DrafterSource:
    from safetensors.torch import load_file

    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise _err(f"{cfg_file}: missing (not an export dir)")
    try:
        d = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise _err(f"{cfg_file}: not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise _err(f"{cfg_file}: not a JSON object")
    cfg = drafter_config_from_hf(d, str(cfg_file))
    wf = path / WEIGHTS_FILE
    if not wf.is_file():
        raise _err(f"{wf}: missing")
    try:
        sd = load_file(str(wf))
    except Exception as e:  # noqa: BLE001 - name the file
        raise _err(f"{wf}: cannot load: {e}") from None
    prov = d.get("dflash_train") or {}
    return DrafterSource(
        kind="export", path=path, config=cfg, state_dict=_clean_state_dict(sd), step=prov.get("step"),
        target_path=prov.get("target_path"), meta=prov,
    )


def _clean_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        if k.startswith("model."):
            k = k[len("model."):]
        if any(f in k for f in _FOREIGN):
            continue
        out[k] = v
    return out


def _run_dir_of(ckpt: Path) -> Path | None:
    """RUN_DIR for RUN_DIR/checkpoints/step-N (None if the layout differs)."""
    ckpt = Path(ckpt).resolve()
    if ckpt.parent.name == "checkpoints":
        return ckpt.parent.parent
    return None


def _target_path_from_run(run_dir: Path | None) -> str | None:
    if run_dir is None or not (run_dir / "config.yaml").is_file():
        return None
    try:
        import yaml

        data = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        return (data.get("target") or {}).get("path")
    except Exception:  # noqa: BLE001 - provenance only
        return None


def _load_checkpoint_source(ckpt: Path) -> DrafterSource:
    from safetensors.torch import load_file

    from dflash_train.rundir import MODEL_FILE, CheckpointError, read_manifest, verify_checkpoint

    try:
        problems = verify_checkpoint(ckpt, check_hashes=True)
        if problems:
            raise _err(f"checkpoint {ckpt} failed verification: " + "; ".join(problems[:3]))
        man = read_manifest(ckpt)
    except CheckpointError as e:
        raise _err(str(e)) from None
    meta = man.get("meta") or {}
    dc = meta.get("drafter_config")
    if not isinstance(dc, dict):
        raise _err(f"{ckpt / 'manifest.json'}: meta has no drafter_config; cannot rebuild the drafter")
    from dflash_train.model.drafter import DrafterConfig

    try:
        cfg = DrafterConfig.from_dict(dc)
    except (TypeError, ValueError) as e:
        raise _err(f"{ckpt / 'manifest.json'}: invalid drafter_config: {e}") from None
    try:
        sd = load_file(str(ckpt / MODEL_FILE))
    except Exception as e:  # noqa: BLE001
        raise _err(f"{ckpt / MODEL_FILE}: cannot load: {e}") from None
    run_dir = _run_dir_of(ckpt)
    target = meta.get("target_path") or _target_path_from_run(run_dir)
    step = man.get("step", meta.get("step"))
    return DrafterSource(
        kind="checkpoint", path=ckpt, config=cfg, state_dict=_clean_state_dict(sd), run_dir=run_dir,
        step=step, target_path=target, meta=meta,
    )


def resolve_drafter_source(path: str | Path, prefer_best: bool = False) -> DrafterSource:
    """RUN_DIR (checkpoints/latest, or `best` with prefer_best), a checkpoint dir, or an export dir.

    `path` may also be RUN_DIR/checkpoints or name ``RUN_DIR/best`` / ``RUN_DIR/latest``.
    Raises the CLI's UserError (one clear line) for anything else.
    """
    from dflash_train.rundir import BEST, LATEST, MANIFEST_FILE, find_resumable, read_link

    p = Path(path)
    if not p.exists():
        # RUN_DIR/best or RUN_DIR/latest shorthand
        if p.name in (BEST, LATEST) and (p.parent / "checkpoints").is_dir():
            t = read_link(p.parent / "checkpoints", p.name)
            if t is None:
                raise _err(f"{p.parent / 'checkpoints' / p.name}: no such checkpoint link")
            return _load_checkpoint_source(t)
        raise _err(f"drafter path not found: {p}")
    if not p.is_dir():
        raise _err(f"drafter path is not a directory: {p} (give a RUN_DIR, checkpoint dir or export dir)")
    if (p / MANIFEST_FILE).is_file():
        return _load_checkpoint_source(p)
    if (p / CONFIG_FILE).is_file() and (p / WEIGHTS_FILE).is_file():
        return _load_export_source(p)
    for base in (p / "checkpoints", p):
        if not base.is_dir():
            continue
        names = (BEST, LATEST) if prefer_best else (LATEST,)
        for name in names:
            t = read_link(base, name)
            if t is not None:
                return _load_checkpoint_source(t)
        found = find_resumable(base, log=lambda m: None) if any(base.glob("step-*")) else None
        if found is not None:
            return _load_checkpoint_source(found)
    raise _err(
        f"{p}: not a run dir (no checkpoints/latest), checkpoint dir (no manifest.json) "
        f"or export dir (no config.json + model.safetensors)"
    )


# --------------------------------------------------------------------------- run summary / README


def run_summary(run_dir: Path | None, step: int | None, meta: dict[str, Any]) -> dict[str, Any]:
    """steps, tokens, final loss, measured tau (if any) from RUN_DIR/summary.json and metrics.jsonl."""
    s: dict[str, Any] = {"step": step, "tokens": meta.get("tokens")}
    if run_dir is None:
        return s
    summ = {}
    sf = run_dir / "summary.json"
    if sf.is_file():
        try:
            summ = json.loads(sf.read_text())
        except ValueError:
            summ = {}
    recs = read_metrics(run_dir)
    if step is not None:
        recs = [r for r in recs if not isinstance(r.get("step"), (int, float)) or r["step"] <= step]
    train = [r for r in recs if not r.get("eval") and "loss" in r]
    evals = [r for r in recs if r.get("eval") and "tau" in r]
    if train:
        last = train[-1]
        s["final_loss"] = last.get("loss_mean", last.get("loss"))
        s["tokens"] = s.get("tokens") or last.get("tokens")
        if "acc_1" in last:
            s["acc_1"] = last["acc_1"]
    if evals:
        s["tau"] = evals[-1]["tau"]
        s["tau_step"] = evals[-1].get("step")
        s["best_tau"] = max(r["tau"] for r in evals if isinstance(r["tau"], (int, float)))
    if isinstance(summ, dict):
        # the demo's summary.json names the trained drafter's tau "tau_trained"
        if summ.get("tau_trained") is not None:
            s["tau"] = summ["tau_trained"]
            s.pop("tau_step", None)
        for k in ("tau", "tau_untrained", "final_loss", "tokens", "steps", "speedup"):
            if summ.get(k) is not None and s.get(k) is None:
                s[k] = summ[k]
    return s


def _fmt(v: Any, spec: str = "") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    try:
        return format(v, spec) if spec else str(v)
    except (TypeError, ValueError):
        return str(v)


def model_card(cfg, summary: dict[str, Any], target_path: str | None, name: str) -> str:
    bs = int(cfg.block_size)
    tgt = target_path or "<the target model>"
    lines = [
        f"# {name}",
        "",
        "A DFlash block-diffusion drafter for speculative decoding, trained with dflash-train.",
        "",
        "## Drafter",
        "",
        f"- target: `{tgt}` ({cfg.num_target_layers} layers; context features from layers {list(cfg.target_layer_ids)})",
        f"- {cfg.num_layers} Qwen3-layout layer(s), hidden {cfg.hidden_size}, {cfg.num_heads} heads / "
        f"{cfg.num_kv_heads} KV heads, head_dim {cfg.head_dim}, intermediate {cfg.intermediate_size}",
        f"- block size {bs} (drafts {bs - 1} tokens per step), mask token id {cfg.mask_token_id}, "
        f"layer types {list(cfg.layer_types)}",
        "- uses the target's embedding and lm_head (not included here)",
        "",
        "## Training summary",
        "",
        f"- steps: {_fmt(summary.get('step') or summary.get('steps'))}",
        f"- tokens trained: {_fmt(summary.get('tokens'))}",
        f"- final loss: {_fmt(summary.get('final_loss'), '.4f')}",
        f"- measured acceptance length (tau, real speculative decoding): {_fmt(summary.get('tau'), '.3f')}"
        + (f" at step {summary['tau_step']}" if summary.get("tau_step") is not None else ""),
    ]
    if summary.get("tau_untrained") is not None:
        lines.append(f"- tau of an untrained drafter of the same shape: {_fmt(summary['tau_untrained'], '.3f')}")
    lines += [
        "",
        "## Serving",
        "",
        "SGLang:",
        "",
        "```bash",
        f"python -m sglang.launch_server --model-path {tgt} \\",
        "    --speculative-algorithm DFLASH \\",
        "    --speculative-draft-model-path ./THIS_DIR \\",
        f"    --speculative-num-draft-tokens {bs}",
        "```",
        "",
        "vLLM:",
        "",
        "```bash",
        f"vllm serve {tgt} \\",
        "    --speculative-config '{\"method\": \"dflash\", \"model\": \"./THIS_DIR\", "
        f"\"num_speculative_tokens\": {bs - 1}}}'",
        "```",
        "",
        "Reference implementation (PyPI `dflash`):",
        "",
        "```python",
        "from dflash import DFlashDraftModel",
        "draft = DFlashDraftModel.from_pretrained('./THIS_DIR')",
        "out = draft.spec_generate(target_model, input_ids, max_new_tokens=256, stop_token_ids=[eos_id])",
        "```",
        "",
    ]
    return "\n".join(lines)


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
    from dflash_train.rundir import holds_checkpoints, is_checkpoint_dir, is_run_dir

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
    from dflash_train.rundir import holds_checkpoints, is_checkpoint_dir, is_run_dir

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
                 provenance: dict[str, Any] | None = None, readme: str | None = None) -> Path:
    """Write config.json + model.safetensors (+ README.md) for a DrafterConfig and its weights.

    `out_dir` is checked by `check_out_dir` (a previous export is replaced only
    with `force`). The files get the usual umask-respecting permissions.
    """
    import secrets

    from dflash_train.utils import save_safetensors

    given = Path(out_dir)
    out = check_out_dir(given, force)
    sd = _clean_state_dict(state_dict)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in sd.items()}
    _validate_tensors(cfg, tensors)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-export-{secrets.token_hex(4)}"
    old = None
    tmp.mkdir()
    try:
        (tmp / CONFIG_FILE).write_text(json.dumps(hf_config_dict(cfg, provenance), indent=2) + "\n")
        save_safetensors(tensors, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
        if readme is not None:
            (tmp / README_FILE).write_text(readme)
        check_out_dir(given, force)  # again, right before replacing anything
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


def expected_tensor_names(cfg) -> list[str]:
    names = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    return names + ["fc.weight", "hidden_norm.weight", "norm.weight"]


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


def export_checkpoint(ckpt_or_run_dir: str | Path, out_dir: str | Path, force: bool = False) -> Path:
    """Export a checkpoint (or a run's latest) to `out_dir`; refuses a non-empty dir without force."""
    out = Path(out_dir)
    check_out_dir(out, force)  # before the (possibly slow) load
    src = resolve_drafter_source(ckpt_or_run_dir)
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
    readme = model_card(src.config, summary, src.target_path, name)
    return write_export(src.config, src.state_dict, out, force=force, provenance=prov, readme=readme)


def export_command(source: Path, out: Path, force: bool) -> None:
    path = export_checkpoint(source, out, force)
    cfg, sd = load_export(path)
    n = sum(int(t.numel()) for t in sd.values())
    print(f"exported {source} -> {path} ({len(sd)} tensors, {n / 1e6:.2f}M parameters, "
          f"block_size {cfg.block_size}, target layers {cfg.target_layer_ids})")
