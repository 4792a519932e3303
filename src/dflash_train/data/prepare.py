"""Prepared (tokenised, templated, loss-masked, packed) training data and its cache.

`load_prepared(cfg, tokenizer, family)` is the trainer's single entry point:

1. conversations come from ``data.regenerated`` (a JSONL written by
   ``dflash-train regenerate``) when set, else from ``data.source``
   (see `dflash_train.data.sources`), at most ``data.limit`` of them, read as the
   build needs them (`stream_source_conversations`: never all held at once);
2. the fixed hash split sets the held-out ones aside (never trained on);
3. each training conversation is formatted with its chat format and
   assistant-only loss mask (`dflash_train.data.template`), cut by
   ``data.long_rule`` and packed into rows of ``data.max_tokens``
   (`dflash_train.data.packing`; documents with fewer than
   ``model.block_size + 1`` supervised tokens are dropped and counted),
   on every core the process is given (`dflash_train.data.prepare_build`).

The result is cached on disk in ``data.cache_dir/<key>/`` in the form
`dflash_train.data.prepared_store` describes (flat arrays that readers memory-map, the
counts training reads instead of scanning them, ``index.json``, ``heldout.jsonl``). ``<key>``
hashes the format version, the source spec and the identity of its file (path, size, mtime;
the package version for ShareGPT), limit, max_tokens, long_rule, heldout_fraction, the drop rule,
the regenerated file's identity and the tokenizer (its full serialisation,
chat template, family). Same inputs -> the cache is reused; any change -> a
new key (caches of the older format have another key: they are rebuilt, not read).
``data.source=prepared:DIR`` reads such a directory directly (its
tokenizer fingerprint and max_tokens must match).

One build per cache directory at a time: the builder holds an exclusive flock on the
directory the cache lives in; every other process (the other ranks of a torchrun node,
another prepare-data) waits on it, then finds the cache whole and reads it. A killed build
leaves no ``index.json`` (the rows are renamed into place whole) but keeps its finished
tokenised shards beside it: the same command goes on from them.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dflash_train.config import DataSource
from dflash_train.data.augment import copy_task_documents
from dflash_train.data.dataset_files import dataset_identity
from dflash_train.data.domains import domain_conversations, domains_identity
from dflash_train.data.prepare_build import (
    CutRule,
    ShardReader,
    available_cores,
    fresh_work_dir,
    tokenize_shards,
    training_shards,
    write_docs,
    write_rows,
)
from dflash_train.data.prepared_store import (FORMAT_VERSION, HELDOUT_FILE, HeldoutWriter, PreparedData, read_prepared,
                                              write_index)
from dflash_train.data.sources import (
    Conversation,
    DataError,
    ReadStats,
    end_of_read,
    iter_conversations,
    read_conversations,
    sharegpt_identity,
)
from dflash_train.data.template import ChatFormat
from dflash_train.storage import StorageError, writing

log = logging.getLogger(__name__)

__all__ = ["FORMAT_VERSION", "PreparedData", "build_prepared", "load_prepared", "prepare_command", "read_prepared"]


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
    if src.kind == "dataset":
        return dataset_identity(src.path)
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
        "chat_template_kwargs": d.chat_template_kwargs or None,
    }


def cache_key(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- build


def read_source_conversations(cfg, limit: int | None = None) -> tuple[list[Conversation], ReadStats]:
    """The run's conversations: ``data.regenerated``'s when set, else the first `limit` (default
    ``data.limit``) of ``data.source`` followed by ``data.domain_prompts``' prompts."""
    convs, stats = stream_source_conversations(cfg, limit)
    return list(convs), stats


def stream_source_conversations(cfg, limit: int | None = None) -> tuple[Iterator[Conversation], ReadStats]:
    """`read_source_conversations`' conversations one at a time (a build never holds them all); the
    stats are whole, and a source without any conversation refused, once the iterator is done."""
    d = cfg.data
    limit = d.limit if limit is None else limit
    spec = "jsonl:" + str(d.regenerated) if d.regenerated else d.source
    if not d.regenerated and not d.parsed_source.has_conversations:
        raise DataError(f"data.source={d.source} holds no conversations")
    stats = ReadStats(spec)

    def conversations() -> Iterator[Conversation]:
        n = 0
        try:
            for conv in iter_conversations(spec, _with_domains(limit, d.domain_prompts) if d.regenerated else limit, stats):
                n += 1
                yield conv
        except OSError as e:  # the source's, not a write's: a build reads it while writing its shards
            raise DataError(f"{spec}: unreadable ({e})") from None
        end_of_read(stats, n)
        if d.domain_prompts and not d.regenerated:
            for conv in domain_conversations(d.domain_prompts, d.source, n, d.heldout_fraction):
                n += 1
                yield conv
            stats.read = n

    return conversations(), stats


