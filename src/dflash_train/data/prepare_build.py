"""Building prepared rows on all the cores the process is given, never holding all rows.

1. The training conversations are cut into fixed shards of `SHARD_CONVERSATIONS` (fixed, not
   per worker: the shards and so the rows are the same whatever the worker count), read from the
   source as the workers need them (the process never holds all conversations). Worker
   processes (spawn: the parent may hold threads, e.g. torch's, that fork would copy mid-lock)
   each format, tokenise, cut and drop the documents of one shard and write them to the build
   directory as flat arrays with a ``.json`` record written last: a killed build keeps its
   finished shards and the next build with the same inputs starts after them.
2. The packer places documents by their lengths alone (`place_documents`: exactly
   `packing.pack_documents`' first fit, in O(SCAN_ROWS) per document).
3. The rows are assembled a chunk at a time from the shard files and appended to the ``.npy``
   arrays (`prepared_store`), and counted (`RowCounts`) as they go.

Workers: ``len(os.sched_getaffinity(0))`` (the cores this process may run on: ``taskset``,
cgroups and Slurm bindings included), at most one per shard.
"""
from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import shutil
import time
from collections import OrderedDict, deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator

import numpy as np

from dflash_train.data.packing import SCAN_ROWS, Document, cut_document
from dflash_train.data.prepared_store import ARRAYS, NpyWriter, RowCounts
from dflash_train.data.sources import Conversation, is_heldout
from dflash_train.data.template import ChatFormat, TemplateMismatch

SHARD_CONVERSATIONS = 512
ROW_CHUNK_TOKENS = 1 << 20  # rows assembled per write: ~13 MiB of arrays whatever max_tokens is
MAX_EXAMPLES = 5


def available_cores() -> int:
    return len(os.sched_getaffinity(0))


@dataclass(frozen=True)
class CutRule:
    """How conversations become documents: the chat format's template variables, the cut, the drop."""
    max_tokens: int
    long_rule: str
    min_supervised: int
    template_kwargs: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- shard files


def write_docs(work: Path, name: str, docs: list[Document], record: dict[str, Any]) -> dict[str, Any]:
    """`docs` as ``NAME.ids.npy`` (int32), ``NAME.mask.npy``, ``NAME.lens.npy``, then ``NAME.json``
    (the shard's record: it exists only once the arrays are whole)."""
    lens = np.array([len(d.input_ids) for d in docs], dtype=np.int64)
    ids = np.fromiter((t for d in docs for t in d.input_ids), dtype=np.int64, count=int(lens.sum()))
    if ids.size and (ids.min() < 0 or ids.max() >= 2 ** 31):
        raise ValueError(f"token ids outside int32 in shard {name}")
    mask = np.fromiter((m for d in docs for m in d.loss_mask), dtype=np.bool_, count=int(lens.sum()))
    for suffix, arr in (("ids", ids.astype(np.int32)), ("mask", mask), ("lens", lens)):
        w = NpyWriter(work / f"{name}.{suffix}.npy", arr.dtype, arr.shape)
        w.write(arr)
        w.close()
    record = dict(record, docs=len(docs), tokens=int(lens.sum()), supervised=int(mask.sum()))
    tmp = work / f"{name}.json.tmp"
    tmp.write_text(json.dumps(record, sort_keys=True))
    os.replace(tmp, work / f"{name}.json")
    return record


