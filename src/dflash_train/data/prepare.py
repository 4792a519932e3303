"""Prepared (tokenised, templated, loss-masked, packed) training data and its cache.

`load_prepared(cfg, tokenizer, family)` is the trainer's single entry point:

1. conversations come from ``data.regenerated`` (a JSONL written by
   ``dflash-train regenerate``) when set, else from ``data.source``
   (see `dflash_train.data.sources`), at most ``data.limit`` of them;
2. the fixed hash split sets the held-out ones aside (never trained on);
3. each training conversation is formatted with its chat format and
   assistant-only loss mask (`dflash_train.data.template`), cut by
   ``data.long_rule`` and packed into rows of ``data.max_tokens``
   (`dflash_train.data.packing`; documents with fewer than
   ``model.block_size + 1`` supervised tokens are dropped and counted).

The result is cached on disk in ``data.cache_dir/<key>/``: ``index.json``
(inputs, stats, shard list), ``rows-NNNNN.safetensors`` (``input_ids`` int64,
``loss_mask`` bool, ``document_ids`` int32; up to 8192 rows each) and
``heldout.jsonl``. ``<key>`` hashes the format version, the source spec and
the identity of its file (path, size, mtime; the package version for
ShareGPT), limit, max_tokens, long_rule, heldout_fraction, the drop rule,
the regenerated file's identity and the tokenizer (its full serialisation,
chat template, family). Same inputs -> the cache is reused; any change -> a
new key. ``data.source=prepared:DIR`` reads such a directory directly (its
tokenizer fingerprint and max_tokens must match).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dflash_train.config import DataSource
from dflash_train.data.domains import domain_conversations, domains_identity
from dflash_train.data.packing import Document, cut_document, pack_documents
from dflash_train.data.sources import (
    Conversation,
    DataError,
    ReadStats,
    is_heldout,
    read_conversations,
    sharegpt_identity,
)
from dflash_train.data.augment import copy_task_documents
from dflash_train.data.template import ChatFormat, TemplateMismatch
from dflash_train.errors import parse_file
from dflash_train.storage import StorageError, writing
from dflash_train.utils import save_safetensors

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
ROWS_PER_SHARD = 8192


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


# --------------------------------------------------------------------------- identities


def tokenizer_fingerprint(tokenizer, family: str | None) -> str:
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    for extra in (getattr(tokenizer, "chat_template", None), getattr(tokenizer, "bos_token", None),
                  getattr(tokenizer, "eos_token", None), family):
        h.update(b"\x00" + str(extra).encode())
    return h.hexdigest()[:16]


def _file_identity(path: Path) -> str:
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def _source_identity(spec: str) -> str:
    src = DataSource.parse(spec)
    if src.kind == "sharegpt":
        return sharegpt_identity()
    if src.kind == "jsonl":
        return _file_identity(Path(src.path))
    return spec


def min_supervised_for(cfg) -> int:
    return int(cfg.model.block_size) + 1


def cache_inputs(cfg, tokenizer, family: str | None) -> dict[str, Any]:
    d = cfg.data
    return {
        "format_version": FORMAT_VERSION,
        "source": d.source,
        "source_identity": _source_identity(d.source) if not d.regenerated else None,
        "regenerated": _file_identity(Path(d.regenerated)) if d.regenerated else None,
        "limit": d.limit,
        "max_tokens": d.max_tokens,
        "long_rule": d.long_rule,
        "heldout_fraction": d.heldout_fraction,
        "copy_task_docs": d.copy_task_docs,
        "domain_prompts": d.domain_prompts or None,
        "domains_identity": domains_identity(d.domain_prompts) if d.domain_prompts and not d.regenerated else None,
        "min_supervised": min_supervised_for(cfg),
        "tokenizer": tokenizer_fingerprint(tokenizer, family),
        "family": family,
    }


def cache_key(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- build


def read_source_conversations(cfg, limit: int | None = None) -> tuple[list[Conversation], ReadStats]:
    """The run's conversations: ``data.regenerated``'s when set, else the first `limit` (default
    ``data.limit``) of ``data.source`` followed by ``data.domain_prompts``' prompts."""
    d = cfg.data
    limit = d.limit if limit is None else limit
    if d.regenerated:
        return read_conversations("jsonl:" + str(d.regenerated), _with_domains(limit, d.domain_prompts))
    if not d.parsed_source.has_conversations:
        raise DataError(f"data.source={d.source} holds no conversations")
    convs, stats = read_conversations(d.source, limit)
    if d.domain_prompts:
        convs = convs + domain_conversations(d.domain_prompts, d.source, len(convs), d.heldout_fraction)
        stats.read = len(convs)
    return convs, stats


def _with_domains(limit: int | None, domains: dict[str, int]) -> int | None:
    return None if limit is None else limit + sum(domains.values())


