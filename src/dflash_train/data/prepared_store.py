"""The on-disk form of prepared rows, and its reader.

A prepared directory holds ``index.json`` (format version, cache inputs and key, row count,
max_tokens, real tokens, stats), ``heldout.jsonl`` and one flat ``.npy`` file per array:

* ``input_ids.npy``    [N, T] int64  (int64 because the batches are sliced straight out of it
  and the loss takes them as labels: no per-batch cast anywhere)
* ``loss_mask.npy``    [N, T] bool
* ``document_ids.npy`` [N, T] int32, -1 = padding

and the counts training needs from all the rows (`RowCounts`: ``token_counts.npy``,
``supervised_counts.npy``, index.json's ``real_tokens``), made while the rows are written, so no
trainer scans the arrays (a scan of mapped arrays brings every page of them into the process).

`read_prepared` memory-maps the arrays (copy-on-write: nothing is ever written back), so a
process holds only the rows it touches and every rank of a node shares the page cache: peak
RSS does not grow with N. The files are written through Python file objects (header, then
chunks of rows) so no process ever holds all rows either.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import numpy as np
import torch

from dflash_train.data.sources import Conversation, DataError
from dflash_train.errors import parse_file

# 1: safetensors shards loaded whole; 2: flat .npy arrays, memory-mapped; 3: and their counts
FORMAT_VERSION = 3
ARRAYS = {"input_ids": np.int64, "loss_mask": np.bool_, "document_ids": np.int32}
COUNTS = ("token_counts", "supervised_counts")
SCAN_TOKENS = 1 << 20  # tokens per chunk of a scan of rows: ~13 MiB of arrays whatever T is


@dataclass
class RowCounts:
    """What training needs from all the rows: the step budget's token count, the vocab subset's
    histogram, the mask token check. Added up a chunk of rows at a time (`add`)."""

    # [max id + 1] int64: each id's occurrences in input_ids, padding included (the mask check's)
    token_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # same length: each id's occurrences where loss_mask is set (the vocab subset's)
    supervised_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    real_tokens: int = 0  # document_ids >= 0
    rows: int = 0

    def add(self, ids, mask, docs) -> None:
        """Rows [n, T] (numpy arrays or CPU tensors) counted in."""
        ids, docs = np.asarray(ids).reshape(-1), np.asarray(docs)
        mask = np.asarray(mask).reshape(-1).astype(np.bool_, copy=False)
        n = max(len(self.token_counts), int(ids.max()) + 1 if ids.size else 0)
        self.token_counts = _grown(self.token_counts, n) + np.bincount(ids, minlength=n)
        self.supervised_counts = _grown(self.supervised_counts, n) + np.bincount(ids[mask], minlength=n)
        self.real_tokens += int(np.count_nonzero(docs >= 0))
        self.rows += len(docs)


def _grown(a: np.ndarray, n: int) -> np.ndarray:
    return a if len(a) == n else np.concatenate([a, np.zeros(n - len(a), np.int64)])


def count_rows(input_ids, loss_mask, document_ids) -> RowCounts:
    """The counts of rows that are not a prepared directory's (precomputed features' rows, rows
    built in memory), a chunk at a time: no whole-array temporary."""
    counts = RowCounts()
    step = max(1, SCAN_TOKENS // max(1, int(input_ids.shape[1])))
    for r in range(0, len(input_ids), step):
        counts.add(input_ids[r:r + step], loss_mask[r:r + step], document_ids[r:r + step])
    return counts


@dataclass
class PreparedData:
    input_ids: torch.Tensor      # [N, T] int64
    loss_mask: torch.Tensor      # [N, T] bool
    document_ids: torch.Tensor   # [N, T] int32, -1 = padding
    heldout: HeldoutFile | list[Conversation]  # eval prompts: .prompt (first user text), .reference (first answer)
    stats: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None     # the cache / prepared directory it came from
    counts: RowCounts | None = None  # counted by prepare (None: count_rows them)

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_tokens(self) -> int:
        return int(self.input_ids.shape[1])


class NpyWriter:
    """One ``.npy`` file of a known shape written in order, a chunk of rows at a time."""

    def __init__(self, path: Path, dtype, shape: tuple[int, ...]) -> None:
        self.dtype, self.shape = np.dtype(dtype), shape
        self.f: BinaryIO = open(path, "wb")
        np.lib.format.write_array_header_1_0(self.f, {"descr": np.lib.format.dtype_to_descr(self.dtype),
                                                      "fortran_order": False, "shape": shape})
        self.rows = 0

    def write(self, chunk: np.ndarray) -> None:
        # f.write, not ndarray.tofile: a refused write surfaces as the OSError of a Python write
        self.f.write(np.ascontiguousarray(chunk, dtype=self.dtype).data)
        self.rows += len(chunk)

    def close(self) -> None:
        self.f.close()
        if self.rows != self.shape[0]:
            raise RuntimeError(f"{self.f.name}: {self.rows} rows written, {self.shape[0]} declared")


def write_index(path: Path, inputs: dict[str, Any], key: str, counts: RowCounts, max_tokens: int,
                stats: dict[str, Any]) -> None:
    """index.json, and the counts' arrays beside it (`counts.rows` rows of `max_tokens`)."""
    for name in COUNTS:
        np.save(path / f"{name}.npy", getattr(counts, name))
    index = {"format_version": FORMAT_VERSION, "inputs": inputs, "key": key, "arrays": sorted(ARRAYS),
             "num_rows": counts.rows, "max_tokens": max_tokens, "real_tokens": counts.real_tokens, "stats": stats}
    (path / "index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


HELDOUT_FILE = "heldout.jsonl"


class HeldoutWriter:
    """The held-out conversations written to `file` as prepare meets them (5 % of a million
    conversations is ~1 GB as Python objects); `len` counts them."""

    def __init__(self, file: Path) -> None:
        self.file, self.count = file, 0
        self._f = file.open("w")

    def append(self, conv: Conversation) -> None:
        self._f.write(json.dumps(conv.to_json(), ensure_ascii=False) + "\n")
        self.count += 1

    def __len__(self) -> int:
        return self.count

    def close(self) -> None:
        self._f.close()


@dataclass(frozen=True)
class HeldoutFile:
    """A prepared directory's held-out conversations, read from its file as they are iterated:
    an evaluation takes its first few prompts, and no rank holds them all (memory independent of
    the data's size)."""
    file: Path
    count: int

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Conversation]:
        if not self.file.is_file():
            return
        with self.file.open("rb") as f:
            for line in f:  # binary lines end at "\n" only: answers may hold U+2028
                if line.strip():
                    yield Conversation.from_json(json.loads(line))