def read_record(work: Path, name: str) -> dict[str, Any] | None:
    try:
        return json.loads((work / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def cut_conversations(convs: list[Conversation], fmt: ChatFormat, rule: CutRule) -> tuple[list[Document], dict]:
    """Format, cut and drop: the documents of `convs` and the counts of what was set aside."""
    docs: list[Document] = []
    mismatched: list[str] = []
    n_long = dropped = 0
    for conv in convs:
        try:
            enc = fmt.encode(conv.messages)
        except TemplateMismatch:
            mismatched.append(conv.id)
            continue
        pieces, was_long = cut_document(enc.input_ids, enc.loss_mask, rule.max_tokens, rule.long_rule)
        n_long += was_long
        for p in pieces:
            if p.supervised >= rule.min_supervised:
                docs.append(p)
            else:
                dropped += 1
    return docs, {"template_mismatch": len(mismatched), "mismatch_examples": mismatched[:MAX_EXAMPLES],
                  "long": n_long, "dropped": dropped, "conversations": len(convs)}


_worker_fmt: ChatFormat | None = None


def _init_worker(tokenizer, family: str | None, template_kwargs: dict[str, Any]) -> None:
    global _worker_fmt
    _worker_fmt = ChatFormat(tokenizer, family, template_kwargs=template_kwargs)


def _shard_task(args: tuple[Path, str, list[Conversation], CutRule]) -> dict[str, Any]:
    work, name, convs, rule = args
    docs, record = cut_conversations(convs, _worker_fmt, rule)
    return write_docs(work, name, docs, record)


def shard_name(i: int) -> str:
    return f"shard-{i:06d}"


def training_shards(convs: Iterable[Conversation], heldout_fraction: float, heldout: list[Conversation],
                    reading: list[float]) -> Iterator[list[Conversation]]:
    """The training conversations of `convs` in shards of SHARD_CONVERSATIONS, read as the shards are
    needed; the held-out ones are appended to `heldout`, the seconds spent reading added to `reading[0]`."""
    shard: list[Conversation] = []
    it = iter(convs)
    while True:
        t = time.perf_counter()
        conv = next(it, None)
        reading[0] += time.perf_counter() - t
        if conv is None:
            break
        if is_heldout(conv, heldout_fraction):
            heldout.append(conv)
            continue
        shard.append(conv)
        if len(shard) == SHARD_CONVERSATIONS:
            yield shard
            shard = []
    if shard:
        yield shard


def tokenize_shards(shards: Iterable[list[Conversation]], tokenizer, family: str | None, rule: CutRule, work: Path,
                    workers: int | None = None, progress: Callable[[int, int | None], None] | None = None
                    ) -> tuple[list[str], list[dict[str, Any]], int, int]:
    """Every shard of `shards` tokenised into `work` (finished shards of an earlier build reused; the
    shards are taken as the workers need them, so only those in flight are held): (shard names in
    order, their records, the worker count used, the training conversations)."""
    names: list[str] = []
    records: dict[str, dict] = {}
    seen = done = queued = 0

    def todo() -> Iterator[tuple]:
        nonlocal seen, done, queued
        for i, convs in enumerate(shards):
            name = shard_name(i)
            names.append(name)
            seen += len(convs)
            if (rec := read_record(work, name)) is not None:
                records[name] = rec
                done += rec["conversations"]
                continue
            queued += 1
            yield (work, name, convs, rule)

    tasks = todo()
    first = list(itertools.islice(tasks, 2))  # one shard to do: tokenised in this process
    workers = max(1, min(workers or available_cores(), len(first) if len(first) < 2 else 1 << 30))
    if progress is not None:
        progress(done, None)
    for rec in _run(itertools.chain(first, tasks), tokenizer, family, rule.template_kwargs, workers):
        records[shard_name(int(rec["shard"]))] = rec
        done += rec["conversations"]
        if progress is not None:
            progress(done, None)
    if progress is not None:
        progress(done, seen)
    # the executor starts a worker only when none is idle: no more than there were shards to do
    return names, [records[n] for n in names], max(1, min(workers, queued)), seen


def _run(todo: Iterator[tuple], tokenizer, family: str | None, template_kwargs: dict[str, Any],
         workers: int) -> Iterator[dict[str, Any]]:
    named = ((t, int(t[1].rsplit("-", 1)[1])) for t in todo)
    if workers == 1:  # in this process: nothing to pickle, no interpreter to start
        _init_worker(tokenizer, family, template_kwargs)
        for task, i in named:
            yield dict(_shard_task(task), shard=i)
        return
    # an executor, not a Pool: a worker that dies (the OOM killer) raises BrokenProcessPool instead of a hang
    ex = ProcessPoolExecutor(workers, multiprocessing.get_context("spawn"), _init_worker,
                             (tokenizer, family, template_kwargs))
    pending: deque = deque()
    finished = False
    try:
        # results in shard order; a shard is read from the source only when one is about to be free
        # (not Executor.map: it submits every task at once, so all conversations would be held)
        for task, i in named:
            pending.append((i, ex.submit(_shard_task, task)))
            if len(pending) > workers:
                j, fut = pending.popleft()
                yield dict(fut.result(), shard=j)
        while pending:
            j, fut = pending.popleft()
            yield dict(fut.result(), shard=j)
        finished = True
    finally:
        # on an error or Ctrl-C the queued shards are dropped, not run to the end
        ex.shutdown(wait=finished, cancel_futures=not finished)


# --------------------------------------------------------------------------- packing


def place_documents(lengths: np.ndarray, max_tokens: int, min_room: int = 1) -> tuple[np.ndarray, np.ndarray, int]:
    """`packing.pack_documents`' first fit on the documents' lengths: (row of each document, its
    offset in the row, number of rows). The open rows are kept as the SCAN_ROWS most recent
    (`window`) and the older ones (`older`, ascending); closing a row of the window lets the most
    recent older one in, as removing it from pack_documents' one list does."""
    n_docs = len(lengths)
    row_of = np.empty(n_docs, dtype=np.int64)
    offset = np.empty(n_docs, dtype=np.int64)
    room: list[int] = []
    window: list[int] = []
    older: list[int] = []
    close_below = max(min_room, 1)
    for i, n in enumerate(lengths.tolist()):
        if n > max_tokens:
            raise ValueError(f"document of {n} tokens exceeds max_tokens={max_tokens}")
        placed = -1
        for r in window:
            if room[r] >= n:
                placed = r
                break
        if placed < 0:
            placed = len(room)
            room.append(max_tokens)
            window.append(placed)
            if len(window) > SCAN_ROWS:
                older.append(window.pop(0))
        row_of[i], offset[i] = placed, max_tokens - room[placed]
        room[placed] -= n
        if room[placed] < close_below:
            window.remove(placed)
            if older:
                window.insert(0, older.pop())
    return row_of, offset, len(room)


class ShardReader:
    """Random access to the documents of the shard files, by global document index. At most
    `OPEN_SHARDS` shards have open files (a 1M-conversation build has ~2,000 shards: more than a
    process may open); the documents of a chunk of rows come from a few neighbouring shards."""

    OPEN_SHARDS = 32

    def __init__(self, work: Path, names: list[str]) -> None:
        self.work, self.names = work, names
        self.offsets: list[tuple[int, int]] = []
        firsts, starts = [0], []
        for name in names:
            lens = np.load(work / f"{name}.lens.npy")
            self.offsets.append((_data_offset(work / f"{name}.ids.npy"), _data_offset(work / f"{name}.mask.npy")))
            starts.append(np.concatenate([[0], np.cumsum(lens)]))
            firsts.append(firsts[-1] + len(lens))
        self.firsts = np.array(firsts, dtype=np.int64)
        self.starts = starts
        self.lengths = np.concatenate([np.diff(s) for s in starts]) if starts else np.zeros(0, np.int64)
        self._open: OrderedDict[int, tuple[BinaryIO, BinaryIO]] = OrderedDict()

    def _files(self, s: int) -> tuple[BinaryIO, BinaryIO]:
        if s in self._open:
            self._open.move_to_end(s)
            return self._open[s]
        if len(self._open) >= self.OPEN_SHARDS:
            for f in self._open.popitem(last=False)[1]:
                f.close()
        name = self.names[s]
        files = (open(self.work / f"{name}.ids.npy", "rb"), open(self.work / f"{name}.mask.npy", "rb"))
        self._open[s] = files
        return files

    def doc(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        s = int(np.searchsorted(self.firsts, i, side="right")) - 1
        j = i - int(self.firsts[s])
        a, b = int(self.starts[s][j]), int(self.starts[s][j + 1])
        (fi, fm), (oi, om) = self._files(s), self.offsets[s]
        fi.seek(oi + 4 * a)
        fm.seek(om + a)
        return np.frombuffer(fi.read(4 * (b - a)), dtype=np.int32), np.frombuffer(fm.read(b - a), dtype=np.bool_)

    def close(self) -> None:
        for files in self._open.values():
            for f in files:
                f.close()
        self._open.clear()


def _data_offset(path: Path) -> int:
    """Where the data of a ``.npy`` file starts (after its header)."""
    with open(path, "rb") as f:
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        return f.tell()


def write_rows(reader: ShardReader, out: Path, max_tokens: int, pad_id: int, min_room: int) -> RowCounts:
    """Pack every document of `reader` and write the three arrays into `out`: their counts."""
    row_of, offset, n_rows = place_documents(reader.lengths, max_tokens, min_room)
    order = np.argsort(row_of, kind="stable")  # by row, documents of a row in source order
    rows_sorted = row_of[order]
    doc_id = np.arange(len(order)) - np.searchsorted(rows_sorted, rows_sorted, side="left")
    writers = {k: NpyWriter(out / f"{k}.npy", dt, (n_rows, max_tokens)) for k, dt in ARRAYS.items()}
    chunk = max(1, ROW_CHUNK_TOKENS // max_tokens)
    counts = RowCounts()
    for r0 in range(0, n_rows, chunk):
        r1 = min(n_rows, r0 + chunk)
        ids = np.full((r1 - r0, max_tokens), pad_id, dtype=np.int64)
        mask = np.zeros((r1 - r0, max_tokens), dtype=np.bool_)
        docs = np.full((r1 - r0, max_tokens), -1, dtype=np.int32)
        lo, hi = np.searchsorted(rows_sorted, [r0, r1], side="left")
        for k in range(int(lo), int(hi)):
            d = int(order[k])
            r, p = int(row_of[d]) - r0, int(offset[d])
            t, m = reader.doc(d)
            ids[r, p:p + len(t)] = t
            mask[r, p:p + len(t)] = m
            docs[r, p:p + len(t)] = doc_id[k]
        writers["input_ids"].write(ids)
        writers["loss_mask"].write(mask)
        writers["document_ids"].write(docs)
        counts.add(ids, mask, docs)
    for w in writers.values():
        w.close()
    return counts


def fresh_work_dir(work: Path, key: str) -> None:
    """`work` ready for a build of `key`: kept when an earlier build of the same key left it."""
    marker = work / "key"
    if work.is_dir() and marker.is_file() and marker.read_text().strip() == key:
        return
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    marker.write_text(key + "\n")