def build_prepared(cfg, tokenizer, family: str | None,
                   progress: Callable[[int, int], None] | None = None) -> PreparedData:
    """Read, split, format, cut and pack (no disk cache)."""
    t0 = time.perf_counter()
    d = cfg.data
    convs, rstats = read_source_conversations(cfg)
    fmt = ChatFormat(tokenizer, family)
    train = [c for c in convs if not is_heldout(c, d.heldout_fraction)]
    heldout = [c for c in convs if is_heldout(c, d.heldout_fraction)]
    skipped = dict(rstats.skipped)
    examples = {k: list(v) for k, v in rstats.examples.items()}
    min_sup = min_supervised_for(cfg)
    docs: list[Document] = []
    n_long = dropped = 0
    for i, conv in enumerate(train):
        try:
            enc = fmt.encode(conv.messages)
        except TemplateMismatch:
            skipped["template_mismatch"] = skipped.get("template_mismatch", 0) + 1
            examples.setdefault("template_mismatch", [])
            if len(examples["template_mismatch"]) < 5:
                examples["template_mismatch"].append(conv.id)
            continue
        pieces, was_long = cut_document(enc.input_ids, enc.loss_mask, d.max_tokens, d.long_rule)
        n_long += was_long
        for p in pieces:
            if p.supervised >= min_sup:
                docs.append(p)
            else:
                dropped += 1
        if progress is not None:
            progress(i + 1, len(train))
    n_real = len(docs)
    if d.copy_task_docs:

        # prompts come from the original source (a regenerated file holds few of them)
        src_convs, _ = read_conversations(d.source, max(d.limit or 0, 4 * d.copy_task_docs))
        docs += copy_task_documents(src_convs, fmt, tokenizer, d.copy_task_docs, d.max_tokens, d.heldout_fraction,
                                    seed=int(cfg.train.seed))
    if not n_real:
        raise DataError(
            f"{d.regenerated or d.source}: no training rows: {len(train)} training conversation(s), "
            f"{dropped} document(s) dropped for fewer than {min_sup} supervised tokens "
            f"(max_tokens={d.max_tokens}, long_rule={d.long_rule})"
        )
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    input_ids, loss_mask, document_ids = pack_documents(docs, d.max_tokens, int(pad_id), min_room=min_sup)
    n_tok = int((document_ids >= 0).sum())
    stats = {
        "source": d.regenerated or d.source,
        "conversations_read": rstats.read,
        "train_conversations": len(train),
        "heldout_conversations": len(heldout),
        "skipped": skipped,
        "skipped_examples": examples,
        "truncated_item": rstats.truncated_item,
        "long_conversations": n_long,
        "long_rule": d.long_rule,
        "documents": len(docs),
        "copy_task_documents": len(docs) - n_real,
        "dropped_documents": dropped,
        "min_supervised": min_sup,
        "rows": int(input_ids.shape[0]),
        "max_tokens": d.max_tokens,
        "tokens": n_tok,
        "supervised_tokens": int(loss_mask.sum()),
        "fill": n_tok / float(input_ids.numel()),
        "seconds": round(time.perf_counter() - t0, 3),
    }
    return PreparedData(input_ids, loss_mask, document_ids, heldout, stats)


# --------------------------------------------------------------------------- disk


def save_prepared(data: PreparedData, out_dir: Path, inputs: dict[str, Any]) -> Path:
    """Write `data` to `out_dir` atomically (a temp dir renamed into place); files get
    the usual (umask-respecting) permissions, like every file a server may read. A write the
    file system refuses raises StorageError naming `out_dir`; the temp dir is removed."""

    out_dir = Path(out_dir)
    tmp = out_dir.parent / f".{out_dir.name}.tmp{os.getpid()}"
    try:
        with writing(out_dir):
            _write_prepared(data, tmp, inputs)
            if out_dir.exists():
                shutil.rmtree(out_dir)
            os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; a failure's leftovers
    return out_dir


