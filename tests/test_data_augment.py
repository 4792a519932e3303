"""Copy-task documents (data.copy_task_docs): answers repeat spans of their own prompt,
only the answer is supervised, held-out prompts are never used, deterministic."""
from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from dflash_train.config import load_config
from dflash_train.data import load_prepared
from dflash_train.data.augment import copy_task_documents, repeat_answer
from dflash_train.data.sources import is_heldout, read_conversations
from dflash_train.data.template import ChatFormat


@pytest.fixture(scope="module")
def qtok(tiny_target_dir):
    return AutoTokenizer.from_pretrained(str(tiny_target_dir))


def _spans_of(answer, user, nl):
    """Split the answer at newlines; every piece must be a contiguous span of the prompt."""
    pieces, cur = [], []
    i = 0
    while i < len(answer):
        if answer[i:i + len(nl)] == nl:
            pieces.append(cur)
            cur = []
            i += len(nl)
        else:
            cur.append(answer[i])
            i += 1
    pieces.append(cur)  # the cut-off last piece is a prefix of a span
    s = " ".join(map(str, user))
    return all(" ".join(map(str, p)) in s for p in pieces if p)


def test_repeat_answer_is_made_of_prompt_spans():
    user, nl = list(range(10, 40)), [7]
    for seed in range(20):
        a = repeat_answer(user, nl, 64, random.Random(seed))
        assert len(a) == 64 and _spans_of(a, user, nl), a
    assert repeat_answer(user, nl, 64, random.Random(3)) == repeat_answer(user, nl, 64, random.Random(3))


def test_copy_task_documents(tiny_jsonl, qtok):
    convs, _ = read_conversations(f"jsonl:{tiny_jsonl}", None)
    fmt = ChatFormat(qtok, "qwen3")
    docs = copy_task_documents(convs, fmt, qtok, count=10, max_tokens=128, heldout_fraction=0.2, answer_tokens=40)
    usable = [c for c in convs if not is_heldout(c, 0.2)]
    assert 0 < len(docs) <= 10
    nl = qtok("\n", add_special_tokens=False).input_ids
    for doc, conv in zip(docs, usable):
        prompt = fmt.prompt_ids([{"role": "user", "content": conv.prompt}])
        assert doc.input_ids[:len(prompt)] == prompt  # prompts in source order, held-out skipped
        assert doc.loss_mask == [False] * len(prompt) + [True] * 40
        assert len(doc.input_ids) <= 128
        user = qtok(conv.prompt.strip(), add_special_tokens=False).input_ids
        assert _spans_of(doc.input_ids[len(prompt):], user, nl)


def test_load_prepared_adds_copy_task_rows(tmp_path, tiny_jsonl, qtok):
    def cfg(*extra):
        return load_config(None, [f"data.source=jsonl:{tiny_jsonl}", "data.max_tokens=256",
                                  f"data.cache_dir={tmp_path / 'cache'}", "model.block_size=8", *extra])
    plain = load_prepared(cfg(), qtok, "qwen3")
    more = load_prepared(cfg("data.copy_task_docs=5"), qtok, "qwen3")
    assert more.stats["copy_task_documents"] == 5 and plain.stats["copy_task_documents"] == 0
    assert int(more.loss_mask.sum()) > int(plain.loss_mask.sum())
    assert more.stats["documents"] == plain.stats["documents"] + 5
