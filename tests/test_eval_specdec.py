"""Real speculative decoding on tiny random targets: greedy output equals plain
greedy token for token (random drafter, a crafted drafter that is often right,
an oracle drafter with known acceptance), context features are the accepted
tokens' only, stop tokens, and sampling is lossless in distribution."""
from __future__ import annotations

import pytest
import torch

from dflash_train.config import ModelConfig, TargetConfig
from dflash_train.eval.specdec import (
    acceptance_histogram,
    plain_generate,
    rejection_sample,
    sampling_probs,
    speculative_generate,
    tau_of,
)
from specdec_fakes import OracleDrafter, bias_target_towards, simulate_acceptance, slot_prediction
from dflash_train.model import DFlashDrafter, DrafterConfig
from dflash_train.targets import load_target



PROMPTS = ["Hello! How can I help", "The quick brown fox", "Write a short poem about the sea."]


def _target(tiny_target_factory, family):
    return load_target(TargetConfig(path=str(tiny_target_factory(family)), device="cpu", dtype="float32"))


def _drafter(target, family, block_size=8, mask_token_id=None, seed=0):
    if family == "gemma3":  # a sliding layer whose window (5) is shorter than the block
        mc = ModelConfig(num_layers=2, block_size=block_size, layer_types=["sliding_attention", "full_attention"],
                         sliding_window=5, mask_token_id=mask_token_id)
    else:
        mc = ModelConfig(num_layers=2, block_size=block_size, mask_token_id=mask_token_id)
    return DFlashDrafter(DrafterConfig.from_target(mc, target), seed=seed).eval()


def _ids(target, text):
    return target.tokenizer(text, return_tensors="pt").input_ids


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def family(request):
    return request.param


def test_greedy_random_drafter_equals_plain(tiny_target_factory, family):
    t = _target(tiny_target_factory, family)
    dr = _drafter(t, family)
    eos = [t.tokenizer.eos_token_id]
    for text in PROMPTS:
        x = _ids(t, text)
        plain = plain_generate(t, x, 24, eos)
        spec, acc = speculative_generate(dr, t, x, 24, eos)
        assert torch.equal(spec, plain), text
        assert sum(acc) == spec.shape[1] - x.shape[1] - 1  # the first token comes from the prefill
        assert all(1 <= a <= dr.cfg.block_size for a in acc)


def test_greedy_often_right_drafter_equals_plain(tiny_target_factory, family):
    """A target edited to make one token frequent + a random drafter whose masked slots
    predict it: full, partial and single-token steps all occur, output stays exact."""
    t = _target(tiny_target_factory, family)
    tok = 100
    if family == "qwen3":
        bias_target_towards(t, tok, alpha=5.0, anti=1.0)
        mask = 0
        while slot_prediction(t, mask) != tok:
            mask += 1
    else:  # the tiny gemma repeats tokens; predict the first prompt's repeated token
        x0 = _ids(t, PROMPTS[0])
        rep = int(plain_generate(t, x0, 4, [])[0, -1])
        mask = next(m for m in range(t.vocab_size) if slot_prediction(t, m) == rep)
    dr = _drafter(t, family, mask_token_id=mask)
    all_acc = []
    for text in PROMPTS if family == "qwen3" else PROMPTS[:1]:
        x = _ids(t, text)
        plain = plain_generate(t, x, 20, [])
        spec, acc = speculative_generate(dr, t, x, 20, [])
        assert torch.equal(spec, plain), text
        all_acc += acc
    assert max(all_acc) > 3 and 1 in all_acc, all_acc
    assert any(1 < a < dr.cfg.block_size for a in all_acc[:-1]), all_acc  # a genuine mid-block rejection
    if family == "qwen3":
        assert max(all_acc) == dr.cfg.block_size, all_acc  # whole blocks accepted


def _full_features(t, seq, layer_ids):
    with torch.inference_mode():
        out = t.model(seq, output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)[0]


