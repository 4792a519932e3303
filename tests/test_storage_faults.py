"""Storage faults lose nothing and read as one line (issue 37, item 4).

Driven as a user would: the CLI in real subprocesses, on real file systems that really fail.
As root the tests mount small tmpfs file systems and fill them (a real ENOSPC), bind-mount a
directory read-only (a real EROFS), or remove the run dir; the fault lands at a known step
through DFLASH_TEST_BEFORE_CHECKPOINT (tests/hooks: a shell command run just before that
checkpoint is written). Without the right to mount, those cases are skipped with the reason;
/dev/full (every write fails with ENOSPC) and a removed run dir need no privilege.

Each case checks: exit 2, exactly one `error:` line naming the cause and the path, no
traceback; what was saved before is intact and is what the next run picks; and, once the
cause is gone, the same command goes on to the end.
"""
from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from trainrun import CLI, REPO, env, losses, metrics, tiny_overrides, train_cmd

FILLER = "filler"
# fill the file system holding argv[1] but for argv[2] bytes (a file of preallocated blocks)
_FILL = ("import os, sys; d = sys.argv[1]; st = os.statvfs(d); "
         "fd = os.open(os.path.join(d, 'filler'), os.O_WRONLY | os.O_CREAT); "
         "os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize - int(sys.argv[2])); os.close(fd)")


def fill_command(directory: Path, leave: int) -> str:
    return f"{shlex.quote(sys.executable)} -c {shlex.quote(_FILL)} {shlex.quote(str(directory))} {leave}"


def fill(directory: Path, leave: int) -> None:
    subprocess.run(fill_command(directory, leave), shell=True, check=True)


def _mount_refusal() -> str | None:
    """Why this process may not mount a tmpfs (None: it may), tried once for real."""
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", d], capture_output=True, text=True)
        if r.returncode != 0:
            return f"cannot mount a tmpfs here ({(r.stderr or r.stdout).strip() or r.returncode}): needs root"
        subprocess.run(["umount", d], check=True)
    return None


try:
    MOUNT_REFUSAL = _mount_refusal()
except OSError as e:  # no mount binary at all
    MOUNT_REFUSAL = f"cannot run mount: {e}"
