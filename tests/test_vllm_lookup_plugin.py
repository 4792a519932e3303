"""The vLLM plugin of issue 46 (plugins/vllm_dflash_lookup): DFlash drafting with prompt lookup.

Unit tests of the plugin's own code run here, in the trainer's environment (numpy + torch, no vLLM):
its lookup proposal equals the trainer's rule (model/lookup.py), the gate's and the seed's edges,
the version pin and the switch. The end-to-end tests read the engine run the engine tests share
(tests/engine_fixtures.py `served_accepting`: `serve-bench` in vLLM's environment, .venv-vllm, where
`make vllm` installs the plugin): seeded blocks and the gate, then plain, n-gram and DFlash with the
plugin off for them and the caller's DFLASH_LOOKUP kept out; every output equals plain vLLM's.
"""
from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_train.model.lookup import lookup_proposals

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "plugins" / "vllm_dflash_lookup"))

import vllm_dflash_lookup as plugin  # noqa: E402
from vllm_dflash_lookup import runner  # noqa: E402
from vllm_dflash_lookup.proposal import lookup  # noqa: E402


def trainer_rule(context: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    T = len(context)
    out = lookup_proposals(torch.tensor([context]), torch.zeros(1, T, dtype=torch.long), torch.tensor([[T - 1]]),
                           k, max_ngram, min_ngram)[0, 0].tolist()
    return [t for t in out if t >= 0]


EDGES = [
    ([5, 6, 7, 8], 3, []),                       # no match
    ([1], 3, []),                                 # nothing before the anchor
    ([4, 4], 3, [4]),                             # match at the end of the context: one token follows
    ([1, 2, 3, 9, 1, 2, 3], 5, [9, 1, 2, 3]),    # k larger than the continuation: cut at the anchor
    ([1, 2, 3, 9, 8, 1, 2, 3], 2, [9, 8]),       # k smaller: the first k
    ([7, 1, 2, 5, 3, 2, 9, 1, 2], 3, [5, 3, 2]),  # the longest n wins over a more recent shorter one
    ([3, 1, 4, 3, 1, 5, 3, 1], 2, [5, 3]),        # the most recent occurrence of the 2-gram
]


@pytest.mark.parametrize("context,k,expected", EDGES)
def test_lookup_edges_equal_the_trainer(context, k, expected):
    assert lookup(context, k)[0] == expected
    if len(context) >= 2:  # the trainer's rule starts at two tokens
        assert trainer_rule(context, k) == expected


def test_lookup_equals_the_trainer_on_random_contexts():
    rng = random.Random(46)
    for _ in range(1500):
        max_ngram = rng.randint(1, 4)
        min_ngram = rng.randint(1, max_ngram)
        # the trainer's rule needs max_ngram - 1 <= len (shorter rows break its shifted compare)
        T = rng.randint(max(2, max_ngram - 1), 48)
        context = [rng.randrange(rng.choice([2, 3, 6, 40])) for _ in range(T)]
        k = rng.randint(1, 10)
        got, match = lookup(context, k, max_ngram, min_ngram)
        assert got == trainer_rule(context, k, max_ngram, min_ngram), (context, k, max_ngram, min_ngram)
        assert (match == 0) == (not got)


def test_match_length_extends_past_the_ngram():
    # "1 2 3 4" occurs before: the 3-gram match extends to 4 tokens; capped at MAX_MATCH
    assert lookup([1, 2, 3, 4, 9, 8, 1, 2, 3, 4], 2) == ([9, 8], 4)
    assert lookup([5, 1, 2, 9, 7, 1, 2], 2) == ([9, 7], 2)
    period = list(range(100))
    tokens, match = lookup(period + period, 4)
    assert tokens == [0, 1, 2, 3] and match == plugin.proposal.MAX_MATCH


def test_gate_edges():
    drafts = torch.full((4, 3), 50)
    ctxs = [np.array([5, 6, 7, 8]),              # no match: the drafter's block
            np.array([1, 2, 3, 9, 1, 2, 3]),     # match 3, continuation of 4 >= k: lookup's 3
            np.array([4, 8, 4]),                 # match 1 < min match 2: the drafter's
            None]                                # a prefill chunk: untouched
    assert runner.gate(drafts, ctxs, min_match=2) == 1
    assert drafts.tolist() == [[50] * 3, [9, 1, 2], [50] * 3, [50] * 3]
    # a continuation shorter than k (the match ends at the context's end): lookup's tokens, then the drafter's
    drafts = torch.full((1, 3), 50)
    probs = torch.full((1, 3, 60), 1 / 60)
    assert runner.gate(drafts, [np.array([2, 7, 2, 7])], min_match=2, probs=probs) == 1
    assert drafts.tolist() == [[2, 7, 50]]
    # the replaced positions are deterministic proposals: one-hot draft probabilities
    assert probs[0, 0, 2] == 1 and probs[0, 0].sum() == 1 and probs[0, 1, 7] == 1
    assert torch.allclose(probs[0, 2], torch.full((60,), 1 / 60))


def test_seed_writes_the_mask_slots():
    mask = 99
    ids = torch.tensor([10, mask, mask, mask, 20, mask, mask, mask, 30, mask, mask, mask], dtype=torch.int32)
    runner.seed(ids, [np.array([1, 2, 10, 1, 2, 10]),   # continuation 1 2 10 (cut at the anchor)
                      np.array([3, 4, 20]),             # no match: masks stay
                      np.array([6, 30, 6, 30])], k=3)   # match at the end: "6 30", then masks
    assert ids.tolist() == [10, 1, 2, 10, 20, mask, mask, mask, 30, 6, 30, mask]


def test_switch(monkeypatch):
    monkeypatch.delenv("DFLASH_LOOKUP", raising=False)
    assert plugin.settings() == (frozenset(), 3)
    monkeypatch.setitem(sys.modules, "vllm", None)  # off must not even import vLLM
    assert plugin.register() is False
    assert plugin.settings({"DFLASH_LOOKUP": "Gate", "DFLASH_LOOKUP_MIN_MATCH": "5"}) == (frozenset({"gate"}), 5)
    assert plugin.settings({"DFLASH_LOOKUP": "seed+gate"})[0] == {"seed", "gate"}
    with pytest.raises(ValueError, match="DFLASH_LOOKUP='gat'"):
        plugin.settings({"DFLASH_LOOKUP": "gat"})


def test_unknown_vllm_version_refused_in_one_line(monkeypatch, caplog):
    fake = type(sys)("vllm")
    fake.__version__ = "0.33.1"
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setenv("DFLASH_LOOKUP", "gate")
    monkeypatch.setattr(runner, "install", lambda *a: pytest.fail("patched an untested vLLM"))
    with caplog.at_level(logging.INFO, logger="vllm.dflash_lookup"):
        assert plugin.register() is False
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.dflash_lookup"]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "vLLM 0.33.1" in lines[0] and "0.32.0" in lines[0] and "without it" in lines[0]
    # a local build tag of a tested release is that release
    assert plugin.supported("0.32.0+cu130") and plugin.supported("0.32.0") and not plugin.supported("0.32.1")


# ---- end to end, in vLLM's environment --------------------------------------------------------

from dflash_train.engine.vllm_process import REPO_VENV  # noqa: E402

VLLM_PY = REPO_VENV / "bin" / "python"


def plugin_installed() -> bool:
    if not VLLM_PY.is_file():
        return False
    r = subprocess.run([str(VLLM_PY), "-c", "import importlib.metadata as m; "
                        "print([e.name for e in m.entry_points(group='vllm.general_plugins')])"],
                       capture_output=True, text=True)
    return "dflash_lookup" in r.stdout


if VLLM_PY.is_file() and not plugin_installed() and os.environ.get("CI"):
    raise RuntimeError("CI must have the plugin in .venv-vllm (make vllm installs it)")
needs_vllm = pytest.mark.skipif(not plugin_installed(), reason="vLLM + the plugin not installed: run `make vllm`")

SEED = "dflash+lookup:seed"


@pytest.fixture(scope="module")
def served(served_accepting):
    """The engine run the engine tests share (tests/engine_fixtures.py `served_accepting`: the session's
    drafter that accepts, 4 prompts x 24 tokens at k 3): the plugin's engines first (seed, the gate at
    match >= 3 and at >= 1), then plain, n-gram and DFlash with the plugin off for them, with
    DFLASH_LOOKUP=CALLER_LOOKUP in serve-bench's own environment (which must reach none of them)."""
    from engine_fixtures import CALLER_LOOKUP, SERVED_METHODS

    assert CALLER_LOOKUP == "seed" and list(SERVED_METHODS[:3]) == [SEED, "dflash+lookup", "dflash+lookup@1"]
    return {row["method"]: row for row in served_accepting["rows"]}, served_accepting["outputs"]


@needs_vllm
def test_plugin_acts_in_vllm_only_for_its_methods(served, accepting_export):
    rows, outs = served
    # the worker checked the plugin's record (DFLASH_LOOKUP_RECORD): it patched each of its engines' processes
    # with that method's mode and gate threshold
    for method, mode, min_match in ((SEED, "seed", 3), ("dflash+lookup", "gate", 3), ("dflash+lookup@1", "gate", 1)):
        lk = rows[method]["lookup"]
        assert lk["mode"] == mode and lk["min_match"] == min_match and lk["processes"] >= 1, (method, lk)
    # DFlash alone, served after the plugin's engines with DFLASH_LOOKUP=seed in the caller's environment,
    # drafts what our replay of the drafter alone drafts, step for step: neither a plugin left patched from the
    # engines before nor the caller's setting acted in its engine ...
    from test_engine_vllm import assert_engine_steps_are_replay, replay_steps

    acc = accepting_export
    assert_engine_steps_are_replay(rows["dflash"], outs["plain"],
                                   replay_steps(acc.export, str(acc.target), acc.prompts, outs["plain"]))
    # ... where either would show: the seed's and the gate's verify steps are not DFlash's on these prompts
    steps = {m: rows[m]["accepted_per_step"] for m in (SEED, "dflash+lookup@1", "dflash")}
    assert steps[SEED] != steps["dflash"] and steps["dflash+lookup@1"] != steps["dflash"], steps


def counters(row: dict) -> tuple[float, float, float]:
    """(drafts, draft tokens, accepted tokens) the engine counted (vllm:spec_decode_num_*)."""
    return row["drafts"], row["draft_tokens"], row["accepted_tokens"]


@needs_vllm
def test_gate_and_seed_lossless_with_accepted_tokens(served):
    rows, outs = served
    plain = outs["plain"]
    assert outs["dflash"] == plain
    for mode in (SEED, "dflash+lookup", "dflash+lookup@1"):
        d = rows[mode]
        assert outs[mode] == plain, mode  # lossless: verification is vLLM's
        drafts, draft_tokens, accepted = counters(d)
        k = d["k"]
        assert k == 3 and drafts > 0 and draft_tokens == k * drafts and 0 < accepted <= draft_tokens, (mode, d)
    # (the gate's exact steps against our replay of it: tests/test_engine_vllm.py; its bounds at match >= 1:
    # tests/test_serve_lookup.py)
