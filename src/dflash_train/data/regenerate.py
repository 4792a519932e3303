"""`dflash-train regenerate`: rewrite assistant answers with the target itself.

Single-turn: for every conversation of ``data.source`` (at most ``data.limit``)
the prompt is its system text (if any) + FIRST user turn, formatted with the
target's chat format and its generation prompt; the target generates the
answer (greedy at temperature 0, else sampling seeded by ``train.seed``),
batched with left padding, stopping at the end-of-turn / eos token or
``max_new_tokens``. Later turns of multi-turn conversations are dropped.
Prompts of ``data.max_tokens`` tokens or more are skipped (their answer could
not fit in a training row).

Output: one JSON line per conversation, ShareGPT shape with the SAME id (so the
held-out split is unchanged) plus ``"regenerated": {"max_new_tokens",
"temperature", "finished", "new_tokens"}``. Resumable: the output file is
appended to, conversations whose id is already present are skipped, and a
torn last line (an interrupted write) is cut off first. Train on the result
with ``data.regenerated=OUT``.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from dflash_train.data.sources import Conversation, DataError, read_conversations
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


def generate_answers(target, fmt: ChatFormat, prompts: list[list[int]], max_new_tokens: int,
                     temperature: float, generator_seed: int | None = None) -> list[tuple[list[int], bool]]:
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
        kw.update(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0)
        if generator_seed is not None:
            torch.manual_seed(generator_seed)
    else:
        kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    head = target.packed_head_for_generate() if hasattr(target, "packed_head_for_generate") else contextlib.nullcontext()
    with torch.inference_mode(), head:
        out = target.model.generate(input_ids=ids.to(target.device), attention_mask=att.to(target.device), **kw)
    res = []
    for row in out[:, T:].tolist():
        new, finished = [], False
        for t in row:
            if t in stops:
                finished = True
                break
            new.append(t)
        res.append((new, finished))
    return res


# prompts per engine call: an interrupted or timed-out engine run loses at most this many answers
# (each call is one engine start, ~20-40 s on CPU; 1,024 x 128 tokens is ~15 min at 143 tok/s)
ENGINE_CHUNK = 1024


def regenerate_conversations(cfg, out: Path, target, max_conversations: int | None = None, max_new_tokens: int = 256,
                             batch_size: int = 8, temperature: float = 0.0, generate=None,
                             engine_chunk: int = ENGINE_CHUNK) -> dict:
    """Regenerate the answers of the first `max_conversations` conversations of
    ``data.source`` (default ``data.limit``) into `out` (JSONL, appended,
    resumable) with `target`: a loaded Target, or a function that loads one (called only when
    something is left to regenerate). Returns counts:
    conversations, already_done, written, prompt_too_long, empty_answer,
    new_tokens, seconds.

    `generate`: answers all prompts in one batched call instead of our own decoding loop
    (``generate(prompt_ids, max_new_tokens, stop_token_ids) -> [(new ids, finished)]``, greedy;
    the demo passes vLLM's batched generation, `engine.serve_bench.generate_in_vllm`), called on
    `engine_chunk` prompts at a time, each chunk's answers written before the next; `target`
    then only needs its tokenizer and family."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if max_new_tokens < 1 or batch_size < 1 or temperature < 0:
        raise DataError("regenerate needs max_new_tokens >= 1, batch_size >= 1, temperature >= 0")
    src = cfg.data.source
    if src.startswith(("prepared:", "precomputed:")):
        raise DataError(f"regenerate reads conversations; data.source={src} has none")
    out = Path(out)
    with writing(out.parent, "creating"):
        out.parent.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    limit = max_conversations if max_conversations is not None else cfg.data.limit
    convs, _ = read_conversations(src, limit)
    with writing(out):  # cutting a torn last line off
        done = done_ids(out)
    todo = [c for c in convs if c.id not in done]
    counts = {"conversations": len(convs), "already_done": len(convs) - len(todo), "written": 0,
              "prompt_too_long": 0, "empty_answer": 0, "new_tokens": 0}
    if not todo:
        console.print(f"regenerate: all {len(convs)} conversations already in {out}")
        return counts
    if not hasattr(target, "tokenizer"):
        target = target()
    fmt = ChatFormat(target.tokenizer, target.family)
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
    # batches of similar prompt lengths: left padding is wasted compute on every decode step
    items.sort(key=lambda it: len(it[1]))
    t0 = time.perf_counter()
    # a refused write (full disk, read-only or vanished directory): one line; the batches fsync'd
    # before stay, a torn last line is cut off by the rerun (done_ids)
    appending = lambda: writing(out, hint="the answers written before are kept and "  # noqa: E731
                                          "the same command goes on from there")

    def write(f, conv: Conversation, new: list[int], finished: bool) -> None:
        text = target.tokenizer.decode(new, skip_special_tokens=True).strip()
        counts["new_tokens"] += len(new)
        if not text:
            counts["empty_answer"] += 1
            return
        rec = Conversation(conv.id, conv.messages + [{"role": "assistant", "content": text}]).to_json()
        rec["regenerated"] = {"max_new_tokens": max_new_tokens, "temperature": temperature,
                              "finished": finished, "new_tokens": len(new)}
        f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        counts["written"] += 1

    if generate is not None:
        if temperature != 0:
            raise DataError("regenerate through an engine is greedy only (temperature 0)")
        runs = range(0, len(items), engine_chunk)
        console.print(f"regenerating {len(items)} answers in {len(runs)} batched engine run(s)")
        with appending(), out.open("a", encoding="utf-8") as f:
            for b in runs:
                chunk = items[b:b + engine_chunk]
                try:
                    answers = generate([ids for _, ids in chunk], max_new_tokens, fmt.stop_token_ids())
                except BaseException:
                    console.print(f"regenerate: {counts['written']} answers of this run kept in {out}; "
                                  "a rerun goes on from there")
                    raise
                for (conv, _), (new, finished) in zip(chunk, answers):
                    write(f, conv, list(new), bool(finished))
                f.flush()
                os.fsync(f.fileno())
    else:
        with Progress(TextColumn("[bold]regenerating[/bold]"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), TextColumn("{task.fields[tps]}"), console=console) as bar:
            task = bar.add_task("regen", total=len(items), tps="")
            with appending(), out.open("a", encoding="utf-8") as f:
                for b in range(0, len(items), batch_size):
                    chunk = items[b:b + batch_size]
                    seed = None if temperature == 0 else int(cfg.train.seed) * 1_000_003 + b
                    answers = generate_answers(target, fmt, [ids for _, ids in chunk], max_new_tokens, temperature, seed)
                    for (conv, _), (new, finished) in zip(chunk, answers):
                        write(f, conv, new, finished)
                    f.flush()
                    os.fsync(f.fileno())
                    dt = time.perf_counter() - t0
                    bar.update(task, advance=len(chunk), tps=f"{counts['new_tokens'] / max(dt, 1e-9):.1f} tok/s")
    counts["seconds"] = round(time.perf_counter() - t0, 2)
    console.print(f"regenerate: wrote {counts['written']} answers to {out} ({counts['already_done']} already there, "
                  f"{counts['prompt_too_long']} prompts too long, {counts['empty_answer']} empty) "
                  f"in {counts['seconds']} s, {counts['new_tokens']} new tokens")
    return counts
