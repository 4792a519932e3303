"""train.epochs: one of train.max_steps / train.epochs sets a run's length; the steps of an epoch
count are ceil(epochs x rows / global batch), logged at start-up with the rows, tokens and lr
schedule they mean; a run stopped mid-epoch 2 and resumed equals the uninterrupted one bit for
bit; a resume may change the epochs (the lr schedule is recomputed, as for max_steps)."""
from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from dflash_train.config import ConfigError, load_config, read_run_config, save_config
from dflash_train.data import DataOrder, RankSlice
from dflash_train.resume_rule import check_resume_config
from dflash_train.train.schedule import lr_factor, step_budget
from trainrun import (CLI, REPO, assert_same_training_state, checkpoint_payload, env, losses, metrics, run_train,
                      signal_and_wait, start_train, tiny_overrides, wait_step)

# 16 conversations: ~36 rows, so two epochs are a few dozen steps
EPOCHS = {"train.max_steps": "null", "train.epochs": 2, "checkpoint.every_steps": 1000, "data.limit": 16}
LINE = re.compile(r"epochs 2 = (\d+) rows x 2 / global batch 2 = (\d+) steps \(([\d,]+) tokens\); "
                  r"lr warmup (\d+) steps, cosine to step (\d+)")


# --------------------------------------------------------------------------- the schema


def test_one_of_max_steps_or_epochs():
    assert load_config(None, []).train.max_steps == 200  # neither: the default length, as before
    t = load_config(None, ["train.epochs=2"]).train
    assert t.epochs == 2.0 and t.max_steps is None
    assert load_config(None, ["train.epochs=0.5"]).train.epochs == 0.5  # half an epoch of a big data set
    with pytest.raises(ConfigError, match=r"train.max_steps=5 and train.epochs=2 are both set.*train.max_steps=null"):
        load_config(None, ["train.max_steps=5", "train.epochs=2"])
    for bad in ("0", "-1", "abc"):
        with pytest.raises(ConfigError, match="train.epochs"):
            load_config(None, [f"train.epochs={bad}"])
    for shipped in sorted((REPO / "configs").glob("*.yaml")):  # every shipped config still loads, by steps
        assert load_config(shipped).train.epochs is None


