"""torchrun on gloo: 1 target rank + 2 trainer ranks (DDP) train a tiny drafter."""
from __future__ import annotations

import math
import subprocess
import sys

from trainrun import REPO, env, losses, tiny_overrides


def _torchrun(run_dir, overrides, timeout=600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           "-m", "dflash_train.cli", "train", "--run-dir", str(run_dir), *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(), cwd=REPO)


def test_one_target_two_trainers_gloo(tiny_target_factory, tmp_path):
    from conftest import write_tiny_jsonl

    jsonl = write_tiny_jsonl(tmp_path / "conv.jsonl", n=40)
    target = tiny_target_factory("qwen3")
    over = tiny_overrides(target, jsonl, **{"train.max_steps": 12, "pipeline.target_ranks": 1,
                                            "train.lr": 1e-2, "checkpoint.every_steps": 6})
    rd = tmp_path / "ddp"
    res = _torchrun(rd, over)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    ls = losses(rd)
    assert sorted(ls) == list(range(1, 13))
    assert all(math.isfinite(v) for v in ls.values())
    first, last = sum(ls[s] for s in (1, 2, 3)) / 3, sum(ls[s] for s in (10, 11, 12)) / 3
    assert last < first, ls
    assert (rd / "checkpoints" / "latest").resolve().name == "step-00000012"
    log = (rd / "logs" / "train.rank0.log").read_text()
    assert "serving trainer ranks [1, 2]" in log and "all trainers done" in log


def test_torchrun_sigterm_resume_is_bit_exact(tiny_target_factory, tmp_path):
    """World size 3 (1 target + 2 trainers): SIGTERM to the leading trainer,
    resume with the same world size -> the same losses as an uninterrupted run."""
    import json
    import os
    import signal

    from conftest import write_tiny_jsonl

    from trainrun import wait_for

    jsonl = write_tiny_jsonl(tmp_path / "conv.jsonl", n=40)
    target = tiny_target_factory("qwen3")
    over = tiny_overrides(target, jsonl, **{"train.max_steps": 10, "pipeline.target_ranks": 1,
                                            "checkpoint.every_steps": 100})
    ref = tmp_path / "ref"
    assert _torchrun(ref, over).returncode == 0
    rd = tmp_path / "stopped"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           "-m", "dflash_train.cli", "train", "--run-dir", str(rd), *over]
    log = open(tmp_path / "stopped.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env(step_delay=0.5), cwd=REPO)
    wait_for(lambda: len(losses(rd)) >= 4, 300, what="step 4")
    pid = json.loads((rd / "run.json").read_text())["pid"]
    os.kill(pid, signal.SIGTERM)  # what `dflash-train stop` does: the leading trainer's verified pid
    assert proc.wait(300) == 0, (tmp_path / "stopped.log").read_text()[-4000:]
    stopped = max(losses(rd))
    assert stopped < 10
    assert (rd / "checkpoints" / "latest").resolve().name == f"step-{stopped:08d}"
    res = _torchrun(rd, over)
    assert res.returncode == 0, res.stderr[-4000:]
    assert losses(rd) == losses(ref)


def test_fsdp2_trainers_train_and_resume_exactly(tiny_target_factory, tmp_path):
    """train.sharding=fsdp2: 2 sharded trainer ranks learn; stopped with SIGTERM
    and resumed, the run logs the same losses as an uninterrupted one."""
    import json
    import os
    import signal

    from conftest import write_tiny_jsonl

    from trainrun import wait_for

    jsonl = write_tiny_jsonl(tmp_path / "conv.jsonl", n=40)
    target = tiny_target_factory("qwen3")
    over = tiny_overrides(target, jsonl, **{"train.max_steps": 10, "pipeline.target_ranks": 1,
                                            "train.sharding": "fsdp2", "train.lr": 1e-2,
                                            "checkpoint.every_steps": 100})
    ref = tmp_path / "ref"
    res = _torchrun(ref, over)
    assert res.returncode == 0, res.stderr[-4000:]
    ls = losses(ref)
    assert sorted(ls) == list(range(1, 11)) and all(math.isfinite(v) for v in ls.values())
    assert sum(ls[s] for s in (8, 9, 10)) < sum(ls[s] for s in (1, 2, 3))
    rd = tmp_path / "stopped"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           "-m", "dflash_train.cli", "train", "--run-dir", str(rd), *over]
    log = open(tmp_path / "stopped.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env(step_delay=0.5), cwd=REPO)
    wait_for(lambda: len(losses(rd)) >= 3, 300, what="step 3")
    os.kill(json.loads((rd / "run.json").read_text())["pid"], signal.SIGTERM)
    assert proc.wait(300) == 0, (tmp_path / "stopped.log").read_text()[-4000:]
    assert max(losses(rd)) < 10
    res = _torchrun(rd, over)
    assert res.returncode == 0, res.stderr[-4000:]
    assert losses(rd) == ls
