"""model.init_from_target_layers as a user runs it: `dflash-train train` subprocesses on tiny
Llama (no q/k norms) and Qwen3 (q/k norms) targets; the checkpoint's drafter layer is the target's."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from trainrun import run_train, tiny_overrides

# lr this small leaves one AdamW step's change below 1e-8: the checkpoint shows the initial weights
ONE_STEP = {"train.max_steps": 1, "train.lr": 1e-10, "checkpoint.every_steps": 1}
COPIED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
          "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
          "input_layernorm.weight", "post_attention_layernorm.weight")


def _drafter_after_one_step(target, jsonl, rd, **extra) -> dict[str, torch.Tensor]:
    res = run_train(rd, tiny_overrides(target, jsonl, **ONE_STEP, **extra))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "drafter layers initialised from target layer" in res.stderr
    return load_file(str(rd / "checkpoints" / "step-00000001" / "model.safetensors"))


@pytest.mark.parametrize("qk_norm", ["ones", "match"])
def test_llama_layer_copied_and_qk_norms_set(tiny_target_factory, tiny_jsonl, tmp_path, qk_norm):
    target = tiny_target_factory("llama")
    drafter = _drafter_after_one_step(target, tiny_jsonl, tmp_path / qk_norm, **{
        "model.init_from_target_layers": "[1]", "model.init_qk_norm": qk_norm})
    tw = load_file(str(target / "model.safetensors"))
    for name in COPIED:
        torch.testing.assert_close(drafter[f"layers.0.{name}"], tw[f"model.layers.1.{name}"], atol=1e-7, rtol=0)
    g = tw["model.layers.1.input_layernorm.weight"]
    for which in ("q", "k"):
        got = drafter[f"layers.0.self_attn.{which}_norm.weight"]
        if qk_norm == "ones":
            want = torch.ones_like(got)
        else:  # the projection's RMS per output channel on unit-RMS inputs, averaged
            w = tw[f"model.layers.1.self_attn.{which}_proj.weight"] * g
            want = torch.full_like(got, float((w ** 2).sum(1).mean().sqrt()))
            assert abs(float(want[0]) - 1.0) > 0.05  # the test can tell match from ones
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    # fc has no target counterpart: random, as without the option
    assert 0.005 < float(drafter["fc.weight"].std()) < 0.05


def test_qwen3_layer_brings_its_qk_norms(tiny_target_factory, tiny_jsonl, tmp_path):
    target = tiny_target_factory("qwen3")
    drafter = _drafter_after_one_step(target, tiny_jsonl, tmp_path / "q3", **{"model.init_from_target_layers": "[3]"})
    tw = load_file(str(target / "model.safetensors"))
    for name in (*COPIED, "self_attn.q_norm.weight", "self_attn.k_norm.weight"):
        torch.testing.assert_close(drafter[f"layers.0.{name}"], tw[f"model.layers.3.{name}"], atol=1e-7, rtol=0)


@pytest.mark.parametrize("extra,words", [
    ({"model.init_from_target_layers": "[9]"}, "model.init_from_target_layers=[9]: [9] out of range"),
    ({"model.init_qk_norm": "match"}, "init_qk_norm applies with init_from_target_layers only"),
    ({"model.init_from_target_layers": "[0,1]"}, "give 1 or num_layers=1"),
])
def test_bad_init_request_is_one_line_exit_2(tiny_target_factory, tiny_jsonl, tmp_path, extra, words):
    target = tiny_target_factory("llama")
    rd = tmp_path / "bad"
    res = run_train(rd, tiny_overrides(target, tiny_jsonl, **ONE_STEP, **extra))
    assert res.returncode == 2, res.stderr[-2000:]
    assert words in res.stderr and "Traceback" not in res.stderr
    assert not (rd / "checkpoints").exists() or not any((rd / "checkpoints").iterdir())
