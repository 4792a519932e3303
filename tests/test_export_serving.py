"""Exports follow the target and pass the SGLang/vLLM loader check that `dflash-train export` runs.

The target: Qwen3-shaped, stored in bfloat16, 40960 positions (Qwen3-8B's context),
tiny widths. The export must come out bf16 (config and every tensor), with the
target's context length and RoPE, load in the reference package, and a drafter
that does not fit the target must fail the export with one line and exit 2.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dflash_train.checkpoint.manager import CheckpointManager
from dflash_train.config import ModelConfig, RunConfig, TargetConfig, save_config
from dflash_train.export import hf_config_dict, write_export
from dflash_train.model import DFlashDrafter, DrafterConfig
from dflash_train.serving_check import check_config, check_export, target_facts
from dflash_train.targets import load_target


@pytest.fixture(scope="module")
def bf16_target(tmp_path_factory):
    """A tiny Qwen3 saved in bfloat16 with max_position_embeddings 40960."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tiny_target import make_tiny_target

    src = make_tiny_target(tmp_path_factory.mktemp("src") / "qwen3", "qwen3", num_layers=4)
    out = tmp_path_factory.mktemp("bf16") / "qwen3-bf16-40960"
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16)
    model.config.max_position_embeddings = 40960
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(out))
    return out


def _run_with_checkpoint(root: Path, target_dir: Path, cfg: DrafterConfig) -> Path:
    run = root / "run"
    run.mkdir(parents=True)
    rc = RunConfig()
    rc.target.path = str(target_dir)
    save_config(rc, run / "config.yaml")
    mgr = CheckpointManager(run / "checkpoints", keep_last=2, async_save=False)
    mgr.save(3, DFlashDrafter(cfg, seed=0).state_dict(), {"optimizer": {}},
             {"step": 3, "drafter_config": cfg.to_dict(), "target_path": str(target_dir)})
    mgr.wait()
    mgr.close()
    return run