def _with_domains(limit: int | None, domains: dict[str, int]) -> int | None:
    return None if limit is None else limit + sum(domains.values())


def build_prepared(cfg, tokenizer, family: str | None, out_dir: Path, inputs: dict[str, Any],
                   progress: Callable[[int, int], None] | None = None, workers: int | None = None) -> PreparedData:
    """Read, split, format, cut and pack into `out_dir` (replaced whole at the end, through a temp
    dir beside it), then read it back memory-mapped. `workers`: worker processes (default: the
    cores this process is given). A write the file system refuses raises StorageError naming
    `out_dir` and leaves nothing beside it; any other end keeps the finished shards for the next
    build of the same inputs (``.NAME.build`` beside `out_dir`)."""
    t0 = time.perf_counter()
    d = cfg.data
    out_dir = Path(out_dir)
    key = cache_key(inputs)
    convs, rstats = stream_source_conversations(cfg)
    heldout: HeldoutWriter | None = None
    reading = [0.0]  # seconds spent reading the source, between the shards
    rule = CutRule(int(d.max_tokens), d.long_rule, min_supervised_for(cfg), dict(d.chat_template_kwargs or {}))
    work = out_dir.parent / f".{out_dir.name}.build"
    tmp = out_dir.parent / f".{out_dir.name}.tmp{os.getpid()}"
    done = False
    try:
        with writing(out_dir):
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            fresh_work_dir(work, key)
            heldout = HeldoutWriter(work / HELDOUT_FILE)  # streamed to disk, not held (prepared_store)
            log.info("preparing the training conversations of %s on up to %d worker(s) into %s",
                     d.regenerated or d.source, workers or available_cores(), out_dir)
            try:
                shards = training_shards(convs, d.heldout_fraction, heldout, reading)
                names, records, used, n_train = tokenize_shards(shards, tokenizer, family, rule, work, workers, progress)
            except BrokenProcessPool:
                raise DataError(f"prepare-data: a worker process died (killed, out of memory?) while preparing "
                                f"{out_dir}; the same command goes on after the shards already done") from None
            t_tok = time.perf_counter()
            log.info("prepared %d training conversations (%d held out) in %d shard(s)", n_train, len(heldout), len(names))
            stats = _shard_stats(records, rstats, rule)
            if not stats["documents"]:
                raise DataError(
                    f"{d.regenerated or d.source}: no training rows: {n_train} training conversation(s), "
                    f"{stats['dropped_documents']} document(s) dropped for fewer than {rule.min_supervised} "
                    f"supervised tokens (max_tokens={d.max_tokens}, long_rule={d.long_rule})")
            if d.copy_task_docs:
                # prompts come from the original source (a regenerated file holds few of them)
                src_convs, _ = read_conversations(d.source, max(d.limit or 0, 4 * d.copy_task_docs))
                fmt = ChatFormat(tokenizer, family, template_kwargs=rule.template_kwargs)
                docs = copy_task_documents(src_convs, fmt, tokenizer, d.copy_task_docs,
                                           d.max_tokens, d.heldout_fraction, seed=int(cfg.train.seed))
                extra = write_docs(work, "copy-task", docs, {"conversations": 0})
                names.append("copy-task")
                stats["copy_task_documents"] = extra["docs"]
                stats["documents"] += extra["docs"]
                stats["tokens"] += extra["tokens"]
                stats["supervised_tokens"] += extra["supervised"]
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            reader = ShardReader(work, names)
            try:
                counts = write_rows(reader, tmp, rule.max_tokens, _pad_id(tokenizer), rule.min_supervised)
            finally:
                reader.close()
            n_rows = counts.rows
            seconds = time.perf_counter() - t0
            stats.update(source=d.regenerated or d.source, conversations_read=rstats.read,
                         train_conversations=n_train, heldout_conversations=len(heldout), rows=n_rows,
                         max_tokens=rule.max_tokens, fill=stats["tokens"] / float(n_rows * rule.max_tokens),
                         seconds=round(seconds, 3), workers=used,
                         # where the time went: reading the source and packing are the serial parts
                         phase_seconds={"read": round(reading[0], 3), "tokenize": round(t_tok - t0 - reading[0], 3),
                                        "pack": round(time.perf_counter() - t_tok, 3)},
                         tokens_per_second=round(stats["tokens"] / max(seconds, 1e-9), 1))
            heldout.close()
            os.replace(work / HELDOUT_FILE, tmp / HELDOUT_FILE)
            write_index(tmp, inputs, key, counts, rule.max_tokens, stats)
            if out_dir.exists():
                shutil.rmtree(out_dir)
            os.replace(tmp, out_dir)
            done = True
    except (StorageError, DataError):
        shutil.rmtree(work, ignore_errors=True)  # a full disk or bad input: nothing is left beside out_dir
        raise
    finally:
        if heldout is not None:
            heldout.close()
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; a failure's leftovers
        if done:
            shutil.rmtree(work, ignore_errors=True)
    return read_prepared(out_dir)


