"""Target: layer capture by hooks, packed documents, embedding, logits, mask token rule."""
from __future__ import annotations

import math

import pytest
import torch

from dflash_train.config import TargetConfig
from dflash_train.targets import Target, TargetError, choose_mask_token_id, document_positions, load_target

FAMILIES = ["qwen3", "llama", "gemma3"]


@pytest.fixture(scope="module")
def targets(tiny_target_factory):
    return {f: load_target(TargetConfig(path=str(tiny_target_factory(f))), device="cpu") for f in FAMILIES}


def _hidden_states(t: Target, ids: torch.Tensor):
    with torch.no_grad():
        return t.model(ids, output_hidden_states=True).hidden_states


def _rand_ids(g, n, vocab=400):
    return torch.randint(7, vocab, (n,), generator=g)


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_equals_output_hidden_states(targets, family):
    t = targets[family]
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([_rand_ids(g, 20), _rand_ids(g, 20)])
    doc = torch.zeros_like(ids, dtype=torch.int32)
    hs = _hidden_states(t, ids)
    for layer_ids in ([0], [2], [1, 2], [2, 0, 1]):
        feats = t.capture(ids, doc, layer_ids)
        ref = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)
        assert feats.shape == (2, 20, len(layer_ids) * t.hidden_size)
        torch.testing.assert_close(feats, ref, atol=2e-5, rtol=1e-4)
    # the last layer: HF's hidden_states[L] has the final norm applied; capture
    # returns the raw layer output (DFlash never selects the last layer anyway)
    last = t.capture(ids, doc, [t.num_layers - 1])
    with torch.no_grad():
        torch.testing.assert_close(t.decoder.norm(last), hs[t.num_layers], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_equal_each_document_alone(targets, family):
    t = targets[family]
    g = torch.Generator().manual_seed(2)
    # lengths longer than the tiny gemma3 sliding window (6) so windows matter
    rows = [[13, 9, 1], [30], [4, 15, 7]]
    T = 32
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    doc = torch.full((len(rows), T), -1, dtype=torch.int32)
    docs = []
    for r, lens in enumerate(rows):
        p = 0
        for d, n in enumerate(lens):
            x = _rand_ids(g, n)
            ids[r, p:p + n] = x
            doc[r, p:p + n] = d
            docs.append((r, p, x))
            p += n
    layer_ids = [0, 2, 1]
    feats = t.capture(ids, doc, layer_ids)
    for r, p, x in docs:
        hs = _hidden_states(t, x[None])
        ref = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)[0]
        torch.testing.assert_close(feats[r, p:p + len(x)], ref, atol=2e-5, rtol=1e-4)
    assert torch.all(feats[doc < 0] == 0)
    # padding content does not matter
    ids2 = ids.clone()
    ids2[doc < 0] = 11
    torch.testing.assert_close(t.capture(ids2, doc, layer_ids), feats)


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_final_hidden_state_gives_the_models_logits(targets, family):
    """Layer id num_layers = the final hidden state (after the final norm), packed documents
    each as if alone: target.logits of it are the model's own logits (the distillation teacher)."""
    t = targets[family]
    g = torch.Generator().manual_seed(4)
    a, b = _rand_ids(g, 9), _rand_ids(g, 14)
    ids = torch.cat([a, b, torch.zeros(3, dtype=torch.long)])[None]
    doc = torch.tensor([[0] * 9 + [1] * 14 + [-1] * 3], dtype=torch.int32)
    feats = t.capture(ids, doc, [1, t.num_layers])
    assert feats.shape == (1, 26, 2 * t.hidden_size)
    final = feats[..., t.hidden_size:]
    with torch.no_grad():
        for x, s in ((a, 0), (b, 9)):
            ref = t.model(x[None]).logits[0]
            torch.testing.assert_close(t.logits(final[0, s:s + len(x)]), ref, atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(feats[0, s:s + len(x), :t.hidden_size], _hidden_states(t, x[None])[2][0],
                                       atol=2e-5, rtol=1e-4)
    assert torch.all(feats[0, 23:] == 0)


def test_document_positions():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1], [0, 0, 0, 0, 0, 0, 0, 0]])
    assert document_positions(doc).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]


def test_capture_stops_after_last_needed_layer(targets):
    t = targets["qwen3"]
    calls = {"layer3": 0, "norm": 0}
    h1 = t.layers[3].register_forward_hook(lambda *a: calls.__setitem__("layer3", calls["layer3"] + 1), prepend=True)
    h2 = t.decoder.norm.register_forward_hook(lambda *a: calls.__setitem__("norm", calls["norm"] + 1))
    try:
        ids = torch.arange(10, 20)[None]
        t.capture(ids, torch.zeros_like(ids), [1])
        assert calls == {"layer3": 0, "norm": 0}
        t.capture(ids, torch.zeros_like(ids), [3])
        assert calls == {"layer3": 1, "norm": 0}
        # capture's hooks are inert outside capture: a plain forward runs every layer
        with torch.no_grad():
            t.model(ids)
        assert calls == {"layer3": 2, "norm": 1}
    finally:
        h1.remove()
        h2.remove()


