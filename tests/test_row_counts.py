"""The counts training needs from all the rows (issue 47 item 1): prepare writes them beside the
rows (data/prepared_store.py RowCounts), so a trainer's start never scans the memory-mapped
arrays; rows that are not a prepared directory are counted a chunk at a time. Both give what a
direct computation over the whole arrays gives: the same step budget, vocab subset and refusal
of a mask token the data uses."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import write_tiny_jsonl
from trainrun import CLI, REPO, env
from transformers import AutoTokenizer

from dflash_train.config import load_config
from dflash_train.data import DataError, load_prepared, prepared_store, read_prepared
from dflash_train.data.prepared_store import (
    ARRAYS,
    NpyWriter,
    RowCounts,
    count_rows,
    write_index,
)
from dflash_train.pipeline import training_data
from dflash_train.pipeline.training_data import TrainingData
from dflash_train.train.preflight import TrainError, check_mask_unused
from dflash_train.train.schedule import step_budget
from dflash_train.train.vocab_subset import vocab_subset_from_counts


@pytest.fixture(scope="module")
def prepared(tiny_target_dir, tmp_path_factory):
    """A prepared directory of 300 conversations in rows of 96 tokens (padding in some rows)."""
    root = tmp_path_factory.mktemp("row_counts")
    jsonl = write_tiny_jsonl(root / "conv.jsonl", n=300, seed=3)
    cfg = load_config(None, [f"data.source=jsonl:{jsonl}", "data.max_tokens=96", f"data.cache_dir={root / 'cache'}",
                             "model.block_size=4", "data.heldout_fraction=0.05", "train.epochs=1.5", "train.batch_size=3"])
    tok = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    return cfg, load_prepared(cfg, tok, "qwen3"), tok


def _oracle(data):
    """Straight from the whole arrays: each id's count, each id's supervised count, the real tokens."""
    ids, mask, docs = (np.array(a.numpy()) for a in (data.input_ids, data.loss_mask, data.document_ids))
    return np.bincount(ids.ravel()), np.bincount(ids[mask], minlength=ids.max() + 1), int((docs >= 0).sum())


def test_prepare_counts_and_chunked_counts_are_the_arrays_counts(prepared, monkeypatch):
    cfg, data, tok = prepared
    tokens, supervised, real = _oracle(data)
    assert (data.input_ids == tok.pad_token_id).any() and 0 < real < data.input_ids.numel()  # padding counted apart
    for counts in (data.counts, count_rows(data.input_ids, data.loss_mask, data.document_ids)):
        assert np.array_equal(counts.token_counts, tokens) and np.array_equal(counts.supervised_counts, supervised)
        assert (counts.real_tokens, counts.rows) == (real, data.num_rows)
    monkeypatch.setattr(prepared_store, "SCAN_TOKENS", 5 * 96)  # chunks of 5 rows, the last one shorter
    assert data.num_rows % 5
    small = count_rows(data.input_ids, data.loss_mask, data.document_ids)
    assert np.array_equal(small.token_counts, tokens) and np.array_equal(small.supervised_counts, supervised)
    assert small.real_tokens == real


def test_vocab_subset_from_counts_is_the_most_frequent_supervised_ids(prepared):
    cfg, data, tok = prepared
    _, supervised, _ = _oracle(data)
    present = [i for i in range(len(supervised)) if supervised[i]]
    assert len(set(supervised[present].tolist())) < len(present)  # ties, broken by id
    for k in (1, 7, 40, len(present), 10 * len(present)):
        want = sorted(sorted(present, key=lambda i: (-supervised[i], i))[:k])
        assert vocab_subset_from_counts(data.counts.supervised_counts, k).tolist() == want, k
    assert vocab_subset_from_counts(data.counts.supervised_counts, 0) is None


def test_step_budget_from_counts_is_the_scan(prepared, monkeypatch):
    cfg, data, _ = prepared
    _, _, real = _oracle(data)
    got = step_budget(cfg.train, data.document_ids, 2, data.counts.real_tokens)
    assert got == step_budget(cfg.train, data.document_ids, 2)  # counted a chunk at a time
    assert (got.rows, got.tokens, got.steps) == (data.num_rows, real, -(-3 * data.num_rows // (2 * 3 * 2)))
    monkeypatch.setattr(prepared_store, "SCAN_TOKENS", 5 * 96)
    monkeypatch.setattr("dflash_train.train.schedule.SCAN_TOKENS", 5 * 96)
    assert step_budget(cfg.train, data.document_ids, 2).tokens == real


def test_mask_token_refused_when_the_data_uses_it(prepared):
    cfg, data, tok = prepared
    tokens, _, _ = _oracle(data)
    for used in (int(tokens.argmax()), tok.pad_token_id):  # the most frequent id, and padding's
        with pytest.raises(TrainError, match=rf"model.mask_token_id={used} occurs {tokens[used]} times"):
            check_mask_unused(used, data.counts.token_counts)
    unused = [i for i in range(len(tokens)) if not tokens[i]]
    assert unused
    for free in (unused[0], len(tokens), 10 ** 6):  # inside the counts, past the largest id
        check_mask_unused(free, data.counts.token_counts)


def test_training_data_takes_prepares_counts(prepared, monkeypatch):
    """A prepared directory's rows are never counted by the trainer; other rows are."""
    _, data, _ = prepared
    monkeypatch.setattr(training_data, "count_rows", lambda *a: pytest.fail("scanned the prepared rows"))
    td = TrainingData(data.input_ids, data.loss_mask, data.document_ids, counts=data.counts)
    assert td.row_counts() is data.counts
    monkeypatch.undo()
    plain = TrainingData(data.input_ids.clone(), data.loss_mask.clone(), data.document_ids.clone()).row_counts()
    assert np.array_equal(plain.token_counts, data.counts.token_counts)


