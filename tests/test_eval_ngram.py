"""Prompt lookup (n-gram drafting): `propose` on hand-computed sequences (no match,
a match at the very end, overlapping n-grams, longest n first, most recent
occurrence first); `ngram_generate` acceptance lengths and verify blocks on a
fake context-free target; output equal to plain greedy on tiny random targets."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dflash_train.config import TargetConfig
from dflash_train.eval import decoding
from dflash_train.eval.ngram import ngram_generate, propose
from dflash_train.eval.specdec import plain_generate
from dflash_train.targets import load_target

# --------------------------------------------------------------------------- propose


def test_propose_no_match_is_empty():
    assert propose([5, 6, 7, 8], 3) == []
    assert propose([], 3) == [] and propose([4], 3) == []


def test_propose_match_at_the_end_gives_what_is_there():
    # [1, 2] recurs at 0; only 3 tokens follow it before the trailing [1, 2]
    assert propose([1, 2, 3, 1, 2], 4) == [3, 1, 2]
    assert propose([1, 2, 3, 1, 2], 2) == [3, 1]
    assert propose([7, 7], 5) == [7]


def test_propose_overlapping_ngrams():
    # trailing [1, 1, 1] = s[1:4]; the earlier occurrence s[0:3] overlaps it: one token follows
    assert propose([1, 1, 1, 1], 4) == [1]
    assert propose([1, 1, 1, 1, 1, 1], 4) == [1]  # most recent earlier occurrence starts at 2
    assert propose([2, 1, 2, 1, 2], 4) == [1, 2]  # [2, 1, 2] at 0 overlaps the trailing one at 2


def test_propose_longest_n_wins():
    # 3-gram [4, 5, 6] at 0 -> 9; the 1-gram [6] recurs more recently (at 6, -> 0) but is shorter
    s = [4, 5, 6, 9, 9, 9, 6, 0, 4, 5, 6]
    assert propose(s, 2) == [9, 9]
    # no 3-gram match: the 2-gram [5, 6] at 1 -> 7 beats the more recent 1-gram [6] at 4 -> 8
    assert propose([4, 5, 6, 7, 6, 8, 3, 5, 6], 3) == [7, 6, 8]
    # min_ngram / max_ngram bound the search
    assert propose([4, 5, 6, 7, 6, 8, 3, 5, 6], 3, max_ngram=1) == [8, 3, 5]
    assert propose([4, 7, 6, 8, 3, 5, 6], 3, min_ngram=2) == []


def test_propose_most_recent_occurrence_wins():
    # [2, 3] occurs at 1 (-> 9, 1) and at 5 (-> 4, 5): the later one is used
    assert propose([1, 2, 3, 9, 1, 2, 3, 4, 5, 2, 3], 4) == [4, 5, 2, 3]
    assert propose([8, 1, 5, 1, 6, 1], 1) == [6]


def test_propose_accepts_tensors_and_k_zero():
    s = [1, 2, 3, 9, 1, 2, 3, 4, 5, 2, 3]
    assert propose(torch.tensor(s), 4) == [4, 5, 2, 3]
    assert propose(torch.tensor([s]), 2) == [4, 5]
    assert propose(s, 0) == []
    with pytest.raises(ValueError):
        propose(s, 2, max_ngram=1, min_ngram=2)


# --------------------------------------------------------------------------- acceptance on a fake target


class _FakeCache:
    def __init__(self):
        self.length = 0

    def get_seq_length(self):
        return self.length

    def crop(self, n):
        assert n <= 0
        self.length += n


class _FakeModel:
    """Context-free greedy target: at position p its argmax is `seq[p + 1]`.
    Checks that every forward continues the cache exactly (positions = cache length on)."""

    config = None

    def __init__(self, seq, vocab=16):
        self.seq = list(seq)
        self.vocab = vocab
        self.calls: list[tuple[int, list[int]]] = []

    def __call__(self, ids, position_ids=None, use_cache=True, logits_to_keep=None, past_key_values=None):
        pos = position_ids[0].tolist()
        assert pos[0] == past_key_values.length and pos == list(range(pos[0], pos[0] + ids.shape[1]))
        past_key_values.length += ids.shape[1]
        self.calls.append((pos[0], ids[0].tolist()))
        logits = torch.zeros(1, len(pos), self.vocab)
        for j, p in enumerate(pos):
            logits[0, j, self.seq[p + 1]] = 10.0
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return SimpleNamespace(logits=logits)

    forward = __call__


def _fake(monkeypatch, seq):
    monkeypatch.setattr(decoding, "make_target_cache", lambda m, **kw: _FakeCache())
    model = _FakeModel(seq)
    return SimpleNamespace(model=model, device=torch.device("cpu")), model


def test_acceptance_hand_computed(monkeypatch):
    prompt = [1, 2, 3, 4, 5, 1, 2]
    seq = prompt + [3, 4, 7, 1, 2, 3, 8, 6, 0, 0]
    t, model = _fake(monkeypatch, seq)
    out, acc = ngram_generate(t, torch.tensor([prompt]), 8, None, 3)
    assert out[0].tolist() == seq[:15]
    # [1,2,3] -> [4,5,1]: 4 accepted, bonus 7 | [7] unseen: plain step | [1] -> [2,3,4]: 2,3 accepted,
    # bonus 8 | [8] unseen: plain step (the last new token)
    assert acc == [2, 1, 3, 1]
    assert model.calls == [(0, prompt), (7, [3, 4, 5, 1]), (9, [7]), (10, [1, 2, 3, 4]), (13, [8])]


def test_acceptance_full_block_cap_and_stop(monkeypatch):
    prompt = [5, 6, 7, 8, 5, 6]
    seq = prompt + [7, 8, 5, 6, 7, 8, 5, 6, 7]
    t, model = _fake(monkeypatch, seq)
    out, acc = ngram_generate(t, torch.tensor([prompt]), 6, [], 3)
    # [5,6,7] -> [8,5,6] all accepted + bonus 7; then one token left: the draft is capped at 1
    assert acc == [4, 1] and out[0].tolist() == seq[:12]
    assert model.calls[1:] == [(6, [7, 8, 5, 6]), (10, [7, 8])]
    t, _ = _fake(monkeypatch, seq)
    out, acc = ngram_generate(t, torch.tensor([prompt]), 6, [5], 3)  # stop token inside the accepted run
    assert acc == [2] and out[0].tolist() == seq[:9]
    t, _ = _fake(monkeypatch, seq)
    out, acc = ngram_generate(t, torch.tensor([prompt]), 6, [7], 3)  # the first token is a stop token
    assert acc == [] and out[0].tolist() == seq[:7]
    t, _ = _fake(monkeypatch, seq)
    out, acc = ngram_generate(t, torch.tensor([prompt]), 1, [], 3)
    assert acc == [] and out[0].tolist() == seq[:7]


# --------------------------------------------------------------------------- exactness on tiny targets


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_greedy_output_equals_plain(tiny_target_factory, family):
    t = load_target(TargetConfig(path=str(tiny_target_factory(family)), device="cpu", dtype="float32"))
    eos = [t.tokenizer.eos_token_id]
    prompts = ["Hello! How can I help",
               "one two three one two three one two three one two",  # repeats: prompt lookup proposes
               "a b a b a b a b a b"]
    all_acc = []
    for text in prompts:
        x = t.tokenizer(text, return_tensors="pt").input_ids
        for k, stops in ((3, eos), (7, [])):
            plain = plain_generate(t, x, 24, stops)
            out, acc = ngram_generate(t, x, 24, stops, k)
            assert torch.equal(out, plain), (text, k)
            assert sum(acc) == out.shape[1] - x.shape[1] - 1  # the first token comes from the prefill
            assert all(1 <= a <= k + 1 for a in acc)
            all_acc += acc
    assert max(all_acc) > 1, all_acc  # some drafts were accepted
