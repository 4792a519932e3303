"""`dflash+lookup` in the product (issue 46 item 3): `serve-bench --method dflash+lookup` serves the
export with our vLLM plugin (plugins/vllm_dflash_lookup) acting in that engine only, beside plain
vLLM and DFlash alone, in one serve-bench call as a user runs it.

Checked here, not taken from the product's flags: every output equals plain vLLM's token for token,
tau recomputed from the engine's counters, the gate at a 1-token match accepting other tokens than
DFlash alone (so the test fails when the plugin did not act), and our replay of the gate (the drafter's
masks-only blocks from eval/replay.py, lookup's continuation where its match is long enough: the
plugin's own rule) against the engine's accepted tokens (bounds: see that test for why not 1 % in
tau). Plus the refusals (no plugin in the vLLM
environment, a bad mode) in one line, the k sweep's per-method pick and report.md's rows, which
start no engine.

The engines are the run the engine tests share (tests/engine_fixtures.py `served_accepting`, spawned:
a job with dflash+lookup starts every engine core by spawn), built by whichever test asks first.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from dflash_train.engine import k_sweep
from dflash_train.engine.measure import LOOKUP, LOOKUP_MIN_MATCH, LOOKUP_MODE, label_of, method_spec
from dflash_train.errors import UserError
from dflash_train.report import explanation, suite_lines

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "plugins" / "vllm_dflash_lookup"))
from vllm_dflash_lookup.proposal import lookup  # noqa: E402  (the plugin's rule: what the engine gates with)
from engine_fixtures import SERVED_METHODS, SERVED_TOKENS, cli  # noqa: E402
from test_vllm_lookup_plugin import needs_vllm  # noqa: E402

K = 3  # the accepting export's block of 4 - 1
MAX_NEW = 24  # as tests/test_engine_vllm.py serves this export (its engine-vs-replay check holds 1 % there)
# the gate at a 1-token match hands many blocks to lookup (on this drafter, which learnt its target's
# loops, the default threshold changes few): the row whose tau tells an acting plugin from an idle one
LOW = f"{LOOKUP}@1"


@pytest.fixture(scope="module")
def setup(accepting_export, tmp_path_factory):
    """The session's accepting export (tests/engine_fixtures.py: a drafter that accepts in vLLM, trained
    on its target's own answers to these prompts)."""
    from test_engine_vllm import prompts_file

    prompts = list(accepting_export.prompts)
    root = tmp_path_factory.mktemp("serve_lookup")
    return accepting_export.target, accepting_export.export, prompts, prompts_file(root / "p.jsonl", prompts)


@pytest.fixture(scope="module")
def served(served_accepting):
    """The engine run the engine tests share (tests/engine_fixtures.py: the seed, the default dflash+lookup
    and the gate at match >= 1, then plain, n-gram and DFlash, one worker job, MAX_NEW tokens at k 3)."""
    assert SERVED_TOKENS == MAX_NEW and {LOOKUP, LOW} <= set(SERVED_METHODS)
    return served_accepting


@needs_vllm
def test_lookup_row_lossless_and_acted(served):
    rows = {row["method"]: row for row in served["rows"]}
    assert list(rows) == [f"{LOOKUP}:seed", LOOKUP, LOW, "plain", "ngram", "dflash"] == list(SERVED_METHODS)
    assert rows[LOOKUP]["label"] == "DFlash + lookup (vLLM)"
    # the worker's check: the plugin patched the engine's process with the default mode and threshold
    assert rows[LOOKUP]["lookup"]["mode"] == LOOKUP_MODE and rows[LOOKUP]["lookup"]["min_match"] == LOOKUP_MIN_MATCH
    assert rows[LOOKUP]["lookup"]["processes"] >= 1 and "lookup" not in rows["dflash"]
    outs = served["outputs"]
    n_prompts = len(outs["plain"])
    assert rows[LOW]["label"] == "DFlash + lookup (vLLM, gate, match >= 1)" and rows[LOW]["lookup"]["min_match"] == 1
    for m in ("dflash", LOOKUP, LOW):
        assert outs[m] == outs["plain"], m  # lossless, compared here
        row = rows[m]
        assert row["k"] == K and row["drafts"] > 0 and row["draft_tokens"] == K * row["drafts"], row
        assert row["new_tokens"] == sum(len(o) for o in outs[m])
        decode = row["new_tokens"] - n_prompts
        # tau over the accepted tokens the outputs kept (the counter also counts what max_tokens cut)
        assert row["accepted_in_output"] <= row["accepted_tokens"] <= row["accepted_in_output"] + K * n_prompts, row
        assert row["tau"] == pytest.approx(decode / (decode - row["accepted_in_output"])), row
    assert rows["dflash"]["tau"] > 1.3  # the drafter accepts: lossless is checked on kept drafts
    # the plugin acted in its engines only: at a 1-token match lookup's copies replace many blocks
    assert rows[LOW]["accepted_tokens"] != rows["dflash"]["accepted_tokens"], (rows[LOW], rows["dflash"])