def _write_prepared(data: PreparedData, tmp: Path, inputs: dict[str, Any]) -> None:
    tmp.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards = []
    for k, s in enumerate(range(0, data.num_rows, ROWS_PER_SHARD)):
        name = f"rows-{k:05d}.safetensors"
        e = s + ROWS_PER_SHARD
        save_safetensors({"input_ids": data.input_ids[s:e].contiguous(),
                          "loss_mask": data.loss_mask[s:e].contiguous(),
                          "document_ids": data.document_ids[s:e].contiguous()}, tmp / name)
        shards.append({"file": name, "rows": int(min(e, data.num_rows) - s)})
    with (tmp / "heldout.jsonl").open("w") as f:
        for c in data.heldout:
            f.write(json.dumps(c.to_json(), ensure_ascii=False) + "\n")
    index = {"format_version": FORMAT_VERSION, "inputs": inputs, "key": cache_key(inputs), "shards": shards,
             "num_rows": data.num_rows, "max_tokens": data.max_tokens, "stats": data.stats}
    (tmp / "index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def read_prepared(path: Path) -> PreparedData:
    from safetensors.torch import load_file

    path = Path(path)
    idx_file = path / "index.json"
    index = parse_file(idx_file, json.loads, DataError, f"{path} is not a prepared-data directory (no index.json)",
                       lambda e: f"{idx_file}: unreadable ({e})", (json.JSONDecodeError,))
    if index.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path}: prepared-data format {index.get('format_version')}, this version reads {FORMAT_VERSION}; "
                        "run prepare-data again")
    parts = [load_file(str(path / s["file"])) for s in index["shards"]]
    cat = lambda k: torch.cat([p[k] for p in parts]) if parts else torch.empty(0)  # noqa: E731
    heldout = []
    hf = path / "heldout.jsonl"
    if hf.is_file():
        heldout = [Conversation.from_json(json.loads(line)) for line in hf.read_bytes().split(b"\n") if line.strip()]  # "\n" only: answers may hold U+2028
    data = PreparedData(cat("input_ids"), cat("loss_mask"), cat("document_ids"), heldout,
                        dict(index.get("stats", {})), path)
    data.stats["inputs"] = index.get("inputs", {})
    return data


def cache_dir_for(cfg, tokenizer, family: str | None) -> tuple[Path, dict[str, Any]]:
    inputs = cache_inputs(cfg, tokenizer, family)
    return Path(cfg.data.cache_dir).expanduser() / cache_key(inputs), inputs


def load_prepared(cfg, tokenizer, family: str | None = None,
                  progress: Callable[[int, int], None] | None = None) -> PreparedData:
    """Prepared rows for `cfg` (RunConfig): from the cache when the inputs are
    unchanged, else built and cached. ``data.source=prepared:DIR`` reads DIR."""
    d = cfg.data
    src = d.parsed_source
    if src.kind == "prepared" and not d.regenerated:
        path = src.local_path
        data = read_prepared(path)
        want = tokenizer_fingerprint(tokenizer, family)
        got = data.stats.get("inputs", {}).get("tokenizer")
        if got and got != want:
            raise DataError(f"{path} was prepared with a different tokenizer than the target's")
        if data.max_tokens != d.max_tokens:
            raise DataError(f"{path} has rows of {data.max_tokens} tokens but data.max_tokens={d.max_tokens}")
        data.stats["cache"] = "prepared"
        return data
    if src.kind == "precomputed" and not d.regenerated:
        raise DataError(f"data.source={d.source}: precomputed features are read by the pipeline, not by load_prepared")
    cdir, inputs = cache_dir_for(cfg, tokenizer, family)
    if (cdir / "index.json").is_file():
        try:
            data = read_prepared(cdir)
            if data.stats.get("inputs") == inputs:
                data.stats["cache"] = "hit"
                return data
        except (DataError, OSError, KeyError, ValueError) as e:
            log.warning("rebuilding unreadable prepared-data cache %s: %s", cdir, e)
    data = build_prepared(cfg, tokenizer, family, progress)
    try:
        save_prepared(data, cdir, inputs)
        data.path = cdir
    except StorageError as e:  # the rows are in memory: a cache that cannot be written costs time, not data
        log.warning("could not write the prepared-data cache: %s", e)
    data.stats["inputs"] = inputs
    data.stats["cache"] = "miss"
    return data


def prepare_command(cfg, out: Path | None, tokenizer, family: str) -> Path:
    """`dflash-train prepare-data`: tokenise + template + loss-mask once with the target's `tokenizer`
    (of chat `family`), into `out` (default: the cache directory load_prepared will look in)."""
    console = Console(stderr=True)
    with Progress(TextColumn("[bold]preparing[/bold] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=False) as bar:
        task = bar.add_task(cfg.data.regenerated or cfg.data.source, total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        if out is None:
            data = load_prepared(cfg, tokenizer, family, progress)
            dest = data.path
        else:
            inputs = cache_inputs(cfg, tokenizer, family)
            data = build_prepared(cfg, tokenizer, family, progress)
            dest = save_prepared(data, Path(out), inputs)
    s = data.stats
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(s.get("skipped", {}).items())) or "none"
    console.print(
        f"{s['conversations_read']} conversations ({s['train_conversations']} train, {s['heldout_conversations']} held out), "
        f"skipped: {skipped}; {s['rows']} rows x {s['max_tokens']} tokens, fill {s['fill']:.2f}, "
        f"{s['supervised_tokens']} supervised tokens, {s['dropped_documents']} short documents dropped"
        + (f"; source file cut off at item {s['truncated_item']['index']}" if s.get("truncated_item") else "")
        + (" (cached)" if s.get("cache") == "hit" else "")
    )
    print(dest)
    return Path(dest) if dest else Path(".")
