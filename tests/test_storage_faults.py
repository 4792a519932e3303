"""Storage faults lose nothing and read as one line (issue 37, item 4).

Driven as a user would: the CLI in real subprocesses, on real file systems that really fail.
As root the tests mount small tmpfs file systems and fill them (a real ENOSPC), bind-mount a
directory read-only (a real EROFS), or remove the run dir; the fault lands at a known step
through DFLASH_TEST_BEFORE_CHECKPOINT (tests/hooks: a shell command run just before that
checkpoint is written). Without the right to mount (a CI container, an unprivileged user) the
same cases run on a "disk" the test hooks make refuse writes instead: DFLASH_TEST_WRITE_FAULT
fails every write under a directory with ENOSPC (once a number of bytes are written) or EROFS,
from the moment a flag file appears (the same known step); removing the flag frees the space.
DFLASH_TEST_NO_MOUNT=1 picks that way where mounting works too. /dev/full (every write fails
with ENOSPC) and a removed run dir need neither.

Each case checks: exit 2, exactly one `error:` line naming the cause and the path, no
traceback; what was saved before is intact and is what the next run picks; and, once the
cause is gone, the same command goes on to the end.
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from trainrun import CLI, REPO, env, losses, metrics, tiny_overrides, train_cmd, write_run_with_checkpoint

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


if os.environ.get("DFLASH_TEST_NO_MOUNT"):
    MOUNT_REFUSAL = "DFLASH_TEST_NO_MOUNT is set"
else:
    try:
        MOUNT_REFUSAL = _mount_refusal()
    except OSError as e:  # no mount binary at all
        MOUNT_REFUSAL = f"cannot run mount: {e}"
# where mounting is refused, the faults are injected at the write (tests/hooks) instead of skipped
INJECTED = MOUNT_REFUSAL is not None


class Disk:
    """A small file system that can be filled and freed: a real tmpfs (`filler` is a file of
    preallocated blocks), or, where mounting is refused, a plain directory whose writes the test
    hooks refuse with ENOSPC while a flag file exists (DFLASH_TEST_WRITE_FAULT, tests/hooks)."""

    def __init__(self, path: Path, flag: Path | None, inner: list) -> None:
        self.path, self.flag, self._inner = path, flag, inner  # inner: the disks mounted inside
        self.leave: int | None = None

    @property
    def leftovers(self) -> list[str]:
        """What filling left in the directory itself."""
        return [FILLER] if self.flag is None and (self.path / FILLER).exists() else []

    def fill_command(self, leave: int) -> str:
        """A shell command that leaves `leave` bytes free (run by the trainer at a known step)."""
        if self.flag is None:
            return fill_command(self.path, leave)
        self.leave = leave
        return f"touch {shlex.quote(str(self.flag))}"

    def fill(self, leave: int) -> None:
        subprocess.run(self.fill_command(leave), shell=True, check=True)

    def free(self) -> None:
        (self.path / FILLER if self.flag is None else self.flag).unlink()

    def env(self) -> dict:
        """What a subprocess writing here needs in its environment."""
        if self.flag is None or self.leave is None:
            return {}
        globs = [f"{self.path}/*"] + [f"!{d.path}{tail}" for d in self._inner if d is not self
                                      and d.path.is_relative_to(self.path) for tail in ("", "/*")]
        return {"DFLASH_TEST_WRITE_FAULT": f"ENOSPC:{self.leave}:" + "|".join(globs),
                "DFLASH_TEST_WRITE_FAULT_WHILE": str(self.flag)}


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size, at=None) -> a fresh Disk of `size` (e.g. "8m") at `at` (default: a new dir):
    a tmpfs, all unmounted after the test, innermost first; where mounting is refused, a
    directory whose writes the test hooks refuse once it is "filled" (Disk)."""
    mounted: list[Path] = []
    disks: list[Disk] = []

    def mount(size: str, at: Path | None = None) -> Disk:
        where = at or Path(tempfile.mkdtemp(dir=tmp_path))
        where.mkdir(parents=True, exist_ok=True)
        if INJECTED:
            disks.append(Disk(where, tmp_path / f"disk-{len(disks)}-full", disks))
            return disks[-1]
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
        mounted.append(where)
        disks.append(Disk(where, None, disks))
        return disks[-1]

    yield mount
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], check=False)


