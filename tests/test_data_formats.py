"""data.source=dataset:PATH: Parquet / Arrow files and directories (a Hugging Face data set saved
with save_to_disk, or downloaded from the hub), read with pyarrow, record batch by record batch;
the same conversations as the JSONL of the same rows, bad rows counted and skipped, a file that
is not a data set one line with exit 2."""
from __future__ import annotations

import json
import subprocess
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import tiny_conversations, write_tiny_jsonl
from dflash_train.config import ConfigError, DataSource
from dflash_train.data import DataError, read_conversations
from dflash_train.data.dataset_files import dataset_files, dataset_identity
from trainrun import CLI, REPO, env, losses, run_train, tiny_overrides

BAD_ROW = {"id": "bad-1", "conversations": [{"from": "human", "value": "a question nobody answered"}]}


def _sharegpt_rows(n: int = 12) -> list[dict]:
    return tiny_conversations(n)


def _messages_rows(n: int = 12) -> list[dict]:
    """The same conversations in the OpenAI `messages` shape."""
    role = {"human": "user", "gpt": "assistant", "system": "system"}
    return [{"id": c["id"], "messages": [{"role": role[t["from"]], "content": t["value"]} for t in c["conversations"]]}
            for c in tiny_conversations(n)]


def _write_stream(path, table: pa.Table, max_chunksize: int | None = None) -> None:
    """An Arrow IPC stream, as datasets' ArrowWriter writes data-0000i-of-0000n.arrow."""
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table, max_chunksize=max_chunksize)


def save_to_disk_dir(root, rows: list[dict], shards: int = 2):
    """The layout `datasets.Dataset.save_to_disk` writes: data-0000i-of-0000n.arrow (IPC streams),
    dataset_info.json and state.json listing the data files in order."""
    root.mkdir(parents=True)
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    per = -(-len(rows) // shards)
    for i, name in enumerate(names):
        _write_stream(root / name, pa.Table.from_pylist(rows[i * per:(i + 1) * per]))
    (root / "dataset_info.json").write_text(json.dumps({"citation": "", "description": "", "features": {}}))
    (root / "state.json").write_text(json.dumps({
        "_data_files": [{"filename": n} for n in names], "_fingerprint": "0123456789abcdef",
        "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
        "_split": "train"}))
    return root


def _same(convs, expected_jsonl) -> None:
    want, _ = read_conversations(f"jsonl:{expected_jsonl}", None)
    assert [(c.id, c.messages) for c in convs] == [(c.id, c.messages) for c in want]


@pytest.fixture
def jsonl(tmp_path):
    return write_tiny_jsonl(tmp_path / "same.jsonl", n=12)


def test_parquet_file_sharegpt_column(tmp_path, jsonl):
    p = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_sharegpt_rows()), p, row_group_size=5)  # several row groups
    convs, stats = read_conversations(f"dataset:{p}", None)
    _same(convs, jsonl)
    assert stats.skipped == {}


def test_arrow_file_messages_column_with_a_bad_row(tmp_path, jsonl):
    rows = _messages_rows()
    rows.insert(3, {"id": "bad-1", "messages": [{"role": "user", "content": "no answer"}]})
    table = pa.Table.from_pylist(rows)
    p = tmp_path / "train.arrow"
    with pa.OSFile(str(p), "wb") as f, pa.ipc.new_file(f, table.schema) as w:  # the IPC file format
        w.write_table(table, max_chunksize=4)
    convs, stats = read_conversations(f"dataset:{p}", None)
    _same(convs, jsonl)
    assert stats.skipped == {"no_exchange": 1} and stats.examples["no_exchange"] == ["train.arrow:3"]


def test_save_to_disk_directory_in_state_json_order(tmp_path, jsonl):
    rows = _sharegpt_rows()
    rows.append(BAD_ROW)
    d = save_to_disk_dir(tmp_path / "saved", rows, shards=3)
    convs, stats = read_conversations(f"dataset:{d}", None)
    _same(convs, jsonl)
    assert stats.skipped == {"no_exchange": 1}
    # a saved DatasetDict: its train split
    dd = tmp_path / "dict"
    save_to_disk_dir(dd / "train", rows, shards=1)
    save_to_disk_dir(dd / "test", [BAD_ROW], shards=1)
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    convs2, _ = read_conversations(f"dataset:{dd}", None)
    _same(convs2, jsonl)
    # the cache identity names every file read: state.json and each data file
    ident = dataset_identity(d)
    assert ident.count("|") == 3 and "state.json" in ident and "data-00002-of-00003.arrow" in ident
    before = dataset_identity(d)
    time.sleep(0.01)
    (d / "data-00001-of-00003.arrow").write_bytes((d / "data-00001-of-00003.arrow").read_bytes())
    assert dataset_identity(d) != before


