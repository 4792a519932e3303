"""The CLI as a user meets it: a real subprocess for --help, exit codes for mistakes."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_train import cli

# every command a user can type, by hand (a command added to the app without being listed here,
# or listed and gone, fails test_help_lists_every_command)
COMMANDS = ["train", "demo", "prepare-data", "regenerate", "precompute", "eval", "export", "serve-bench", "compare",
            "status", "stop", "deploy", "profile", "bench"]
CLI = [sys.executable, "-m", "dflash_train.cli"]
REPO = Path(__file__).resolve().parents[1]


def _listed_commands(help_text: str) -> list[str]:
    """The command names of the `Commands` box of `--help` (rich's table: `│ name   summary │`)."""
    box = help_text.split("Commands", 1)[1]
    return [m.group(1) for m in re.finditer(r"^│ ([a-z][a-z-]*) {2,}\S", box, re.M)]


def test_help_lists_every_command():
    out = subprocess.run([*CLI, "--help"], capture_output=True, text=True, env={**os.environ, "COLUMNS": "120"})
    assert out.returncode == 0, out.stderr
    assert _listed_commands(out.stdout) == COMMANDS, out.stdout
    registered = [c.name or c.callback.__name__ for c in cli.app.registered_commands]
    assert sorted(registered) == sorted(COMMANDS)


@pytest.mark.parametrize("name", COMMANDS)
def test_help_for_each_command(name):
    res = CliRunner().invoke(cli.app, [name, "--help"], terminal_width=200)
    assert res.exit_code == 0, res.output
    # its own usage line and its own summary (the docstring's first sentence), not the app's
    assert re.search(rf"Usage: .* {re.escape(name)} \[OPTIONS\]", res.output), res.output
    command = next(c for c in cli.app.registered_commands if (c.name or c.callback.__name__) == name)
    first_words = " ".join(command.callback.__doc__.split()[:4])
    assert first_words in " ".join(res.output.split()), (first_words, res.output)


# --------------------------------------------------------------------------- one real call of each command
# (train and demo: test_config_mistake_is_one_line_exit_2 and the demo test below; every command is
# also run for real, at length, by its own test module)


@pytest.fixture(scope="module")
def world(tiny_target_factory, tmp_path_factory):
    """A finished run dir with one real checkpoint (CheckpointManager, a drafter of the tiny
    target's shape), the tiny target and a small JSONL."""
    from conftest import write_tiny_jsonl
    from trainrun import write_run_with_checkpoint

    root = tmp_path_factory.mktemp("cli")
    target = tiny_target_factory("qwen3")
    run = write_run_with_checkpoint(root / "run")
    (run / "run.json").write_text(json.dumps({"pid": 1, "live": False, "step": 2}))
    return {"root": root, "run": run, "target": target, "jsonl": write_tiny_jsonl(root / "conv.jsonl", n=8)}


def _call(*args) -> subprocess.CompletedProcess:
    """The command run in this process (the app's own entry, not a subprocess: each of those pays
    torch's import again; the subprocess path is test_help_lists_every_command's)."""
    res = CliRunner().invoke(cli.app, list(map(str, args)))
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        import traceback

        raise AssertionError("".join(traceback.format_exception(res.exception)) + res.stderr[-3000:])
    return subprocess.CompletedProcess(args, res.exit_code, res.stdout, res.stderr)


def _one_error(res: subprocess.CompletedProcess, code: int = 2) -> str:
    errors = [l for l in res.stderr.splitlines() if l.startswith("error:")]
    assert res.returncode == code and len(errors) == 1, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-3000:]
    return errors[0]


def test_status_stop_profile_of_a_finished_run(world):
    run = world["run"]
    res = _call("status", run, "--json")
    assert res.returncode == 3, res.stderr  # 3: not live
    info = json.loads(res.stdout)
    assert info["live"] is False and info["latest_checkpoint_step"] == 2, info
    assert "not live" in _one_error(_call("stop", run))
    assert "not live" in _one_error(_call("profile", run, "--seconds", 1))


def test_export_writes_the_serving_files(world):
    out = world["root"] / "export"
    res = _call("export", world["run"], "--out", out)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["dflash_train"]["step"] == 2


def test_prepare_data_writes_the_rows(world):
    out = world["root"] / "prepared"
    res = _call("prepare-data", "--out", out, f"target.path={world['target']}", f"data.source=jsonl:{world['jsonl']}",
                "data.max_tokens=64", f"data.cache_dir={world['root'] / 'cache'}")
    assert res.returncode == 0, res.stderr[-3000:]
    index = json.loads((out / "index.json").read_text())
    assert index["num_rows"] > 0 and index["arrays"], index
    assert all((out / f"{a}.npy").is_file() for a in index["arrays"]), index


@pytest.mark.parametrize("args, needle", [
    (["eval", "--drafter", "MISSING"], "drafter path not found: MISSING"),
    (["serve-bench", "MISSING"], "drafter path not found: MISSING"),
    (["compare", "--config", "MISSING", "--variant", "a"], "--config MISSING: no such file"),
    (["regenerate", "--out", "ROOT/answers.jsonl", "target.path=MISSING", "data.source=jsonl:JSONL"],
     "target path not found: MISSING"),
    (["precompute", "--out", "ROOT/features", "target.path=MISSING", "data.source=jsonl:JSONL"],
     "target path not found: MISSING"),
    (["bench", "--shape", "huge"], "--shape huge: must be one of small, 8b"),
], ids=["eval", "serve-bench", "compare", "regenerate", "precompute", "bench"])
def test_a_mistake_is_one_line_naming_it(world, args, needle):
    """The commands whose real work takes minutes (each has its own test module): a mistake reaches
    the command's own check and ends in one `error:` line, exit 2."""
    missing = str(world["root"] / "missing")
    sub = lambda a: a.replace("MISSING", missing).replace("ROOT", str(world["root"])).replace(  # noqa: E731
        "JSONL", str(world["jsonl"]))
    line = _one_error(_call(*map(sub, args)))
    assert sub(needle) in line, line


def test_deploy_of_a_missing_run_dir_fails_naming_it(world):
    missing = world["root"] / "missing"
    res = _call("deploy", missing, "--code", world["root"], "--dry-run")
    assert res.returncode == 1, res.stderr[-3000:]
    assert f"deploy: FAILED: run dir {missing} does not exist" in res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr


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
