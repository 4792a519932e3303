"""Conversation sources: shapes, role mapping, bad input, truncated JSON, split."""
from __future__ import annotations

import json
import logging

import pytest

from dflash_train.data import DataError, heldout_score, is_heldout, read_conversations
from dflash_train.data.sources import Conversation, ReadStats, iter_json_array, normalize_item


def _write(path, lines: list[bytes | str]):
    with open(path, "wb") as f:
        for ln in lines:
            f.write(ln if isinstance(ln, bytes) else ln.encode())
            f.write(b"\n")
    return path


def _sg(*turns, cid=None):
    obj = {"conversations": [{"from": r, "value": v} for r, v in turns]}
    if cid is not None:
        obj["id"] = cid
    return json.dumps(obj)


def test_sharegpt_and_openai_shapes(tmp_path):
    p = _write(tmp_path / "a.jsonl", [
        _sg(("human", "Hi"), ("gpt", "Hello"), cid="x1"),
        json.dumps({"id": "x2", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                                             {"role": "assistant", "content": [{"type": "text", "text": "A"}]}]}),
        _sg(("user", "a"), ("chatgpt", "b"), ("human", "c"), ("bing", "d"), ("user", "e"), ("bard", "f")),
    ])
    convs, stats = read_conversations(f"jsonl:{p}", None)
    assert [c.id for c in convs][:2] == ["x1", "x2"]
    assert convs[0].messages == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert convs[1].system == "S" and convs[1].prompt == "Q" and convs[1].reference == "A"
    assert [m["role"] for m in convs[2].messages] == ["user", "assistant"] * 3
    assert convs[2].id.startswith("p-")  # no id: a hash of the prompt
    assert stats.read == 3 and stats.skipped == {}


def test_normalisation_rules():
    conv, _ = normalize_item(json.loads(_sg(("gpt", "orphan answer"), ("human", " a "), ("human", "b"),
                                            ("system", "late system"), ("gpt", "c"), ("gpt", ""), ("gpt", "d"),
                                            ("human", "trailing question"))))
    assert conv.messages == [{"role": "user", "content": "a\n\nb"}, {"role": "assistant", "content": "c\n\nd"}]
    assert normalize_item(json.loads(_sg(("human", "only a question"))))[1] == "no_exchange"


def test_bad_input_is_skipped_and_counted(tmp_path, caplog):
    good = _sg(("human", "q"), ("gpt", "a"), cid="ok")
    p = _write(tmp_path / "bad.jsonl", [
        good,                                                    # 1
        "{not json",                                             # 2
        b"\xff\xfe not utf-8 \xc3\x28",                          # 3
        "[1, 2]",                                                # 4
        json.dumps({"conversations": []}),                       # 5
        json.dumps({"id": "nothing"}),                           # 6
        json.dumps({"conversations": [{"value": "no role"}]}),   # 7
        _sg(("alien", "x"), ("gpt", "y")),                       # 8
        json.dumps({"conversations": [{"from": "human"}]}),      # 9
        _sg(("human", "no answer")),                             # 10
        "",                                                      # 11 (blank: ignored)
        good.replace('"ok"', '"ok2"'),                           # 12
        "{still not json",                                       # 13
    ])
    with caplog.at_level(logging.WARNING):
        convs, stats = read_conversations(f"jsonl:{p}", None)
    assert [c.id for c in convs] == ["ok", "ok2"]
    assert stats.skipped == {"malformed_json": 2, "not_utf8": 1, "not_an_object": 1, "no_turns": 2,
                             "missing_role": 1, "unknown_role": 1, "missing_text": 1, "no_exchange": 1}
    assert stats.examples["malformed_json"] == [2, 13]
    assert stats.examples["not_utf8"] == [3]
    assert "malformed_json" in caplog.text and "[2, 13]" in caplog.text


def test_no_usable_conversation_is_an_error_naming_the_file(tmp_path):
    p = _write(tmp_path / "useless.jsonl", ["{bad", _sg(("human", "q"))])
    with pytest.raises(DataError, match="useless.jsonl.*no usable conversation"):
        read_conversations(f"jsonl:{p}", None)
    empty = _write(tmp_path / "empty.jsonl", [])
    with pytest.raises(DataError, match="empty.jsonl"):
        read_conversations(f"jsonl:{empty}", None)
    with pytest.raises(DataError, match="not found"):
        read_conversations(f"jsonl:{tmp_path / 'missing.jsonl'}", None)


def test_limit_counts_usable_conversations(tmp_path):
    p = _write(tmp_path / "a.jsonl", ["{bad"] + [_sg(("human", f"q{i}"), ("gpt", "a"), cid=str(i)) for i in range(10)])
    convs, stats = read_conversations(f"jsonl:{p}", 4)
    assert [c.id for c in convs] == ["0", "1", "2", "3"] and stats.read == 4


@pytest.mark.parametrize("block", [7, 64, 1 << 20])
def test_truncated_json_array_recovers_complete_items(tmp_path, block):
    items = [json.loads(_sg(("human", f"question {i} ünï"), ("gpt", f"answer {i}"), cid=f"t{i}")) for i in range(6)]
    text = json.dumps(items, indent=1, ensure_ascii=False)
    cut = text.rfind('"answer 5"') + 4  # inside the last item's string
    p = tmp_path / "cut.json"
    p.write_bytes(text[:cut].encode())
    stats = ReadStats("cut")
    got = list(iter_json_array(p, stats, block=block))
    assert [c.id for c in got] == [f"t{i}" for i in range(5)]
    assert stats.truncated_item["index"] == 5
    # a complete file reads to the end without a report
    p2 = tmp_path / "full.json"
    p2.write_text(text)
    stats2 = ReadStats("full")
    assert len(list(iter_json_array(p2, stats2, block=block))) == 6 and stats2.truncated_item is None


def test_sharegpt_package_limited():
    convs, stats = read_conversations("sharegpt", 40)
    assert len(convs) == 40 and stats.truncated_item is None
    assert all(c.messages[0]["role"] in ("user", "system") and c.messages[-1]["role"] == "assistant" for c in convs)
    assert all(c.id for c in convs)


@pytest.mark.slow
def test_sharegpt_truncated_file_recovery_full():
    """The real (truncated) file: every complete item is read, the cut-off one reported."""
    convs, stats = read_conversations("sharegpt", None)
    assert stats.truncated_item is not None
    assert len(convs) + sum(stats.skipped.values()) == 17671
    assert stats.truncated_item["index"] == 17671
    assert len(convs) > 17000


def test_heldout_split_is_stable_and_by_id():
    ids = [f"conv-{i}" for i in range(4000)]
    frac = sum(heldout_score(i) < 0.1 for i in ids) / len(ids)
    assert 0.08 < frac < 0.12
    a = Conversation("conv-7", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
    b = Conversation("conv-7", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "regenerated"}])
    assert is_heldout(a, 0.5) == is_heldout(b, 0.5) == (heldout_score("conv-7") < 0.5)
    assert not is_heldout(a, 0.0)
    # no id: the prompt decides, so regenerating the answer keeps the split
    x, _ = normalize_item(json.loads(_sg(("human", "same prompt"), ("gpt", "answer one"))))
    y, _ = normalize_item(json.loads(_sg(("human", "same prompt"), ("gpt", "answer two"))))
    assert x.id == y.id


def test_hf_source_without_datasets_is_a_clear_error(monkeypatch):
    import builtins

    real = builtins.__import__

    def fake(name, *a, **k):
        if name == "datasets":
            raise ImportError("no datasets")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(DataError, match="datasets"):
        read_conversations("hf:some/dataset", 10)
