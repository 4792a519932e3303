"""bench/lookup_gate.py's ranking of suite rows: pooled over the suites, tau from the accepted tokens
the outputs kept (the raw counter also counts drafts cut at max_tokens), the fastest first."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("lookup_gate", REPO / "bench" / "lookup_gate.py")
lookup_gate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lookup_gate)


def _row(method, new_tokens, seconds, raw, kept):
    return {"method": method, "k": 3, "new_tokens": new_tokens, "seconds": seconds, "accepted_tokens": raw,
            "accepted_in_output": kept, "lossless": True, "tau": None}


def test_suite_rows_pool_the_kept_accepted_tokens():
    groups = [
        {"suite": "mtbench", "category": None, "num_prompts": 2,
         "rows": [_row("plain", 50, 5.0, 0, 0), _row("dflash", 50, 4.0, 30, 24),
                  _row("dflash+lookup:gate@2", 50, 2.0, 40, 36)]},
        {"suite": "mtbench", "category": "writing", "num_prompts": 1,  # a category: not pooled again
         "rows": [_row("plain", 25, 2.5, 0, 0), _row("dflash", 25, 2.0, 15, 12),
                  _row("dflash+lookup:gate@2", 25, 1.0, 20, 18)]},
        {"suite": "humaneval", "category": None, "num_prompts": 2,
         "rows": [_row("plain", 30, 3.0, 0, 0), _row("dflash", 30, 3.0, 10, 8),
                  _row("dflash+lookup:gate@2", 30, 1.0, 20, 16)]},
    ]
    ranked = lookup_gate.ranked({"groups": groups})
    assert [r["method"] for r in ranked] == ["dflash+lookup:gate@2", "dflash"]
    gate, dflash = ranked
    decode = 80 - 4  # new tokens less each prompt's first token
    assert gate["accepted_in_output"] == 52 and gate["accepted_tokens"] == 60
    assert gate["tau"] == pytest.approx(decode / (decode - 52))
    assert dflash["tau"] == pytest.approx(decode / (decode - 32))
    assert gate["tokens_per_s"] == pytest.approx(80 / 3.0) and gate["speedup"] == pytest.approx((80 / 3.0) / (80 / 8.0))
