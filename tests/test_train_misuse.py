"""Issue 14 part B, as a user makes the mistakes: the real `dflash-train` command in a
subprocess, real files. Each user mistake ends with ONE `error:` line naming the
file/key and exit 2, and nothing on disk is lost (config.yaml, run.json, checkpoints,
metrics are byte-for-byte what they were)."""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainrun import CLI, REPO, env, metrics, tiny_overrides


def cli_cmd() -> list[str]:
    return list(CLI)


def cli(*args, timeout: float = 300, prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*(prefix or []), *cli_cmd(), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env(), cwd=REPO)


def snapshot(run_dir: Path) -> dict[str, str]:
    """Every file and link of a run dir except logs/ (the log is appended to by design)."""
    out = {}
    for p in sorted(run_dir.rglob("*")):
        rel = p.relative_to(run_dir).as_posix()
        if rel.startswith("logs"):
            continue
        if p.is_symlink():
            out[rel] = "-> " + str(p.readlink())
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


def one_error_line(res: subprocess.CompletedProcess, *needles: str) -> str:
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    errs = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errs) == 1, res.stderr[-3000:]
    for n in needles:
        assert n in errs[0], (n, errs[0])
    return errs[0]


def target_not_loaded(res: subprocess.CompletedProcess) -> None:
    assert "loaded Target(" not in res.stderr, "the check should come before the target loads"


def _as_yaml(overrides: list[str]) -> str:
    d: dict = {}
    for o in overrides:
        k, v = o.split("=", 1)
        sec, key = k.split(".")
        d.setdefault(sec, {})[key] = yaml.safe_load(v)
    return yaml.safe_dump(d)


@pytest.fixture(scope="module")
def ref(tiny_target_dir, tmp_path_factory):
    """A run trained 4 steps from a --config FILE (block size 4, rows of 64), one
    checkpoint at step 4. Its target is a private copy (one test swaps its files)."""
    from conftest import write_tiny_jsonl

    root = tmp_path_factory.mktemp("misuse")
    target = root / "target"
    shutil.copytree(tiny_target_dir, target)
    jsonl = write_tiny_jsonl(root / "conv.jsonl", n=40)
    over = tiny_overrides(target, jsonl, **{"train.max_steps": 4})
    cfg_file = root / "run.yaml"
    cfg_file.write_text(_as_yaml(over))
    rd = root / "ref"
    res = cli("train", "--config", cfg_file, "--run-dir", rd)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (rd / "checkpoints" / "step-00000004").is_dir()
    return {"root": root, "run": rd, "target": target, "jsonl": jsonl, "config": cfg_file}


def copy_run(ref, tmp_path: Path, name: str = "run") -> Path:
    dst = tmp_path / name
    shutil.copytree(ref["run"], dst, symlinks=True)
    return dst


# --------------------------------------------------------------------------- the run remembers its config


def test_resume_without_config_uses_the_runs_config_and_applies_allowed_changes(ref, tmp_path):
    rd = copy_run(ref, tmp_path)
    before = metrics(rd)
    res = cli("train", "--run-dir", rd, "train.max_steps=6", "train.lr=0.001")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "config: " + str(rd / "config.yaml") in res.stderr
    # one line per applied change, with its effect
    assert res.stderr.count("resume: train.max_steps changed 4 -> 6: applied") == 1
    assert res.stderr.count("resume: train.lr changed 0.003 -> 0.001: applied") == 1
    cfg = yaml.safe_load((rd / "config.yaml").read_text())
    # the run's own settings, not the built-in defaults (block size 16, rows of 256, ShareGPT)
    assert cfg["model"]["block_size"] == 4 and cfg["data"]["max_tokens"] == 64
    assert cfg["data"]["source"].startswith("jsonl:")
    assert cfg["train"]["max_steps"] == 6 and cfg["train"]["lr"] == 0.001
    # nothing lost: steps 1-4 as they were, the step-4 checkpoint kept
    after = metrics(rd)
    assert after[:len(before)] == before and after[-1]["step"] == 6
    assert (rd / "checkpoints" / "step-00000004").is_dir()
    # the new lr is in effect (not silently ignored while config.yaml records it), on the schedule of
    # the new max_steps: warmup round(0.1 * 6) = 1 step, then cosine from 1e-3 down to min_lr_ratio 0.1
    # of it. By hand: after step 5, 4 of the 5 decay steps: 0.1 + 0.9 * (1 + cos(0.8 pi)) / 2 =
    # 0.1 + 0.45 * (1 - 0.80901699...) = 0.18594235...; after step 6 the floor, 0.1
    lr = {r["step"]: r["lr"] for r in after if not r.get("eval")}
    assert math.isclose(lr[5], 1e-3 * 0.18594235253127366, rel_tol=1e-9), lr
    assert math.isclose(lr[6], 1e-4, rel_tol=1e-9), lr
    # every checkpoint carries the full resolved config
    man = json.loads((rd / "checkpoints" / "step-00000006" / "manifest.json").read_text())
    assert man["meta"]["config"] == cfg
    assert man["meta"]["drafter_config"]["block_size"] == 4


