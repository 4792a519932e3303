"""Static check of an export against what the serving engines' DFlash loaders read.

Read from the loaders (SGLang ``srt/models/dflash.py`` + ``speculative/dflash_utils.py``,
vLLM ``model_executor/models/qwen3_dflash.py``; see docs/serving.md):

* config.json: ``architectures`` holds ``DFlashDraftModel``; ``hidden_size``,
  ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
  ``head_dim``, ``intermediate_size``, ``rms_norm_eps``, ``vocab_size``,
  ``max_position_embeddings``, ``rope_theta`` / ``rope_parameters``;
  ``hidden_act`` must be ``silu`` (SGLang raises otherwise); ``layer_types``
  one entry per layer, ``full_attention`` or ``sliding_attention``, the latter
  with ``sliding_window``; ``num_target_layers`` and ``block_size`` (top level
  or ``dflash_config``); ``dflash_config.target_layer_ids`` (non-empty, each
  inside the target) and an integer ``dflash_config.mask_token_id``.
* dtype: SGLang's default ``--dtype auto`` takes the draft config's ``dtype``
  (a float32 config is served in float16); it must be the target's serving
  dtype, and every tensor must be stored in it.
* context: SGLang refuses a draft whose ``max_position_embeddings`` is below
  the target's unless ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1``.
* vocabulary: vLLM expects a ``draft_id_to_target_id`` tensor when the draft's
  ``vocab_size`` differs from the target's; we never write one, so they must be equal.
* tensors: SGLang silently ignores names it does not know (a misnamed weight
  would stay random), both engines fuse q/k/v and gate/up by name; so the
  names must be exactly the expected set and every shape must match the config
  (``fc.weight`` [H, K*H] with K = len(target_layer_ids)).

`check_export(dir, target)` returns (problems, warnings); problems make
`dflash-train export` fail (one line, exit 2) before anything is replaced.
Warnings (an embedding scale the engines do not apply) are printed and go in
the model card.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_train.model.dflash2 import config_problems, export_shapes
from dflash_train.model.rope import SUPPORTED_TYPES

DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
ENGINES_WITHOUT_EMBED_SCALE = "SGLang (--speculative-algorithm DFLASH) and vLLM (method dflash)"


def target_facts(target_path: str | None) -> dict[str, Any] | None:
    """What the check needs from the target's config.json (a local HF directory); for a GGUF or
    embedded target only its serving dtype (bfloat16: what the engines' ``--dtype auto`` picks for
    the original checkpoints); None when unknown."""
    if not target_path:
        return None
    if target_path.startswith("embedded:") or target_path.lower().endswith(".gguf"):
        return {"path": str(target_path), "hidden_size": None, "vocab_size": None, "num_hidden_layers": None,
                "max_position_embeddings": None, "dtype": "bfloat16"}
    cj = Path(target_path).expanduser() / "config.json"
    try:
        mc = json.loads(cj.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(mc, dict):
        return None
    tc = mc.get("text_config") if isinstance(mc.get("text_config"), dict) else {}

    def get(key):
        return tc.get(key, mc.get(key))

    dtype = next((v for v in (tc.get("dtype"), tc.get("torch_dtype"), mc.get("dtype"), mc.get("torch_dtype"))
                  if v in DTYPES), None)
    return {"path": str(target_path), "hidden_size": get("hidden_size"), "vocab_size": get("vocab_size"),
            "num_hidden_layers": get("num_hidden_layers"), "max_position_embeddings": get("max_position_embeddings"),
            "dtype": dtype}


def expected_shapes(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape an engine builds for config.json dict `c`."""
    H, I = int(c["hidden_size"]), int(c["intermediate_size"])
    nh, nkv = int(c["num_attention_heads"]), int(c["num_key_value_heads"])
    D = int(c.get("head_dim") or H // nh)
    K = len((c.get("dflash_config") or {}).get("target_layer_ids") or [])
    out: dict[str, tuple[int, ...]] = {}
    for i in range(int(c["num_hidden_layers"])):
        p = f"layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (nh * D, H), p + "self_attn.k_proj.weight": (nkv * D, H),
                    p + "self_attn.v_proj.weight": (nkv * D, H), p + "self_attn.o_proj.weight": (H, nh * D),
                    p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
                    p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                    p + "mlp.down_proj.weight": (H, I),
                    p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)})
    out.update({"fc.weight": (H, K * H), "hidden_norm.weight": (H,), "norm.weight": (H,)})

    out.update(export_shapes(c))  # DFlash 2: convolutions and candidate selector
    out.update(draft_vocab_shapes(c))
    return out


# the integer tensor of a draft-vocabulary export (every other tensor is in the config's dtype)
D2T = "d2t"