def _synthetic(path: Path, rows: int, t: int) -> Path:
    """A prepared directory of `rows` rows of `t` tokens (ids 10..59, every token supervised)."""
    path.mkdir()
    writers = {k: NpyWriter(path / f"{k}.npy", dt, (rows, t)) for k, dt in ARRAYS.items()}
    counts = RowCounts()
    for s in range(0, rows, 4096):
        n = min(rows, s + 4096) - s
        chunk = (np.broadcast_to(np.arange(t) % 50 + 10, (n, t)), np.ones((n, t), bool), np.zeros((n, t), np.int32))
        for k, a in zip(("input_ids", "loss_mask", "document_ids"), chunk):
            writers[k].write(a)
        counts.add(*chunk)
    for w in writers.values():
        w.close()
    write_index(path, {}, "synthetic", counts, t, {})
    return path


_PEAK = "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); " \
        "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"


def test_training_start_does_not_grow_with_the_rows(tiny_target_dir, tmp_path):
    """`train` on 2,000 and on 32,000 rows of 1,024 tokens (26 MB and 420 MB of arrays), one step
    with the vocab subset on: the same peak RSS within tens of MB. A scan of the rows (the mask token
    check, the vocab subset, the step budget) would touch all 420 MB of mapped pages."""
    peak = {}
    for rows in (2_000, 32_000):
        d = _synthetic(tmp_path / f"r{rows}", rows, 1024)
        cmd = [*CLI, "train", "--run-dir", str(tmp_path / f"run{rows}"), f"target.path={tiny_target_dir}",
               f"data.source=prepared:{d}", "data.max_tokens=1024", "model.num_layers=1", "model.block_size=4",
               "train.max_steps=1", "train.batch_size=2", "train.num_anchors=4", "train.vocab_subset=20",
               "logging.tensorboard=false", "logging.progress=plain"]
        res = subprocess.run([sys.executable, "-c", _PEAK, *cmd], capture_output=True, text=True, timeout=300,
                             env=env(), cwd=REPO)
        rc, kb = res.stdout.split()[-2:]
        assert rc == "0", res.stderr[-3000:]
        peak[rows] = int(kb) * 1024
    # a scan touches the 420 MB of mapped rows (measured ~400 MB of growth with the old start-up); the
    # start-up itself grows by 10-31 MB with 16x the rows (the order's permutation, allocator noise:
    # 31 MB measured on a fresh clone), so the line is drawn at a quarter of what a scan costs
    assert peak[32_000] - peak[2_000] < 100 << 20, peak


def test_a_prepared_directory_without_its_counts_is_one_line(prepared, tmp_path):
    _, data, _ = prepared
    d = tmp_path / "rows"
    shutil.copytree(data.path, d)
    (d / "supervised_counts.npy").unlink()
    with pytest.raises(DataError, match=r"supervised_counts.npy: missing; run prepare-data again"):
        read_prepared(d)