def _copied_target(ref, tmp_path):
    dst = tmp_path / "target-copy"
    shutil.copytree(ref["target"], dst)
    return f"target.path={dst}"


@pytest.mark.parametrize("change, key, old, new", [
    ("model.block_size=8", "model.block_size", "4", "8"),
    ("train.seed=7", "train.seed", "0", "7"),
    ("data.max_tokens=32", "data.max_tokens", "64", "32"),
    ("--config:model.num_layers=2", "model.num_layers", "1", "2"),
    ("target-copy", "target.path", "", ""),
])
def test_resume_refuses_changes_that_change_the_runs_meaning(ref, tmp_path, change, key, old, new):
    rd = copy_run(ref, tmp_path)
    before = snapshot(rd)
    if change == "target-copy":
        change = _copied_target(ref, tmp_path)
        old, new = json.dumps(str(ref["target"])), json.dumps(change.split("=", 1)[1])
    if change.startswith("--config:"):
        res = cli("train", "--config", ref["config"], "--run-dir", rd, change.split(":", 1)[1])
    else:
        res = cli("train", "--run-dir", rd, change)
    line = one_error_line(res, key, "cannot change on resume", "step-00000004")
    assert f"{key}={old}" in line and f"now {new}" in line, line
    target_not_loaded(res)
    assert snapshot(rd) == before  # config.yaml, run.json, checkpoints, metrics untouched
    assert "cannot change on resume" in (rd / "logs" / "train.log").read_text()


def test_resume_refuses_a_target_that_changed_under_the_same_path(ref, tmp_path, tiny_target_factory):
    rd = copy_run(ref, tmp_path)
    before = snapshot(rd)
    other = tiny_target_factory("qwen3", hidden_size=32)
    target = ref["target"]
    saved = target.with_name("target.orig")
    target.rename(saved)
    try:
        shutil.copytree(other, target)
        res = cli("train", "--run-dir", rd)
    finally:
        shutil.rmtree(target, ignore_errors=True)
        saved.rename(target)
    one_error_line(res, "does not fit this drafter", "hidden_size was 64, now 32", str(target))
    # run.json records this (refused) start, not live; everything else as it was
    assert json.loads((rd / "run.json").read_text())["live"] is False
    after = snapshot(rd)
    assert {k: v for k, v in after.items() if k != "run.json"} == {k: v for k, v in before.items() if k != "run.json"}


# --------------------------------------------------------------------------- start-up checks


def test_resume_pointing_at_a_file_or_a_corrupt_checkpoint(ref, tmp_path):
    rd = copy_run(ref, tmp_path)
    before = snapshot(rd)
    res = cli("train", "--run-dir", rd, "--resume", rd / "config.yaml")
    one_error_line(res, "--resume", "config.yaml", "is a file")
    target_not_loaded(res)

    broken = tmp_path / "elsewhere" / "step-00000004"
    shutil.copytree(rd / "checkpoints" / "step-00000004", broken)
    f = broken / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    res = cli("train", "--run-dir", rd, "--resume", broken)
    one_error_line(res, "--resume", "not a valid checkpoint", str(f))
    target_not_loaded(res)
    assert snapshot(rd) == before


def _fake_gguf(ref, tmp_path):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"this is not a gguf file at all\n" * 10)
    return [f"target.path={p}"], str(p)


def _broken_config_json(ref, tmp_path):
    t = tmp_path / "tgt"
    shutil.copytree(ref["target"], t)
    (t / "config.json").write_text('{"model_type": "qwen3", oops')
    return [f"target.path={t}"], str(t / "config.json")


def _truncated_safetensors(ref, tmp_path):
    t = tmp_path / "tgt"
    shutil.copytree(ref["target"], t)
    f = t / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    return [f"target.path={t}"], str(f)


def _layer_ids(ref, tmp_path):
    return ["model.target_layer_ids=[0,9]"], "model.target_layer_ids"


def _mask_token(ref, tmp_path):
    return ["model.mask_token_id=99999"], "model.mask_token_id=99999"