def test_run_dirs_of_older_versions_and_epoch_runs_load(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    # a config.yaml an older version wrote: no train.epochs key at all
    cfg = yaml.safe_load(load_config(None, ["train.max_steps=8"]).to_yaml())
    del cfg["train"]["epochs"]
    (old / "config.yaml").write_text(yaml.safe_dump(cfg))
    loaded = read_run_config(old)
    assert loaded.train.max_steps == 8 and loaded.train.epochs is None
    # the old checkpoint's config records no epochs: not a change to refuse or to log
    assert check_resume_config(cfg, loaded, "ckpt") == []
    # to train an old run on by epochs, max_steps is cleared in the same command
    with pytest.raises(ConfigError, match="both set"):
        read_run_config(old, ["train.epochs=3"])
    by_epochs = read_run_config(old, ["train.epochs=3", "train.max_steps=null"])
    lines = check_resume_config(cfg, by_epochs, "ckpt")
    assert lines == ['resume: train.max_steps changed 8 -> null: applied (the lr schedule is recomputed with it '
                     'from the resumed step on)']
    # an epochs run's own config.yaml round-trips
    new = tmp_path / "new"
    new.mkdir()
    save_config(load_config(None, ["train.epochs=3"]), new / "config.yaml")
    assert read_run_config(new).train.epochs == 3.0 and read_run_config(new).train.max_steps is None
    changed = check_resume_config(load_config(None, ["train.epochs=3"]).to_dict(),
                                  load_config(None, ["train.epochs=4"]), "ckpt")
    assert changed == ["resume: train.epochs changed 3.0 -> 4.0: applied (the lr schedule is recomputed with it "
                       "from the resumed step on)"]


# --------------------------------------------------------------------------- the step count


def _rows(rows: int, tokens: int) -> torch.Tensor:
    """document_ids of `rows` rows holding `tokens` tokens in all, the rest padding (-1)."""
    ids = torch.full((rows, -(-tokens // rows)), -1, dtype=torch.int32)
    ids.view(-1)[:tokens] = 0
    return ids


def test_step_budget_figures():
    t = load_config(None, ["train.epochs=2", "train.batch_size=2", "train.grad_accum=2"]).train
    b = step_budget(t, _rows(1234, 201_056), data_parallel=2)
    assert b.global_batch == 8 and b.steps == 309  # ceil(2468 / 8)
    assert b.line() == ("epochs 2 = 1,234 rows x 2 / global batch 8 (batch_size 2 x grad_accum 2 x 2 ranks) = "
                        "309 steps (402,112 tokens); lr warmup 12 steps, cosine to step 309")
    # exact arithmetic on the epochs as written: 0.1 x 30 rows / 3 is one step, not two
    assert step_budget(load_config(None, ["train.epochs=0.1", "train.batch_size=3"]).train, _rows(30, 300), 1).steps == 1
    assert step_budget(load_config(None, ["train.epochs=0.01"]).train, _rows(30, 300), 1).steps == 1  # never 0
    m = step_budget(load_config(None, ["train.max_steps=50", "train.warmup_fraction=0"]).train,
                    _rows(40, 4000), 1)
    assert m.steps == 50 and m.line() == ("max_steps 50 x global batch 2 = 100 rows = 2.50 epochs of 40 rows "
                                          "(10,000 tokens); lr cosine from step 0 to step 50")


def test_every_epoch_is_a_new_order_and_ranks_share_it():
    o = DataOrder(10, seed=0)
    rows = o.rows_for(o.next_positions(30))
    assert all(sorted(rows[e * 10:(e + 1) * 10]) == list(range(10)) for e in range(3))
    assert len({tuple(rows[e * 10:(e + 1) * 10]) for e in range(3)}) == 3
    # two colocated ranks of batch 1 walk the global order of one process with batch 2
    ranks = [RankSlice(DataOrder(10, seed=0), r, 2) for r in range(2)]
    got = [row for _ in range(15) for r in ranks for row in r.rows_for(r.next_positions(1))]
    assert got == rows


# --------------------------------------------------------------------------- training by epochs


@pytest.fixture(scope="module")
def reference(train_setup):
    target, jsonl, root = train_setup
    rd = root / "reference"
    res = run_train(rd, tiny_overrides(target, jsonl, **EPOCHS))
    assert res.returncode == 0, res.stderr[-3000:]
    m = LINE.search(res.stderr)
    assert m, res.stderr[-3000:]
    rows, steps = int(m[1]), int(m[2])
    return rd, rows, steps, res.stderr


def test_epochs_set_the_steps_and_the_schedule(reference):
    rd, rows, steps, stderr = reference
    m = LINE.search(stderr)
    assert steps == -(-2 * rows // 2) and int(m[5]) == steps and int(m[4]) == round(0.1 * steps)
    recs = metrics(rd)
    assert [r["step"] for r in recs] == list(range(1, steps + 1))
    lr = [r["lr"] for r in recs]
    assert lr[-1] == pytest.approx(3e-3 * lr_factor(steps, steps, 0.1, 0.1)) == pytest.approx(3e-4)
    run = json.loads((rd / "run.json").read_text())
    assert run["stop_reason"] == "max_steps" and run["step"] == steps
    cfg = yaml.safe_load((rd / "config.yaml").read_text())
    assert cfg["train"]["epochs"] == 2 and cfg["train"]["max_steps"] is None


def test_stopped_mid_epoch_2_and_resumed_is_bit_exact(train_setup, reference):
    ref, rows, steps, _ = reference
    target, jsonl, root = train_setup
    rd = root / "stopped"
    proc = start_train(rd, tiny_overrides(target, jsonl, **EPOCHS), root / "stopped.log", step_delay=0.15)
    wait_step(rd, rows // 2 + 3, proc)  # epoch 2 began at step rows/2 + 1
    assert signal_and_wait(proc, signal.SIGTERM) == 0, (root / "stopped.log").read_text()[-3000:]
    stopped = max(losses(rd))
    assert stopped < steps, "the run finished before the signal; the test proves nothing"
    order = checkpoint_payload(rd / "checkpoints" / "latest")[1]["train_state"]["order_state"]
    assert order["epoch"] == 1 and 0 < order["position"] < rows, order  # mid-epoch 2
    res = run_train(rd, tiny_overrides(target, jsonl, **EPOCHS))
    assert res.returncode == 0, res.stderr[-3000:]
    assert losses(rd) == losses(ref)  # exact float equality, every step
    assert_same_training_state(rd, ref)

    # a resume may train on for more epochs: the schedule is laid out over the new step count
    more = run_train(rd, tiny_overrides(target, jsonl, **dict(EPOCHS, **{"train.epochs": 3})))
    assert more.returncode == 0, more.stderr[-3000:]
    assert "resume: train.epochs changed 2.0 -> 3.0: applied" in more.stderr, more.stderr[-3000:]
    total = -(-3 * rows // 2)
    assert f"epochs 3 = {rows} rows x 3 / global batch 2 = {total} steps" in more.stderr
    recs = {r["step"]: r for r in metrics(rd)}
    assert max(recs) == total
    assert recs[steps + 1]["lr"] == pytest.approx(3e-3 * lr_factor(steps + 1, total, 0.1, 0.1))


def test_both_set_on_resume_is_one_line_exit_2(train_setup, reference):
    """An epochs run resumed with train.max_steps alone names both keys (one line, exit 2, nothing written)."""
    ref, _, _, _ = reference
    before = (ref / "run.json").read_text()
    res = subprocess.run([*CLI, "train", "--run-dir", str(ref), "train.max_steps=100"], capture_output=True,
                         text=True, timeout=120, env=env(), cwd=REPO)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "train.max_steps=100 and train.epochs=2 are both set" in res.stderr
    assert (ref / "run.json").read_text() == before
    assert Path(ref / "config.yaml").is_file()