def read_index(path: Path) -> dict[str, Any]:
    idx_file = Path(path) / "index.json"
    return parse_file(idx_file, json.loads, DataError, f"{path} is not a prepared-data directory (no index.json)",
                      lambda e: f"{idx_file}: unreadable ({e})", (json.JSONDecodeError,))


def _open_array(path: Path, name: str, n: int, t: int) -> torch.Tensor:
    f = path / f"{name}.npy"
    try:
        arr = np.load(f, mmap_mode="c")  # copy-on-write: a stray in-place op never reaches the file
    except FileNotFoundError:
        raise DataError(f"{f}: missing; run prepare-data again") from None
    except ValueError as e:
        raise DataError(f"{f}: unreadable ({e}); run prepare-data again") from None
    if arr.dtype != ARRAYS[name] or arr.shape != (n, t):
        raise DataError(f"{f}: {arr.dtype} {list(arr.shape)}, index.json says {np.dtype(ARRAYS[name])} [{n}, {t}]; "
                        "run prepare-data again")
    return torch.from_numpy(arr)


def _read_counts(path: Path, index: dict[str, Any], n: int) -> RowCounts:
    got = {}
    for name in COUNTS:
        f = path / f"{name}.npy"
        try:
            got[name] = np.load(f)  # small ([vocab] int64): read whole
        except FileNotFoundError:
            raise DataError(f"{f}: missing; run prepare-data again") from None
        except ValueError as e:
            raise DataError(f"{f}: unreadable ({e}); run prepare-data again") from None
    if got["token_counts"].dtype != np.int64 or got["token_counts"].shape != got["supervised_counts"].shape \
            or not isinstance(index.get("real_tokens"), int):
        raise DataError(f"{path}: token counts do not match index.json; run prepare-data again")
    return RowCounts(got["token_counts"], got["supervised_counts"], int(index["real_tokens"]), n)


def read_prepared(path: Path) -> PreparedData:
    """The prepared directory `path`, its arrays memory-mapped."""
    path = Path(path)
    index = read_index(path)
    if index.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path}: prepared-data format {index.get('format_version')}, this version reads {FORMAT_VERSION}; "
                        "run prepare-data again")
    n, t = int(index["num_rows"]), int(index["max_tokens"])
    arrays = {name: _open_array(path, name, n, t) for name in ARRAYS}
    heldout = HeldoutFile(path / HELDOUT_FILE, int(index.get("stats", {}).get("heldout_conversations", 0)))
    data = PreparedData(arrays["input_ids"], arrays["loss_mask"], arrays["document_ids"], heldout,
                        dict(index.get("stats", {})), path, _read_counts(path, index, n))
    data.stats["inputs"] = index.get("inputs", {})
    return data