def _export_cli(run: Path, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "dflash_train.cli", "export", str(run), "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)


def test_export_follows_bf16_target_and_passes_check(tmp_path, bf16_target):
    t = load_target(TargetConfig(path=str(bf16_target), device="cpu", dtype="float32"))
    assert t.serving_dtype == "bfloat16"
    cfg = DrafterConfig.from_target(ModelConfig(num_layers=2, block_size=8, target_layer_ids=[1, 2]), t)
    assert cfg.serving_dtype == "bfloat16" and cfg.max_position_embeddings == 40960
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": t.hf_config.rope_parameters["rope_theta"]}
    run = _run_with_checkpoint(tmp_path, bf16_target, cfg)
    out = tmp_path / "export"
    r = _export_cli(run, out)
    assert r.returncode == 0, r.stderr
    c = json.loads((out / "config.json").read_text())
    assert c["dtype"] == "bfloat16" and c["torch_dtype"] == "bfloat16"
    assert c["max_position_embeddings"] == 40960
    assert c["rope_parameters"]["rope_theta"] == c["rope_theta"] == cfg.rope_theta
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert check_export(out, target_facts(str(bf16_target))) == ([], [])
    # the reference package builds it, in bf16
    import dflash  # installed by `make test`: a broken install fails, never skips
    ref = dflash.DFlashDraftModel.from_pretrained(str(out), dtype=torch.bfloat16)
    assert ref.config.max_position_embeddings == 40960 and ref.fc.weight.dtype == torch.bfloat16


def test_old_checkpoint_export_follows_target(tmp_path, bf16_target):
    """A checkpoint from before serving fields existed (float32, 32768 positions) exports as the target is."""
    t = load_target(TargetConfig(path=str(bf16_target), device="cpu", dtype="float32"))
    cfg = DrafterConfig.from_target(ModelConfig(num_layers=1, block_size=8, max_position_embeddings=32768), t)
    old = cfg.to_dict()
    old.pop("serving_dtype"), old.pop("rope_parameters")
    run = _run_with_checkpoint(tmp_path, bf16_target, DrafterConfig.from_dict(old))
    r = _export_cli(run, tmp_path / "e")
    assert r.returncode == 0, r.stderr
    c = json.loads((tmp_path / "e" / "config.json").read_text())
    assert (c["dtype"], c["max_position_embeddings"]) == ("bfloat16", 40960)


def test_draft_vocabulary_export_and_full_vocab_switch(tmp_path, bf16_target):
    """A checkpoint with a draft vocabulary exports draft_vocab_size, the target's lm_head rows (in the
    target's dtype) and int64 d2t offsets, passes the loader check and reads back to the same ids;
    `--full-vocab` exports the same drafter over the whole vocabulary."""
    from dataclasses import replace

    from dflash_train.checkpoint.source import load_export

    t = load_target(TargetConfig(path=str(bf16_target), device="cpu", dtype="float32"))
    cfg = replace(DrafterConfig.from_target(ModelConfig(num_layers=1, block_size=8), t), draft_vocab_size=5)
    ids = torch.tensor([3, 17, 40, 41, t.vocab_size - 1])
    run = tmp_path / "run"
    run.mkdir()
    rc = RunConfig()
    rc.target.path = str(bf16_target)
    save_config(rc, run / "config.yaml")
    dr = DFlashDrafter(cfg, seed=0)
    dr.draft_vocab.copy_(ids)
    mgr = CheckpointManager(run / "checkpoints", keep_last=2, async_save=False)
    mgr.save(3, dr.state_dict(), {"optimizer": {}},
             {"step": 3, "drafter_config": cfg.to_dict(), "target_path": str(bf16_target)})
    mgr.wait()
    mgr.close()
    r = _export_cli(run, tmp_path / "dv")
    assert r.returncode == 0, r.stderr
    assert "drafting over 5 ids" in r.stdout
    c = json.loads((tmp_path / "dv" / "config.json").read_text())
    assert c["draft_vocab_size"] == 5 and c["vocab_size"] == t.vocab_size
    with safe_open(str(tmp_path / "dv" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("d2t").tolist() == (ids - torch.arange(5)).tolist()
        head = f.get_tensor("lm_head.weight")
    assert head.dtype == torch.bfloat16 and torch.equal(head, t.lm_head_weight[ids].to(torch.bfloat16))
    assert check_export(tmp_path / "dv", target_facts(str(bf16_target))) == ([], [])
    back, sd = load_export(tmp_path / "dv")
    assert back.draft_vocab_size == 5 and sd["draft_vocab"].tolist() == ids.tolist()

    r = subprocess.run([sys.executable, "-m", "dflash_train.cli", "export", str(run), "--out", str(tmp_path / "full"),
                        "--full-vocab"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    c = json.loads((tmp_path / "full" / "config.json").read_text())
    assert "draft_vocab_size" not in c
    with safe_open(str(tmp_path / "full" / "model.safetensors"), "pt") as f:
        assert not {"d2t", "lm_head.weight"} & set(f.keys())
    # a d2t that does not fit the config is caught by the loader check
    c = json.loads((tmp_path / "dv" / "config.json").read_text())
    c["draft_vocab_size"] = 6
    (tmp_path / "dv" / "config.json").write_text(json.dumps(c))
    problems, _ = check_export(tmp_path / "dv", None)
    assert any("d2t has shape [5]" in p for p in problems), problems


def test_export_of_a_drafter_that_does_not_fit_fails_in_one_line(tmp_path, bf16_target):
    t = load_target(TargetConfig(path=str(bf16_target), device="cpu", dtype="float32"))
    cfg = DrafterConfig.from_target(ModelConfig(num_layers=1, block_size=8), t)
    cfg.vocab_size = t.vocab_size + 64  # trained against another target
    run = _run_with_checkpoint(tmp_path, bf16_target, cfg)
    r = _export_cli(run, tmp_path / "bad")
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "vocab_size" in lines[0] and "loader check" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "bad").exists()


def _good() -> dict:
    cfg = DrafterConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                        layer_types=["sliding_attention", "full_attention"], sliding_window=8, block_size=8,
                        mask_token_id=3, target_layer_ids=[1, 2], num_target_layers=4, vocab_size=128,
                        max_position_embeddings=40960, serving_dtype="bfloat16")
    return hf_config_dict(cfg)


TARGET = {"path": "T", "hidden_size": 32, "vocab_size": 128, "num_hidden_layers": 4,
          "max_position_embeddings": 40960, "dtype": "bfloat16"}


@pytest.mark.parametrize("edit,needle", [
    ({"dtype": "float32", "torch_dtype": "float32"}, "served in bfloat16"),
    ({"max_position_embeddings": 32768}, "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"),
    ({"hidden_size": 48}, "hidden_size 48"),
    ({"hidden_act": "gelu"}, "only silu"),
    ({"layer_types": ["full_attention"]}, "one entry per layer"),
    ({"layer_types": ["linear_attention", "full_attention"]}, "do not know"),
    ({"sliding_window": None}, "sliding_window"),
    ({"architectures": ["Qwen3ForCausalLM"]}, "DFlashDraftModel"),
    ({"num_target_layers": 2}, "outside 0..1"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6}}, "rope_type"),
])
def test_config_check_names_each_mismatch(edit, needle):
    c = {**_good(), **edit}
    problems, _ = check_config(c, TARGET)
    assert problems and any(needle in p for p in problems), problems


def test_config_check_mask_token_and_good_config():
    assert check_config(_good(), TARGET) == ([], [])
    c = _good()
    c["dflash_config"] = {**c["dflash_config"], "mask_token_id": 128}
    assert any("mask_token_id" in p for p in check_config(c, TARGET)[0])


def test_tensor_names_shapes_and_dtype_checked(tmp_path):
    cfg = DrafterConfig.from_dict({**DrafterConfig(
        hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
        layer_types=["full_attention"], sliding_window=None, block_size=8, mask_token_id=3,
        target_layer_ids=[1, 2], num_target_layers=4, vocab_size=128, serving_dtype="bfloat16").to_dict()})
    out = write_export(cfg, DFlashDrafter(cfg).state_dict(), tmp_path / "ok")
    assert check_export(out) == ([], [])
    from safetensors.torch import load_file, save_file

    sd = load_file(str(out / "model.safetensors"))
    for mutate, needle in [
        (lambda d: d.update({"layers.0.mlp.gate.weight": d.pop("layers.0.mlp.gate_proj.weight")}), "do not load"),
        (lambda d: d.update({"fc.weight": d["fc.weight"][:, :32].contiguous()}), "fc.weight has shape"),
        (lambda d: d.update({"norm.weight": d["norm.weight"].float()}), "stored as F32"),
    ]:
        bad = tmp_path / f"bad-{needle[:6]}"
        bad.mkdir()
        (bad / "config.json").write_text((out / "config.json").read_text())
        d = dict(sd)
        mutate(d)
        save_file(d, str(bad / "model.safetensors"))
        problems, _ = check_export(bad)
        assert any(needle in p for p in problems), (needle, problems)


def test_gemma_scale_warns_at_export_and_in_card(tmp_path):
    from dflash_train.export import model_card, serving_warnings

    cfg = DrafterConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                        layer_types=["full_attention"], sliding_window=None, block_size=8, mask_token_id=3,
                        target_layer_ids=[1], num_target_layers=4, vocab_size=128,
                        input_embedding_scale=32 ** 0.5)
    w = serving_warnings(cfg)
    assert len(w) == 1 and "SGLang" in w[0] and "vLLM" in w[0] and "UNSCALED" in w[0]
    card = model_card(cfg, {}, "gemma-target", "x")
    assert "WARNING: engine compatibility" in card and "vLLM" in card


