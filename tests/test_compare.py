"""`dflash-train compare` as a user runs it: a real subprocess trains each variant, scores
it against prompt lookup, prints the table; a stop resumes; bad variants cost nothing."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import yaml

from dflash_train.compare import parse_variants, split_overrides
from dflash_train.errors import UserError
from trainrun import REPO, env, metrics, tiny_overrides


def test_split_overrides_keeps_commas_inside_values():
    assert split_overrides("a.b=1,c.d=[1,2, 3],e.f='x,y'") == ["a.b=1", "c.d=[1,2, 3]", "e.f='x,y'"]
    assert split_overrides("") == []


@pytest.mark.parametrize("specs, words", [
    (["a:train.lr=1", "a:train.lr=2"], "used twice"),
    (["../x:train.lr=1"], "name before ':'"),
    (["ok:train.lr"], "not section.key=value"),
    ([], "at least one"),
])
def test_bad_variant_specs_are_refused(specs, words):
    with pytest.raises(UserError, match=words):
        parse_variants(specs)


@pytest.fixture(scope="module")
def setup(tiny_target_factory, tmp_path_factory):
    from conftest import write_tiny_jsonl

    root = tmp_path_factory.mktemp("compare")
    jsonl = write_tiny_jsonl(root / "conv.jsonl", n=40)
    target = tiny_target_factory("qwen3")
    nested: dict = {}
    for kv in tiny_overrides(target, jsonl, **{"train.max_steps": 6, "data.regenerated": str(jsonl)}):
        key, _, value = kv.partition("=")
        section, _, name = key.partition(".")
        nested.setdefault(section, {})[name] = yaml.safe_load(value)
    config = root / "base.yaml"
    config.write_text(yaml.safe_dump(nested))
    return config, root


def compare_cmd(config, out, *args) -> list[str]:
    return [sys.executable, "-m", "dflash_train.cli", "compare", "--config", str(config), "--out", str(out),
            "--num-prompts", "2", "--max-new-tokens", "12", *args]


def test_compare_trains_each_variant_scores_it_and_prints_the_table(setup):
    config, root = setup
    out = root / "ab"
    args = ["--variant", "base", "--variant", "dpace:train.loss=dpace", "--decode"]
    res = subprocess.run(compare_cmd(config, out, *args), capture_output=True, text=True, timeout=600,
                         env=env(), cwd=REPO)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for word in ("base", "dpace", "prompt lookup", "tau held-out", "compare.json"):
        assert word in res.stdout
    results = json.loads((out / "compare.json").read_text())
    assert list(results) == ["base", "dpace"]
    for name, row in results.items():
        assert row["steps"] == 6 and row["num_prompts"] == 2
        assert 1.0 <= row["tau_heldout"] <= 4.0 and 1.0 <= row["tau_ngram_heldout"] <= 4.0
        assert 1.0 <= row["tau_train_answers"] <= 4.0  # data.regenerated is set: training answers are scored
        # replay gives real decoding's tau (greedy); the real run is lossless for both drafters
        assert row["decode"]["tau"] == pytest.approx(row["tau_heldout"], abs=1e-6)
        assert row["decode"]["outputs_match"] is True and row["decode"]["outputs_match_ngram"] is True
    base_cfg = yaml.safe_load((out / "dpace" / "config.yaml").read_text())
    assert base_cfg["train"]["loss"] == "dpace"
    assert json.loads((out / "base" / "run.json").read_text())["stop_reason"] == "max_steps"

    # the same command again trains nothing and gives the same taus
    again = subprocess.run(compare_cmd(config, out, "--variant", "base", "--variant", "dpace:train.loss=dpace"),
                           capture_output=True, text=True, timeout=600, env=env(), cwd=REPO)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("already trained") == 2
    redo = json.loads((out / "compare.json").read_text())
    assert redo["dpace"]["tau_heldout"] == results["dpace"]["tau_heldout"]


def test_a_bad_variant_is_refused_before_anything_trains(setup, tmp_path):
    config, _ = setup
    out = tmp_path / "ab"
    res = subprocess.run(compare_cmd(config, out, "--variant", "base", "--variant", "typo:train.lsos=dpace"),
                         capture_output=True, text=True, timeout=300, env=env(), cwd=REPO)
    assert res.returncode == 2
    err = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and "typo" in err[0] and "train.lsos" in err[0], res.stderr
    assert not (out / "base").exists()


def test_a_stopped_compare_resumes_the_variant_it_was_training(setup, tmp_path):
    config, _ = setup
    out = tmp_path / "ab"
    cmd = compare_cmd(config, out, "--variant", "slow:train.max_steps=8")
    log = open(tmp_path / "compare.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env(step_delay=0.5), cwd=REPO)
    deadline = time.time() + 240
    while time.time() < deadline and not any(r.get("step", 0) >= 2 for r in metrics(out / "slow")):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 2
    text = (tmp_path / "compare.log").read_text()
    assert "stopped by SIGINT" in text and "run the same command again" in text
    stopped_at = json.loads((out / "slow" / "run.json").read_text())
    assert stopped_at["stop_reason"] == "SIGINT" and 2 <= stopped_at["step"] < 8
    assert not (out / "compare.json").exists()  # a half-trained variant is not scored

    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env(), cwd=REPO)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    steps = [r["step"] for r in metrics(out / "slow") if "loss" in r]
    assert steps == list(range(1, 9))  # resumed from its checkpoint, no step trained twice
    assert json.loads((out / "compare.json").read_text())["slow"]["steps"] == 8


def test_seed_summary_pairs_by_seed_and_judges_with_the_interval():
    from dflash_train.seeds import paired_summary, parse_seeds

    assert parse_seeds("0,1, 2") == [0, 1, 2] and parse_seeds(None) is None
    for bad in ("a,b", "1,1", ","):
        with pytest.raises(UserError, match="--seeds"):
            parse_seeds(bad)
    seeds = [0, 1, 2]
    # the seed moves both variants together: paired, a steady +0.05 is a gain though the spread is 0.1
    values = {"base": {0: 1.0, 1: 1.1, 2: 1.2}, "up": {0: 1.05, 1: 1.16, 2: 1.25},
              "down": {0: 0.9, 1: 1.0, 2: 1.1}, "noisy": {0: 1.2, 1: 1.0, 2: 1.25}}
    s = paired_summary(values, seeds)
    assert s["base"]["vs"] == "base" and "verdict" not in s["base"]
    assert s["up"]["verdict"] == "gain" and s["up"]["delta_mean"] == pytest.approx(0.0533, abs=1e-3)
    assert s["down"]["verdict"] == "loss"
    assert s["noisy"]["verdict"] == "within noise" and s["noisy"]["delta"] == pytest.approx([0.2, -0.1, 0.05])
    assert s["noisy"]["mean"] == pytest.approx(1.15) and s["noisy"]["sd"] == pytest.approx(0.1323, abs=1e-3)
    one = paired_summary({"a": {0: 1.0}, "b": {0: 1.5}}, [0])
    assert one["b"]["verdict"] == "one seed: no verdict" and one["b"]["delta_half95"] is None


def test_compare_over_seeds_trains_each_variant_per_seed_and_pairs_them(setup):
    config, root = setup
    out = root / "seeds"
    args = ["--variant", "base", "--variant", "lr:train.lr=1e-2", "--seeds", "0,1"]
    res = subprocess.run(compare_cmd(config, out, *args), capture_output=True, text=True, timeout=900,
                         env=env(), cwd=REPO)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "over seeds" in res.stdout and "verdict" in res.stdout and "compare-seeds.json" in res.stdout
    results = json.loads((out / "compare.json").read_text())
    assert sorted(results) == ["base-seed0", "base-seed1", "lr-seed0", "lr-seed1"]
    for name, row in results.items():
        variant, seed = name.rsplit("-seed", 1)
        cfg = yaml.safe_load((out / name / "config.yaml").read_text())
        assert row["variant"] == variant and row["seed"] == int(seed) == cfg["train"]["seed"]
        assert cfg["train"]["lr"] == (1e-2 if variant == "lr" else yaml.safe_load(config.read_text())["train"]["lr"])
        assert row["steps"] == 6
    summary = json.loads((out / "compare-seeds.json").read_text())["tau_heldout"]
    assert summary["lr"]["values"] == [results["lr-seed0"]["tau_heldout"], results["lr-seed1"]["tau_heldout"]]
    assert summary["lr"]["delta"] == pytest.approx([results[f"lr-seed{s}"]["tau_heldout"]
                                                    - results[f"base-seed{s}"]["tau_heldout"] for s in (0, 1)])
    assert summary["lr"]["verdict"] in ("gain", "loss", "within noise")


@pytest.mark.parametrize("args, words", [
    (["--seeds", "0,x"], "--seeds"),
    (["--seeds", "0,1", "train.seed=3"], "drop train.seed"),
])
def test_bad_seeds_are_refused_before_anything_trains(setup, tmp_path, args, words):
    config, _ = setup
    out = tmp_path / "ab"
    res = subprocess.run(compare_cmd(config, out, "--variant", "base", *args),
                         capture_output=True, text=True, timeout=300, env=env(), cwd=REPO)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    err = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and words in err[0], res.stderr
    assert not list(out.glob("base*"))
