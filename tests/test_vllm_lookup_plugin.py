"""The vLLM plugin of issue 46 (plugins/vllm_dflash_lookup): DFlash drafting with prompt lookup.

Unit tests of the plugin's own code run here, in the trainer's environment (numpy + torch, no vLLM):
its lookup proposal equals the trainer's rule (model/lookup.py), the gate's and the seed's edges,
the version pin and the switch. The end-to-end tests serve a tiny target in vLLM's environment
(.venv-vllm, where `make vllm` installs the plugin) with our worker: one job with the gate, seeded
blocks, then plain and DFlash with the plugin off for them; every output equals plain vLLM's.
"""
from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import write_tiny_jsonl
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

from dflash_train.engine.vllm_process import REPO_VENV, engine_env, kv_cache_gib, vllm_python  # noqa: E402

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

K = 7
MAX_NEW = 32


def prompts() -> list[list[int]]:
    """Token ids with repeats (lookup has something to copy) and without; ids < the tiny vocabulary."""
    rng = random.Random(0)
    span = [rng.randrange(30, 400) for _ in range(12)]
    return [span + [rng.randrange(30, 400) for _ in range(5)] + span[:6],
            [rng.randrange(30, 400) for _ in range(24)],
            (span[:8] + [17]) * 3]


def serve(target: Path, export: Path, tmp: Path, methods: list[dict], caller_lookup: str) -> tuple[dict, str]:
    """vLLM's worker (engine/vllm_worker.py), as serve-bench runs it, on `methods` (the plugin's mode in a
    method's "lookup"), with DFLASH_LOOKUP=`caller_lookup` in the caller's environment (which the worker
    must not let reach the engines of the other methods): its result by method name and its log."""
    from dflash_train.engine.vllm_process import WORKER

    job = {"target": str(target), "dtype": "float32", "max_model_len": 256, "max_new_tokens": MAX_NEW,
           "prompts": prompts(),
           "methods": [{"k": K, **m, **({"model": str(export)} if m["name"] != "plain" else {})} for m in methods]}
    job_file, result_file = tmp / "job.json", tmp / "result.json"
    job_file.write_text(json.dumps(job))
    env = engine_env({"VLLM_CPU_KVCACHE_SPACE": kv_cache_gib(), "DFLASH_LOOKUP": caller_lookup, "OMP_NUM_THREADS": "1"})
    r = subprocess.run([str(vllm_python()), str(WORKER), str(job_file), str(result_file)], capture_output=True,
                       text=True, env=env, cwd=tmp, timeout=900)
    res = json.loads(result_file.read_text())
    assert "error" not in res, res.get("traceback", "")[-3000:]
    return {m["name"]: m for m in res["methods"]}, r.stdout + r.stderr


@pytest.fixture(scope="module")
def served(tiny_target_factory, tmp_path_factory):
    """One tiny drafter, served by one worker job: the gate, seeded blocks, then plain and DFlash with the
    plugin off for them (after the plugin's engines, with DFLASH_LOOKUP=seed+gate in the caller's
    environment: neither may leak into them). (~3 min on 2 cores: the training and four engine starts.)"""
    from test_engine_vllm import train_and_export

    root = tmp_path_factory.mktemp("lookup_plugin")
    target = tiny_target_factory("llama", hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32)
    data = write_tiny_jsonl(root / "conv.jsonl", n=40)
    # trained with lookup-seeded blocks (half of them masks only): the drafter the seed mode is for
    export = train_and_export(root, str(target), data, 60, "model.num_layers=2", "model.target_layer_ids=[1,2]",
                              "model.block_seeds=prompt_lookup", "train.unseeded_fraction=0.5")
    rows, log = serve(target, export, root, [{"name": "gate", "lookup": "gate"}, {"name": "seed", "lookup": "seed"},
                                             {"name": "plain"}, {"name": "dflash"}], caller_lookup="seed+gate")
    return rows, log


@needs_vllm
def test_plugin_loads_in_vllm_only_for_its_methods(served):
    rows, log = served
    for mode in ("gate", "seed"):
        assert f"dflash-lookup 0.1.0 on: {mode}, min match 3" in log, log[-3000:]
        # the worker checked that the plugin patched the engine's process (DFLASH_LOOKUP_RECORD)
        assert rows[mode]["lookup"]["mode"] == mode and rows[mode]["lookup"]["processes"] >= 1
    assert "on: gate+seed" not in log  # the caller's DFLASH_LOOKUP reached no engine
    assert rows["plain"]["lookup"] is None and rows["dflash"]["lookup"] is None


def counters(row: dict) -> tuple[float, float, float]:
    """(drafts, draft tokens, accepted tokens) the engine counted (vllm:spec_decode_num_*)."""
    return (row["spec_decode_num_drafts"], row["spec_decode_num_draft_tokens"],
            row["spec_decode_num_accepted_tokens"])


@needs_vllm
def test_gate_and_seed_lossless_with_accepted_tokens(served):
    rows, _ = served
    plain, dflash = rows["plain"]["outputs"], rows["dflash"]
    assert dflash["outputs"] == plain
    for mode in ("gate", "seed"):
        d = rows[mode]
        assert d["outputs"] == plain, mode  # lossless: verification is vLLM's
        drafts, draft_tokens, accepted = counters(d)
        assert drafts > 0 and draft_tokens == K * drafts and 0 <= accepted <= draft_tokens, (mode, counters(d))
    # (this 60-step drafter accepts nothing with or without seeds on these prompts; the gate's tokens are accepted)
    assert counters(rows["gate"])[2] > 0
    # the gate drafts lookup's copy where the outputs repeat the context: more accepted than DFlash alone
    # (which ran after it: the gate did not stay patched into a later engine)
    gate = counters(rows["gate"])
    assert gate[2] > counters(dflash)[2], (gate, counters(dflash))
