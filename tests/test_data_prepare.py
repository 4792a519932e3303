"""Packing, document ids, the prepared-data cache and load_prepared."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from dflash_train.config import load_config
from dflash_train.data import DataError, cut_document, load_prepared, pack_documents, read_prepared
from dflash_train.data.packing import Document
from dflash_train.data.prepare import prepare_command
from dflash_train.data.sources import is_heldout, read_conversations
from dflash_train.data.template import ChatFormat


def _cfg(tmp_path, src, *extra):
    return load_config(None, [f"data.source={src}", "data.max_tokens=256", f"data.cache_dir={tmp_path / 'cache'}",
                              "model.block_size=8", *extra])


@pytest.fixture(scope="module")
def qtok(tiny_target_dir):
    return AutoTokenizer.from_pretrained(str(tiny_target_dir))


def test_cut_document_rules():
    ids, mask = list(range(10)), [i % 2 == 0 for i in range(10)]
    pieces, long_ = cut_document(ids, mask, 4, "split")
    assert long_ and [p.input_ids for p in pieces] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    pieces, long_ = cut_document(ids, mask, 4, "truncate")
    assert long_ and [p.input_ids for p in pieces] == [[0, 1, 2, 3]] and pieces[0].loss_mask == mask[:4]
    pieces, long_ = cut_document(ids, mask, 10, "split")
    assert not long_ and len(pieces) == 1


def test_pack_documents_first_fit_and_document_ids():
    docs = [Document([i + 1] * n, [True] * n) for i, n in enumerate([5, 3, 6, 2, 4])]
    ids, mask, doc = pack_documents(docs, 8, pad_id=0)
    assert ids.dtype == torch.int64 and mask.dtype == torch.bool and doc.dtype == torch.int32
    # first fit: [5,3] [6,2] [4]
    assert ids.tolist() == [[1] * 5 + [2] * 3, [3] * 6 + [4] * 2, [5] * 4 + [0] * 4]
    assert doc.tolist() == [[0] * 5 + [1] * 3, [0] * 6 + [1] * 2, [0] * 4 + [-1] * 4]
    assert mask[2].tolist() == [True] * 4 + [False] * 4
    with pytest.raises(ValueError):
        pack_documents([Document([1] * 9, [True] * 9)], 8, 0)


def test_load_prepared_rows(tmp_path, tiny_jsonl, qtok):
    cfg = _cfg(tmp_path, f"jsonl:{tiny_jsonl}", "data.heldout_fraction=0.2")
    data = load_prepared(cfg, qtok, "qwen3")
    N, T = data.input_ids.shape
    assert T == 256 and N == data.stats["rows"] >= 1
    assert data.loss_mask.dtype == torch.bool and data.document_ids.dtype == torch.int32
    s = data.stats
    assert s["conversations_read"] == 24 and s["train_conversations"] + s["heldout_conversations"] == 24
    assert s["heldout_conversations"] == len(data.heldout) >= 1
    assert s["supervised_tokens"] == int(data.loss_mask.sum())
    assert s["cache"] == "miss"
    pad = data.document_ids < 0
    assert not data.loss_mask[pad].any()
    assert (data.input_ids[pad] == qtok.pad_token_id).all()
    # documents are contiguous, numbered 0.. in each row, each with >= block_size+1 supervised tokens
    for r in range(N):
        d = data.document_ids[r]
        k = int(d.max()) + 1
        for j in range(k):
            where = (d == j).nonzero().flatten()
            assert len(where) and where[-1] - where[0] + 1 == len(where)
            assert int(data.loss_mask[r][where].sum()) >= 9
        if (d < 0).any():
            assert (d[int((d >= 0).sum()):] == -1).all()
    # held-out conversations never reach training: their answers are in no row
    fmt = ChatFormat(qtok, "qwen3")
    rows = [data.input_ids[r][data.loss_mask[r]].tolist() for r in range(N)]
    train_texts = [qtok.decode(r) for r in rows]
    convs, _ = read_conversations(f"jsonl:{tiny_jsonl}", None)
    held = [c for c in convs if is_heldout(c, 0.2)]
    assert [c.id for c in held] == [c.id for c in data.heldout]
    first = next(iter(data.heldout))  # read from heldout.jsonl as iterated (never loaded whole)
    assert first.prompt and first.reference
    unique_held = [c.reference for c in held if all(c.reference not in t.reference for t in convs if t not in held)]
    for ans in unique_held:
        assert all(ans not in t for t in train_texts)
    assert fmt.kind == "template"


def test_cache_reuse_and_invalidation(tmp_path, tiny_jsonl, qtok):
    cfg = _cfg(tmp_path, f"jsonl:{tiny_jsonl}")
    a = load_prepared(cfg, qtok, "qwen3")
    b = load_prepared(cfg, qtok, "qwen3")
    assert (a.stats["cache"], b.stats["cache"]) == ("miss", "hit") and a.path == b.path
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.document_ids, b.document_ids)
    assert torch.equal(a.loss_mask, b.loss_mask)
    assert [c.id for c in a.heldout] == [c.id for c in b.heldout]
    c = load_prepared(_cfg(tmp_path, f"jsonl:{tiny_jsonl}", "data.max_tokens=192"), qtok, "qwen3")
    assert c.stats["cache"] == "miss" and c.path != a.path and c.max_tokens == 192
    with open(tiny_jsonl, "a") as f:
        f.write(json.dumps({"id": "new", "conversations": [{"from": "human", "value": "x"},
                                                             {"from": "gpt", "value": "y " * 40}]}) + "\n")
    d = load_prepared(cfg, qtok, "qwen3")
    assert d.stats["cache"] == "miss" and d.path != a.path


def test_prepared_dir_source_and_prepare_command(tmp_path, tiny_jsonl, tiny_target_dir, qtok, capsys):
    cfg = _cfg(tmp_path, f"jsonl:{tiny_jsonl}", f"target.path={tiny_target_dir}")
    out = prepare_command(cfg, tmp_path / "prep", qtok, "qwen3")
    assert (out / "index.json").is_file() and (out / "heldout.jsonl").is_file()
    assert "rows x 256 tokens" in capsys.readouterr().err
    direct = read_prepared(out)
    via = load_prepared(_cfg(tmp_path, f"prepared:{out}"), qtok, "qwen3")
    assert torch.equal(direct.input_ids, via.input_ids) and via.stats["cache"] == "prepared"
    with pytest.raises(DataError, match="max_tokens"):
        load_prepared(_cfg(tmp_path, f"prepared:{out}", "data.max_tokens=128"), qtok, "qwen3")
    with pytest.raises(DataError, match="different tokenizer"):
        load_prepared(_cfg(tmp_path, f"prepared:{out}"), qtok, "llama")
    with pytest.raises(DataError, match="index.json"):
        load_prepared(_cfg(tmp_path, f"prepared:{tmp_path}"), qtok, "qwen3")
    # default output: the cache dir load_prepared uses
    dest = prepare_command(cfg, None, qtok, "qwen3")
    assert load_prepared(cfg, qtok, "qwen3").stats["cache"] == "hit"
    assert dest == load_prepared(cfg, qtok, "qwen3").path


def test_long_rules_and_drop_rule(tmp_path, tiny_jsonl, qtok):
    split = load_prepared(_cfg(tmp_path, f"jsonl:{tiny_jsonl}", "data.max_tokens=64", "data.long_rule=split"), qtok, "qwen3")
    trunc = load_prepared(_cfg(tmp_path, f"jsonl:{tiny_jsonl}", "data.max_tokens=64", "data.long_rule=truncate"), qtok, "qwen3")
    assert split.stats["long_conversations"] > 0
    assert split.stats["documents"] > trunc.stats["documents"]
    strict = load_prepared(_cfg(tmp_path, f"jsonl:{tiny_jsonl}", "data.max_tokens=64", "data.long_rule=truncate",
                                "model.block_size=40"), qtok, "qwen3")
    assert strict.stats["dropped_documents"] > 0 and strict.stats["min_supervised"] == 41
    assert strict.stats["documents"] + strict.stats["dropped_documents"] == trunc.stats["documents"]
    with pytest.raises(DataError, match="no training rows"):
        load_prepared(_cfg(tmp_path, f"jsonl:{tiny_jsonl}", "data.max_tokens=16", "model.block_size=32"), qtok, "qwen3")


def test_regenerated_file_replaces_the_source(tmp_path, tiny_jsonl, qtok):
    regen = tmp_path / "regen.jsonl"
    regen.write_text("".join(json.dumps({"id": f"tiny-{i:04d}", "conversations": [
        {"from": "human", "value": f"prompt {i}"}, {"from": "gpt", "value": "regenerated answer " * 6}]}) + "\n"
        for i in range(5)))
    data = load_prepared(_cfg(tmp_path, f"jsonl:{tiny_jsonl}", f"data.regenerated={regen}", "data.heldout_fraction=0"),
                         qtok, "qwen3")
    assert data.stats["conversations_read"] == 5
    text = qtok.decode(data.input_ids[0][data.loss_mask[0]])
    assert "regenerated answer" in text


def test_answers_holding_unicode_line_separators_survive_the_cache(tmp_path, qtok):
    """JSONL ends lines at "\\n" only: an answer with U+2028 / U+0085 (ShareGPT has them) is one
    record, also in the cached held-out file read back on the second load."""
    src = tmp_path / "sep.jsonl"
    src.write_text("".join(json.dumps({"id": f"s-{i}", "conversations": [
        {"from": "human", "value": f"question\u2028{i}"}, {"from": "gpt", "value": f"one\u2028two\x85three {i} " * 4}]},
        ensure_ascii=False) + "\n" for i in range(20)), encoding="utf-8")
    cfg = _cfg(tmp_path, f"jsonl:{src}", "data.heldout_fraction=0.3")
    first = load_prepared(cfg, qtok, "qwen3")
    again = load_prepared(cfg, qtok, "qwen3")  # from the cache: heldout.jsonl read back
    assert again.stats["cache"] == "hit"  # not rebuilt: an unreadable cache is rebuilt with a warning
    assert len(first.heldout) >= 1 and [c.to_json() for c in again.heldout] == [c.to_json() for c in first.heldout]
    assert "\u2028" in json.dumps(next(iter(again.heldout)).to_json(), ensure_ascii=False)
