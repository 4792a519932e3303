"""`dflash-train regenerate`: rewrite assistant answers with the target itself.

Single-turn: for every conversation of ``data.source`` (at most ``data.limit``)
the prompt is its system text (if any) + FIRST user turn, formatted with the
target's chat format and its generation prompt; the target generates the
answer (greedy at temperature 0, else sampling seeded by ``train.seed``),
stopping at the chat format's stop tokens or ``max_new_tokens``. Later turns of
multi-turn conversations are dropped. Prompts of ``data.max_tokens`` tokens or
more are skipped (their answer could not fit in a training row).

Who writes the answers: an `Answerer`, chosen once by the caller: `InProcess` (our batched
loop, left padding, `generate_answers`), `BatchedEngine` (one batched vLLM run per chunk), or
`EndpointFleet` (OpenAI-compatible servers: `--endpoint URL` repeated, `--local-servers N`;
data/endpoints.py).

Output: one JSON line per conversation, ShareGPT shape with the SAME id (so the
held-out split is unchanged) plus ``"regenerated": {"max_new_tokens",
"temperature", "top_p", "finished", "new_tokens", "token_ids", "engine"}``:
``token_ids`` are the answer's ids exactly as the target produced them (the
stop token excluded), the text is their decoding. Records are appended as
answers come back and fsync'd every chunk (at most every SYNC_EVERY records or
SYNC_SECONDS). Resumable: conversations whose id is already present are
skipped, and a torn last line (an interrupted write) is cut off first. Train on
the result with ``data.regenerated=OUT``.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from dflash_train.data.endpoints import Fleet, FleetSpec, Job, Sampling
from dflash_train.data.prepare import read_source_conversations
from dflash_train.data.sources import Conversation, DataError
from dflash_train.data.template import ChatFormat
from dflash_train.storage import writing

log = logging.getLogger(__name__)


def done_ids(out: Path) -> set[str]:
    """Ids already in `out`; cuts off a torn last line first."""
    if not out.is_file():
        return set()
    raw = out.read_bytes()
    if raw and not raw.endswith(b"\n"):
        cut = raw.rfind(b"\n") + 1
        with out.open("r+b") as f:
            f.truncate(cut)
        raw = raw[:cut]
    ids = set()
    # JSONL lines end at b"\n" only: str.splitlines() also splits at U+2028 / U+0085 inside an
    # answer (ensure_ascii=False), which lost that record's id and regenerated it on every rerun
    for line in raw.split(b"\n"):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and "id" in obj:
            ids.add(str(obj["id"]))
    return ids


def split_stop(ids, stops) -> tuple[list[int], int | None]:
    """The answer before its first stop token, and that stop token (None: no stop token ended
    it). An engine returns the stop id with the answer; a batched generate() pads rows past it."""
    for i, t in enumerate(ids):
        if t in stops:
            return [int(x) for x in ids[:i]], int(t)
    return [int(x) for x in ids], None


def generate_answers(target, fmt: ChatFormat, prompts: list[list[int]], max_new_tokens: int,
                     temperature: float, generator_seed: int | None = None,
                     top_p: float = 1.0) -> list[tuple[list[int], bool]]:
    """Batched generation with left padding -> [(new token ids without the stop token, finished)]."""
    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    stops = fmt.stop_token_ids()
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad, dtype=torch.long)
    att = torch.zeros((len(prompts), T), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = torch.tensor(p, dtype=torch.long)
        att[i, T - len(p):] = 1
    kw = dict(max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=stops or None)
    if temperature > 0:
        kw.update(do_sample=True, temperature=float(temperature), top_k=0, top_p=float(top_p))
        if generator_seed is not None:
            torch.manual_seed(generator_seed)
    else:
        kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    head = target.packed_head_for_generate() if hasattr(target, "packed_head_for_generate") else contextlib.nullcontext()
    with torch.inference_mode(), head:
        out = target.model.generate(input_ids=ids.to(target.device), attention_mask=att.to(target.device), **kw)
    res = []
    for row in out[:, T:].tolist():
        new, stop = split_stop(row, stops)
        res.append((new, stop is not None))
    return res


# prompts per engine call: an interrupted or timed-out engine run loses at most this many answers
# (each call is one engine start, ~20-40 s on CPU; 1,024 x 128 tokens is ~15 min at 143 tok/s)
ENGINE_CHUNK = 1024
# answers from servers come back one at a time: fsync after this many records or seconds
SYNC_EVERY, SYNC_SECONDS = 256, 2.0


class _Records:
    """The output file's writer: one record per answer, fsync'd every chunk."""

    def __init__(self, f, tokenizer, meta: dict, counts: dict):
        self.f, self.tokenizer, self.meta, self.counts = f, tokenizer, meta, counts
        self.unsynced, self.synced_at, self.ids = 0, time.monotonic(), set()

    def add(self, conv: Conversation, new: list[int], finished: bool, engine: str) -> None:
        if conv.id in self.ids:  # the file never holds a conversation twice
            return
        self.ids.add(conv.id)
        self.counts["new_tokens"] += len(new)
        text = self.tokenizer.decode(new, skip_special_tokens=True).strip()
        if not text:
            self.counts["empty_answer"] += 1
            return
        rec = Conversation(conv.id, conv.messages + [{"role": "assistant", "content": text}]).to_json()
        rec["regenerated"] = {**self.meta, "finished": bool(finished), "new_tokens": len(new),
                              "token_ids": list(new), "engine": engine}
        self.f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self.counts["written"] += 1
        self.unsynced += 1

    def sync(self, force: bool = True) -> None:
        if self.unsynced and (force or self.unsynced >= SYNC_EVERY
                              or time.monotonic() - self.synced_at >= SYNC_SECONDS):
            self.f.flush()
            os.fsync(self.f.fileno())
            self.unsynced, self.synced_at = 0, time.monotonic()


@contextlib.contextmanager
def _bar(console, total: int, counts: dict):
    """A rich progress bar: answers, elapsed, ETA, tokens/s, per-endpoint counts;
    yields advance(n_answers, new_tokens_so_far, per_endpoint=""). The seconds it was up are
    counts["answer_seconds"] (local servers' start-up not counted)."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    t0 = time.perf_counter()
    with Progress(TextColumn("[bold]regenerating[/bold]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[tps]}"),
                  TextColumn("{task.fields[per]}"), console=console) as bar:
        task = bar.add_task("regen", total=total, tps="", per="")

        def advance(n: int, new_tokens: int, per: str = "") -> None:
            tps = new_tokens / max(time.perf_counter() - t0, 1e-9)
            bar.update(task, advance=n, tps=f"{tps:.1f} tok/s", per=per)

        try:
            yield advance
        finally:
            counts["answer_seconds"] = round(time.perf_counter() - t0, 2)


@dataclass(frozen=True)
class Ask:
    """What every answer of one regenerate call is asked with."""
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int  # train.seed: sampling at temperature > 0
    batch_size: int  # prompts per forward of the in-process loop


class Answerer(Protocol):
    """Who writes regenerate's answers: `InProcess`, `BatchedEngine` or `EndpointFleet`."""

    greedy_only: bool  # refuses temperature > 0

    def tokenizer_and_family(self) -> tuple[Any, str]:
        """The target's tokenizer and family; called only once something is left to answer."""

    def answer(self, items: list[tuple[Conversation, list[int]]], fmt: ChatFormat, ask: Ask,
               records: _Records, console) -> None:
        """Answer every (prompt conversation, prompt ids) of `items` into `records`."""


class InProcess:
    """Our batched decoding loop on the target loaded in this process. `load`: returns the Target
    (called only when something is left to regenerate)."""

    greedy_only = False

    def __init__(self, load: Callable[[], Any]):
        self._load, self._target = load, None

    def tokenizer_and_family(self) -> tuple[Any, str]:
        if self._target is None:
            self._target = self._load()
        return self._target.tokenizer, self._target.family

    def answer(self, items, fmt: ChatFormat, ask: Ask, records: _Records, console) -> None:
        self.tokenizer_and_family()
        with _bar(console, len(items), records.counts) as advance:
            for b in range(0, len(items), ask.batch_size):
                chunk = items[b:b + ask.batch_size]
                seed = None if ask.temperature == 0 else int(ask.seed) * 1_000_003 + b
                answers = generate_answers(self._target, fmt, [ids for _, ids in chunk], ask.max_new_tokens,
                                           ask.temperature, seed, ask.top_p)
                for (conv, _), (new, finished) in zip(chunk, answers):
                    records.add(conv, new, finished, "trainer")
                records.sync()
                advance(len(chunk), records.counts["new_tokens"])


class BatchedEngine:
    """One batched engine run per `chunk` prompts, greedy: ``generate(prompt_ids, max_new_tokens,
    stop_token_ids) -> [(new ids, finished)]`` (the demo and `--engine vllm` pass vLLM's,
    `engine.vllm_process.vllm_answers`); each chunk's answers are written before the next."""

    greedy_only = True

    def __init__(self, generate: Callable, tokenizer, family: str, chunk: int = ENGINE_CHUNK):
        self.generate, self.tokenizer, self.family, self.chunk = generate, tokenizer, family, chunk

    def tokenizer_and_family(self) -> tuple[Any, str]:
        return self.tokenizer, self.family

    def answer(self, items, fmt: ChatFormat, ask: Ask, records: _Records, console) -> None:
        stops = fmt.stop_token_ids()
        runs = range(0, len(items), self.chunk)
        console.print(f"regenerating {len(items)} answers in {len(runs)} batched engine run(s)")
        with _bar(console, len(items), records.counts) as advance:
            for b in runs:
                chunk = items[b:b + self.chunk]
                answers = self.generate([ids for _, ids in chunk], ask.max_new_tokens, stops)
                for (conv, _), (ids, finished) in zip(chunk, answers):
                    new, stop = split_stop(ids, stops)
                    records.add(conv, new, bool(finished) or stop is not None, "vllm")
                records.sync()
                advance(len(chunk), records.counts["new_tokens"])


class EndpointFleet:
    """OpenAI-compatible servers answer (`spec`: data/endpoints.FleetSpec), requests in flight at
    once, records written as answers come back; `spec.start` (local servers) runs only once
    answers are needed and stops with `answer`, also on errors."""

    greedy_only = False

    def __init__(self, spec: FleetSpec, tokenizer, family: str):
        self.spec, self.tokenizer, self.family = spec, tokenizer, family

    def tokenizer_and_family(self) -> tuple[Any, str]:
        return self.tokenizer, self.family

    def answer(self, items, fmt: ChatFormat, ask: Ask, records: _Records, console) -> None:
        spec, stops = self.spec, fmt.stop_token_ids()
        with (spec.start() if spec.start is not None else contextlib.nullcontext([])) as started:
            # a generation runs at >= 1 tok/s even on a loaded CPU server: past that it hangs
            fleet = Fleet([*spec.urls, *started], spec.max_in_flight, spec.wait_s, log=console.print,
                          request_timeout=300.0 + ask.max_new_tokens)
            served = fleet.connect()
            fleet.check_context(max(len(ids) for _, ids in items) + ask.max_new_tokens)
            models = sorted({s.model for s in served})
            console.print(f"regenerating {len(items)} answers through {len(served)} endpoint(s) serving "
                          f"{', '.join(models)}, at most {spec.max_in_flight} requests in flight each")
            sampling = Sampling(ask.max_new_tokens, stops, ask.temperature, ask.top_p, ask.seed)
            by_id = {conv.id: conv for conv, _ in items}
            with _bar(console, len(items), records.counts) as advance:
                for a in fleet.answer([Job(conv.id, ids) for conv, ids in items], sampling):
                    new, stop = split_stop(a.token_ids, stops)
                    records.add(by_id[a.key], new, stop is not None or a.finish_reason == "stop", a.endpoint)
                    records.sync(force=False)
                    advance(1, records.counts["new_tokens"], fleet.counts())
            records.counts["per_endpoint"] = {e.base: e.answered for e in fleet.endpoints}
            console.print(f"answers per endpoint: {fleet.counts()}")


def regenerate_conversations(cfg, out: Path, answerer: Answerer, max_conversations: int | None = None,
                             max_new_tokens: int = 256, batch_size: int = 8, temperature: float = 0.0,
                             top_p: float = 1.0) -> dict:
    """Regenerate the answers of the first `max_conversations` conversations of
    ``data.source`` (default ``data.limit``) and of ``data.domain_prompts``' prompts into `out` (JSONL, appended,
    resumable) through `answerer` (module docstring). Returns counts:
    conversations, already_done, written, prompt_too_long, empty_answer,
    new_tokens, seconds (+ per_endpoint through a fleet)."""
    if max_new_tokens < 1 or batch_size < 1 or not temperature >= 0 or not 0 < top_p <= 1:
        raise DataError("regenerate needs max_new_tokens >= 1, batch_size >= 1, temperature >= 0, 0 < top_p <= 1")
    if not cfg.data.parsed_source.has_conversations:
        raise DataError(f"regenerate reads conversations; data.source={cfg.data.source} has none")
    out = Path(out)
    with writing(out.parent, "creating"):
        out.parent.mkdir(parents=True, exist_ok=True)
    from rich.console import Console

    console = Console(stderr=True)
    limit = max_conversations if max_conversations is not None else cfg.data.limit
    source = cfg.model_copy(deep=True)
    source.data.regenerated = None
    convs, _ = read_source_conversations(source, limit)  # data.domain_prompts' prompts included
    with writing(out):  # cutting a torn last line off
        done = done_ids(out)
    todo = [c for c in convs if c.id not in done]
    counts = {"conversations": len(convs), "already_done": len(convs) - len(todo), "written": 0,
              "prompt_too_long": 0, "empty_answer": 0, "new_tokens": 0}
    if not todo:
        console.print(f"regenerate: all {len(convs)} conversations already in {out}")
        return counts
    tokenizer, family = answerer.tokenizer_and_family()
    fmt = ChatFormat(tokenizer, family, template_kwargs=cfg.data.chat_template_kwargs)
    items: list[tuple[Conversation, list[int]]] = []
    for c in todo:
        first = c.first_exchange()
        prompt_msgs = [m for m in first.messages if m["role"] != "assistant"]
        ids = fmt.prompt_ids(prompt_msgs)
        if len(ids) >= cfg.data.max_tokens:
            counts["prompt_too_long"] += 1
            continue
        items.append((Conversation(c.id, prompt_msgs), ids))
    if not items:  # a rerun: what is left has prompts too long to answer
        console.print(f"regenerate: nothing left to answer in {out} ({counts['prompt_too_long']} prompts too long)")
        return counts
    if answerer.greedy_only and temperature != 0:
        raise DataError("regenerate through an engine is greedy only (temperature 0)")
    # batches of similar prompt lengths: left padding is wasted compute on every decode step
    items.sort(key=lambda it: len(it[1]))
    t0 = time.perf_counter()
    meta = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}
    ask = Ask(max_new_tokens, temperature, top_p, int(cfg.train.seed), batch_size)
    # a refused write (full disk, read-only or vanished directory): one line; the records fsync'd
    # before stay, a torn last line is cut off by the rerun (done_ids)
    with writing(out, hint="the answers written before are kept and the same command goes on from there"), \
            out.open("a", encoding="utf-8") as f:
        records = _Records(f, tokenizer, meta, counts)
        try:
            answerer.answer(items, fmt, ask, records, console)
        except BaseException:
            records.sync()
            console.print(f"regenerate: {counts['written']} answers of this run kept in {out}; "
                          "a rerun goes on from there")
            raise
        records.sync()
    counts["seconds"] = round(time.perf_counter() - t0, 2)
    console.print(f"regenerate: wrote {counts['written']} answers to {out} ({counts['already_done']} already there, "
                  f"{counts['prompt_too_long']} prompts too long, {counts['empty_answer']} empty) "
                  f"in {counts['seconds']} s, {counts['new_tokens']} new tokens "
                  f"({counts['new_tokens'] / max(counts.get('answer_seconds', 0), 1e-9):.1f} tok/s over the "
                  f"{counts.get('answer_seconds')} s of answering)")
    return counts

