"""The real embedded Gemma 3 270M (GGUF): attributes, capture, chat format.

Slow (loads 270M parameters; the first load in a fresh cache also converts
the GGUF, ~1-2 min on 2 busy cores; later loads read the cached copy)."""
from __future__ import annotations

import math

import pytest
import torch

from dflash_train.config import GEMMA3_270M, TargetConfig
from dflash_train.data import ChatFormat
from dflash_train.targets import load_target

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma():
    return load_target(TargetConfig(path=GEMMA3_270M), device="cpu")


def test_gemma_attributes(gemma):
    t = gemma
    assert t.family == "gemma3" and t.num_layers == 18 and t.hidden_size == 640 and t.vocab_size == 262144
    assert t.dtype == torch.float32
    assert t.embed_scale == pytest.approx(math.sqrt(640))
    assert t.final_logit_softcapping is None and t.output_multiplier == 1.0
    assert t.mask_token_id == t.tokenizer.convert_tokens_to_ids("<mask>") == 4
    assert t.tokenizer.convert_tokens_to_ids("<start_of_turn>") == 105
    assert t.tokenizer.chat_template is None
    assert not any(p.requires_grad for p in t.model.parameters())
    ids = torch.tensor([[2, 105, 2364, 107]])
    torch.testing.assert_close(t.embed(ids), t.model.get_input_embeddings().weight[ids] * math.sqrt(640),
                               rtol=1e-6, atol=1e-6)


def test_gemma_capture_packed_equals_alone(gemma):
    t = gemma
    fmt = ChatFormat(t.tokenizer, "gemma3")
    a = fmt.encode([{"role": "user", "content": "What is the capital of France?"},
                    {"role": "assistant", "content": "The capital of France is Paris."}]).input_ids
    b = fmt.encode([{"role": "user", "content": "Count to five."},
                    {"role": "assistant", "content": "One, two, three, four, five."}]).input_ids
    T = len(a) + len(b) + 3
    ids = torch.zeros(1, T, dtype=torch.long)
    doc = torch.full((1, T), -1, dtype=torch.int32)
    ids[0, :len(a)] = torch.tensor(a)
    doc[0, :len(a)] = 0
    ids[0, len(a):len(a) + len(b)] = torch.tensor(b)
    doc[0, len(a):len(a) + len(b)] = 1
    layers = [1, 8, 15]
    feats = t.capture(ids, doc, layers)
    for off, x in ((0, a), (len(a), b)):
        with torch.no_grad():
            hs = t.decoder(torch.tensor([x]), output_hidden_states=True).hidden_states
        ref = torch.cat([hs[i + 1] for i in layers], dim=-1)[0]
        torch.testing.assert_close(feats[0, off:off + len(x)], ref, atol=2e-3, rtol=1e-3)
    assert feats.shape == (1, T, 3 * 640) and torch.all(feats[0, -3:] == 0)


def test_gemma_loss_mask_round_trip(gemma):
    tok = gemma.tokenizer
    fmt = ChatFormat(tok, "gemma3")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi! ¿Qué tal? 你好"},
            {"role": "assistant", "content": "Hello — bien, 谢谢.\n\n* a list\n* items"},
            {"role": "user", "content": "More?"}, {"role": "assistant", "content": "No."}]
    enc = fmt.encode(msgs)
    runs, cur = [], []
    for i, m in zip(enc.input_ids, enc.loss_mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    assert [tok.decode(r) for r in runs] == [msgs[2]["content"] + "<end_of_turn>", "No.<end_of_turn>"]
    assert enc.input_ids[:2] == [2, 105]
    p = fmt.prompt_ids(msgs[:2])
    assert enc.input_ids[:len(p)] == p
