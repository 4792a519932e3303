"""End to end with the real embedded target (Gemma 3 270M, ~7 s to load): greedy
speculative decoding with a drafter of the demo's shape equals plain greedy decoding token for
token while drafts are accepted (an untrained drafter accepts nothing, so its proposals are
overwritten with plain's own continuation, right for 0..k tokens of each block: every
acceptance length is exercised), and the reference package with our export of the same
(untrained) drafter decodes as ours does, acceptance lengths included."""
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
    from dflash_train.eval import specdec

    real_draft = specdec.DrafterProposer.draft
    state = {"plain": None, "calls": 0}

    def partly_right(self, output_ids, start, room, temperature, generator):
        """The drafter's own block (its forward runs), then its first j drafts replaced by plain's
        tokens and the next one by a wrong token, j = 0, 1, ..., k in turn."""
        block, q = real_draft(self, output_ids, start, room, temperature, generator)
        truth = state["plain"][0, start + 1:start + block.shape[1]]
        j = state["calls"] % (truth.shape[0] + 1)
        state["calls"] += 1
        block[0, 1:1 + j] = truth[:j]
        if j < truth.shape[0]:
            block[0, 1 + j] = truth[j] ^ 1  # another token id
        return block, q

    for i, p in enumerate(ids):
        x = torch.tensor([p])
        plain = plain_generate(t, x, 16, stops)
        state["plain"], state["calls"] = plain, 0
        monkeypatch.setattr(specdec.DrafterProposer, "draft", partly_right)
        spec, acc = speculative_generate(dr, t, x, 16, stops)
        monkeypatch.setattr(specdec.DrafterProposer, "draft", real_draft)
        assert torch.equal(spec, plain), t.tokenizer.decode(plain[0, x.shape[1]:])
        # the drafts were accepted, in blocks of every length (acceptance length = accepted drafts + 1)
        assert max(acc) >= 4 and len(set(acc)) >= 3, acc
        if i == 0:  # the reference is slower; one prompt is enough here
            spec, acc = speculative_generate(dr, t, x, 16, stops)  # our untrained drafter, as exported
            assert torch.equal(spec, plain)
            r = dm.dflash_generate(ref, t.model, x, 16, stops, return_stats=True)
            assert torch.equal(r.output_ids, spec) and r.acceptance_lengths == acc
