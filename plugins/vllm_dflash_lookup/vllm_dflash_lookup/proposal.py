"""Prompt lookup on one request's context: the trainer's rule (dflash_train/model/lookup.py), in numpy.

For the anchor = the last token of `context`:
* for n = max_ngram, ..., min_ngram take the trailing n-gram and find its MOST RECENT earlier
  occurrence, ending at e < anchor (it may overlap the trailing one);
* the first (longest) n with an occurrence wins; the proposal is the up to k tokens that followed
  it, context[e+1 .. min(e+k, anchor)] (never past the anchor);
* no occurrence at any n: no proposal.

The plugin cannot import the trainer, so the rule lives here a second time;
tests/test_vllm_lookup_plugin.py checks that both give the same proposal.

The gate also needs how long the match is: the common suffix of context[..e] and context[..anchor],
extended past max_ngram (up to `MAX_MATCH`). Below max_ngram it is n itself: a longer one would be an
occurrence of the longer n-gram.
"""
from __future__ import annotations

import numpy as np

MAX_MATCH = 64


def lookup(context, k: int, max_ngram: int = 3, min_ngram: int = 1) -> tuple[list[int], int]:
    """(proposal, match length) for the anchor at the end of `context` (a sequence of token ids);
    ([], 0) when nothing is proposed."""
    x = np.asarray(context, dtype=np.int64)
    a = len(x) - 1
    if k < 1 or a < 1:
        return [], 0
    for n in range(min(max_ngram, a + 1), min_ngram - 1, -1):
        # ends e in [n-1, a-1] where x[e-j] == x[a-j] for every j < n
        hit = np.ones(a - (n - 1), dtype=bool)
        for j in range(n):
            hit &= x[n - 1 - j:a - j] == x[a - j]
        ends = np.flatnonzero(hit)
        if len(ends):
            e = int(ends[-1]) + n - 1
            return x[e + 1:min(e + k, a) + 1].tolist(), _match_length(x, e, a, n)
    return [], 0


def _match_length(x: np.ndarray, e: int, a: int, n: int) -> int:
    m = n
    while m < MAX_MATCH and e - m >= 0 and x[e - m] == x[a - m]:
        m += 1
    return m
