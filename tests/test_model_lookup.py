"""Prompt lookup vectorised (model/lookup.py) against a plain loop written from the rule,
at every anchor of packed multi-document rows with padding; block seeding."""
from __future__ import annotations

import torch

from dflash_train.eval.ngram import propose
from dflash_train.model.lookup import NO_TOKEN, lookup_proposals, seed_blocks


def rule(doc_tokens: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """The rule as prose says it: the longest trailing n-gram's most recent earlier occurrence."""
    L = len(doc_tokens)
    for n in range(max_n, min_n - 1, -1):
        if L - n < 1:
            continue
        tail = doc_tokens[L - n:]
        for i in range(L - n - 1, -1, -1):
            if doc_tokens[i:i + n] == tail:
                return doc_tokens[i + n:i + n + k]
    return []


def packed_rows(gen: torch.Generator, B: int = 3, T: int = 40, vocab: int = 4):
    ids = torch.randint(0, vocab, (B, T), generator=gen)
    docs = torch.full((B, T), -1, dtype=torch.long)
    for b in range(B):
        t, d = 0, 0
        while t < T - 6:
            n = int(torch.randint(3, 15, (1,), generator=gen))
            docs[b, t:t + n] = d
            t, d = t + n, d + 1
    return ids, docs


def test_lookup_equals_the_rule_at_every_anchor_of_packed_rows():
    gen = torch.Generator().manual_seed(0)
    for trial in range(4):
        ids, docs = packed_rows(gen, vocab=3 + trial)
        B, T = ids.shape
        anchors = torch.arange(T).expand(B, T)
        for k in (1, 3, 7):
            got = lookup_proposals(ids, docs, anchors, k)
            for b in range(B):
                for a in range(T):
                    if docs[b, a] < 0:
                        assert (got[b, a] == NO_TOKEN).all()
                        continue
                    start = int((docs[b] == docs[b, a]).nonzero()[0])
                    want = rule(ids[b, start:a + 1].tolist(), k)
                    row = got[b, a]
                    assert row[row >= 0].tolist() == want, (b, a, k)
                    assert (row[len(want):] == NO_TOKEN).all()  # proposals are a prefix


def test_propose_is_the_vectorised_rule_at_the_last_token():
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        s = torch.randint(0, 5, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen).tolist()
        assert propose(s, 5) == rule(s, 5)
        assert propose(s, 5, max_ngram=2, min_ngram=2) == rule(s, 5, 2, 2)


def test_seed_blocks_writes_proposals_over_masks_only_where_kept():
    ids = torch.tensor([[1, 2, 3, 4, 1, 2, 9, 9]])
    docs = torch.zeros_like(ids)
    anchors = torch.tensor([[5, 6]])
    mask = 99
    blocks = torch.full((1, 2, 4), mask)
    blocks[:, :, 0] = ids.gather(1, anchors)
    seeded = seed_blocks(blocks, ids, docs, anchors)
    # anchor 5 ends [1, 2] -> [3, 4, 1]; anchor 6 ends [2, 9]: only [9] recurs nowhere earlier -> no seed
    assert seeded[0, 0].tolist() == [2, 3, 4, 1]
    assert seeded[0, 1].tolist() == [9, mask, mask, mask]
    kept = seed_blocks(blocks, ids, docs, anchors, keep=torch.tensor([[False, True]]))
    assert kept[0, 0].tolist() == [2, mask, mask, mask]
    assert blocks[0, 0].tolist() == [2, mask, mask, mask]  # the input is not changed


def test_an_ngram_longer_than_the_row_finds_what_the_shorter_ones_find():
    """max_ngram beyond the row length (a 2-token row, max_ngram 4) crashed with a shape mismatch."""
    ids = torch.tensor([[5, 5]])
    docs = torch.zeros_like(ids)
    anchors = torch.tensor([[1]])
    got = lookup_proposals(ids, docs, anchors, k=3, max_ngram=4)
    assert torch.equal(got, lookup_proposals(ids, docs, anchors, k=3, max_ngram=1))
    assert got[0, 0, 0].item() == 5  # 5 followed the earlier 5