def _shard_stats(records: list[dict[str, Any]], rstats: ReadStats, rule: CutRule) -> dict[str, Any]:
    """The shards' counts added up in shard order (so the examples are the same whatever the workers)."""
    skipped = dict(rstats.skipped)
    examples = {k: list(v) for k, v in rstats.examples.items()}
    mismatched = sum(r["template_mismatch"] for r in records)
    if mismatched:
        skipped["template_mismatch"] = skipped.get("template_mismatch", 0) + mismatched
        ex = examples.setdefault("template_mismatch", [])
        for r in records:
            ex.extend(r["mismatch_examples"][:max(0, 5 - len(ex))])
    return {"skipped": skipped, "skipped_examples": examples, "truncated_item": rstats.truncated_item,
            "long_conversations": sum(r["long"] for r in records), "long_rule": rule.long_rule,
            "documents": sum(r["docs"] for r in records), "copy_task_documents": 0,
            "dropped_documents": sum(r["dropped"] for r in records), "min_supervised": rule.min_supervised,
            "tokens": sum(r["tokens"] for r in records), "supervised_tokens": sum(r["supervised"] for r in records)}


def _pad_id(tokenizer) -> int:
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return int(pad_id)


@contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """An exclusive flock on `directory` for one build in it: the other ranks of a node (or other
    commands) wait here instead of building the same rows beside it. A lock on the directory
    itself, not a lock file: nothing is left behind, and the kernel drops it when its holder dies."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process preparing data in %s", directory)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def cache_dir_for(cfg, tokenizer, family: str | None) -> tuple[Path, dict[str, Any]]:
    inputs = cache_inputs(cfg, tokenizer, family)
    return Path(cfg.data.cache_dir).expanduser() / cache_key(inputs), inputs


def _cached(cdir: Path, inputs: dict[str, Any], say: bool = True) -> PreparedData | None:
    if not (cdir / "index.json").is_file():
        return None
    try:
        data = read_prepared(cdir)
    except (DataError, OSError, KeyError, ValueError) as e:
        if say:
            log.warning("rebuilding unreadable prepared-data cache %s: %s", cdir, e)
        return None
    if data.stats.get("inputs") != inputs:
        return None
    data.stats["cache"] = "hit"
    return data


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
    data = _cached(cdir, inputs)
    if data is not None:
        return data
    try:
        with writing(cdir), build_lock(cdir.parent):
            data = _cached(cdir, inputs, say=False)  # built by the process this one waited for
            if data is None:
                data = build_prepared(cfg, tokenizer, family, cdir, inputs, progress)
                data.stats["cache"] = "miss"
    except StorageError as e:  # a cache that cannot be written costs time, not data
        log.warning("could not write the prepared-data cache: %s", e)
        with tempfile.TemporaryDirectory(prefix="dflash-prepared-") as tmp:
            data = build_prepared(cfg, tokenizer, family, Path(tmp) / "rows", inputs, progress)
        data.path = None  # the mapped files outlive their (removed) directory
        data.stats["cache"] = "miss"
    data.stats["inputs"] = inputs
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
            out = Path(out)
            with writing(out), build_lock(out.parent):
                data = build_prepared(cfg, tokenizer, family, out, cache_inputs(cfg, tokenizer, family), progress)
            dest = out
    s = data.stats
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(s.get("skipped", {}).items())) or "none"
    console.print(
        f"{s['conversations_read']} conversations ({s['train_conversations']} train, {s['heldout_conversations']} held out), "
        f"skipped: {skipped}; {s['rows']} rows x {s['max_tokens']} tokens, fill {s['fill']:.2f}, "
        f"{s['supervised_tokens']} supervised tokens, {s['dropped_documents']} short documents dropped"
        + (f"; source file cut off at item {s['truncated_item']['index']}" if s.get("truncated_item") else "")
        + (" (cached)" if s.get("cache") == "hit" else
           f"; {s['tokens']} tokens in {s['seconds']:.1f}s on {s['workers']} worker(s), "
           f"{s['tokens_per_second']:.0f} tokens/s")
    )
    print(dest)
    return Path(dest) if dest else Path(".")
