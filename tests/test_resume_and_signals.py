"""Issue 14, what parts A and B left open, driven as a user would: the installed
`dflash-train` in real subprocesses, real signals, real files.

* `--resume RUN/checkpoints/step-N` of an older checkpoint records the choice on
  disk before training: the newer checkpoints are moved aside at once (named in
  the log), so SIGKILL before the first save and `--resume auto` continue the
  chosen timeline, not the abandoned newer one.
* When the checkpoint `best` points at is moved aside, `best` is re-pointed at the
  remaining checkpoint with the highest recorded tau (never left dangling).
* A second SIGINT that arrives while the main thread is inside one long C call of
  the tokenizer (both signals during that one call) aborts the start-up (exit 130);
  it used to be merged with the first and lost. The slow tokenizer is test-only:
  tests/slow_tokenizer/sitecustomize.py on PYTHONPATH.
Each test also checks that nothing on disk was lost (hashes of the trees).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from test_no_data_loss import CLI, cli, tree
from trainrun import REPO, assert_same_training_state, env, tiny_overrides, wait_for

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def base(tiny_target_factory, tmp_path_factory):
    """A finished 8-step run: checkpoints 2, 4, 6, 8 (all kept), an eval (tau) at each, `best` set."""
    from conftest import write_tiny_jsonl

    root = tmp_path_factory.mktemp("timeline")
    jsonl = write_tiny_jsonl(root / "conv.jsonl", n=40)
    over = tiny_overrides(tiny_target_factory("qwen3"), jsonl, **{
        "train.max_steps": 8, "checkpoint.every_steps": 2, "checkpoint.keep_last": 6,
        "eval.every_steps": 2, "eval.num_prompts": 2, "eval.max_new_tokens": 6, "data.heldout_fraction": 0.2})
    run = root / "base"
    res = cli("train", "--run-dir", run, *over)
    assert res.returncode == 0, res.stderr
    assert _ckpt_steps(run / "checkpoints") == [2, 4, 6, 8]
    assert sorted(_taus(run)) == [2, 4, 6, 8]
    return root, run, over


def _copy(base_run: Path, to: Path) -> Path:
    shutil.copytree(base_run, to, symlinks=True)
    return to


def _ckpt_steps(d: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in d.glob("step-*"))


def _metrics(run: Path) -> list[dict]:
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]


def _steps(run: Path) -> list[int]:
    try:
        return [r["step"] for r in _metrics(run) if not r.get("eval")]
    except (json.JSONDecodeError, FileNotFoundError):  # a line being written / the file being replaced
        return []


def _taus(run: Path) -> dict[int, float]:
    return {r["step"]: r["tau"] for r in _metrics(run) if r.get("eval")}


def _best_of(taus: dict[int, float], steps) -> int:
    """What training marks best: the highest tau, the earliest of equal ones."""
    return max(sorted(steps), key=lambda s: (taus[s], -s))


def _link(ckpt: Path, name: str) -> str | None:
    p = ckpt / name
    return os.readlink(p) if p.is_symlink() else None


def _start(args, log: Path, extra_env: dict | None = None) -> subprocess.Popen:
    e = env()
    e.update(extra_env or {})
    f = open(log, "w")
    return subprocess.Popen(["/bin/sh", "-c", 'umask 022 && exec "$@"', "sh", *CLI, *map(str, args)],
                            stdout=f, stderr=subprocess.STDOUT, env=e, cwd=REPO)


# --------------------------------------------------------------------------- resume from an older checkpoint


def test_resume_older_checkpoint_is_recorded_before_training(base, tmp_path):
    _, base_run, over = base
    run = _copy(base_run, tmp_path / "run")
    ck = run / "checkpoints"
    old_ck = tree(ck)
    old_metrics = (run / "metrics.jsonl").read_text()
    taus = _taus(run)
    # resume the older step 4 (slowly: each step sleeps, so the first save at step 6 is far away) ...
    log = tmp_path / "resume4.log"
    p = _start(["train", "--run-dir", run, "--resume", ck / "step-00000004"], log,
               extra_env={"DFLASH_TEST_STEP_DELAY": "4"})
    try:
        # ... and SIGKILL it once it trains (step 5 logged), before its first checkpoint
        # (metrics.jsonl is cut back to step 4 at the resume, then step 5 is appended)
        wait_for(lambda: p.poll() is not None or max(_steps(run), default=0) == 5, 240, what="step 5")
        assert p.poll() is None, log.read_text()
        p.kill()
        p.wait(60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    out = log.read_text()
    assert _ckpt_steps(ck) == [2, 4], out  # no save happened; 6 and 8 are no longer candidates
    aside = [d for d in run.iterdir() if d.name.startswith("checkpoints.set-aside-")]
    assert len(aside) == 1, sorted(d.name for d in run.iterdir())
    # the place is named in the log (stderr and train.log) before training started
    line = next(l for l in out.splitlines() if str(aside[0]) in l)
    assert "step-00000006, step-00000008" in line and "--resume auto continues from step 4" in line
    assert "nothing deleted" in line
    assert str(aside[0]) in (run / "logs" / "train.log").read_text()
    # nothing lost: the abandoned timeline and the metrics as they were, byte for byte
    kept = tree(aside[0])
    assert (aside[0] / "metrics.jsonl").read_text() == old_metrics
    kept.pop("metrics.jsonl")
    assert kept == {k: v for k, v in old_ck.items() if k.startswith(("step-00000006/", "step-00000008/"))}
    assert {k: v for k, v in tree(ck).items() if k.startswith("step-")} == \
        {k: v for k, v in old_ck.items() if k.startswith(("step-00000002/", "step-00000004/"))}
    assert _link(ck, "latest") == "step-00000004"
    # best never dangles: it is the best of the remaining checkpoints by recorded tau
    assert _link(ck, "best") == f"step-{_best_of(taus, [2, 4]):08d}"
    assert (ck / "best").resolve().is_dir()

    kept_all = tree(aside[0])
    # the user's next plain resume continues the chosen timeline from step 4
    res = cli("train", "--run-dir", run, "--resume", "auto")
    assert res.returncode == 0, res.stderr
    assert f"resumed from {ck / 'step-00000004'} at step 4" in res.stderr
    assert _steps(run) == list(range(1, 9))  # each step once: the killed run's step 5 was dropped
    assert _ckpt_steps(ck) == [2, 4, 6, 8]
    assert tree(aside[0]) == kept_all
    # the continued timeline is the abandoned one recomputed: losses, and the final weights and
    # optimizer state bit for bit
    old_losses = {json.loads(l)["step"]: json.loads(l)["loss"] for l in old_metrics.splitlines()
                  if not json.loads(l).get("eval")}
    assert {r["step"]: r["loss"] for r in _metrics(run) if not r.get("eval")} == old_losses
    assert_same_training_state(ck / "step-00000008", aside[0] / "step-00000008")


def test_best_is_repointed_when_its_checkpoint_is_moved_aside(base, tmp_path):
    _, base_run, over = base
    run = _copy(base_run, tmp_path / "run")
    ck = run / "checkpoints"
    taus = _taus(run)
    best = int(_link(ck, "best").split("-")[1])
    # the best checkpoint gets damaged on disk (a truncated file)
    f = ck / f"step-{best:08d}" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    broken = tree(ck / f"step-{best:08d}")
    # resume and train on (no eval now, so no later eval re-marks best)
    res = cli("train", "--run-dir", run, "train.max_steps=10", "eval.every_steps=0")
    assert res.returncode == 0, res.stderr
    aside = [d for d in run.iterdir() if d.name.startswith("checkpoints.set-aside-")]
    assert len(aside) == 1 and (aside[0] / f"step-{best:08d}").is_dir(), res.stderr
    assert tree(aside[0] / f"step-{best:08d}") == broken  # kept as it was, not deleted
    remaining = [s for s in (2, 4, 6, 8) if s != best]
    want = _best_of(taus, remaining)
    assert _link(ck, "best") == f"step-{want:08d}" and (ck / "best").resolve().is_dir()
    line = [l for l in res.stderr.splitlines() if "best pointed at" in l]
    assert len(line) == 1, res.stderr
    assert f"step-{best:08d}, which was moved aside; best -> step-{want:08d}" in line[0]
    assert f"recorded tau {taus[want]:.3f}" in line[0]
    # (a damaged step 8 is skipped by the resume, which starts at 6 and saves 8 again)
    assert _ckpt_steps(ck) == sorted(set(remaining) | {10} | ({8} if best == 8 else set()))


# --------------------------------------------------------------------------- a second SIGINT in one long C call


def test_second_sigint_during_one_long_tokenizer_call_aborts(base, tmp_path):
    _, base_run, over = base
    run = _copy(base_run, tmp_path / "run")
    before = {k: v for k, v in tree(run).items() if k.startswith(("checkpoints/", "metrics.jsonl"))}
    marker = tmp_path / "tokenize"
    log = tmp_path / "train.out"
    # a fresh data cache, so that start-up tokenises (the cache dir may change on resume)
    p = _start(["train", "--run-dir", run, f"data.cache_dir={tmp_path / 'cache2'}"], log, {
        "PYTHONPATH": str(HERE / "slow_tokenizer"), "DFLASH_TEST_SLOW_TOKENIZE": str(marker),
        "DFLASH_TEST_SLOW_TOKENIZE_SECONDS": "8"})
    try:
        start = Path(str(marker) + ".start")
        wait_for(lambda: start.exists() or p.poll() is not None, 180, what="the long tokenizer call")
        assert p.poll() is None, log.read_text()
        p.send_signal(signal.SIGINT)
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        t_second = time.time()
        rc = p.wait(120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    out = log.read_text()
    end = float(Path(str(marker) + ".end").read_text())
    assert end > t_second + 1, "both signals must arrive during the one long call"
    assert rc == 130, out
    assert out.count("SIGINT again: abandoning") == 1 and "Traceback" not in out
    assert "loaded Target" not in out and "Loading weights" not in out  # start-up ended there: no target load
    assert "second signal" in (run / "logs" / "train.log").read_text()
    # nothing lost, and the run dir is free again
    assert {k: v for k, v in tree(run).items() if k.startswith(("checkpoints/", "metrics.jsonl"))} == before
    assert json.loads((run / "run.json").read_text())["live"] is False
