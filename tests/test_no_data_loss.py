"""Nothing that exists is deleted unless the user named exactly that thing (issue 14, part A).

Driven as a user would: the CLI (`python -m dflash_train.cli`, the test's interpreter) in real subprocesses on real
files. Every refusal is checked for its one-line message and exit code 2 AND for
the files on disk being byte-for-byte what they were before (hashes of the whole
tree). Also: the permissions of exported and checkpoint files (umask, not 0600),
and a fresh start that keeps, never deletes, the checkpoints it could not read.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from trainrun import CLI, REPO, env, tiny_overrides


def cli(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    # umask 022 as on a usual server account; the files must come out 0644, not 0600
    return subprocess.run(["/bin/sh", "-c", 'umask 022 && exec "$@"', "sh", *CLI, *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env(), cwd=REPO)


def tree(root: Path) -> dict[str, str]:
    """relpath -> sha256 of every file (symlinks: their target) under `root`."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            out[rel] = "link:" + os.readlink(p) if p.is_symlink() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def one_line_error(res: subprocess.CompletedProcess, *needles: str) -> str:
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert res.returncode == 2, res.stdout + res.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# --------------------------------------------------------------------------- export


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """root/runs/run: a run dir with two real checkpoints (written by CheckpointManager) + metrics."""
    import torch

    from dflash_train.checkpoint.manager import CheckpointManager
    from dflash_train.config import RunConfig, save_config
    from dflash_train.model import DFlashDrafter, DrafterConfig

    root = tmp_path_factory.mktemp("world")
    run = root / "runs" / "run"
    run.mkdir(parents=True)
    save_config(RunConfig(), run / "config.yaml")
    cfg = DrafterConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                        layer_types=["full_attention"], sliding_window=None, block_size=4, mask_token_id=4, target_layer_ids=[1],
                        num_target_layers=4, vocab_size=300)
    mgr = CheckpointManager(run / "checkpoints", keep_last=5, async_save=False, log=lambda m: None)
    for s in (2, 4):
        torch.manual_seed(s)
        mgr.save(s, DFlashDrafter(cfg, seed=s).state_dict(), {"optimizer": {}},
                 {"step": s, "drafter_config": cfg.to_dict(), "target_path": "/models/t"})
    mgr.close()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 5)))
    (run / "run.json").write_text(json.dumps({"pid": 1, "live": False}))
    (root / "notes").mkdir()
    (root / "notes" / "mine.txt").write_text("the user's own file")
    (root / "afile").write_text("x")
    return root, run


@pytest.mark.parametrize("out,force,needles", [
    ("RUN", True, ["is a run dir"]),
    ("RUN", False, ["is a run dir"]),
    ("RUN/..", True, ["contains", "runs/run", "--force or not"]),
    ("ROOT", True, ["contains", "--force or not"]),
    ("RUN/checkpoints", True, ["directory of checkpoints"]),
    ("RUN/checkpoints/step-00000004", True, ["is a checkpoint", "--force or not"]),
    ("RUN/checkpoints/latest", True, ["is a checkpoint"]),
    ("RUN/checkpoints/step-00000002/sub", True, ["lies inside the checkpoint"]),
    ("RUN/checkpoints/step-00000099", True, ["lies inside", "directory of checkpoints"]),
    ("ROOT/notes", True, ["not a previous export", "--force or not"]),
    ("ROOT/afile", True, ["not a directory"]),
])
def test_export_refuses_out_that_would_lose_data(world, out, force, needles):
    root, run = world
    target = Path(out.replace("RUN", str(run)).replace("ROOT", str(root)))
    before = tree(root)
    res = cli("export", run, "--out", target, *(["--force"] if force else []))
    line = one_line_error(res, *needles)
    assert str(target) in line
    assert tree(root) == before  # nothing lost, nothing added


def test_export_into_run_export_and_force_replaces_only_a_previous_export(world):
    root, run = world
    out = run / "export"
    before = tree(root)
    res = cli("export", run, "--out", out)
    assert res.returncode == 0, res.stderr
    after = tree(root)
    assert {k: v for k, v in after.items() if not k.startswith("runs/run/export/")} == before
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    for f in out.iterdir():  # a serving process of another user can read them
        assert f.stat().st_mode & 0o777 == 0o644, f
    # again without --force: refused, the previous export intact
    one_line_error(cli("export", run, "--out", out), "previous export", "--force")
    assert tree(root) == after
    # --force replaces the previous export (and only it)
    res = cli("export", run / "checkpoints" / "step-00000002", "--out", out, "--force")
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "config.json").read_text())["dflash_train"]["step"] == 2
    now = tree(root)
    assert {k: v for k, v in now.items() if not k.startswith("runs/run/export/")} == before
    assert not [p for p in run.iterdir() if p.name.startswith(".")]  # no temp dirs left behind
    # an export dir the user added a file to is no longer "a previous export"
    (out / "notes.txt").write_text("mine")
    snap = tree(root)
    one_line_error(cli("export", run, "--out", out, "--force"), "not a previous export")
    assert tree(root) == snap


# --------------------------------------------------------------------------- fresh start keeps what it cannot read


@pytest.fixture(scope="module")
def trained(tiny_target_factory, tmp_path_factory):
    from conftest import write_tiny_jsonl

    root = tmp_path_factory.mktemp("fresh")
    jsonl = write_tiny_jsonl(root / "conv.jsonl", n=40)
    over = tiny_overrides(tiny_target_factory("qwen3"), jsonl,
                          **{"train.max_steps": 4, "checkpoint.every_steps": 2})
    return root, over