def run_cli(*args, extra_env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**env(), **(extra_env or {})}, cwd=REPO)


def train(run: Path, over: list[str], before_checkpoint: tuple[int, str] | None = None,
          step_delay: float | None = None, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    e = {**env(step_delay), **(extra_env or {})}
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


def test_disk_full_during_a_checkpoint_keeps_the_last_one_and_the_same_command_resumes(train_setup, tmpfs):
    """The disk fills just before checkpoint 8 (32 KiB left: metrics and logs still fit, the
    checkpoint does not): one line naming model.safetensors, step 4 intact and `latest`; with
    the space back, the same command resumes at step 4 and reproduces steps 5-8 exactly."""
    from dflash_train.rundir import verify_checkpoint

    target, jsonl, _ = train_setup
    disk = tmpfs("16m")
    mnt = disk.path
    run, over = mnt / "run", tiny_overrides(target, jsonl)
    ck = run / "checkpoints"
    fill = disk.fill_command(32 * 1024)
    res = train(run, over, before_checkpoint=(8, fill), extra_env=disk.env())
    line = one_line_error(res, "no space left on device while writing", f"{ck}/step-00000008/model.safetensors")
    assert "step-00000004 is intact" in line
    # the half-written checkpoint is gone (never verifies, never `latest`); the previous one verifies
    assert checkpoint_state(ck) == (["latest", "step-00000004"], "step-00000004")
    assert verify_checkpoint(ck / "step-00000004") == []
    uninterrupted = losses(run)
    assert sorted(uninterrupted) == list(range(1, 9))

    disk.free()
    res = train(run, over, extra_env=disk.env())
    assert res.returncode == 0, res.stderr
    assert f"resumed from {ck / 'step-00000004'} at step 4" in res.stderr
    assert verify_checkpoint(ck / "step-00000008") == []
    assert steps(run) == list(range(1, 9))
    assert losses(run) == uninterrupted  # bit-exact: the resume recomputed steps 5-8 as they were


def test_metrics_that_cannot_be_written_hold_back_the_next_checkpoint(train_setup, tmpfs):
    """The run dir's disk (metrics.jsonl, run.json, train.log) fills at step 4 while its
    checkpoints live on another one: run.json warns once and the run goes on; the held
    metrics lines stop it at checkpoint 8, which is not written ahead of them. With the space
    back the same command resumes at step 4 and metrics.jsonl has every step once."""
    target, jsonl, _ = train_setup
    disk = tmpfs("4m")
    mnt = disk.path
    run, over = mnt / "run", tiny_overrides(target, jsonl)
    ck = tmpfs("16m", at=run / "checkpoints").path
    fill = disk.fill_command(0)
    res = train(run, over, before_checkpoint=(4, fill), step_delay=0.3, extra_env=disk.env())
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

    disk.free()
    res = train(run, over, extra_env=disk.env())
    assert res.returncode == 0, res.stderr
    assert f"resumed from {ck / 'step-00000004'} at step 4" in res.stderr
    assert steps(run) == list(range(1, 9))
    assert checkpoint_state(ck)[1] == "step-00000008"


def test_read_only_checkpoints_directory_is_one_line_and_keeps_the_last_checkpoint(train_setup, tmp_path):
    """RUN/checkpoints turns read-only (a read-only bind mount: chmod does not stop root; where
    mounting is refused, the test hooks refuse every creation under it with EROFS) before
    checkpoint 8: one line, step 4 intact and `latest`."""
    from dflash_train.rundir import verify_checkpoint

    target, jsonl, _ = train_setup
    run, over = tmp_path / "run", tiny_overrides(target, jsonl)
    ck = run / "checkpoints"
    q = shlex.quote(str(ck))
    if INJECTED:
        flag = tmp_path / "read-only"
        res = train(run, over, before_checkpoint=(8, f"touch {shlex.quote(str(flag))}"),
                    extra_env={"DFLASH_TEST_WRITE_FAULT": f"EROFS:0:{ck}/*", "DFLASH_TEST_WRITE_FAULT_WHILE": str(flag)})
    else:
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


def test_regenerate_on_a_full_disk_keeps_whole_answers_and_goes_on(tiny_target_dir, tiny_jsonl, tmpfs):
    """4 KiB left: the first batches are written, one fails part way. With the space back the
    same command keeps every whole answer and writes the rest, each conversation once."""
    disk = tmpfs("1m")
    disk.fill(4096)
    out = disk.path / "answers.jsonl"
    cmd = ("regenerate", "--out", out, "--max-new-tokens", 16, "--batch-size", 4,
           *_data_overrides(tiny_target_dir, tiny_jsonl))
    one_line_error(run_cli(*cmd, extra_env=disk.env()), f"no space left on device while writing {out}")
    kept = _answers(out)
    assert 0 < len(kept) < 24

    disk.free()
    res = run_cli(*cmd, extra_env=disk.env())
    assert res.returncode == 0, res.stderr
    lines = out.read_text().splitlines()
    ids = [json.loads(l)["id"] for l in lines]
    assert len(ids) == len(set(ids)) == 24
    assert all(_answers(out)[i] == line for i, line in kept.items())  # the answers before, untouched


def test_precompute_on_a_full_disk_is_one_line_and_the_same_command_goes_on(tiny_target_dir, tiny_jsonl, tmpfs):
    from dflash_train.pipeline.precomputed import PrecomputedFeatures

    disk = tmpfs("1m")
    disk.fill(200 * 1024)
    out = disk.path / "features"
    cmd = ("precompute", "--out", out, "--dtype", "float32", "--rows-per-shard", 8,
           *_data_overrides(tiny_target_dir, tiny_jsonl))
    one_line_error(run_cli(*cmd, extra_env=disk.env()), "no space left on device while writing", f"{out}/shard-")
    assert not (out / "index.json").exists()  # so nothing reads the half as features

    disk.free()
    res = run_cli(*cmd, extra_env=disk.env())
    assert res.returncode == 0, res.stderr
    pre = PrecomputedFeatures(out)  # every shard's checksum verified
    assert pre.input_ids.shape[0] == json.loads((out / "index.json").read_text())["num_rows"] > 8


@pytest.fixture
def run_with_checkpoint(tmp_path) -> Path:
    """A run dir with one real checkpoint (written by CheckpointManager, no training)."""
    return write_run_with_checkpoint(tmp_path / "run")


def test_export_on_a_full_disk_changes_nothing_at_out_and_the_same_command_goes_on(run_with_checkpoint, tmpfs):
    """--force over a previous export on a disk with 8 KiB left: one line naming
    model.safetensors; the previous export byte for byte as it was, no temp dir left."""
    disk = tmpfs("2m")
    mnt = disk.path
    out = mnt / "export"
    assert run_cli("export", run_with_checkpoint, "--out", out).returncode == 0
    before = tree(out)
    disk.fill(8192)
    cmd = ("export", run_with_checkpoint, "--out", out, "--force")
    line = one_line_error(run_cli(*cmd, extra_env=disk.env()),
                          f"no space left on device while writing {out}/model.safetensors")
    assert f"nothing at {out} was changed" in line
    assert tree(out) == before
    assert sorted(p.name for p in mnt.iterdir()) == sorted(["export", *disk.leftovers])

    disk.free()
    res = run_cli(*cmd, extra_env=disk.env())
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


# --------------------------------------------------------------------------- prepare-data, the data cache, TensorBoard
# (no mount needed: the faults are injected at the write by the test hooks, everywhere)


def _full(directory: Path, leave: int = 0, errno_name: str = "ENOSPC") -> dict:
    """The environment of a subprocess for which `directory` is a full disk (`leave` bytes free)."""
    return {"DFLASH_TEST_WRITE_FAULT": f"{errno_name}:{leave}:{directory}/*"}


def test_prepare_data_onto_a_full_disk_keeps_the_previous_output_and_the_same_command_goes_on(
        tiny_target_dir, tiny_jsonl, tmp_path):
    """prepare-data --out over a previous output on a disk that fills after 1 KiB: one line naming
    --out, the previous output byte for byte as it was, no temp dir left; with the space back the
    same command writes what a run on a healthy disk writes."""
    disk = tmp_path / "disk"
    out = disk / "prepared"
    over = _data_overrides(tiny_target_dir, tiny_jsonl)
    res = run_cli("prepare-data", "--out", out, *over, "data.limit=12")
    assert res.returncode == 0, res.stderr
    previous = tree(out)
    cmd = ("prepare-data", "--out", out, *over)
    one_line_error(run_cli(*cmd, extra_env=_full(disk, 1024)), f"no space left on device while writing {out}")
    assert tree(out) == previous
    assert sorted(p.name for p in disk.iterdir()) == ["prepared"]  # the temp dir beside --out is gone

    res = run_cli(*cmd)
    assert res.returncode == 0, res.stderr
    healthy = tmp_path / "healthy"
    assert run_cli("prepare-data", "--out", healthy, *over).returncode == 0
    new, ok = tree(out), tree(healthy)
    assert new != previous
    # the rows and held-out conversations byte for byte; index.json differs in its timings only
    assert {k: v for k, v in new.items() if k != "index.json"} == {k: v for k, v in ok.items() if k != "index.json"}
    index, ok_index = (json.loads((d / "index.json").read_text()) for d in (out, healthy))
    assert {k: index[k] for k in ("key", "arrays", "num_rows")} == {k: ok_index[k] for k in ("key", "arrays", "num_rows")}


def test_data_cache_and_tensorboard_that_cannot_be_written_warn_once_and_the_run_goes_on(train_setup, tmp_path):
    """data.cache_dir and the TensorBoard directory on a full disk: one warning each, the rows stay
    in memory (no half-written cache entry is left to be read as a hit), TensorBoard is switched
    off, and training, metrics.jsonl and the checkpoint are as on a healthy disk."""
    from dflash_train.rundir import verify_checkpoint

    target, jsonl, _ = train_setup
    cache, run = tmp_path / "cache", tmp_path / "run"
    tb = run / "logs" / "tensorboard"
    over = tiny_overrides(target, jsonl, **{"data.cache_dir": cache, "logging.tensorboard": True,
                                            "train.max_steps": 2, "checkpoint.every_steps": 2})
    res = train(run, over, extra_env={"DFLASH_TEST_WRITE_FAULT": f"ENOSPC:0:{cache}/*|{tb}/*"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "error:" not in res.stderr, res.stderr[-3000:]
    assert res.stderr.count("could not write the prepared-data cache: no space left on device while writing "
                            f"{cache}/") == 1, res.stderr[-3000:]
    assert not [p for p in cache.rglob("*") if p.is_file()]  # nothing a later run could read as a hit
    assert steps(run) == [1, 2]
    assert verify_checkpoint(run / "checkpoints" / "latest") == []
    tb_lines = [l for l in res.stderr.splitlines() if "TensorBoard disabled" in l]
    assert len(tb_lines) == 1 and "no space left on device" in tb_lines[0].lower(), res.stderr[-3000:]
    # TensorBoard's own writer thread hits the full disk too: no thread traceback (train/metrics.py)
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
