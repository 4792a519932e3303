"""Copy-task documents: teach the drafter to copy from its context, cheaply.

A drafter learns copying ("where did this token occur before, and what followed
it") only from many distinct examples of it; a few hundred regenerated answers
are memorised instead (docs/benchmarks.md). Answers written by the target cost
one decode step per token; these documents cost one capture forward per row.

Each document is a real training prompt (``data.source``, held-out ones never
used) formatted as one user turn, followed by an answer of ``answer_tokens``
tokens that repeats spans of that prompt - optionally the whole prompt first,
then a few spans, each repeated 2-12 times and ended by a newline. That is what
a base model such as the embedded Gemma 3 270M does under a chat format (it
echoes the prompt and loops), and what prompt lookup exploits; the loss covers
the answer only. Deterministic for a given seed.
"""
from __future__ import annotations

import random
from typing import Sequence

from dflash_train.data.packing import Document
from dflash_train.data.sources import Conversation, is_heldout
from dflash_train.data.template import ChatFormat


def repeat_answer(user_ids: Sequence[int], newline_ids: Sequence[int], length: int, rng: random.Random) -> list[int]:
    """`length` tokens that repeat spans of `user_ids`, each repetition followed by a newline."""
    u = list(user_ids)
    out: list[int] = []
    if rng.random() < 0.5:
        out += u + list(newline_ids)
    while len(out) < length:
        if rng.random() < 0.4:
            seg = u
        else:
            n = rng.randint(1, min(24, len(u)))
            i = rng.randint(0, len(u) - n)
            seg = u[i:i + n]
        for _ in range(rng.randint(2, 12)):
            out += seg + list(newline_ids)
    return out[:length]


def copy_task_documents(convs: Sequence[Conversation], fmt: ChatFormat, tokenizer, count: int, max_tokens: int,
                        heldout_fraction: float, answer_tokens: int = 64, seed: int = 0) -> list[Document]:
    """Up to `count` copy-task documents from the first usable training prompts of `convs`."""
    rng = random.Random(seed)
    newline = tokenizer("\n", add_special_tokens=False).input_ids
    docs: list[Document] = []
    for conv in convs:
        if len(docs) >= count:
            break
        if is_heldout(conv, heldout_fraction):
            continue
        try:
            text = conv.prompt
        except (StopIteration, ValueError, IndexError):
            continue
        if not text or not text.strip():
            continue
        prompt = fmt.prompt_ids([{"role": "user", "content": text}])
        if len(prompt) + answer_tokens > max_tokens:
            continue
        user = tokenizer(text.strip(), add_special_tokens=False).input_ids
        if len(user) < 2:
            continue
        answer = repeat_answer(user, newline, answer_tokens, rng)
        docs.append(Document(prompt + answer, [False] * len(prompt) + [True] * len(answer)))
    return docs
