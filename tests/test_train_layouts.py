"""The two torchrun layouts on gloo (pipeline.layout): colocated ranks (each holds the target and a
drafter replica) train the same model as one process with the world's batch, stop together and
resume bit for bit; the split layout's wire carries nothing an NCCL world would refuse."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import torch
from conftest import write_tiny_jsonl
from safetensors.torch import load_file

from trainrun import REPO, env, losses, run_train, tiny_overrides, wait_for

TESTS = REPO / "tests"


def _torchrun(run_dir, overrides, nproc=2, module=("-m", "dflash_train.cli"), extra_env=None, timeout=600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           *module, "train", "--run-dir", str(run_dir), *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**env(), **(extra_env or {})},
                          cwd=REPO)


def _final_tensors(run_dir):
    return load_file(str((run_dir / "checkpoints" / "latest").resolve() / "model.safetensors"))


def _setup(tiny_target_factory, tmp_path, **extra):
    jsonl = write_tiny_jsonl(tmp_path / "conv.jsonl", n=40)
    # every position of a 64-token row anchors a block (63 anchors): no anchor is drawn at random,
    # so ranks with other anchor streams train exactly the blocks one process trains
    base = {"train.num_anchors": 63, "train.lr": 1e-2, "checkpoint.every_steps": 100}
    return tiny_overrides(tiny_target_factory("qwen3"), jsonl, **{**base, **extra})


def test_colocated_two_ranks_equal_one_process_with_twice_the_batch(tiny_target_factory, tmp_path):
    over = _setup(tiny_target_factory, tmp_path, **{"train.max_steps": 6})
    one = tmp_path / "one"
    res = run_train(one, over + ["train.batch_size=4"])
    assert res.returncode == 0, res.stderr[-3000:]
    two = tmp_path / "two"
    res = _torchrun(two, over + ["train.batch_size=2", "pipeline.layout=colocated"])
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    a, b = losses(one), losses(two)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for s in a:  # float tolerance: the ranks capture and sum in another order than one process
        assert math.isclose(a[s], b[s], rel_tol=1e-4), (s, a[s], b[s])
    assert a[6] < a[1]  # it learns (lr 1e-2)
    wa, wb = _final_tensors(one), _final_tensors(two)
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=1e-3, atol=1e-5), k
    log = (two / "logs" / "train.log").read_text()
    assert "layout colocated, measured per GPU target" in log  # the rule, with this run's own rates


def test_colocated_sigterm_stops_every_rank_and_resumes_bit_exact(tiny_target_factory, tmp_path):
    over = _setup(tiny_target_factory, tmp_path, **{"train.max_steps": 10, "pipeline.layout": "colocated"})
    ref = tmp_path / "ref"
    res = _torchrun(ref, over)
    assert res.returncode == 0, res.stderr[-4000:]
    rd = tmp_path / "stopped"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "dflash_train.cli", "train", "--run-dir", str(rd), *over]
    with open(tmp_path / "stopped.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env(step_delay=0.5), cwd=REPO)
        wait_for(lambda: len(losses(rd)) >= 3, 300, what="step 3")
        os.kill(json.loads((rd / "run.json").read_text())["pid"], signal.SIGINT)  # Ctrl-C on the leader
        assert proc.wait(300) == 0, (tmp_path / "stopped.log").read_text()[-4000:]
    stopped = max(losses(rd))
    assert stopped < 10
    assert (rd / "checkpoints" / "latest").resolve().name == f"step-{stopped:08d}"
    text = (tmp_path / "stopped.log").read_text()
    assert text.count(f"stopping at step {stopped} ") == 1  # the leader's line; the other rank logs to its file
    assert f"stopping at step {stopped} " in (rd / "logs" / "train.rank1.log").read_text()
    res = _torchrun(rd, over)
    assert res.returncode == 0, res.stderr[-4000:]
    assert losses(rd) == losses(ref)
    wr, wd = _final_tensors(ref), _final_tensors(rd)
    assert wr.keys() == wd.keys() and all(torch.equal(wr[k], wd[k]) for k in wr)


def test_split_wire_sends_nothing_an_nccl_world_refuses(tiny_target_factory, tmp_path):
    """1 target rank + 1 trainer rank under a spy that applies NCCL's device rule to every send / recv
    (tests/nccl_rule_worker.py): the batches travel on a gloo group of their own."""
    over = _setup(tiny_target_factory, tmp_path, **{"train.max_steps": 3, "pipeline.target_ranks": 1,
                                                    "pipeline.layout": "split"})
    spy_log = tmp_path / "nccl-rule.log"
    res = _torchrun(tmp_path / "split", over, module=(str(TESTS / "nccl_rule_worker.py"),),
                    extra_env={"NCCL_RULE_LOG": str(spy_log)})  # the script's folder (tests/) is on its path
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    checked = spy_log.read_text().splitlines()
    assert checked.count("send ok") >= 3 * 6 and checked.count("recv ok") >= 3 * 6  # 3 batches, 6 parts each
    assert sorted(losses(tmp_path / "split")) == [1, 2, 3]


def test_layouts_that_cannot_run_are_refused_at_start_in_one_line(tiny_target_factory, tmp_path):
    """torchrun as a user runs it: FSDP2 with the in-training eval (the leader alone would run the sharded
    forward: a hang later), and a split with more target ranks than trainers (a target with no trainer would
    wait forever). Each rank exits 2 with the line, before any config.yaml or checkpoint is written."""
    over = _setup(tiny_target_factory, tmp_path, **{"train.max_steps": 2})
    res = _torchrun(tmp_path / "fsdp2-eval", over + ["pipeline.layout=colocated", "train.sharding=fsdp2",
                                                     "eval.every_steps=2"])
    assert res.returncode != 0
    assert "eval.every_steps with train.sharding=fsdp2 is not supported" in res.stderr, res.stderr[-3000:]
    # the ranks exit 2 with the line; the only traceback is torchrun's own ChildFailedError
    assert "exitcode  : 2" in res.stderr and "src/dflash_train/" not in res.stderr, res.stderr[-3000:]
    assert not (tmp_path / "fsdp2-eval" / "config.yaml").exists()
    res = _torchrun(tmp_path / "split", over + ["pipeline.layout=split", "pipeline.target_ranks=2"], nproc=3)
    assert res.returncode != 0
    assert "pipeline.target_ranks=2 makes 2 targets for 1 trainer rank(s)" in res.stderr, res.stderr[-3000:]
    assert "exitcode  : 2" in res.stderr and "src/dflash_train/" not in res.stderr, res.stderr[-3000:]
    assert not (tmp_path / "split" / "config.yaml").exists()
