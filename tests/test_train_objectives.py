"""train.loss / train.optimizer as a user runs them: real `dflash-train` subprocesses."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from trainrun import REPO, env, losses, metrics, run_train, tiny_overrides

# prompt-lookup seeds with half the blocks unseeded: one more draw from the step's generator
RECIPE = {"train.loss": "lk_lambda", "train.loss_ce_weight": 0.2, "train.optimizer": "muon",
          "train.max_steps": 6, "checkpoint.every_steps": 3,
          "model.block_seeds": "prompt_lookup", "train.unseeded_fraction": 0.5}


@pytest.fixture(scope="module")
def reference(train_setup):
    target, jsonl, root = train_setup
    rd = root / "reference"
    res = run_train(rd, tiny_overrides(target, jsonl, **RECIPE))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return rd


def test_muon_and_lk_train_and_checkpoint_carries_them(reference):
    ls = losses(reference)
    assert sorted(ls) == list(range(1, 7)) and all(math.isfinite(v) and v > 0 for v in ls.values())
    recs = metrics(reference)
    # Muon groups run at 10x the AdamW lr, and the schedule moves both (warmup 1 step, then cosine)
    assert all(r["lr"] > 0 for r in recs)
    ck = reference / "checkpoints" / "step-00000006"
    meta = json.loads((ck / "manifest.json").read_text())["meta"]
    assert meta["config"]["train"]["loss"] == "lk_lambda" and meta["config"]["train"]["optimizer"] == "muon"
    assert meta["drafter_config"]["block_seeds"] == "prompt_lookup"
    state = torch.load(ck / "state.pt", weights_only=False)
    assert state["recipe"] == {"loss": "lk_lambda", "optimizer": "muon"}
    opt = state["optimizer"]
    assert opt["kind"] == "muon+adamw"
    muon_lr = opt["muon"]["param_groups"][0]["lr"]
    adamw_lr = opt["adamw"]["param_groups"][0]["lr"]
    assert muon_lr == pytest.approx(10 * adamw_lr)
    assert any("momentum_buffer" in s for s in opt["muon"]["state"].values())


def test_resume_from_a_middle_checkpoint_is_bit_exact(train_setup, reference, tmp_path):
    target, jsonl, _ = train_setup
    rd = tmp_path / "resumed"
    res = run_train(rd, tiny_overrides(target, jsonl, **RECIPE), resume=reference / "checkpoints" / "step-00000003")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got, want = losses(rd), losses(reference)
    assert sorted(got) == [4, 5, 6]
    assert all(got[s] == want[s] for s in got), (got, want)  # exact float equality


@pytest.mark.parametrize("key,value", [("train.loss", "dpace"), ("train.optimizer", "adamw"),
                                       ("model.block_seeds", "none")])
def test_resume_with_another_objective_or_optimizer_is_refused(train_setup, reference, key, value):
    target, jsonl, _ = train_setup
    before = (reference / "metrics.jsonl").read_text()
    res = run_train(reference, tiny_overrides(target, jsonl, **dict(RECIPE, **{key: value})))
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    old = RECIPE[key]
    line = [ln for ln in res.stderr.splitlines() if key in ln]
    assert line and old in line[0] and value in line[0], res.stderr
    assert "Traceback" not in res.stderr
    assert (reference / "metrics.jsonl").read_text() == before  # nothing changed on disk


def test_checkpoint_without_recorded_config_still_refuses_another_recipe(tmp_path):
    """The second guard: the checkpoint's own record (state.pt), for checkpoints whose
    manifest has no config (older writers)."""
    from types import SimpleNamespace

    from dflash_train.errors import UserError
    from dflash_train.train.state import check_recipe

    cfg = SimpleNamespace(loss="ce_decay", optimizer="muon")
    check_recipe(tmp_path, {"recipe": {"loss": "ce_decay", "optimizer": "muon"}}, cfg)
    with pytest.raises(UserError, match=r"train.optimizer=adamw, this run asks for train.optimizer=muon"):
        check_recipe(tmp_path, {}, cfg)  # no record: written before the option existed = adamw
    with pytest.raises(UserError, match=r"train.loss=distill, this run asks for train.loss=ce_decay"):
        check_recipe(tmp_path, {"recipe": {"loss": "distill", "optimizer": "muon"}}, cfg)


def test_config_rejects_meaningless_combinations():
    from dflash_train.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="loss_ce_weight"):
        load_config(None, ["train.loss=dpace", "train.loss_ce_weight=0.5"])
    with pytest.raises(ConfigError, match="muon with sharding=fsdp2"):
        load_config(None, ["train.optimizer=muon", "train.sharding=fsdp2"])
    with pytest.raises(ConfigError, match="train.loss"):
        load_config(None, ["train.loss=kl"])
    cfg = load_config(None, ["train.loss=distill", "train.loss_ce_weight=0.3", "train.optimizer=muon"])
    assert (cfg.train.loss, cfg.train.loss_ce_weight, cfg.train.muon_lr_mult) == ("distill", 0.3, 10.0)


def test_distill_from_precomputed_features_with_the_final_state(train_setup, tmp_path):
    """precompute with a teacher objective stores the final hidden state as one more layer;
    training from it with that objective works, with an objective that does not read it is refused."""
    target, jsonl, _ = train_setup
    over = tiny_overrides(target, jsonl, **{"train.loss": "distill", "train.max_steps": 2})
    pre = tmp_path / "pre"
    res = subprocess.run([sys.executable, "-m", "dflash_train.cli", "precompute", "--out", str(pre),
                          "--dtype", "float32", *over], capture_output=True, text=True, timeout=300, env=env(),
                         cwd=REPO)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    index = json.loads((pre / "index.json").read_text())
    n_layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    assert index["layer_ids"][-1] == n_layers and max(index["layer_ids"][:-1]) < n_layers
    from safetensors import safe_open

    with safe_open(str(pre / index["shards"][0]["file"]), framework="pt") as f:
        assert f.get_slice("features").get_shape()[-1] == len(index["layer_ids"]) * index["hidden_size"]
    src = f"data.source=precomputed:{pre}"
    res = run_train(tmp_path / "distill", over + [src])
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert sorted(losses(tmp_path / "distill")) == [1, 2]
    res = run_train(tmp_path / "ce", over + [src, "train.loss=ce_decay"])
    assert res.returncode == 2 and "final hidden state" in res.stderr and "Traceback" not in res.stderr