def test_repeated_target_layer_warns_at_export():
    """The method's rule gives [1, 1] for 2 draft layers on a 4-layer target; vLLM captures each
    target layer once and its engine stops on such an export (seen with vLLM 0.32): a warning."""
    from dflash_train.export import serving_warnings

    kw = dict(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, sliding_window=None,
              block_size=8, mask_token_id=3, num_target_layers=4, vocab_size=128)
    cfg = DrafterConfig(num_layers=2, layer_types=["full_attention"] * 2, target_layer_ids=[1, 1], **kw)
    w = serving_warnings(cfg)
    assert len(w) == 1 and "[1, 1] repeat a layer" in w[0] and "vLLM" in w[0] and "model.target_layer_ids" in w[0]
    cfg = DrafterConfig(num_layers=2, layer_types=["full_attention"] * 2, target_layer_ids=[1, 2], **kw)
    assert serving_warnings(cfg) == []


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 500000.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
     "truncate": False, "original_max_position_embeddings": 4096},
])
def test_drafter_rope_equals_what_the_export_rebuilds(rope):
    """The cos/sin the drafter trains with = transformers' rotary built from the exported config
    (what the reference package runs; SGLang/vLLM build get_rope from the same keys)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    cfg = DrafterConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                        layer_types=["full_attention"], sliding_window=None, block_size=8, mask_token_id=3,
                        target_layer_ids=[1], num_target_layers=4, vocab_size=128, rope_parameters=rope,
                        max_position_embeddings=131072)
    d = hf_config_dict(cfg)
    assert check_config(d, None)[0] == []
    ref = Qwen3RotaryEmbedding(Qwen3Config.from_dict(d))
    pos = torch.tensor([[0, 5, 1000, 70000]])
    rc, rs = ref(torch.zeros(1, 4, 8), pos)
    ours = DFlashDrafter(cfg).rotary(pos, torch.float32)
    torch.testing.assert_close(ours[0], rc, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[1], rs, rtol=1e-5, atol=1e-5)


def test_model_card_launch_flags_follow_the_drafter():
    from dflash_train.export import model_card

    def card(layer_types, window):
        cfg = DrafterConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                            intermediate_size=64, layer_types=layer_types, sliding_window=window, block_size=10,
                            mask_token_id=3, target_layer_ids=[1], num_target_layers=4, vocab_size=128,
                            serving_dtype="bfloat16")
        return model_card(cfg, {}, "org/target", "x")

    mixed = card(["sliding_attention", "full_attention"], 8)
    full = card(["full_attention"] * 2, None)
    for c in (mixed, full):
        assert "--speculative-num-draft-tokens 10" in c and '"num_speculative_tokens": 9' in c
        assert "--speculative-algorithm DFLASH" in c and '"method": "dflash"' in c and "--dtype bfloat16" in c
    assert "VLLM_USE_V2_MODEL_RUNNER=1 vllm serve" in mixed and "VLLM_USE_V2_MODEL_RUNNER" not in full


def test_old_checkpoint_of_a_gguf_target_exports_bf16(tmp_path):
    cfg = DrafterConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                        layer_types=["full_attention"], sliding_window=None, block_size=8, mask_token_id=3,
                        target_layer_ids=[1], num_target_layers=4, vocab_size=128)
    old = cfg.to_dict()
    old.pop("serving_dtype"), old.pop("rope_parameters")
    run = tmp_path / "run"
    mgr = CheckpointManager(run / "checkpoints", keep_last=2, async_save=False)
    mgr.save(1, DFlashDrafter(cfg).state_dict(), {"optimizer": {}},
             {"step": 1, "drafter_config": old, "target_path": "embedded:gemma3-270m"})
    mgr.wait()
    mgr.close()
    from dflash_train.export import export_checkpoint

    out = export_checkpoint(run, tmp_path / "e")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_cli_export_of_a_gemma_drafter_warns_on_stderr(tmp_path, bf16_target):
    t = load_target(TargetConfig(path=str(bf16_target), device="cpu", dtype="float32"))
    cfg = DrafterConfig.from_target(ModelConfig(num_layers=1, block_size=8), t)
    cfg.input_embedding_scale = 8.0  # as a Gemma target's sqrt(hidden_size)
    run = _run_with_checkpoint(tmp_path, bf16_target, cfg)
    r = _export_cli(run, tmp_path / "g")
    assert r.returncode == 0, r.stderr
    assert "WARNING:" in r.stderr and "SGLang" in r.stderr and "vLLM" in r.stderr and "UNSCALED" in r.stderr
    assert "WARNING: engine compatibility" in (tmp_path / "g" / "README.md").read_text()