def test_concurrent_captures_from_threads(targets):
    import threading

    t = targets["gemma3"]
    g = torch.Generator().manual_seed(5)
    jobs = [(torch.randint(7, 400, (2, 24), generator=g), [i % 4, (i + 1) % 3]) for i in range(6)]
    ref = [t.capture(ids, torch.zeros_like(ids), ls) for ids, ls in jobs]
    out = [None] * len(jobs)

    def work(k):
        for _ in range(3):
            ids, ls = jobs[k]
            out[k] = t.capture(ids, torch.zeros_like(ids), ls)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(jobs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b)


def test_capture_output_usable_in_autograd(targets):
    t = targets["qwen3"]
    ids = torch.arange(10, 26)[None]
    feats = t.capture(ids, torch.zeros_like(ids), [1, 2])
    assert not feats.is_inference() and not feats.requires_grad
    fc = torch.nn.Linear(feats.shape[-1], 8)
    fc(feats).sum().backward()
    assert fc.weight.grad is not None


def test_capture_rejects_bad_layers(targets):
    t = targets["llama"]
    ids = torch.arange(10, 14)[None]
    with pytest.raises(TargetError, match="out of range"):
        t.capture(ids, torch.zeros_like(ids), [t.num_layers + 1])  # num_layers itself = the final state
    with pytest.raises(ValueError):
        t.capture(ids, torch.zeros(1, 3, dtype=torch.long), [0])


@pytest.mark.parametrize("family", FAMILIES)
def test_frozen_and_attributes(targets, family):
    t = targets[family]
    assert not t.model.training
    assert not any(p.requires_grad for p in t.model.parameters())
    assert t.family == family
    assert (t.num_layers, t.hidden_size, t.vocab_size) == (4, 64, 512)
    assert t.dtype == torch.float32 and t.device.type == "cpu"
    assert t.lm_head_weight.shape == (512, 64)
    assert t.output_multiplier == 1.0
    assert t.final_logit_softcapping is None
    assert t.hf_config.model_type in ("qwen3", "llama", "gemma3_text")


@pytest.mark.parametrize("family", FAMILIES)
def test_embed_is_the_targets_own_embedding(targets, family):
    t = targets[family]
    ids = torch.tensor([[5, 17, 300, 2]])
    e = t.embed(ids)
    torch.testing.assert_close(e, t.model.get_input_embeddings()(ids), rtol=0, atol=0)
    w = t.model.get_input_embeddings().weight
    if family == "gemma3":
        assert t.embed_scale == pytest.approx(math.sqrt(64))
        torch.testing.assert_close(e, w[ids] * 8.0, rtol=0, atol=0)
    else:
        assert t.embed_scale == 1.0
        torch.testing.assert_close(e, w[ids], rtol=0, atol=0)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_logits_match_model(targets, family):
    t = targets[family]
    ids = torch.arange(10, 22)[None]
    with torch.no_grad():
        last = t.decoder(ids).last_hidden_state
        ref = t.model(ids).logits
    torch.testing.assert_close(t.logits(last), ref, atol=1e-5, rtol=1e-4)
    # gradient flows to the hidden input
    h = last.clone().requires_grad_(True)
    t.logits(h).sum().backward()
    assert h.grad is not None and h.grad.abs().sum() > 0


def test_logit_softcapping(tiny_target_factory):
    t = load_target(TargetConfig(path=str(tiny_target_factory("gemma3", final_logit_softcapping=0.5))), device="cpu")
    assert t.final_logit_softcapping == 0.5
    ids = torch.arange(10, 22)[None]
    with torch.no_grad():
        last = t.decoder(ids).last_hidden_state
        ref = t.model(ids).logits
    out = t.logits(last)
    assert out.abs().max() <= 0.5
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_mask_token_rule(targets):
    # gemma: tokenizer.mask_token; llama: reserved special token; qwen3: first row beyond the tokenizer
    assert targets["gemma3"].mask_token_id == targets["gemma3"].tokenizer.convert_tokens_to_ids("<mask>")
    assert targets["llama"].mask_token_id == targets["llama"].tokenizer.convert_tokens_to_ids("<|reserved_special_token_0|>")
    assert targets["qwen3"].mask_token_id == len(targets["qwen3"].tokenizer) == 480
    tok = targets["qwen3"].tokenizer
    # no spare embedding row: falls to <|fim_pad|>
    assert choose_mask_token_id(tok, len(tok)) == tok.convert_tokens_to_ids("<|fim_pad|>")

    class Bare:
        mask_token_id = None

        def get_vocab(self):
            return {"a": 0, "b": 1}

        def __len__(self):
            return 2

    assert choose_mask_token_id(Bare(), 2) is None
    t = Target.__new__(Target)
    t._mask_token_id, t.source, t.family = None, "x", "x"
    with pytest.raises(TargetError, match="model.mask_token_id"):
        t.mask_token_id


def test_load_errors(tmp_path):
    with pytest.raises(TargetError, match="not found"):
        load_target(TargetConfig(path=str(tmp_path / "nope")), device="cpu")
    with pytest.raises(TargetError, match="config.json"):
        load_target(TargetConfig(path=str(tmp_path)), device="cpu")
    with pytest.raises(TargetError, match="GGUF file not found"):
        load_target(TargetConfig(path=str(tmp_path / "x.gguf")), device="cpu")
    with pytest.raises(TargetError, match="unknown embedded"):
        load_target(TargetConfig(path="embedded:llama-1b"), device="cpu")
