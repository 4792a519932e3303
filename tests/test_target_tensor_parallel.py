"""Tensor-parallel target groups (pipeline.target_tp_size) and head-only targets on trainer ranks
(issue 17), on CPU with gloo: torchrun subprocesses of at most 4 ranks, tiny targets."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainrun import REPO, env, losses, tiny_overrides, wait_for

TESTS = Path(__file__).resolve().parent


def _torchrun(nproc: int, args: list[str], timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(), cwd=REPO, **kw)


def _train_args(run_dir: Path, overrides: list[str]) -> list[str]:
    return ["-m", "dflash_train.cli", "train", "--run-dir", str(run_dir), *overrides]


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_head_only_target_is_the_full_targets_head_without_layers(tiny_target_factory, family):
    """What a trainer rank loads: no decoder layer, the same embedding (Gemma's scale), lm_head
    (tied for Gemma), soft-cap, mask token and drafter config as the whole target."""
    from dflash_train.config import ModelConfig, TargetConfig
    from dflash_train.model.drafter import DrafterConfig
    from dflash_train.targets import load_target
    from dflash_train.targets.head_only import load_head_only_target

    kw = {"final_logit_softcapping": 30.0} if family == "gemma3" else {}
    cfg = TargetConfig(path=str(tiny_target_factory(family, **kw)))
    full, head = load_target(cfg, device="cpu"), load_head_only_target(cfg, "cpu")
    assert len(head.layers) == 0 and not any(".layers." in n for n, _ in head.model.named_parameters())
    assert head.num_layers == full.num_layers == 4
    ids = torch.arange(40)[None]
    hidden = torch.randn(2, 5, full.hidden_size)
    assert torch.equal(head.embed(ids), full.embed(ids))
    assert torch.equal(head.logits(hidden), full.logits(hidden))
    assert (head.embed_scale, head.final_logit_softcapping, head.mask_token_id, head.vocab_size) == \
           (full.embed_scale, full.final_logit_softcapping, full.mask_token_id, full.vocab_size)
    m = ModelConfig(num_layers=1, block_size=4)
    assert DrafterConfig.from_target(m, head) == DrafterConfig.from_target(m, full)
    n_head = sum(p.numel() for p in head.model.parameters())
    n_full = sum(p.numel() for p in full.model.parameters())
    assert n_head < n_full / 2


def _tiny_moe_target(out: Path, tokenizer_dir: Path) -> Path:
    """A tiny random Qwen3-MoE target (4 experts, top 2) with the tiny qwen3 tokenizer."""
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_experts=4, num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_sharded_capture_equals_unsharded(tiny_target_factory, tmp_path):
    """A tiny target sharded over 2 ranks (the model's own TP plan, DTensor shards; MoE: its experts by
    expert parallelism) captures packed rows (two documents + padding; Gemma: sliding-window layers)
    like the unsharded target, to fp32 rounding; read shard by shard, each rank holds about half."""
    qwen = tiny_target_factory("qwen3")
    dirs = [qwen, tiny_target_factory("gemma3"), _tiny_moe_target(tmp_path / "moe", qwen)]
    out = tmp_path / "capture.json"
    res = _torchrun(2, [str(TESTS / "tp_capture_worker.py"), str(out), ",".join(map(str, dirs))])
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    report = json.loads(out.read_text())
    assert sorted(report) == sorted(f"{d}:{how}" for d in dirs for how in ("from_files", "whole_then_sliced"))
    for d, r in report.items():
        assert r["shape_ok"], (d, r)
        assert r["q_proj_local"] == [r["q_proj_full"][0] // 2, r["q_proj_full"][1]], (d, r)  # really sharded
        assert r["max_abs_diff"] <= 1e-5 * max(1.0, r["max_abs"]), (d, r)
        if d.endswith(":from_files"):
            assert r["params_local"] <= 0.6 * r["params_full"], (d, r)


def test_sharded_group_trains_like_one_target_rank_and_resumes_exactly(tiny_target_factory, tmp_path):
    """World 4 = one target sharded over ranks 0-1 + 2 trainer ranks, against world 3 = one unsharded
    target rank + 2 trainers: the same rows in the same order, losses equal to fp32 rounding. Then
    SIGTERM to the leading trainer of a sharded run and resume: bit-exact against the uninterrupted one."""
    from conftest import write_tiny_jsonl

    jsonl = write_tiny_jsonl(tmp_path / "conv.jsonl", n=40)
    target = tiny_target_factory("qwen3")
    over = tiny_overrides(target, jsonl, **{"train.max_steps": 8, "checkpoint.every_steps": 100})
    tp = [*over, "pipeline.target_ranks=2", "pipeline.target_tp_size=2"]

    ref = tmp_path / "unsharded"
    res = _torchrun(3, _train_args(ref, [*over, "pipeline.target_ranks=1"]))
    assert res.returncode == 0, res.stderr[-4000:]
    sharded = tmp_path / "sharded"
    res = _torchrun(4, _train_args(sharded, tp))
    assert res.returncode == 0, res.stderr[-4000:]
    want, got = losses(ref), losses(sharded)
    assert sorted(got) == list(range(1, 9)) and all(math.isfinite(v) for v in got.values())
    for s in want:
        assert math.isclose(got[s], want[s], rel_tol=1e-4), (s, got[s], want[s])
    logs = {p.name: p.read_text() for p in (sharded / "logs").glob("*.log")}
    assert "target sharded over 2 ranks" in logs["train.rank0.log"]
    assert "serving trainer ranks [2, 3]" in logs["train.rank0.log"]
    assert "captures for group leader 0, done" in logs["train.rank1.log"]
    # both trainer ranks (2 = leader -> train.log, 3) hold the head only
    for name in ("train.log", "train.rank3.log"):
        assert "target head only (no decoder layer loaded)" in logs[name], name

    stopped = tmp_path / "stopped"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           *_train_args(stopped, tp)]
    with open(tmp_path / "stopped.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env(step_delay=0.5), cwd=REPO)
        wait_for(lambda: len(losses(stopped)) >= 3, 300, what="step 3")
        os.kill(json.loads((stopped / "run.json").read_text())["pid"], signal.SIGTERM)
        assert proc.wait(300) == 0, (tmp_path / "stopped.log").read_text()[-4000:]
    at = max(losses(stopped))
    assert at < 8 and (stopped / "checkpoints" / "latest").resolve().name == f"step-{at:08d}"
    res = _torchrun(4, _train_args(stopped, tp))
    assert res.returncode == 0, res.stderr[-4000:]
    assert losses(stopped) == got


def test_target_tp_size_is_checked_against_the_layout(tiny_target_factory, tmp_path):
    """One clear line + exit 2: target_tp_size without torchrun, and target_ranks not a multiple of it."""
    from conftest import write_tiny_jsonl

    from trainrun import run_train

    jsonl = write_tiny_jsonl(tmp_path / "conv.jsonl", n=8)
    over = tiny_overrides(tiny_target_factory("qwen3"), jsonl)
    res = run_train(tmp_path / "alone", [*over, "pipeline.target_tp_size=2"])
    assert res.returncode == 2, res.stderr[-3000:]
    assert "pipeline.target_tp_size=2" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "alone" / "config.yaml").exists()
    res = _torchrun(3, _train_args(tmp_path / "odd", [*over, "pipeline.target_ranks=1", "pipeline.target_tp_size=2"]),
                    timeout=300)
    assert res.returncode != 0
    assert "pipeline.target_ranks=1 is not a multiple of pipeline.target_tp_size=2" in res.stderr
    # the ranks exit 2 with the line; the only traceback is torchrun's own ChildFailedError
    assert "exitcode  : 2" in res.stderr and "src/dflash_train/" not in res.stderr, res.stderr[-3000:]
