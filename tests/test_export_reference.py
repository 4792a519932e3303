"""An export loads in the reference implementation (PyPI dflash 0.1.0), and the
reference's own `dflash_generate` with the same target reproduces our greedy
output AND our acceptance lengths - with acceptance > 1 exercised (a target
edited to make one token frequent + a drafter whose slots predict it), and a
sliding-window drafter layer for the Gemma-family target."""
from __future__ import annotations

import time

import pytest
import torch

from dflash_train.config import ModelConfig, TargetConfig
from dflash_train.eval.specdec import plain_generate, speculative_generate
from specdec_fakes import bias_target_towards, slot_prediction
from dflash_train.checkpoint.source import load_export
from dflash_train.export import write_export
from dflash_train.model import DFlashDrafter, DrafterConfig
from dflash_train.targets import load_target

# the reference package is installed by `make test` (Makefile): a broken install fails here, never skips
import dflash  # noqa: E402
import dflash.model as dm  # noqa: E402

PROMPTS = ["Hello! How can I help", "The quick brown fox", "Write a short poem about the sea."]


@pytest.fixture(autouse=True)
def _cpu_timing(monkeypatch):
    # the reference times with torch.cuda.synchronize(); on CPU use the plain clock
    monkeypatch.setattr(dm, "_cuda_time", time.perf_counter)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _setup(tiny_target_factory, family, crafted: bool):
    t = load_target(TargetConfig(path=str(tiny_target_factory(family)), device="cpu", dtype="float32"))
    mask = None
    if crafted and family == "qwen3":
        bias_target_towards(t, 100, alpha=5.0, anti=1.0)
        mask = next(m for m in range(t.vocab_size) if slot_prediction(t, m) == 100)
    elif crafted:
        x0 = t.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
        rep = int(plain_generate(t, x0, 4, [])[0, -1])
        mask = next(m for m in range(t.vocab_size) if slot_prediction(t, m) == rep)
    if family == "gemma3":
        mc = ModelConfig(num_layers=2, block_size=8, layer_types=["sliding_attention", "full_attention"],
                         sliding_window=5, mask_token_id=mask)
    else:
        mc = ModelConfig(num_layers=2, block_size=8, mask_token_id=mask)
    cfg = DrafterConfig.from_target(mc, t)
    return t, DFlashDrafter(cfg, seed=1).eval()


@pytest.mark.parametrize("family,crafted", [("qwen3", True), ("gemma3", True), ("qwen3", False)])
def test_reference_reproduces_output_and_acceptance(tmp_path, tiny_target_factory, family, crafted):
    t, dr = _setup(tiny_target_factory, family, crafted)
    out = write_export(dr.cfg, dr.state_dict(), tmp_path / "export")
    ref = dflash.DFlashDraftModel.from_pretrained(str(out)).eval()
    assert ref.block_size == dr.cfg.block_size
    assert ref.mask_token_id == dr.cfg.mask_token_id
    assert list(ref.target_layer_ids) == dr.cfg.target_layer_ids
    if family == "gemma3":
        assert ref.layers[0].self_attn.sliding_window == 5 and ref.layers[1].self_attn.sliding_window is None
        assert ref.config.dflash_config["input_embedding_scale"] == pytest.approx(8.0)
    # every exported tensor is loaded by the reference, none left at random init
    ref_sd = ref.state_dict()
    for k, v in dr.state_dict().items():
        assert torch.equal(ref_sd[k], v), k
    eos = [t.tokenizer.eos_token_id]
    all_acc = []
    prompts = PROMPTS if not (family == "gemma3" and crafted) else PROMPTS[:1]
    for text in prompts:
        x = t.tokenizer(text, return_tensors="pt").input_ids
        ours, acc = speculative_generate(dr, t, x, 24, eos)
        r = dm.dflash_generate(ref, t.model, x, 24, eos, return_stats=True)
        assert torch.equal(ours, r.output_ids), text
        assert acc == r.acceptance_lengths, text
        assert torch.equal(ours, plain_generate(t, x, 24, eos))
        all_acc += acc
    if crafted:
        assert max(all_acc) > 3, all_acc


def test_load_export_round_trip_builds_same_drafter(tmp_path, tiny_target_factory):
    t, dr = _setup(tiny_target_factory, "gemma3", False)
    out = write_export(dr.cfg, dr.state_dict(), tmp_path / "e")
    cfg, sd = load_export(out)
    assert cfg.to_dict() == dr.cfg.to_dict()
    again = DFlashDrafter(cfg, seed=123)
    again.load_state_dict(sd, strict=True)
    x = t.tokenizer(PROMPTS[1], return_tensors="pt").input_ids
    a, acc_a = speculative_generate(dr, t, x, 12, [])
    b, acc_b = speculative_generate(again.eval(), t, x, 12, [])
    assert torch.equal(a, b) and acc_a == acc_b