def gate_replay(export: Path, target_dir: Path, prompts: list[str], outputs: list[list[int]], k: int,
                min_match: int) -> tuple[list[int], list[int]]:
    """(DFlash alone, the gate): our greedy replay's acceptance lengths (tokens per step) on plain vLLM's
    outputs. The gate's block at an anchor is lookup's continuation (the plugin's rule, its match >=
    min_match) followed by the drafter's own tokens past it, else the drafter's masks-only block, as the
    plugin writes it in vLLM."""
    from dflash_train.checkpoint.source import resolve_drafter_source
    from dflash_train.config import TargetConfig
    from dflash_train.eval.prompts import encode_prompts
    from dflash_train.eval.replay import replay_drafts
    from dflash_train.eval.source import load_drafter
    from dflash_train.model.acceptance import walk_acceptance
    from dflash_train.targets import load_target

    target = load_target(TargetConfig(path=str(target_dir), device="cpu", dtype="float32"))
    drafter = load_drafter(resolve_drafter_source(export), target.device)
    ids, _ = encode_prompts(target, prompts)
    alone, gated = [], []
    with torch.no_grad():
        for p, out in zip(ids, outputs):
            seq = list(p) + list(out)
            drafts = replay_drafts(drafter, target, seq, len(p), seeded=False, k=k).tolist()

            def block(s: int, gate: bool) -> list[int]:
                d = drafts[s - len(p)]
                if gate:
                    tokens, match = lookup(seq[:s + 1], k)
                    if tokens and match >= min_match:
                        d = tokens + d[len(tokens):]
                return d[:len(seq) - 1 - s]

            alone += walk_acceptance(seq, len(p), lambda s: block(s, False))
            gated += walk_acceptance(seq, len(p), lambda s: block(s, True))
    return alone, gated


@needs_vllm
def test_gate_replay_reproduces_the_engine(setup, served):
    """Our replay of the gate against the engine's raw accepted counter, for DFlash alone and the gate at
    the default threshold and at 1 (where the gate's blocks differ most from the drafter's): bounds,
    because the raw counter also counts drafts a step accepted past max_tokens (up to k + 1 per output
    cut at the cap). The exact check, the engine's kept steps equal to replay's step for step, is
    tests/test_engine_vllm.py's (plain DFlash and the default gate; it holds since the engine's drafter
    is the export's: vllm_worker.fix_dflash_context_k_norm)."""
    target, export, prompts, _ = setup
    rows = {row["method"]: row for row in served["rows"]}
    plain = served["outputs"]["plain"]
    capped = sum(1 for o in plain if len(o) >= MAX_NEW)
    alone, gated = gate_replay(export, target, prompts, plain, K, LOOKUP_MIN_MATCH)
    _, low = gate_replay(export, target, prompts, plain, K, 1)
    assert sum(alone) != sum(low) or len(alone) != len(low)
    for method, ours in (("dflash", alone), (LOOKUP, gated), (LOW, low)):
        accepted = sum(ours) - len(ours)  # each step produces its accepted drafts + 1
        engine = rows[method]["accepted_tokens"]
        assert accepted - len(prompts) <= engine <= accepted + (K + 1) * capped, (method, rows[method], accepted)