def test_hub_download_parquet_directory_reads_the_train_split(tmp_path, jsonl):
    """A hub download: data/train-0000i-of-0000n.parquet beside test files and the hub's hidden cache."""
    d = tmp_path / "hub"
    (d / "data").mkdir(parents=True)
    rows = _sharegpt_rows()
    pq.write_table(pa.Table.from_pylist(rows[:7]), d / "data" / "train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows[7:]), d / "data" / "train-00001-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist([BAD_ROW]), d / "data" / "test-00000-of-00001.parquet")
    (d / ".cache" / "huggingface").mkdir(parents=True)
    (d / ".cache" / "huggingface" / "x.parquet").write_text("not read")
    (d / "README.md").write_text("# a dataset card")
    files, _ = dataset_files(d)
    assert [f.name for f in files] == ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]
    convs, stats = read_conversations(f"dataset:{d}", None)
    _same(convs, jsonl)
    assert stats.skipped == {}


def test_rows_are_streamed_batch_by_batch(tmp_path):
    """A stream whose last record batch is cut off: data.limit rows from the first batches read fine
    (nothing past them was decoded); reading it all is one line naming the file."""
    rows = _sharegpt_rows(12)
    d = save_to_disk_dir(tmp_path / "saved", rows, shards=1)
    f = d / "data-00000-of-00001.arrow"
    _write_stream(f, pa.Table.from_pylist(rows), max_chunksize=4)
    f.write_bytes(f.read_bytes()[:-200])
    convs, _ = read_conversations(f"dataset:{d}", 4)
    assert len(convs) == 4
    with pytest.raises(DataError, match=r"data-00000-of-00001\.arrow: cannot read it as a Arrow IPC stream") as e:
        read_conversations(f"dataset:{d}", None)
    assert "\n" not in str(e.value)


def test_refusals_name_the_file(tmp_path):
    text = tmp_path / "posing.parquet"
    text.write_text("id,conversations\n1,hello\n")
    with pytest.raises(DataError, match=r"posing\.parquet: not a data set"):
        read_conversations(f"dataset:{text}", None)
    no_col = tmp_path / "nocol.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": "hello"}]), no_col)
    with pytest.raises(DataError, match=r"nocol\.parquet: no 'conversations' or 'messages' column \(columns: text\)"):
        read_conversations(f"dataset:{no_col}", None)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match=r"empty: no Parquet or Arrow files"):
        read_conversations(f"dataset:{empty}", None)
    only_bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([BAD_ROW]), only_bad)
    with pytest.raises(DataError, match=r"no usable conversation \(no_exchange: 1\)"):
        read_conversations(f"dataset:{only_bad}", None)
    assert DataSource.parse(f"dataset:{text}").local_path == text
    with pytest.raises(ValueError, match="dataset:PATH"):
        DataSource.parse(f"parquet:{text}")
    assert issubclass(DataError, ConfigError)


def test_cli_text_file_posing_as_parquet_is_one_line_exit_2(tmp_path, tiny_target_dir):
    text = tmp_path / "posing.parquet"
    text.write_text("not parquet at all\n")
    res = subprocess.run([*CLI, "prepare-data", f"target.path={tiny_target_dir}", f"data.source=dataset:{text}",
                          f"data.cache_dir={tmp_path / 'cache'}"],
                         capture_output=True, text=True, timeout=120, env=env(), cwd=REPO)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines and "Traceback" not in res.stderr, res.stderr
    assert "posing.parquet: not a data set" in lines[-1], res.stderr


def test_cli_trains_on_a_saved_dataset(tmp_path, tiny_target_dir):
    """`train` on a save_to_disk directory, as a user runs it: same losses as on the JSONL of the same rows."""
    rows = tiny_conversations(24)
    d = save_to_disk_dir(tmp_path / "saved", rows, shards=2)
    jsonl = write_tiny_jsonl(tmp_path / "same.jsonl", n=24)
    over = {"train.max_steps": 3, "checkpoint.every_steps": 10}
    a = run_train(tmp_path / "on-dataset", tiny_overrides(tiny_target_dir, jsonl, **over, **{"data.source": f"dataset:{d}"}))
    assert a.returncode == 0, a.stderr[-3000:]
    b = run_train(tmp_path / "on-jsonl", tiny_overrides(tiny_target_dir, jsonl, **over))
    assert b.returncode == 0, b.stderr[-3000:]
    assert len(losses(tmp_path / "on-dataset")) == 3
    assert losses(tmp_path / "on-dataset") == losses(tmp_path / "on-jsonl")