def test_oracle_drafter_known_acceptance_and_context(tiny_target_factory, family):
    """The oracle proposes the true greedy tokens except at positions with (7p mod 13) < 2:
    acceptance lengths are exactly the simulated reference loop's, and every
    context extension carries exactly the plain sequence's features of the
    anchor + accepted tokens (never a rejected draft's or the bonus's)."""
    t = _target(tiny_target_factory, family)
    layer_ids = [1, 2]
    bs, new = 6, 30
    for text in PROMPTS[:2]:
        x = _ids(t, text)
        n = x.shape[1]
        plain = plain_generate(t, x, new, [])
        feats = _full_features(t, plain, layer_ids)
        wrong = lambda p: (p * 7) % 13 < 2  # noqa: E731
        dr = OracleDrafter(t, plain[0], feats, bs, layer_ids, mask_token_id=3, wrong=wrong)
        spec, acc = speculative_generate(dr, t, x, new, [])
        assert torch.equal(spec, plain)
        expect = simulate_acceptance(plain[0].tolist(), n, new, bs, dr.expected_token)
        assert acc == expect
        assert max(acc) >= 4 and min(acc) < bs and len(set(acc)) >= 2, acc
        # context = prompt, then exactly the produced tokens of each step, contiguous
        assert dr.extend_calls[0] == (0, n)
        assert [c[1] for c in dr.extend_calls[1:]] == acc
        # with a stop token that appears in the middle of an accepted block
        stop_pos = n + 9
        stop_tok = int(plain[0, stop_pos])
        first = next(i for i in range(n, plain.shape[1]) if int(plain[0, i]) == stop_tok)
        dr2 = OracleDrafter(t, plain[0], feats, bs, layer_ids, mask_token_id=3, wrong=wrong)
        spec2, acc2 = speculative_generate(dr2, t, x, new, [stop_tok])
        assert torch.equal(spec2, plain[:, :first + 1])
        assert torch.equal(spec2, plain_generate(t, x, new, [stop_tok]))
        assert acc2 == simulate_acceptance(plain[0].tolist(), n, new, bs, dr2.expected_token, {stop_tok})


def test_edge_lengths(tiny_target_factory):
    t = _target(tiny_target_factory, "qwen3")
    dr = _drafter(t, "qwen3", block_size=4)
    x = _ids(t, PROMPTS[0])
    out, acc = speculative_generate(dr, t, x, 1, [])
    assert out.shape[1] == x.shape[1] + 1 and acc == []
    assert torch.equal(out, plain_generate(t, x, 1, []))
    out, acc = speculative_generate(dr, t, x, 2, [])
    assert torch.equal(out, plain_generate(t, x, 2, [])) and acc == [1]
    first = int(out[0, x.shape[1]])  # first token is a stop token: nothing more
    out, acc = speculative_generate(dr, t, x, 10, [first])
    assert out.shape[1] == x.shape[1] + 1 and acc == []


def test_histogram_and_tau():
    assert acceptance_histogram([1, 3, 3, 8], 8) == {1: 1, 2: 0, 3: 2, 4: 0, 5: 0, 6: 0, 7: 0, 8: 1}
    assert tau_of([1, 3, 3, 8]) == 3.75


# --------------------------------------------------------------------------- sampling