def _cuda(ref, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    return ["train.device=cuda"], "train.device=cuda"


def _missing_data(ref, tmp_path):
    return [f"data.source=jsonl:{tmp_path / 'nope.jsonl'}"], "nope.jsonl"


@pytest.mark.parametrize("make", [_fake_gguf, _broken_config_json, _truncated_safetensors, _layer_ids, _mask_token,
                                  _cuda, _missing_data], ids=lambda f: f.__name__.strip("_"))
def test_startup_mistakes_are_one_line_before_the_target_loads(ref, tmp_path, make):
    extra, needle = make(ref, tmp_path)
    rd = tmp_path / "fresh"
    res = cli("train", "--run-dir", rd, *tiny_overrides(ref["target"], ref["jsonl"]), *extra)
    one_error_line(res, needle)
    target_not_loaded(res)
    assert not (rd / "config.yaml").exists() and not (rd / "run.json").exists()


def test_run_dir_that_is_a_file(ref, tmp_path):
    f = tmp_path / "run"
    f.write_text("my notes\n")
    res = cli("train", "--run-dir", f, *tiny_overrides(ref["target"], ref["jsonl"]))
    one_error_line(res, str(f), "is a file")
    assert f.read_text() == "my notes\n"


def _ro_prefix(path: Path) -> list[str] | None:
    """A read-only bind mount of `path` in a private mount namespace (works as root,
    where chmod does not stop writes), or None where this machine cannot make one."""
    if not shutil.which("unshare"):
        return None
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind '{path}' '{path}' && "
                            f"mount -o remount,bind,ro '{path}' && ! touch '{path}/.probe' 2>/dev/null"],
                           capture_output=True)
    if probe.returncode != 0:
        return None
    return ["unshare", "-m", "sh", "-c", f"mount --bind '{path}' '{path}' && mount -o remount,bind,ro '{path}' && "
            'exec "$@"', "sh"]


def test_read_only_run_dir(ref, tmp_path):
    rd = copy_run(ref, tmp_path)
    prefix = _ro_prefix(rd)
    if prefix is None:
        if __import__("os").geteuid() == 0:
            pytest.skip("no way to make a read-only directory here (root, no mount namespace)")
        rd.chmod(0o555)
        prefix = []
    before = snapshot(rd)
    try:
        res = cli("train", "--run-dir", rd, "train.max_steps=6", prefix=prefix)
    finally:
        rd.chmod(0o755)
    one_error_line(res, str(rd), "not writable")
    assert snapshot(rd) == before


def test_crawling_anchors_are_capped_and_an_eval_that_cannot_run_is_skipped(ref, tmp_path):
    """10,000 anchors on 64-token rows: capped (a row has at most 63 anchor positions);
    no held-out prompt at all: the in-training eval is a warning, the run finishes."""
    rd = tmp_path / "run"
    over = tiny_overrides(ref["target"], ref["jsonl"], **{
        "train.num_anchors": 10000, "train.max_steps": 4, "eval.every_steps": 2, "data.heldout_fraction": 0.0})
    res = cli("train", "--run-dir", rd, *over, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "train.num_anchors=10000 capped to 63" in res.stderr
    assert "in-training eval disabled" in res.stderr
    assert [r["step"] for r in metrics(rd) if not r.get("eval")] == [1, 2, 3, 4]
    assert (rd / "checkpoints" / "step-00000004").is_dir()


# --------------------------------------------------------------------------- internal errors, smaller items


def test_internal_error_traceback_lands_in_train_log(ref, tmp_path):
    rd = copy_run(ref, tmp_path)
    before = snapshot(rd)
    code = ("import sys\n"
            "import dflash_train.train.run as r\n"
            "def boom(self):\n"
            "    raise RuntimeError('injected bug for the test')\n"
            "r.Trainer._build = boom\n"
            "from dflash_train.cli import main\n"
            f"sys.argv = ['dflash-train', 'train', '--run-dir', {str(rd)!r}, 'train.max_steps=6']\n"
            "main()\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env(),
                         cwd=REPO)
    assert res.returncode == 1 and "Traceback" in res.stderr and "injected bug" in res.stderr
    logged = (rd / "logs" / "train.log").read_text()
    assert "Traceback" in logged and "RuntimeError: injected bug for the test" in logged
    after = snapshot(rd)
    assert json.loads((rd / "run.json").read_text())["live"] is False
    assert {k: v for k, v in after.items() if k not in ("run.json", "config.yaml")} == \
        {k: v for k, v in before.items() if k not in ("run.json", "config.yaml")}


def test_stop_refuses_a_negative_timeout(ref, tmp_path):
    rd = copy_run(ref, tmp_path)
    before = snapshot(rd)
    one_error_line(cli("stop", rd, "--timeout", "-1"), "--timeout")
    assert snapshot(rd) == before


def test_eval_says_when_it_runs_fewer_prompts_than_asked(ref):
    res = cli("eval", "--drafter", ref["run"], "--num-prompts", "50", "--max-new-tokens", "4", "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["num_prompts_requested"] == 50 and 0 < out["num_prompts"] < 50
    assert f"evaluating {out['num_prompts']} prompts, not the 50 asked for" in res.stderr
