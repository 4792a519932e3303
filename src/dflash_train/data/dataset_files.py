"""Data sets on disk, read with pyarrow (``data.source=dataset:PATH``; `dflash_train.data.sources`
turns their rows into conversations): a Parquet file, an Arrow IPC file or stream, a
``datasets.save_to_disk`` directory (its ``train`` split for a DatasetDict) or a directory of
Parquet / Arrow files (a hub download). Rows are streamed a record batch at a time, never loaded
whole; `dataset_identity` names every file read (the prepared-data cache key).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator

import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq

from dflash_train.data.errors import DataError

CONVERSATION_COLUMNS = ("id", "conversations", "messages")
ROWS_PER_BATCH = 256  # rows decoded into Python objects at once (a Parquet file is read this many rows at a time)
_FORMATS = {b"PAR1": "Parquet", b"ARROW1": "Arrow IPC file", b"\xff\xff\xff\xff": "Arrow IPC stream"}


def _file_format(path: Path) -> str:
    """Parquet / Arrow IPC file / Arrow IPC stream, from the file's first bytes (a name says nothing:
    datasets writes streams as .arrow, hubs serve .parquet); DataError for anything else."""
    try:
        with Path(path).open("rb") as f:
            head = f.read(8)
    except OSError as e:
        raise DataError(f"{path}: cannot read it: {e.strerror or e}") from None
    for magic, name in _FORMATS.items():
        if head.startswith(magic):
            return name
    raise DataError(f"{path}: not a data set (neither a Parquet nor an Arrow file); data.source=dataset:PATH reads "
                    "Parquet / Arrow files or a directory of them, JSONL is jsonl:PATH")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot read it as JSON: {e}") from None


def dataset_files(path: str | Path) -> tuple[list[Path], list[Path]]:
    """(the data files of data set `path` in reading order, the layout files read to find them:
    state.json, dataset_dict.json) - THE rule for which files a dataset:PATH source reads."""
    root = Path(path).expanduser()
    if root.is_file():
        return [root], []
    if not root.is_dir():
        raise DataError(f"data set not found: {root}")
    meta: list[Path] = []
    if (root / "dataset_dict.json").is_file():  # DatasetDict.save_to_disk: a directory per split
        meta.append(root / "dataset_dict.json")
        splits = _read_json(meta[-1])
        splits = splits.get("splits") if isinstance(splits, dict) else None
        if not isinstance(splits, list) or "train" not in splits:
            raise DataError(f"{root}: a saved DatasetDict without a 'train' split (splits: {splits}); "
                            "point data.source at the split's directory")
        root = root / "train"
    if (root / "state.json").is_file():  # Dataset.save_to_disk: data-0000i-of-0000n.arrow in state.json's order
        meta.append(root / "state.json")
        state = _read_json(meta[-1])
        entries = state.get("_data_files") if isinstance(state, dict) else None
        if not isinstance(entries, list) or not all(isinstance(e, dict) and "filename" in e for e in entries):
            raise DataError(f"{meta[-1]}: no '_data_files' list: not a datasets save_to_disk directory")
        files = [root / e["filename"] for e in entries]
        for f in files:
            if not f.is_file():
                raise DataError(f"{f}: listed in {meta[-1]} but missing")
        if not files:
            raise DataError(f"{meta[-1]}: lists no data files")
        return files, meta
    files = sorted(p for p in root.rglob("*") if p.suffix in (".parquet", ".arrow") and p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(root).parts)
                   and not p.name.startswith("cache-"))  # datasets' cache files of mapped copies
    # a hub download keeps its splits side by side (data/train-*.parquet, data/test-*.parquet, or
    # train/0000.parquet): train only, where the names say which files that is
    train = [p for p in files if any(part.startswith("train") for part in p.relative_to(root).parts)]
    files = train or files
    if not files:
        raise DataError(f"{root}: no Parquet or Arrow files in this directory")
    return files, meta


def dataset_identity(path: str | Path) -> str:
    """What a dataset:PATH source's rows depend on: path, size and mtime of every file read
    (data and layout files), for the prepared-data cache key."""
    files, meta = dataset_files(path)
    parts = []
    for f in [*meta, *files]:
        st = f.stat()
        parts.append(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(parts)


def _columns(names: list[str], path: Path) -> list[str]:
    if "conversations" not in names and "messages" not in names:
        raise DataError(f"{path}: no 'conversations' or 'messages' column (columns: {', '.join(names) or 'none'})")
    return [c for c in CONVERSATION_COLUMNS if c in names]


def _record_batches(path: Path) -> Iterator[pa.RecordBatch]:
    """The conversation columns of one Parquet / Arrow file, batch by batch (memory-mapped Arrow,
    Parquet decoded ROWS_PER_BATCH rows at a time)."""
    fmt = _file_format(path)
    try:
        if fmt == "Parquet":
            pf = pq.ParquetFile(path)
            yield from pf.iter_batches(batch_size=ROWS_PER_BATCH, columns=_columns(pf.schema_arrow.names, path))
            return
        with pa.memory_map(str(path)) as mm:
            reader = pa.ipc.open_file(mm) if fmt == "Arrow IPC file" else pa.ipc.open_stream(mm)
            cols = _columns(reader.schema.names, path)
            if fmt == "Arrow IPC file":
                batches: Iterable[pa.RecordBatch] = (reader.get_batch(i) for i in range(reader.num_record_batches))
            else:
                batches = reader
            for b in batches:
                yield b.select(cols)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot read it as a {fmt} data set: {e}") from None


def _without_nulls(obj: dict[str, Any]) -> dict[str, Any]:
    """A row as its JSON line would have been: an Arrow struct holds every field of the column's type,
    the ones a turn does not have as None (a turn typed {from, value, role, content} read as
    {"from": None, "role": "user", ...} would otherwise lose its role)."""
    out = {k: v for k, v in obj.items() if v is not None}
    for key in ("conversations", "messages"):
        turns = out.get(key)
        if isinstance(turns, list):
            out[key] = [{k: v for k, v in t.items() if v is not None} if isinstance(t, dict) else t for t in turns]
    return out


def iter_dataset_rows(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(place "file:row", row as its JSON line would have been) for every row of the data set."""
    files, _ = dataset_files(path)
    for f in files:
        row = 0
        for batch in _record_batches(f):
            for start in range(0, batch.num_rows, ROWS_PER_BATCH):
                for obj in batch.slice(start, ROWS_PER_BATCH).to_pylist():
                    yield f"{f.name}:{row}", _without_nulls(obj)
                    row += 1
