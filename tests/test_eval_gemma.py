"""End to end with the real embedded target (Gemma 3 270M, ~7 s to load): greedy
speculative decoding with an (untrained) drafter of the demo's shape equals
plain greedy decoding token for token, and so does the reference package with
our export of the same drafter."""
from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write one sentence about the sea."]




@pytest.fixture(scope="module")
def gemma():
    from dflash_train.config import GEMMA3_270M, TargetConfig
    from dflash_train.targets import load_target

    return load_target(TargetConfig(path=GEMMA3_270M, device="cpu", dtype="float32"))


def test_gemma270m_greedy_spec_equals_plain_and_reference(gemma, tmp_path, monkeypatch):
    import dflash
    import dflash.model as dm

    from dflash_train.config import ModelConfig
    from dflash_train.eval.prompts import encode_prompts
    from dflash_train.eval.specdec import plain_generate, speculative_generate
    from dflash_train.export import write_export
    from dflash_train.model import DFlashDrafter, DrafterConfig

    t = gemma
    cfg = DrafterConfig.from_target(ModelConfig(num_layers=1, block_size=8), t)
    assert cfg.input_embedding_scale == pytest.approx(640 ** 0.5)
    # served in bf16 (Gemma 3's dtype); here the export is compared with our float32 numerics
    assert cfg.serving_dtype == "bfloat16"
    cfg.serving_dtype = "float32"
    dr = DFlashDrafter(cfg, seed=0).eval()
    ids, stops = encode_prompts(t, PROMPTS)
    assert t.tokenizer.decode(ids[0]).endswith("<start_of_turn>user\nWhat is the capital of France?"
                                               "<end_of_turn>\n<start_of_turn>model\n")
    monkeypatch.setattr(dm, "_cuda_time", time.perf_counter)
    ref = dflash.DFlashDraftModel.from_pretrained(str(write_export(cfg, dr.state_dict(), tmp_path / "e"))).eval()
    for i, p in enumerate(ids):
        x = torch.tensor([p])
        plain = plain_generate(t, x, 16, stops)
        spec, acc = speculative_generate(dr, t, x, 16, stops)
        assert torch.equal(spec, plain), t.tokenizer.decode(plain[0, x.shape[1]:])
        if i == 0:  # the reference is slower; one prompt is enough here
            r = dm.dflash_generate(ref, t.model, x, 16, stops, return_stats=True)
            assert torch.equal(r.output_ids, spec) and r.acceptance_lengths == acc
