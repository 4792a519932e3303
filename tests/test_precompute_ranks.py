"""`dflash-train precompute` under torchrun (2 ranks, gloo): the same files as one process, bit
for bit in float32; the same command redoes only the shards an interrupted run left unfinished;
leftovers of other settings are refused; a rank that fails stops the other one."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainrun import CLI, REPO, env

ROWS_PER_SHARD = 3


def _over(target: Path, jsonl: Path) -> list[str]:
    return [f"target.path={target}", f"data.source=jsonl:{jsonl}", "data.limit=24", "data.max_tokens=64",
            f"data.cache_dir={jsonl.parent / 'data-cache'}"]


def _precompute(out: Path, over: list[str], ranks: int = 1, dtype: str = "float32") -> subprocess.CompletedProcess:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
              "-m", "dflash_train.cli"] if ranks > 1 else CLI
    cmd = [*launch, "precompute", "--out", str(out), "--dtype", dtype, "--rows-per-shard", str(ROWS_PER_SHARD), *over]
    return subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=REPO, timeout=240)


def _assert_same(got: Path, ref: Path) -> None:
    """The same files; every shard's tensors equal; index.json identical byte for byte."""
    from safetensors.torch import load_file

    assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in ref.iterdir())
    assert (got / "index.json").read_bytes() == (ref / "index.json").read_bytes()
    for sh in json.loads((ref / "index.json").read_text())["shards"]:
        a, b = load_file(str(got / sh["file"])), load_file(str(ref / sh["file"]))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), sh["file"]


@pytest.fixture(scope="module")
def made(tiny_target_factory, tmp_path_factory):
    """(overrides, the single-process output, the 2-rank output, the 2-rank run's stderr)."""
    from conftest import write_tiny_jsonl

    root = tmp_path_factory.mktemp("precompute-ranks")
    over = _over(tiny_target_factory("qwen3"), write_tiny_jsonl(root / "conv.jsonl", n=24))
    one, two = root / "one", root / "two"
    res = _precompute(one, over)
    assert res.returncode == 0, res.stderr[-3000:]
    res = _precompute(two, over, ranks=2)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return over, one, two, res.stderr


def test_two_ranks_write_what_one_process_writes(made):
    _, one, two, stderr = made
    shards = json.loads((one / "index.json").read_text())["shards"]
    assert len(shards) >= 6  # several shards per rank
    _assert_same(two, one)
    assert stderr.count("wrote ") == 1  # rank 0 reports; rank 1 is quiet
    assert not list(two.glob(".*"))  # no temp file left


def test_the_same_command_redoes_only_what_an_interrupted_run_left_unfinished(made, tmp_path):
    """What a kill can leave: no index.json, a shard renamed into place whose record was not
    written yet, a shard's temp file half written; and a shard damaged on disk since."""
    over, one, two, _ = made
    out = tmp_path / "cut"
    shutil.copytree(two, out)
    (out / "index.json").unlink()
    (out / "shard-00001.json").unlink()
    (out / "shard-00002.safetensors").rename(out / ".shard-00002.safetensors.partial")
    (out / "shard-00002.json").unlink()
    with open(out / ".shard-00002.safetensors.partial", "r+b") as f:
        f.truncate(100)
    with open(out / "shard-00004.safetensors", "r+b") as f:
        f.seek(-5, os.SEEK_END)
        f.write(b"xxxxx")
    redo = {"shard-00001.safetensors", "shard-00002.safetensors", "shard-00004.safetensors"}
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.safetensors")}

    res = _precompute(out, over, ranks=2)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    after = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.safetensors")}
    assert {k for k in after if after[k] != before.get(k)} == redo  # the others untouched
    _assert_same(out, one)


def test_a_leftover_of_other_settings_is_one_line_and_exit_2(made, tmp_path):
    over, one, _, _ = made
    out = tmp_path / "bf16"
    shutil.copytree(one, out)
    (out / "index.json").unlink()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    res = _precompute(out, over, dtype="bfloat16")
    assert res.returncode == 2
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr
    assert f"error: {out}/shard-00000.json: left by a precompute with other settings" in errors[0]
    assert "dtype 'float32' there, 'bfloat16' now" in errors[0]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing mixed in


def test_a_rank_that_fails_stops_the_other(made, tmp_path):
    """Shard 1 (rank 1's) records rows of other data: rank 1 refuses it, rank 0 says so and
    stops too instead of waiting for rank 1; nothing is written as complete."""
    over, one, _, _ = made
    out = tmp_path / "other-rows"
    shutil.copytree(one, out)
    (out / "index.json").unlink()
    side = out / "shard-00001.json"
    rec = json.loads(side.read_text())
    side.write_text(json.dumps(dict(rec, rows_sha256="0" * 64)))
    res = _precompute(out, over, ranks=2)
    assert res.returncode != 0
    err = f"error: {side}: its rows differ from the data of this config"
    assert res.stderr.count(err) == 1, res.stderr[-3000:]
    assert f"error: rank 1 stopped the capture: {side}: its rows differ" in res.stderr
    assert not (out / "index.json").exists()
