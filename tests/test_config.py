"""The strict config schema: round trip, overrides, and every error path."""
import re
from pathlib import Path

import pytest
import yaml

from dflash_train.config import ConfigError, RunConfig, load_config, save_config


def test_defaults_round_trip(tmp_path: Path):
    cfg = load_config()
    out = tmp_path / "config.yaml"
    save_config(cfg, out)
    again = load_config(out)
    assert again == cfg
    assert again.hash() == cfg.hash()


def test_yaml_and_overrides(tmp_path: Path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"name": "x", "train": {"lr": 1e-3, "max_steps": 5}}))
    cfg = load_config(f, ["train.max_steps=7", "model.num_layers=3", "data.source=jsonl:/tmp/a.jsonl",
                          "model.target_layer_ids=[1,2,3]", "checkpoint.async_save=false"])
    assert cfg.name == "x"
    assert cfg.train.lr == 1e-3 and cfg.train.max_steps == 7
    assert cfg.model.num_layers == 3 and cfg.model.target_layer_ids == [1, 2, 3]
    assert cfg.data.source == "jsonl:/tmp/a.jsonl"
    assert cfg.checkpoint.async_save is False


@pytest.mark.parametrize("dotted, text, value", [
    ("train.max_steps", "123", 123), ("train.lr", "2.5e-4", 2.5e-4), ("train.batch_size", "3", 3),
    ("train.num_anchors", "5", 5), ("train.seed", "11", 11), ("model.num_layers", "2", 2),
    ("model.block_size", "8", 8), ("target.path", "/models/x", "/models/x"),
    ("data.source", "jsonl:/data/c.jsonl", "jsonl:/data/c.jsonl"), ("data.limit", "17", 17),
    ("data.max_tokens", "96", 96), ("checkpoint.every_steps", "7", 7), ("checkpoint.keep_last", "4", 4),
    ("eval.every_steps", "9", 9), ("eval.num_prompts", "6", 6), ("logging.every_steps", "2", 2),
])
def test_documented_keys_take_an_override_and_round_trip(tmp_path: Path, dotted, text, value):
    """The keys the README and configs/ use: an override sets exactly that value, config.yaml keeps
    it, and a value of the wrong type is refused naming the key."""
    sec, key = dotted.split(".")
    cfg = load_config(None, [f"{dotted}={text}"])
    assert getattr(getattr(cfg, sec), key) == value
    default = getattr(getattr(RunConfig(), sec), key)
    assert value != default  # the override is what changed it
    save_config(cfg, tmp_path / "c.yaml")
    assert yaml.safe_load((tmp_path / "c.yaml").read_text())[sec][key] == value
    assert getattr(getattr(load_config(tmp_path / "c.yaml"), sec), key) == value
    if not isinstance(value, str):
        with pytest.raises(ConfigError, match=re.escape(dotted)):
            load_config(None, [f"{dotted}=not-a-number"])


def test_unknown_key_suggests_closest(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"unknown key 'train.max_step'.*did you mean 'max_steps'"):
        load_config(None, ["train.max_step=3"])
    f = tmp_path / "c.yaml"
    f.write_text("trian:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown key 'trian'.*did you mean 'train'"):
        load_config(f)
    with pytest.raises(ConfigError, match=r"unknown key 'model.num_layer'.*'num_layers'"):
        load_config(None, ["model.num_layer.x=3"])


def test_wrong_type_and_range():
    with pytest.raises(ConfigError, match=r"train.max_steps"):
        load_config(None, ["train.max_steps=abc"])
    with pytest.raises(ConfigError, match=r"train.lr.*greater than 0"):
        load_config(None, ["train.lr=-1"])
    with pytest.raises(ConfigError, match=r"data.source"):
        load_config(None, ["data.source=ftp://x"])
    with pytest.raises(ConfigError, match=r"sliding_window"):
        load_config(None, ["model.layer_types=[sliding_attention]"])


def test_bad_files(tmp_path: Path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(lst)
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["trainlr"])


def test_shipped_configs_validate():
    root = Path(__file__).resolve().parents[1] / "configs"
    files = sorted(root.glob("*.yaml"))
    assert files, "no shipped configs"
    for f in files:
        load_config(f)


def test_config_yaml_of_an_earlier_version_still_loads(tmp_path):
    """Earlier versions wrote the test knobs train.step_delay_seconds / checkpoint.test_delay_seconds
    into every RUN/config.yaml: reading such a file drops them; naming them now is an error."""
    p = tmp_path / "config.yaml"
    p.write_text("train:\n  max_steps: 7\n  step_delay_seconds: 0\ncheckpoint:\n  test_delay_seconds: 0.0\n")
    cfg = load_config(p)
    assert cfg.train.max_steps == 7 and "step_delay_seconds" not in cfg.to_dict()["train"]
    with pytest.raises(ConfigError, match="step_delay_seconds"):
        load_config(None, ["train.step_delay_seconds=1"])