needs_mount = pytest.mark.skipif(MOUNT_REFUSAL is not None, reason=MOUNT_REFUSAL or "")


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size, at=None) -> a fresh tmpfs of `size` (e.g. "8m") at `at` (default: a new dir);
    all unmounted after the test, innermost first."""
    mounted: list[Path] = []

    def mount(size: str, at: Path | None = None) -> Path:
        where = at or Path(tempfile.mkdtemp(dir=tmp_path))
        where.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], check=False)


def run_cli(*args, extra_env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**env(), **(extra_env or {})}, cwd=REPO)


def train(run: Path, over: list[str], before_checkpoint: tuple[int, str] | None = None,
          step_delay: float | None = None) -> subprocess.CompletedProcess:
    e = env(step_delay)
    if before_checkpoint is not None:
        e["DFLASH_TEST_BEFORE_CHECKPOINT"] = f"{before_checkpoint[0]}:{before_checkpoint[1]}"
    return subprocess.run(train_cmd(run, over), capture_output=True, text=True, timeout=300, env=e, cwd=REPO)


def one_line_error(res: subprocess.CompletedProcess, *needles: str) -> str:
    """The run failed with exit 2 and exactly one `error:` line, the last one, holding `needles`."""
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr + res.stdout, res.stderr
    errors = [l for l in lines if l.startswith("error:")]
    assert errors == lines[-1:], res.stderr
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


def checkpoint_state(ck: Path) -> tuple[list[str], str | None]:
    """(entries of the checkpoints dir, the step dir `latest` points at)."""
    from dflash_train.rundir import read_link

    latest = read_link(ck, "latest")
    return sorted(p.name for p in ck.iterdir()), latest.name if latest else None


def steps(run: Path) -> list[int]:
    return [r["step"] for r in metrics(run) if not r.get("eval")]


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- train


@needs_mount
def test_disk_full_during_a_checkpoint_keeps_the_last_one_and_the_same_command_resumes(train_setup, tmpfs):
    """The disk fills just before checkpoint 8 (32 KiB left: metrics and logs still fit, the
    checkpoint does not): one line naming model.safetensors, step 4 intact and `latest`; with
    the space back, the same command resumes at step 4 and reproduces steps 5-8 exactly."""
    from dflash_train.rundir import verify_checkpoint

    target, jsonl, _ = train_setup
    mnt = tmpfs("16m")
    run, over = mnt / "run", tiny_overrides(target, jsonl)
    ck = run / "checkpoints"
    res = train(run, over, before_checkpoint=(8, fill_command(mnt, 32 * 1024)))
    line = one_line_error(res, "no space left on device while writing", f"{ck}/step-00000008/model.safetensors")
    assert "step-00000004 is intact" in line
    # the half-written checkpoint is gone (never verifies, never `latest`); the previous one verifies
    assert checkpoint_state(ck) == (["latest", "step-00000004"], "step-00000004")
    assert verify_checkpoint(ck / "step-00000004") == []
    uninterrupted = losses(run)
    assert sorted(uninterrupted) == list(range(1, 9))

    (mnt / FILLER).unlink()
    res = train(run, over)
    assert res.returncode == 0, res.stderr
    assert f"resumed from {ck / 'step-00000004'} at step 4" in res.stderr
    assert verify_checkpoint(ck / "step-00000008") == []
    assert steps(run) == list(range(1, 9))
    assert losses(run) == uninterrupted  # bit-exact: the resume recomputed steps 5-8 as they were


@needs_mount
def test_metrics_that_cannot_be_written_hold_back_the_next_checkpoint(train_setup, tmpfs):
    """The run dir's disk (metrics.jsonl, run.json, train.log) fills at step 4 while its
    checkpoints live on another one: run.json warns once and the run goes on; the held
    metrics lines stop it at checkpoint 8, which is not written ahead of them. With the space
    back the same command resumes at step 4 and metrics.jsonl has every step once."""
    target, jsonl, _ = train_setup
    mnt = tmpfs("4m")
    run, over = mnt / "run", tiny_overrides(target, jsonl)
    ck = tmpfs("16m", at=run / "checkpoints")
    res = train(run, over, before_checkpoint=(4, fill_command(mnt, 0)), step_delay=0.3)
    one_line_error(res, f"no space left on device while writing {run}/metrics.jsonl",
                   "the run stopped at step 8, step-00000004 is intact")
    assert res.stderr.count(f"cannot write {run}/run.json (no space left on device); the run goes on") == 1
    assert "callback failed" not in res.stderr  # the checkpoint's run.json update is the same view
    assert res.stderr.count(f"cannot write {run}/metrics.jsonl (no space left on device)") == 1
    assert checkpoint_state(ck) == (["latest", "step-00000004"], "step-00000004")
    # whole lines only (the page the file had begun still took a line or two), never step 8's
    raw = (run / "metrics.jsonl").read_text()
    assert raw.endswith("\n") and len(raw.splitlines()) == len(steps(run))
    assert steps(run) == list(range(1, len(steps(run)) + 1)) and len(steps(run)) < 8

    (mnt / FILLER).unlink()
    res = train(run, over)
    assert res.returncode == 0, res.stderr
    assert f"resumed from {ck / 'step-00000004'} at step 4" in res.stderr
    assert steps(run) == list(range(1, 9))
    assert checkpoint_state(ck)[1] == "step-00000008"


@needs_mount
def test_read_only_checkpoints_directory_is_one_line_and_keeps_the_last_checkpoint(train_setup, tmp_path):
    """RUN/checkpoints turns read-only (a read-only bind mount: chmod does not stop root) before
    checkpoint 8: one line, step 4 intact and `latest`."""
    from dflash_train.rundir import verify_checkpoint

    target, jsonl, _ = train_setup
    run, over = tmp_path / "run", tiny_overrides(target, jsonl)
    ck = run / "checkpoints"
    q = shlex.quote(str(ck))
    try:
        res = train(run, over, before_checkpoint=(8, f"mount --bind {q} {q} && mount -o remount,bind,ro {q}"))
    finally:
        subprocess.run(["umount", str(ck)], check=False)
    one_line_error(res, "read-only file system while creating", f"{ck}/step-00000008")
    assert checkpoint_state(ck) == (["latest", "step-00000004"], "step-00000004")
    assert verify_checkpoint(ck / "step-00000004") == []


def test_run_dir_removed_mid_run_is_one_line(train_setup, tmp_path):
    """The run dir is deleted under the trainer before checkpoint 8: one line saying so."""
    target, jsonl, _ = train_setup
    run, over = tmp_path / "run", tiny_overrides(target, jsonl)
    res = train(run, over, before_checkpoint=(8, f"rm -rf {shlex.quote(str(run))}"))
    one_line_error(res, "no such file or directory (was the directory removed?) while creating",
                   f"{run}/checkpoints/step-00000008")
    # no checkpoint was written back into it: only run.json (created again by its atomic
    # write, live: false) records that a run ended there
    assert sorted(p.name for p in run.iterdir()) == ["run.json"]
    assert json.loads((run / "run.json").read_text())["live"] is False


# --------------------------------------------------------------------------- data stages and export


def _data_overrides(target: Path, jsonl: Path) -> list[str]:
    return [f"target.path={target}", f"data.source=jsonl:{jsonl}", "data.limit=24", "data.max_tokens=64",
            f"data.cache_dir={jsonl.parent / 'data-cache'}"]


def test_regenerate_into_dev_full_is_one_line(tiny_target_dir, tiny_jsonl):
    """/dev/full fails every write with ENOSPC (no privilege needed)."""
    res = run_cli("regenerate", "--out", "/dev/full", "--max-new-tokens", 4, "--batch-size", 8,
                  *_data_overrides(tiny_target_dir, tiny_jsonl))
    one_line_error(res, "no space left on device while writing /dev/full",
                   "the answers written before are kept and the same command goes on from there")


def _answers(out: Path) -> dict[str, str]:
    """id -> its complete JSON line (a torn last line is not an answer)."""
    raw = out.read_bytes()
    whole = raw[:raw.rfind(b"\n") + 1]
    return {json.loads(l)["id"]: l for l in whole.decode().splitlines()}


@needs_mount
def test_regenerate_on_a_full_disk_keeps_whole_answers_and_goes_on(tiny_target_dir, tiny_jsonl, tmpfs):
    """4 KiB left: the first batches are written, one fails part way. With the space back the
    same command keeps every whole answer and writes the rest, each conversation once."""
    mnt = tmpfs("1m")
    fill(mnt, 4096)
    out = mnt / "answers.jsonl"
    cmd = ("regenerate", "--out", out, "--max-new-tokens", 16, "--batch-size", 4,
           *_data_overrides(tiny_target_dir, tiny_jsonl))
    one_line_error(run_cli(*cmd), f"no space left on device while writing {out}")
    kept = _answers(out)
    assert 0 < len(kept) < 24

    (mnt / FILLER).unlink()
    res = run_cli(*cmd)
    assert res.returncode == 0, res.stderr
    lines = out.read_text().splitlines()
    ids = [json.loads(l)["id"] for l in lines]
    assert len(ids) == len(set(ids)) == 24
    assert all(_answers(out)[i] == line for i, line in kept.items())  # the answers before, untouched


@needs_mount
def test_precompute_on_a_full_disk_is_one_line_and_the_same_command_goes_on(tiny_target_dir, tiny_jsonl, tmpfs):
    from dflash_train.pipeline.precomputed import PrecomputedFeatures

    mnt = tmpfs("1m")
    fill(mnt, 200 * 1024)
    out = mnt / "features"
    cmd = ("precompute", "--out", out, "--dtype", "float32", "--rows-per-shard", 8,
           *_data_overrides(tiny_target_dir, tiny_jsonl))
    one_line_error(run_cli(*cmd), "no space left on device while writing", f"{out}/shard-")
    assert not (out / "index.json").exists()  # so nothing reads the half as features

    (mnt / FILLER).unlink()
    res = run_cli(*cmd)
    assert res.returncode == 0, res.stderr
    pre = PrecomputedFeatures(out)  # every shard's checksum verified
    assert pre.input_ids.shape[0] == json.loads((out / "index.json").read_text())["num_rows"] > 8


@pytest.fixture
def run_with_checkpoint(tmp_path) -> Path:
    """A run dir with one real checkpoint (written by CheckpointManager, no training)."""
    from dflash_train.checkpoint.manager import CheckpointManager
    from dflash_train.config import RunConfig, save_config
    from dflash_train.model import DFlashDrafter, DrafterConfig

    run = tmp_path / "run"
    run.mkdir()
    save_config(RunConfig(), run / "config.yaml")
    cfg = DrafterConfig(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                        layer_types=["full_attention"], sliding_window=None, block_size=4, mask_token_id=4,
                        target_layer_ids=[1], num_target_layers=4, vocab_size=300)
    mgr = CheckpointManager(run / "checkpoints", keep_last=2, async_save=False, log=lambda m: None)
    mgr.save(2, DFlashDrafter(cfg, seed=0).state_dict(), {"optimizer": {}},
             {"step": 2, "drafter_config": cfg.to_dict(), "target_path": "/models/t"})
    mgr.close()
    return run


@needs_mount
def test_export_on_a_full_disk_changes_nothing_at_out_and_the_same_command_goes_on(run_with_checkpoint, tmpfs):
    """--force over a previous export on a disk with 8 KiB left: one line naming
    model.safetensors; the previous export byte for byte as it was, no temp dir left."""
    mnt = tmpfs("2m")
    out = mnt / "export"
    assert run_cli("export", run_with_checkpoint, "--out", out).returncode == 0
    before = tree(out)
    fill(mnt, 8192)
    cmd = ("export", run_with_checkpoint, "--out", out, "--force")
    line = one_line_error(run_cli(*cmd), f"no space left on device while writing {out}/model.safetensors")
    assert f"nothing at {out} was changed" in line
    assert tree(out) == before
    assert sorted(p.name for p in mnt.iterdir()) == ["export", FILLER]

    (mnt / FILLER).unlink()
    res = run_cli(*cmd)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in mnt.iterdir()) == ["export"]


# --------------------------------------------------------------------------- where the libraries hide the OSError


def test_torch_save_into_a_full_file_raises_the_storage_error(tmp_path):
    """torch.save's zip writer turns the ENOSPC of the file's write() into `RuntimeError: [enforce
    fail at inline_container.cc] unexpected pos`; on /dev/full (every write fails with ENOSPC, no
    privilege needed) it comes out as the one-line StorageError naming the path. (safetensors'
    hidden ENOSPC is met for real by the checkpoint and export tests above: its Rust writer
    saves through a temp file and a rename, so it must never be pointed at /dev/full.)"""
    import torch

    from dflash_train.storage import StorageError, writing

    f = open("/dev/full", "wb")
    try:
        with pytest.raises(StorageError, match=r"^no space left on device while writing /dev/full$"):
            with writing("/dev/full"):  # torch.save itself raises here, not the file's close
                torch.save({"w": torch.zeros(4096)}, f)
    finally:
        try:
            f.close()
        except OSError:  # the buffered bytes cannot be flushed either
            pass
    with pytest.raises(ZeroDivisionError):  # anything else passes unchanged
        with writing(tmp_path / "x"):
            1 / 0


def test_a_log_file_that_cannot_be_written_warns_once_and_logging_goes_on(capsys):
    """train.log on a full disk (/dev/full): one warning on stderr, not logging's traceback per
    record; the records still reach the other handlers (stderr)."""
    import logging

    from dflash_train.train.metrics import _LogFile

    logger = logging.getLogger("dflash_train.test_storage_faults")
    handler, seen = _LogFile("/dev/full"), []
    logger.addHandler(handler)
    logger.addHandler(type("Seen", (logging.Handler,), {"emit": lambda self, r: seen.append(r.getMessage())})())
    try:
        for i in range(3):
            logger.warning("line %d", i)
    finally:
        for h in list(logger.handlers):
            logger.removeHandler(h)
        try:
            handler.close()
        except OSError:
            pass
    err = capsys.readouterr().err
    assert err.count("warning: cannot write /dev/full (no space left on device)") == 1, err
    assert "Traceback" not in err and "Logging error" not in err
    assert seen == ["line 0", "line 1", "line 2"]
