"""The on-disk form of prepared rows, and its reader.

A prepared directory holds ``index.json`` (format version, cache inputs and key, row count,
max_tokens, stats), ``heldout.jsonl`` and one flat ``.npy`` file per array:

* ``input_ids.npy``    [N, T] int64  (int64 because the batches are sliced straight out of it
  and the loss takes them as labels: no per-batch cast anywhere)
* ``loss_mask.npy``    [N, T] bool
* ``document_ids.npy`` [N, T] int32, -1 = padding

`read_prepared` memory-maps the arrays (copy-on-write: nothing is ever written back), so a
process holds only the rows it touches and every rank of a node shares the page cache: peak
RSS does not grow with N. The files are written through Python file objects (header, then
chunks of rows) so no process ever holds all rows either.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from dflash_train.data.sources import Conversation, DataError
from dflash_train.errors import parse_file

FORMAT_VERSION = 2  # 1: safetensors shards loaded whole; 2: flat .npy arrays, memory-mapped
ARRAYS = {"input_ids": np.int64, "loss_mask": np.bool_, "document_ids": np.int32}


@dataclass
class PreparedData:
    input_ids: torch.Tensor      # [N, T] int64
    loss_mask: torch.Tensor      # [N, T] bool
    document_ids: torch.Tensor   # [N, T] int32, -1 = padding
    heldout: list[Conversation]  # eval prompts: .prompt (first user text), .reference (first answer)
    stats: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None     # the cache / prepared directory it came from

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


def write_index(path: Path, inputs: dict[str, Any], key: str, num_rows: int, max_tokens: int,
                stats: dict[str, Any]) -> None:
    index = {"format_version": FORMAT_VERSION, "inputs": inputs, "key": key, "arrays": sorted(ARRAYS),
             "num_rows": num_rows, "max_tokens": max_tokens, "stats": stats}
    (path / "index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_heldout(path: Path, heldout: list[Conversation]) -> None:
    with (path / "heldout.jsonl").open("w") as f:
        for c in heldout:
            f.write(json.dumps(c.to_json(), ensure_ascii=False) + "\n")


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


def read_prepared(path: Path) -> PreparedData:
    """The prepared directory `path`, its arrays memory-mapped."""
    path = Path(path)
    index = read_index(path)
    if index.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path}: prepared-data format {index.get('format_version')}, this version reads {FORMAT_VERSION}; "
                        "run prepare-data again")
    n, t = int(index["num_rows"]), int(index["max_tokens"])
    arrays = {name: _open_array(path, name, n, t) for name in ARRAYS}
    heldout = []
    hf = path / "heldout.jsonl"
    if hf.is_file():
        heldout = [Conversation.from_json(json.loads(line)) for line in hf.read_bytes().split(b"\n") if line.strip()]  # "\n" only: answers may hold U+2028
    data = PreparedData(arrays["input_ids"], arrays["loss_mask"], arrays["document_ids"], heldout,
                        dict(index.get("stats", {})), path)
    data.stats["inputs"] = index.get("inputs", {})
    return data
