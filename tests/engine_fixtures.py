"""The engine tests' shared drafter (issue 49 item 1): one tiny export that ACCEPTS in vLLM, trained
once per session on its target's own answers, so that "lossless" and "engine tau == counters ==
replay" are checked on drafts that are kept, not on a drafter whose tau would be 1.0 either way.

Registered in conftest.py; a test asks for `speaking_llama` (the target) or `accepting_export`.

Why a special target: a random target's greedy answers are not text. Answers reach training as text
(`regenerate` writes JSONL), and a random byte-level BPE model emits special tokens, lone UTF-8
bytes and non-canonical merges, none of which survive decode -> encode: measured, 0 of 40 answers
came back as the ids the target emitted, and a drafter trained on them reached replay tau 1.27.
`speaking_llama` has no merges (its vocabulary is the byte alphabet) and can only say printable
characters, so every answer encodes back to exactly its ids: 600 steps (~20 s) reach replay tau
~2.4 at k 3 on the prompts it trained on and ~1.3 on others (measured 2026-12-07).
"""
from __future__ import annotations

import json
import os
import string
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import tiny_conversations
from dflash_train.engine.vllm_process import lookup_plugin_missing
from shared_once import build_once

REPO = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 4  # k 1..3: a k sweep of three engines, and a served k below the block's (2)
# the prompts the engine tests serve; all of them are in the drafter's training data
PROMPTS = ["Please explain how speculative decoding works.", "Write a short poem about the sea.",
           "What is the capital of France?", "Could you summarize this text in one sentence, please?"]
SUITE_PROMPTS_PER_SUITE = 2  # the suites' first items, as the suite tests serve them


@dataclass(frozen=True)
class AcceptingExport:
    target: Path   # speaking_llama's directory
    export: Path   # the export directory vLLM serves (draft vocabulary + d2t: train.vocab_subset)
    run: Path      # the run it came from
    data: Path     # the conversations (JSONL) ...
    regenerated: Path  # ... and the target's own answers to them, the drafter's training data
    prompts: list[str]  # prompts it trained on (PROMPTS)