def _steps(run: Path) -> list[int]:
    return [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()
            if not json.loads(l).get("eval")]


def test_fresh_start_moves_unreadable_checkpoints_aside(trained):
    root, over = trained
    run = root / "unreadable"
    res = cli("train", "--run-dir", run, *over)
    assert res.returncode == 0, res.stderr
    ck = run / "checkpoints"
    for f in ("model.safetensors", "state.pt", "manifest.json"):  # checkpoint files: 0644 under umask 022
        assert (ck / "step-00000004" / f).stat().st_mode & 0o777 == 0o644, f
    # so are the files of the tokenised-data cache (data/prepare.py) the run wrote
    cached = [p for p in (root / "data-cache").rglob("*") if p.is_file()]
    assert any(p.name == "input_ids.npy" for p in cached), cached  # the rows' arrays (data/prepared_store.py)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in cached} == {p.name: "0o644" for p in cached}
    assert _steps(run) == [1, 2, 3, 4]
    # every checkpoint becomes unreadable (e.g. a bad copy): no resume is possible
    for p in ck.glob("step-*/model.safetensors"):
        data = bytearray(p.read_bytes())
        data[-5] ^= 0xFF
        p.write_bytes(bytes(data))
    old_ck, old_metrics = tree(ck), (run / "metrics.jsonl").read_text()
    res = cli("train", "--run-dir", run, "--resume", "auto", *over)
    assert res.returncode == 0, res.stderr
    aside = [p for p in run.iterdir() if p.name.startswith("checkpoints.unreadable-")]
    assert len(aside) == 1, sorted(p.name for p in run.iterdir())
    # the place is named on stderr and in the log
    assert str(aside[0]) in res.stderr and "nothing deleted" in res.stderr
    assert str(aside[0]) in (run / "logs" / "train.log").read_text()
    # the old checkpoints, links and metrics are all there, byte for byte
    kept = tree(aside[0])
    assert (aside[0] / "metrics.jsonl").read_text() == old_metrics
    kept.pop("metrics.jsonl")
    assert kept == old_ck
    # the new run's metrics do not mix with the old run's
    assert _steps(run) == [1, 2, 3, 4]
    assert (ck / "latest").resolve().name == "step-00000004"


def test_precomputed_features_and_their_data_cache_are_readable_by_others(trained):
    """`dflash-train precompute` under umask 022: shards, index and the data cache come out 0644."""
    root, over = trained
    out, cache = root / "pre", root / "pre-data-cache"
    over = [o for o in over if not o.startswith("data.cache_dir=")] + [f"data.cache_dir={cache}"]
    res = cli("precompute", "--out", out, "--dtype", "float32", "--rows-per-shard", 8, *over)
    assert res.returncode == 0, res.stderr
    files = [p for d in (out, cache) for p in d.rglob("*") if p.is_file()]
    shards = [p for p in files if p.name.startswith("shard-")]
    assert len(shards) > 1 and any(p.name == "input_ids.npy" for p in files), files
    assert {str(p): oct(p.stat().st_mode & 0o777) for p in files} == {str(p): "0o644" for p in files}


def test_resume_never_moves_old_checkpoints_aside(trained):
    root, over = trained
    run = root / "never"
    res = cli("train", "--run-dir", run, *over)
    assert res.returncode == 0, res.stderr
    old_ck, old_metrics = tree(run / "checkpoints"), (run / "metrics.jsonl").read_text()
    res = cli("train", "--run-dir", run, "--resume", "never", *over)
    assert res.returncode == 0, res.stderr
    aside = [p for p in run.iterdir() if p.name.startswith("checkpoints.previous-")]
    assert len(aside) == 1 and str(aside[0]) in res.stderr and "--resume never" in res.stderr
    kept = tree(aside[0])
    assert kept.pop("metrics.jsonl") == hashlib.sha256(old_metrics.encode()).hexdigest()
    assert kept == old_ck
    assert _steps(run) == [1, 2, 3, 4]
    # an export may not be written into the set-aside checkpoints either
    before = tree(run)
    one_line_error(cli("export", run, "--out", aside[0] / "step-00000004", "--force"), "is a checkpoint")
    one_line_error(cli("export", run, "--out", aside[0] / "new", "--force"), "directory of checkpoints")
    assert tree(run) == before


def test_resume_after_the_training_data_changed_is_one_line_and_keeps_the_checkpoints(trained, tmp_path):
    """A data file edited between a stop and a resume (a rerun appending answers): the data order
    of the checkpoint does not fit the new rows. One line naming the data keys, exit 2, nothing lost."""
    from conftest import write_tiny_jsonl

    root, over = trained
    jsonl = write_tiny_jsonl(tmp_path / "conv.jsonl", n=40)
    over = [o for o in over if not o.startswith("data.source=")] + [f"data.source=jsonl:{jsonl}"]
    run = root / "changed"
    assert cli("train", "--run-dir", run, *over).returncode == 0
    before = tree(run / "checkpoints")
    write_tiny_jsonl(jsonl, n=60)  # more conversations, more rows
    res = cli("train", "--run-dir", run, *over, "train.max_steps=6")
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]  # the rest is the log
    assert res.returncode == 2 and len(errors) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "changed since the checkpoint" in errors[0] and "data.regenerated" in errors[0]
    assert tree(run / "checkpoints") == before