def test_refused_without_the_plugin_in_one_line(setup, tmp_path):
    """A vLLM environment without our plugin (a user's own vLLM): one line, exit 2, before any engine."""
    target, export, _, prompts = setup
    bare = tmp_path / "python"  # the interpreter without site-packages: no vllm.general_plugins entry points
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    bare.chmod(0o755)
    r = cli("serve-bench", str(export), "--target", str(target), "--prompts", str(prompts), "--method", "plain",
            "--method", LOOKUP, env={"DFLASH_TRAIN_VLLM_PYTHON": str(bare)}, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "vllm-dflash-lookup plugin" in lines[0] and "make vllm" in lines[0], r.stderr
    r = cli("serve-bench", str(export), "--target", str(target), "--method", f"{LOOKUP}:gat", timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "gate, seed, seed+gate" in r.stderr, r.stderr


def test_method_names():
    assert method_spec(LOOKUP) == {"name": LOOKUP, "lookup": LOOKUP_MODE, "min_match": LOOKUP_MIN_MATCH}
    assert method_spec(f"{LOOKUP}:seed+gate@5") == {"name": f"{LOOKUP}:seed+gate@5", "lookup": "seed+gate",
                                                    "min_match": 5}
    assert method_spec(f"{LOOKUP}@2")["min_match"] == 2 and method_spec("ngram") == {"name": "ngram"}
    assert label_of(f"{LOOKUP}:seed") == "DFlash + lookup (vLLM, seed)"
    assert label_of(f"{LOOKUP}:gate@4") == "DFlash + lookup (vLLM, gate, match >= 4)"
    for bad in ("dflash+lookupx", f"{LOOKUP}:foo", f"{LOOKUP}@0", f"{LOOKUP}@x", "eagle"):
        with pytest.raises(UserError):
            method_spec(bad)


def test_k_sweep_picks_a_k_per_method(monkeypatch, tmp_path):
    """`--k auto` with dflash+lookup: both swept at every candidate k, each method's fastest k picked."""
    (tmp_path / "config.json").write_text(json.dumps({"block_size": 4}))  # candidates 1, 2, 3
    fast = {("dflash", 2): 9.0, (LOOKUP, 3): 12.0}
    seen = {}

    def fake_serve(export_dir, target_dir, ids, stops, tokens, methods, dtype=None, log=None, temperature=0.0,
                   top_p=1.0, ks=None):
        seen["methods"], seen["ks"] = list(methods), list(ks)
        out = [{"name": m, "k": k, "outputs": [[1, 2, 3]], "load_seconds": 1.0, "per_prompt": [],
                "seconds": 3 / fast.get((m, k), 5.0), "spec_decode_num_drafts": 1.0,
                "spec_decode_num_draft_tokens": float(k), "spec_decode_num_accepted_tokens": 0.0}
               for m, k in zip(methods, ks)]
        return {"methods": out}, {"dtype": "float32"}

    monkeypatch.setattr(k_sweep, "serve_methods", fake_serve)
    sweep = k_sweep.sweep_k(tmp_path, tmp_path, [[1, 2]], [], 8, lookup=[LOOKUP])
    assert seen["methods"] == ["plain"] + ["dflash"] * 3 + [LOOKUP] * 3 and seen["ks"] == [0, 1, 2, 3, 1, 2, 3]
    assert sweep["k"] == 2 and sweep["ks"] == {"dflash": 2, LOOKUP: 3}
    assert [r["method"] for r in sweep["rows"]] == ["dflash"] * 3 + [LOOKUP] * 3
    assert "DFlash + lookup (vLLM) 3" in k_sweep.sweep_note(sweep)


def test_report_shows_the_lookup_rows():
    group = {"suite": "mtbench", "category": None, "label": "mtbench", "num_prompts": 4, "tau": 1.2,
             "tau_ngram": 1.3, "speedup": 1.1, "speedup_ngram": 1.2, "lossless": True, "lossless_ngram": True,
             "tau_lookup": 1.45, "speedup_lookup": 1.31, "lossless_lookup": True}
    cat = {**group, "category": "writing", "label": "mtbench/writing", "num_prompts": 2}
    lines = suite_lines({"k": 3, "groups": [group, cat], "num_prompts_per_suite": 2, "max_new_tokens": 64})
    text = "\n".join(lines)
    assert "DFlash + lookup tau" in text
    assert "| mtbench | 4 | 1.200 | 1.300 | 1.10x | 1.20x | 1.450 | 1.31x | yes |" in text
    assert "| mtbench/writing | 2 |" in text  # the categories too, where the copies differ
    head = next(ln for ln in lines if ln.startswith("| suite"))
    sep = lines[lines.index(head) + 1]
    assert head.count("|") == sep.count("|")
    summary = {"judge": "engine", "engine": {"rows": [{"method": "plain"}, {"method": LOOKUP}]}}
    assert any("DFlash + lookup" in ln for ln in explanation(summary))
    assert not any("DFlash + lookup" in ln for ln in explanation({"judge": "engine", "engine": {"rows": []}}))