# vLLM's own switch (engine/vllm_worker.py engine_plan): the engine core and its model in the worker's process,
# an engine start ~6 s instead of ~30-55 s; lookup engines still get processes of their own (`served_accepting`
# runs both kinds in one job), and the teardown test (tests/test_engine_teardown.py) keeps vLLM's default
IN_PROCESS_ENGINES = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def cli(*args: str, timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    """The product's CLI as a user runs it, its vLLM engines in the worker's process (IN_PROCESS_ENGINES)."""
    return subprocess.run([sys.executable, "-m", "dflash_train.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "2", **IN_PROCESS_ENGINES, **(env or {})})


@pytest.fixture(scope="session")
def speaking_llama(tiny_target_factory) -> Path:
    # vLLM's CPU attention takes head sizes 32, 64, 80, ...: 2 heads of 32; 262 = 256 bytes + 6 specials
    return tiny_target_factory("llama", hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32,
                               tokenizer_vocab=262, speaks=string.ascii_letters + string.digits + ".,;:!?()-")


def _training_conversations() -> list[dict]:
    """40 tiny conversations, the engine tests' prompts and the suites' first prompts, one turn each."""
    from dflash_train.eval.suites import load_suite

    asks = list(PROMPTS)
    for suite in ("mtbench", "humaneval"):
        asks += [it.turns[0] for it in load_suite(suite, SUITE_PROMPTS_PER_SUITE)]
    extra = [{"id": f"engine-{i:02d}", "conversations": [{"from": "human", "value": a}, {"from": "gpt", "value": "x"}]}
             for i, a in enumerate(asks)]
    return tiny_conversations(40) + extra


@pytest.fixture(scope="session")
def accepting_export(speaking_llama, tmp_path_factory) -> AcceptingExport:
    # trained once per test run, shared by the xdist workers (tests/shared_once.py)
    root = build_once(tmp_path_factory, "accepting-export", lambda root: _train(speaking_llama, root))
    return AcceptingExport(speaking_llama, root / "export", root / "run", root / "conv.jsonl", root / "regen.jsonl",
                           list(PROMPTS))


def _train(speaking_llama: Path, root: Path) -> None:
    """regenerate -> train -> export into `root` (the layout `accepting_export` returns)."""
    convs = _training_conversations()
    data = root / "conv.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in convs))
    common = [f"target.path={speaking_llama}", f"data.source=jsonl:{data}", f"data.limit={len(convs)}",
              "data.max_tokens=128", "data.heldout_fraction=0", "data.domain_prompts={}"]
    regen = root / "regen.jsonl"
    r = cli("regenerate", *common, "--out", str(regen), "--max-new-tokens", "48")
    assert r.returncode == 0, r.stderr[-3000:]
    run = root / "run"
    r = cli("train", "--config", str(REPO / "configs" / "cpu-demo.yaml"), "--run-dir", str(run), *common,
            f"data.regenerated={regen}", f"data.cache_dir={root / 'cache'}",
            "train.max_steps=600", "train.max_seconds=900", "train.batch_size=4", "train.num_anchors=16",
            "train.lr=3e-3", "train.vocab_subset=48", "checkpoint.every_steps=1000", "logging.progress=plain",
            f"model.block_size={BLOCK_SIZE}", "model.num_layers=2", "model.target_layer_ids=[1,2]")
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli("export", str(run), "--out", str(root / "export"))
    assert r.returncode == 0, r.stderr[-3000:]


# the served run the engine tests share: one serve-bench of the accepting export at k 3 on PROMPTS and, in the
# same engines (--prompts FILE --suite), the suites' first SUITE_PROMPTS_PER_SUITE items (MT-Bench's two turns)
SERVED_TOKENS = 24
SERVED_SUITES = "mtbench,humaneval"
# the plugin's engines (seed, the default gate, the gate at a 1-token match) and plain, n-gram and DFlash alone,
# with CALLER_LOOKUP in serve-bench's own environment and IN_PROCESS_ENGINES: the worker starts plain, n-gram and
# DFlash in its own process first, then each lookup engine in processes of its own (engine_plan). A worker that
# let the caller's DFLASH_LOOKUP reach DFlash alone's engine, or started the lookup engines in its own process
# (the plugin is set up once per process: the gate would be served with the seed's settings), would change
# drafts that the engine tests compare with our replay, step by step
SERVED_LOOKUP = ("dflash+lookup:seed", "dflash+lookup", "dflash+lookup@1")
SERVED_BASE = ("plain", "ngram", "dflash")
SERVED_METHODS = SERVED_LOOKUP + SERVED_BASE
CALLER_LOOKUP = "seed"  # a user's DFLASH_LOOKUP that must reach no engine but the seed method's


@pytest.fixture(scope="session")
def served_accepting(accepting_export, tmp_path_factory) -> dict:
    """serve-bench's JSON for the accepting export: its PROMPTS (4 x SERVED_TOKENS tokens, k 3; the rows
    and outputs at the top) and, in the same engine runs, the suites (under "suites", as `serve-bench
    --suite` alone reports them), every method of SERVED_METHODS in one worker job: the main engine test
    (plain / n-gram / DFlash), the suite test, the lookup row tests, the plugin's tests and the gate-vs-replay
    test read the same engines instead of starting their own (one run per test run, shared by the xdist
    workers)."""
    acc = accepting_export

    def serve(root: Path) -> None:
        prompts = root / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in acc.prompts))
        args = ["serve-bench", str(acc.export), "--target", str(acc.target), "--prompts", str(prompts),
                "--num-prompts", str(len(acc.prompts)), "--suite", SERVED_SUITES,
                "--suite-prompts", str(SUITE_PROMPTS_PER_SUITE), "--max-new-tokens", str(SERVED_TOKENS), "--json"]
        # the lookup rows need the plugin (make vllm installs it; its tests skip, and fail in CI, without)
        for m in SERVED_METHODS if not lookup_plugin_missing() else SERVED_BASE:
            args += ["--method", m]
        r = cli(*args, timeout=1800, env={"DFLASH_LOOKUP": CALLER_LOOKUP})
        assert r.returncode == 0, r.stderr[-3000:]
        (root / "served.json").write_text(r.stdout)

    return json.loads((build_once(tmp_path_factory, "served-accepting", serve) / "served.json").read_text())
