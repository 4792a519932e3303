"""The CLI as a user meets it: a real subprocess for --help, exit codes for mistakes."""
import subprocess
from pathlib import Path
import sys

import pytest
from typer.testing import CliRunner

from dflash_train import cli

COMMANDS = ["train", "eval", "export", "status", "stop", "deploy", "prepare-data", "precompute",
            "regenerate", "bench", "profile", "demo"]


def test_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "dflash_train.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for name in COMMANDS:
        assert name in out.stdout, name


@pytest.mark.parametrize("name", COMMANDS)
def test_help_for_each_command(name):
    res = CliRunner().invoke(cli.app, [name, "--help"])
    assert res.exit_code == 0, res.output
    assert "Usage" in res.output


def test_unbuilt_command_exits_2(monkeypatch):
    # simulate a command whose implementation module is missing
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *a, **k):
        if name == "dflash_train.export":
            raise ModuleNotFoundError("No module named 'dflash_train.export'", name="dflash_train.export")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    res = CliRunner().invoke(cli.app, ["export", "somewhere", "--out", "x"])
    assert res.exit_code == 2
    assert "not built yet" in res.output


def test_config_mistake_is_one_line_exit_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dflash_train.cli", "train", "--run-dir", str(tmp_path / "r"),
                          "train.max_step=3"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "did you mean 'max_steps'" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("override, key", [("model.block_seeds=ngram", "model.block_seeds"),
                                           ("train.unseeded_fraction=1.5", "train.unseeded_fraction")])
def test_seeding_mistakes_are_one_line_exit_2(tmp_path, override, key):
    out = subprocess.run([sys.executable, "-m", "dflash_train.cli", "train", "--run-dir", str(tmp_path / "r"),
                          override], capture_output=True, text=True)
    assert out.returncode == 2
    assert f"{key}:" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "r").exists()


def test_demo_refuses_more_served_drafts_than_the_block_holds(tmp_path):
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "dflash_train.cli", "demo", "--run-dir", str(run), "demo.serve_k=8"],
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "demo.serve_k=8" in out.stderr and "block_size 8" in out.stderr and "Traceback" not in out.stderr
    assert not run.exists()  # refused before the run dir (or any data, training) is made