def test_rejection_sample_is_lossless_tiny_vocab():
    """Context-free target (fixed p per position): conditional on reaching position j
    of a block, the token emitted there is distributed as p[j], whatever the draft q
    (so the emitted sequence is distributed as sampling the target)."""
    g = torch.Generator().manual_seed(0)
    V, gamma = 4, 3
    p = torch.softmax(torch.randn(gamma + 1, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(gamma, V, generator=g) * 1.5, -1)
    N = 12000
    counts = torch.zeros(gamma + 1, V)
    accepted_hist = torch.zeros(gamma + 1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(N):
        d = torch.multinomial(q, 1, generator=gen)[:, 0]
        acc, nxt = rejection_sample(d, q, p, gen)
        for j, tk in enumerate(d[:acc].tolist() + [nxt]):
            counts[j, tk] += 1
        accepted_hist[acc] += 1
    for j in range(gamma + 1):
        reached = counts[j].sum()
        assert reached > 300, (j, reached)
        emp = counts[j] / reached
        tv = 0.5 * (emp - p[j]).abs().sum().item()
        assert tv < 0.05, (j, tv, emp, p[j])
    assert accepted_hist[0] > 0 and accepted_hist[gamma] > 0  # rejection and bonus paths both used


def test_rejection_sample_equal_distributions_accept_all():
    p = torch.softmax(torch.randn(4, 5, generator=torch.Generator().manual_seed(3)), -1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        d = torch.multinomial(p[:3], 1, generator=gen)[:, 0]
        acc, _ = rejection_sample(d, p[:3], p, gen)
        assert acc == 3


def test_sampling_end_to_end_matches_target_distribution(tiny_target_factory):
    """T=1 on a tiny target whose token 100 is frequent and whose drafter proposes it:
    the distribution of the 2nd generated token (decided by the first verify step:
    accepted draft, residual or bonus) equals the target's exact marginal."""
    t = _target(tiny_target_factory, "qwen3")
    tok = 100
    bias_target_towards(t, tok, alpha=5.0, anti=1.0)
    mask = 0
    while slot_prediction(t, mask) != tok:
        mask += 1
    dr = _drafter(t, "qwen3", block_size=4, mask_token_id=mask)
    x = _ids(t, PROMPTS[0])
    n = x.shape[1]
    T = 1.0
    with torch.inference_mode():
        p1 = sampling_probs(t.model(x).logits[0, -1], T)  # [V]
        V = p1.shape[0]
        batch = torch.cat([x.expand(V, n), torch.arange(V)[:, None]], dim=1)
        p2_given = torch.cat([sampling_probs(t.model(batch[i:i + 128]).logits[:, -1], T)
                              for i in range(0, V, 128)])  # [V, V]
    exact2 = (p1[:, None] * p2_given).sum(0)
    N = 400
    gen = torch.Generator().manual_seed(0)
    second = []
    accepted_any = 0
    for _ in range(N):
        # the 2nd new token is decided by the first verify step (block of 3: 2 drafts)
        out, acc = speculative_generate(dr, t, x, 3, [], temperature=T, generator=gen)
        second.append(int(out[0, n + 1]))
        accepted_any += acc[0] > 1
    emp = torch.bincount(torch.tensor(second), minlength=V).float() / N
    # events with real mass: the 4 likeliest tokens and "anything else"
    top = exact2.topk(4).indices
    cells_e = torch.cat([exact2[top], (1 - exact2[top].sum())[None]])
    cells_o = torch.cat([emp[top], (1 - emp[top].sum())[None]])
    assert cells_e[0] > 0.1
    assert (cells_o - cells_e).abs().max() < 0.08, (cells_o, cells_e)  # > 3 sigma at N=400
    assert 0 < accepted_any < N  # drafts were both accepted and rejected


# --------------------------------------------------------------------------- the decoding head


def test_inference_logits_equal_logits_and_do_not_depend_on_the_row_count(tiny_target_factory, family, monkeypatch):
    """`Target.inference_logits` (packed oneDNN lm_head on CPU float32) == `logits` up to
    rounding; a row's logits are bitwise the same in a block of any size; an in-place edit
    of the weight is seen; with autograd, or switched off, it is exactly `logits`."""
    t = _target(tiny_target_factory, family)
    h = torch.randn(1, 9, t.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full = t.inference_logits(h)
        torch.testing.assert_close(full, t.logits(h), rtol=1e-5, atol=1e-5)
        for k in (1, 2, 7, 8):
            assert torch.equal(t.inference_logits(h[:, :k]), full[:, :k])
            assert torch.equal(t.inference_logits(h[:, k:k + 1]), full[:, k:k + 1])
    if torch.backends.mkldnn.is_available():
        assert t._packed_head not in (None, "off")  # the packed path is the one tested here
    with torch.no_grad():
        t.lm_head_weight[:5] *= 2.0
    with torch.inference_mode():
        torch.testing.assert_close(t.inference_logits(h), t.logits(h), rtol=1e-5, atol=1e-5)
    hg = h.clone().requires_grad_(True)
    assert torch.equal(t.inference_logits(hg), t.logits(hg))
    t.release_inference_cache()
    monkeypatch.setenv("DFLASH_TRAIN_PACKED_LM_HEAD", "0")
    t2 = _target(tiny_target_factory, family)
    with torch.inference_mode():
        assert torch.equal(t2.inference_logits(h), t2.logits(h))
    assert t2._packed_head == "off"
