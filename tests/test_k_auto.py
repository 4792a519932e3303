"""`serve-bench --k auto` (issue 38, item 5b): a short sweep in vLLM over candidate draft lengths,
the fastest by the engine's tok/s chosen (ties: the smaller k), then the measurement at that k;
--json carries the sweep. A k that is neither a number >= 1 nor auto is one line and exit 2
before anything loads.

The served export is the session's accepting one (block_size 4: candidates 1, 2 and 3): 4 engine starts
for the sweep (plain and DFlash at each k) and 1 for the measurement (DFlash alone: the sweep checked
lossless at every k), ~20-40 s each on 2 cores."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_fixtures import cli
from test_engine_vllm import HAS_VLLM, PROMPTS, prompts_file

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("value, message", [("0", "--k 0: draft tokens per step must be >= 1 (or auto)"),
                                            ("banana", "--k banana: give a number of draft tokens per step (>= 1) "
                                                       "or auto")])
def test_bad_k_is_one_line_and_exit_2_before_anything_loads(tmp_path, value, message):
    # no drafter there and no vLLM: the flag is checked first
    r = cli("serve-bench", str(tmp_path / "none"), "--k", value, timeout=120,
            env={"DFLASH_TRAIN_VLLM_PYTHON": str(tmp_path / "no-python")})
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [f"error: {message}"], r.stderr


def test_demo_serve_k_takes_auto_and_refuses_other_words(tmp_path):
    from dflash_train.config import load_config

    assert load_config(REPO / "configs" / "cpu-demo.yaml", ["demo.serve_k=auto"]).demo.serve_k == "auto"
    run = tmp_path / "run"
    r = cli("demo", "--run-dir", str(run), "demo.serve_k=banana", timeout=300)
    assert r.returncode == 2 and "demo.serve_k" in r.stderr and "or auto" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not run.exists()


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed: run `make vllm`")
def test_k_auto_sweeps_every_candidate_and_serves_at_the_fastest(accepting_export, tmp_path, capsys):
    """The sweep on the shared drafter that accepts (block 4: k 1, 2, 3), each k lossless and its drafts
    kept, the measurement at the fastest."""
    export, tiny_llama = accepting_export.export, accepting_export.target
    prompts = prompts_file(tmp_path / "p.jsonl", PROMPTS[:3])
    base = ["serve-bench", str(export), "--target", str(tiny_llama), "--prompts", str(prompts), "--num-prompts", "3",
            "--max-new-tokens", "16", "--method", "dflash", "--json"]
    # a number past the block is still refused once the drafter is read
    r = cli(*base, "--k", "4")
    assert r.returncode == 2 and "--k=4" in r.stderr and "block_size 4" in r.stderr and "Traceback" not in r.stderr

    r = cli(*base, "--k", "AUTO")
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    sweep = res["k_sweep"]
    assert sweep["candidates"] == [1, 2, 3] and [row["k"] for row in sweep["rows"]] == [1, 2, 3]
    assert sweep["num_prompts"] == 3 and sweep["max_new_tokens"] == 16
    for row in sweep["rows"]:  # each k's own engine and counters: k draft tokens at every DFlash step
        assert row["drafts"] > 0 and row["draft_tokens"] == row["k"] * row["drafts"], row
        assert 0 < row["accepted_tokens"] <= row["draft_tokens"] and row["tau"] > 1.0  # drafts that are kept
        assert row["lossless"] is True and row["tokens_per_s"] > 0 and row["speedup"] > 0
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / sweep["tokens_per_s_plain"])
    fastest = max(sweep["rows"], key=lambda row: (row["tokens_per_s"], -row["k"]))["k"]
    assert sweep["k"] == fastest and res["k"] == fastest
    # the measurement ran at the chosen k, on all the prompts and tokens asked for
    (d,) = res["rows"]
    assert d["method"] == "dflash" and d["k"] == fastest and d["draft_tokens"] == fastest * d["drafts"] > 0
    assert res["num_prompts"] == 3 and res["max_new_tokens"] == 16

    from dflash_train.engine.k_sweep import print_sweep

    print_sweep(sweep)
    out = capsys.readouterr().out
    assert f"{fastest} *" in out and "3 prompts x <= 16 tokens per k (short" in out