def draft_vocab_shapes(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """A draft vocabulary's tensors (vLLM's DFlash loader: draft_vocab_size rows of lm_head, and
    d2t, the offsets draft id -> target id); none when draft_vocab_size is absent or the vocabulary."""
    n = c.get("draft_vocab_size")
    if not _is_int(n) or n == c.get("vocab_size"):
        return {}
    return {"lm_head.weight": (n, int(c["hidden_size"])), D2T: (n,)}


def _safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def embedding_scale_warning(scale: float) -> str | None:
    """The warning for a drafter trained on scaled embeddings (Gemma targets), None at scale 1."""
    if scale == 1.0:
        return None
    return (f"the drafter was trained on embeddings scaled by {scale:g} (the target's own, e.g. Gemma's "
            f"sqrt(hidden_size)); {ENGINES_WITHOUT_EMBED_SCALE} feed it the UNSCALED embedding "
            f"(dflash_config.input_embedding_scale is not read there): acceptance will be lower than "
            f"measured here; the reference dflash package (HF target) computes what was trained")


def check_config(c: dict[str, Any], target: dict[str, Any] | None) -> tuple[list[str], list[str]]:
    P: list[str] = []
    W: list[str] = []
    if not {"DFlashDraftModel", "DFlash2DraftModel"} & set(c.get("architectures") or []):
        P.append(f"architectures is {c.get('architectures')!r}; the engines look for DFlashDraftModel "
                 "(or DFlash2DraftModel)")
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "vocab_size", "max_position_embeddings"):
        if not _is_int(c.get(k)) or c[k] <= 0:
            P.append(f"{k} is {c.get(k)!r}, not a positive integer")
    if P:
        return P, W

    P += config_problems(c)
    if c["num_attention_heads"] % c["num_key_value_heads"]:
        P.append(f"num_attention_heads {c['num_attention_heads']} is not a multiple of num_key_value_heads "
                 f"{c['num_key_value_heads']}")
    if c.get("hidden_act", "silu") != "silu":
        P.append(f"hidden_act is {c.get('hidden_act')!r}; SGLang's DFlash MLP supports only silu")
    if not isinstance(c.get("rms_norm_eps"), (int, float)):
        P.append("rms_norm_eps missing")
    rope = c.get("rope_parameters") or {}

    if rope.get("rope_type", "default") not in SUPPORTED_TYPES:
        P.append(f"rope_parameters.rope_type {rope.get('rope_type')!r} is not one of {SUPPORTED_TYPES}")
    if rope and c.get("rope_theta") is not None and float(rope.get("rope_theta", c["rope_theta"])) != float(c["rope_theta"]):
        P.append(f"rope_theta {c['rope_theta']} differs from rope_parameters.rope_theta {rope.get('rope_theta')} "
                 "(SGLang reads one, vLLM the other)")
    lt = c.get("layer_types")
    if lt is not None:
        if not isinstance(lt, list) or len(lt) != c["num_hidden_layers"]:
            P.append(f"layer_types must have one entry per layer ({c['num_hidden_layers']}), got {lt!r}")
        elif any(t not in ("full_attention", "sliding_attention") for t in lt):
            P.append(f"layer_types {lt} holds a type the engines do not know (full_attention, sliding_attention)")
        elif "sliding_attention" in lt and not _is_int(c.get("sliding_window")):
            P.append("sliding_attention layers but no integer sliding_window")
    dfc = c.get("dflash_config") if isinstance(c.get("dflash_config"), dict) else {}
    bs = dfc.get("block_size", c.get("block_size"))
    if not _is_int(bs) or bs < 2:
        P.append(f"block_size is {bs!r}, not an integer >= 2")
    ntl = dfc.get("num_target_layers", c.get("num_target_layers"))
    if not _is_int(ntl) or ntl <= 0:
        P.append(f"num_target_layers is {ntl!r}, not a positive integer")
    ids = dfc.get("target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(_is_int(i) for i in ids):
        P.append(f"dflash_config.target_layer_ids is {ids!r}, not a non-empty list of integers")
    elif _is_int(ntl) and any(not 0 <= i < ntl for i in ids):
        P.append(f"dflash_config.target_layer_ids {ids} outside 0..{ntl - 1}")
    elif len(set(ids)) < len(ids):  # the method's rule gives [1, 1] for 2 draft layers on a 4-layer target
        W.append(f"dflash_config.target_layer_ids {ids} repeat a layer: vLLM captures each target layer once, "
                 "so its fc gets fewer features than it takes and the engine stops (vLLM 0.32); "
                 "train with distinct model.target_layer_ids")
    dv = c.get("draft_vocab_size")
    if dv is not None and (not _is_int(dv) or not 0 < dv <= c["vocab_size"]):
        P.append(f"draft_vocab_size is {dv!r}, not an integer in 1..vocab_size ({c['vocab_size']})")
    mid = dfc.get("mask_token_id")
    if not _is_int(mid) or not 0 <= mid < c["vocab_size"]:
        P.append(f"dflash_config.mask_token_id is {mid!r}, not an id inside the vocabulary ({c['vocab_size']})")
    dtype = c.get("dtype") or c.get("torch_dtype")
    if dtype not in DTYPES:
        P.append(f"dtype is {dtype!r}, not one of {sorted(DTYPES)}")
    w = embedding_scale_warning(float(dfc.get("input_embedding_scale", 1.0) or 1.0))
    if w:
        W.append(w)
    if target:
        where = f"the target {target['path']}"
        if _is_int(target.get("hidden_size")) and target["hidden_size"] != c["hidden_size"]:
            P.append(f"hidden_size {c['hidden_size']} but {where} has {target['hidden_size']} "
                     "(the target's features and embeddings would not fit)")
        if _is_int(target.get("vocab_size")) and target["vocab_size"] != c["vocab_size"]:
            P.append(f"vocab_size {c['vocab_size']} but {where} has {target['vocab_size']} (vLLM would look for "
                     "a draft_id_to_target_id map this export does not have)")
        if _is_int(target.get("num_hidden_layers")) and _is_int(ntl) and target["num_hidden_layers"] != ntl:
            P.append(f"num_target_layers {ntl} but {where} has {target['num_hidden_layers']} layers")
        tmax = target.get("max_position_embeddings")
        if _is_int(tmax) and c["max_position_embeddings"] < tmax:
            P.append(f"max_position_embeddings {c['max_position_embeddings']} is below the target's {tmax} "
                     f"({where}); SGLang refuses it unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1")
        if target.get("dtype") and dtype in DTYPES and dtype != target["dtype"]:
            P.append(f"dtype {dtype} but {where} is served in {target['dtype']} (SGLang's --dtype auto would run "
                     f"the drafter in {'float16' if dtype == 'float32' else dtype})")
    return P, W


def check_export(path: str | Path, target: dict[str, Any] | None = None) -> tuple[list[str], list[str]]:
    """(problems, warnings) of the export in `path` against the engines' loaders and `target` (target_facts)."""
    path = Path(path)
    try:
        c = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        return [f"config.json: unreadable ({e})"], []
    if not isinstance(c, dict):
        return ["config.json: not a JSON object"], []
    P, W = check_config(c, target)
    if P:
        return [f"config.json: {p}" for p in P], W
    try:
        header = _safetensors_header(path / "model.safetensors")
    except (OSError, ValueError) as e:
        return [f"model.safetensors: unreadable header ({e})"], W
    want = expected_shapes(c)
    missing, extra = sorted(set(want) - set(header)), sorted(set(header) - set(want))
    if missing:
        P.append(f"model.safetensors: missing {missing[:3]}" + (f" (+{len(missing) - 3})" if len(missing) > 3 else ""))
    if extra:
        P.append(f"model.safetensors: names the engines do not load {extra[:3]}"
                 + (f" (+{len(extra) - 3})" if len(extra) > 3 else ""))
    dtype = DTYPES[c.get("dtype") or c.get("torch_dtype")]
    for name in sorted(set(want) & set(header)):
        shape = tuple(header[name].get("shape", ()))
        if shape != want[name]:
            P.append(f"model.safetensors: {name} has shape {list(shape)}, the config implies {list(want[name])}")
        if header[name].get("dtype") != ("I64" if name == D2T else dtype):
            P.append(f"model.safetensors: {name} is stored as {header[name].get('dtype')}, config.json says {dtype}")
    return P, W


def launch_commands(block_size: int, layer_types: list[str], dtype: str, target: str) -> list[str]:
    """Markdown lines: SGLang and vLLM launch commands for a drafter (flags from reading both
    engines' DFlash code and z-lab's launch docs; see docs/serving.md)."""
    bs, lt = int(block_size), list(layer_types) or ["full_attention"]
    mixed = 0 < lt.count("sliding_attention") < len(lt)
    v2 = "VLLM_USE_V2_MODEL_RUNNER=1 " if mixed else ""
    return [
        "SGLang (`--speculative-num-draft-tokens` = block size; add `--mamba-scheduler-strategy extra_buffer` for",
        "hybrid linear-attention targets such as Qwen3.5 / Qwen3-Next):",
        "",
        "```bash",
        f"python -m sglang.launch_server --model-path {target} --dtype {dtype} \\",
        "    --speculative-algorithm DFLASH --speculative-draft-model-path ./THIS_DIR \\",
        f"    --speculative-num-draft-tokens {bs} --attention-backend fa3",
        "```",
        "",
        "vLLM (`num_speculative_tokens` = block size - 1; the drafter's full-attention layers are non-causal, so its",
        "attention backend must support that: `flash_attn`"
        + ("; drafters mixing sliding and full layers need the V2 model runner" if mixed else "") + "):",
        "",
        "```bash",
        f"{v2}vllm serve {target} \\",
        "    --speculative-config '{\"method\": \"dflash\", \"model\": \"./THIS_DIR\", "
        f"\"num_speculative_tokens\": {bs - 1}, \"attention_backend\": \"flash_attn\"}}'",
        "```",
    ]
