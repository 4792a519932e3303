"""prepare-data at scale (issue 47 item 1): worker processes on the cores the process is given with
the same bytes whatever their number, rows memory-mapped (peak RSS not growing with the rows), a
killed build going on from its finished shards, and one build per node under torchrun."""
from __future__ import annotations

import json
import random
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import write_tiny_jsonl
from transformers import AutoTokenizer
from trainrun import CLI, REPO, env, losses, tiny_overrides

from dflash_train.config import load_config
from dflash_train.data import DataError, load_prepared, pack_documents, read_prepared
from dflash_train.data import prepare as prepare_mod
from dflash_train.data import prepare_build
from dflash_train.data.packing import Document
from dflash_train.data.prepare import build_prepared, cache_inputs, cache_key, read_source_conversations
from dflash_train.data.prepare_build import SHARD_CONVERSATIONS, place_documents
from dflash_train.data.prepared_store import ARRAYS, NpyWriter, RowCounts, write_index
from dflash_train.data.sources import is_heldout
from dflash_train.data.template import ChatFormat

ARRAY_FILES = [f"{k}.npy" for k in sorted(ARRAYS)]


def _cfg(tmp_path, jsonl, *extra):
    return load_config(None, [f"data.source=jsonl:{jsonl}", "data.max_tokens=256", f"data.cache_dir={tmp_path / 'cache'}",
                              "model.block_size=8", "data.heldout_fraction=0.05", *extra])


@pytest.fixture(scope="module")
def qtok(tiny_target_dir):
    return AutoTokenizer.from_pretrained(str(tiny_target_dir))


@pytest.mark.parametrize("max_tokens,min_room", [(64, 17), (64, 1), (200, 9)])
def test_placement_is_pack_documents_first_fit(max_tokens, min_room):
    """The packer that sees only lengths puts every document where pack_documents does, also
    past its 256-row scan window (rows closing let older open rows back in)."""
    rng = random.Random(max_tokens * 100 + min_room)
    docs = [Document([i % 97 + 1] * n, [j % 3 == 0 for j in range(n)])
            for i, n in enumerate(rng.choice([rng.randint(1, max_tokens), rng.randint(1, 12)]) for _ in range(4000))]
    ids, mask, doc = pack_documents(docs, max_tokens, pad_id=0, min_room=min_room)
    assert len(ids) > 300  # more rows than the scan window
    row_of, offset, n_rows = place_documents(np.array([len(d.input_ids) for d in docs]), max_tokens, min_room)
    assert n_rows == len(ids)
    got, got_mask, got_doc = torch.zeros_like(ids), torch.zeros_like(mask), torch.full_like(doc, -1)
    for d, r, p in zip(docs, row_of.tolist(), offset.tolist()):
        got[r, p:p + len(d.input_ids)] = torch.tensor(d.input_ids)
        got_mask[r, p:p + len(d.input_ids)] = torch.tensor(d.loss_mask)
        got_doc[r, p:p + len(d.input_ids)] = int(got_doc[r].max()) + 1  # documents of a row in source order
    assert torch.equal(got, ids) and torch.equal(got_mask, mask) and torch.equal(got_doc, doc)


def _prepare(out: Path, jsonl: Path, target: Path, cores: str, *extra: str) -> subprocess.CompletedProcess:
    # the cores a user gives the command: taskset (os.sched_getaffinity sees it, as it sees Slurm's binding)
    cmd = ["taskset", "-c", cores, *CLI, "prepare-data", "--out", str(out), f"target.path={target}",
           f"data.source=jsonl:{jsonl}", "data.max_tokens=128", "model.block_size=4", f"data.cache_dir={out.parent / 'c'}",
           *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env(), cwd=REPO)


def test_one_and_two_workers_write_the_same_bytes(tiny_target_dir, tmp_path):
    """Three shards of conversations on 1 core and on 2: the command says how many workers it used,
    and the arrays and held-out conversations are byte for byte the same; a rerun is a cache hit."""
    jsonl = write_tiny_jsonl(tmp_path / "conv.jsonl", n=2 * SHARD_CONVERSATIONS + 200)
    one, two = tmp_path / "one", tmp_path / "two"
    r1 = _prepare(one, jsonl, tiny_target_dir, "0")
    assert r1.returncode == 0, r1.stderr[-3000:]
    assert "on 1 worker(s)" in r1.stderr, r1.stderr[-2000:]
    r2 = _prepare(two, jsonl, tiny_target_dir, "0,1")
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "on 2 worker(s)" in r2.stderr, r2.stderr[-2000:]
    for name in [*ARRAY_FILES, "heldout.jsonl"]:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    i1, i2 = (json.loads((d / "index.json").read_text()) for d in (one, two))
    assert i1["key"] == i2["key"] and i1["num_rows"] == i2["num_rows"] > 0
    assert {k: v for k, v in i1["stats"].items() if k not in ("seconds", "workers", "tokens_per_second", "phase_seconds")} == \
        {k: v for k, v in i2["stats"].items() if k not in ("seconds", "workers", "tokens_per_second", "phase_seconds")}
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no build dir left


def test_killed_build_goes_on_from_its_finished_shards(tmp_path, qtok, monkeypatch):
    """A build interrupted after its first shard leaves no prepared directory that reads as whole;
    the next one tokenises only the shards not done and writes what an uninterrupted build writes."""
    jsonl = write_tiny_jsonl(tmp_path / "conv.jsonl", n=SHARD_CONVERSATIONS + 100)
    cfg = _cfg(tmp_path, jsonl)
    inputs = cache_inputs(cfg, qtok, "qwen3")
    out, ref = tmp_path / "rows", tmp_path / "ref"
    write_docs = prepare_build.write_docs
    calls: list[str] = []

    def interrupted(work, name, docs, record):
        calls.append(name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C / a kill, after the first shard is written
        return write_docs(work, name, docs, record)

    monkeypatch.setattr(prepare_build, "write_docs", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_prepared(cfg, qtok, "qwen3", out, inputs, workers=1)
    assert not out.exists()
    assert (tmp_path / ".rows.build" / "shard-000000.json").is_file()
    calls.clear()
    monkeypatch.setattr(prepare_build, "write_docs", lambda *a: calls.append(a[1]) or write_docs(*a))
    data = build_prepared(cfg, qtok, "qwen3", out, inputs, workers=1)
    assert calls == ["shard-000001"]  # shard 0 came from the interrupted build
    assert not (tmp_path / ".rows.build").exists()
    build_prepared(cfg, qtok, "qwen3", ref, inputs, workers=1)
    for name in ARRAY_FILES:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    assert data.num_rows == json.loads((ref / "index.json").read_text())["num_rows"]


def test_rows_are_memory_mapped_and_old_or_broken_directories_are_one_line(tmp_path, qtok, tiny_jsonl):
    data = load_prepared(_cfg(tmp_path, tiny_jsonl), qtok, "qwen3")
    maps = Path("/proc/self/maps").read_text()
    assert all(str(data.path / f) in maps for f in ARRAY_FILES)
    assert data.input_ids.dtype == torch.int64 and data.loss_mask.dtype == torch.bool
    assert data.input_ids[torch.tensor([0])].shape == (1, 256)  # a batch: a copy out of the mapping
    (data.path / "document_ids.npy").unlink()
    with pytest.raises(DataError, match=r"document_ids.npy: missing; run prepare-data again"):
        read_prepared(data.path)
    index = json.loads((data.path / "index.json").read_text())
    (data.path / "index.json").write_text(json.dumps(dict(index, format_version=1)))
    with pytest.raises(DataError, match="prepared-data format 1, this version reads 3; run prepare-data again"):
        read_prepared(data.path)
    # a cache entry that does not read (here: of the older format) is built again in its place
    again = load_prepared(_cfg(tmp_path, tiny_jsonl), qtok, "qwen3")
    assert again.stats["cache"] == "miss" and again.path == data.path
    assert load_prepared(_cfg(tmp_path, tiny_jsonl), qtok, "qwen3").stats["cache"] == "hit"


_READ_A_BATCH = """
import resource, sys, torch
from dflash_train.data import read_prepared
d = read_prepared(sys.argv[1])
idx = torch.arange(0, d.num_rows, max(1, d.num_rows // 8))[:8]
b = d.input_ids[idx], d.loss_mask[idx], d.document_ids[idx]
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def _synthetic(path: Path, rows: int, t: int) -> Path:
    path.mkdir()
    for k, dt in ARRAYS.items():
        w = NpyWriter(path / f"{k}.npy", dt, (rows, t))
        for s in range(0, rows, 4096):
            w.write(np.ones((min(rows, s + 4096) - s, t), dtype=dt))
        w.close()
    write_index(path, {}, "synthetic", RowCounts(np.array([0, rows * t]), np.array([0, rows * t]), rows * t, rows), t, {})
    return path


def test_peak_rss_of_a_reader_does_not_grow_with_the_rows(tmp_path):
    """Opening a prepared directory and taking a batch: 16x the rows (26 MB -> 420 MB of arrays), the
    same peak RSS within a few MB (whole tensors would add the 400 MB)."""
    rss = {}
    for rows in (2_000, 32_000):
        d = _synthetic(tmp_path / f"r{rows}", rows, 1024)
        res = subprocess.run([sys.executable, "-c", _READ_A_BATCH, str(d)], capture_output=True, text=True,
                             timeout=300, env=env(), cwd=REPO)
        assert res.returncode == 0, res.stderr[-2000:]
        rss[rows] = int(res.stdout.split()[-1]) * 1024
    assert rss[32_000] - rss[2_000] < 24 << 20, rss
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > 0


def test_torchrun_ranks_build_once(tiny_target_factory, tmp_path):
    """Two colocated ranks on gloo and an empty data cache: one build, the other rank waits for it
    and reads the same rows; training goes on."""
    jsonl = write_tiny_jsonl(tmp_path / "conv.jsonl", n=40)
    target = tiny_target_factory("qwen3")
    over = tiny_overrides(target, jsonl, **{"train.max_steps": 2, "checkpoint.every_steps": 2})
    rd = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "dflash_train.cli", "train", "--run-dir", str(rd), *over]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env(), cwd=REPO)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    out = res.stdout + res.stderr + "".join(p.read_text() for p in (rd / "logs").glob("train.rank*.log"))
    assert out.count("prepared 38 training conversations") == 1, out[-5000:]
    assert sorted(losses(rd)) == [1, 2]
    caches = [p for p in (jsonl.parent / "data-cache").iterdir()]
    assert len(caches) == 1 and (caches[0] / "index.json").is_file()


_RACE = """
import logging, sys, time
from pathlib import Path
from transformers import AutoTokenizer
from dflash_train.config import load_config
from dflash_train.data import load_prepared, prepare_build
from dflash_train.data import prepare as prepare_mod

logging.basicConfig(level=logging.INFO, format="%(message)s")
tok_dir, jsonl, cache, me, other = sys.argv[1:6]
cfg = load_config(None, [f"data.source=jsonl:{jsonl}", "data.max_tokens=256", f"data.cache_dir={cache}",
                         "model.block_size=8"])
tok = AutoTokenizer.from_pretrained(tok_dir)
write_rows = prepare_build.write_rows
def slow(*a):
    time.sleep(3)  # the build is still running when the other process arrives
    return write_rows(*a)
prepare_mod.write_rows = slow
Path(me).touch()
while not Path(other).exists():  # both processes call load_prepared at the same moment
    time.sleep(0.01)
print("cache", load_prepared(cfg, tok, "qwen3").stats["cache"], flush=True)
"""


def test_processes_preparing_the_same_cache_at_once_build_it_once(tiny_target_dir, tiny_jsonl, tmp_path):
    """Two processes (two ranks of a node, or two commands) asking for the same missing cache at
    the same moment: one builds, the other says it waits, then reads the finished cache."""
    cache = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, "-c", _RACE, str(tiny_target_dir), str(tiny_jsonl), str(cache),
                               str(tmp_path / f"ready{i}"), str(tmp_path / f"ready{1 - i}")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(), cwd=REPO)
             for i in (0, 1)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    both = "".join(outs)
    assert both.count("prepared 2") == 1 and both.count("waiting for another process preparing data") == 1, both
    assert sorted(o.strip().splitlines()[-1] for o in outs) == ["cache hit", "cache miss"], outs


def test_rows_are_the_rows_pack_documents_makes(tmp_path, qtok):
    """Across a shard boundary, the rows written from the shard files are pack_documents' rows of
    the same documents: the rows prepare made before the change, byte for byte."""
    jsonl = write_tiny_jsonl(tmp_path / "conv.jsonl", n=SHARD_CONVERSATIONS + 100)
    cfg = _cfg(tmp_path, jsonl)
    data = build_prepared(cfg, qtok, "qwen3", tmp_path / "rows", cache_inputs(cfg, qtok, "qwen3"), workers=1)
    convs, _ = read_source_conversations(cfg)
    train = [c for c in convs if not is_heldout(c, cfg.data.heldout_fraction)]
    rule = prepare_build.CutRule(256, cfg.data.long_rule, 9, {})
    docs, _ = prepare_build.cut_conversations(train, ChatFormat(qtok, "qwen3"), rule)
    ids, mask, doc = pack_documents(docs, 256, qtok.pad_token_id, min_room=9)
    assert torch.equal(data.input_ids, ids) and torch.equal(data.loss_mask, mask)
    assert torch.equal(data.document_ids, doc)


def test_the_source_is_read_as_the_shards_are_needed(tmp_path, qtok, monkeypatch):
    """The build never holds all conversations: when a shard is tokenised the source has been read
    at most two shards past it; the rows of 15 shards are still pack_documents' rows of them all."""
    monkeypatch.setattr(prepare_build, "SHARD_CONVERSATIONS", 8)
    jsonl = write_tiny_jsonl(tmp_path / "conv.jsonl", n=120)
    cfg = _cfg(tmp_path, jsonl)
    read: list[str] = []
    iter_conversations = prepare_mod.iter_conversations

    def counted(*a):
        for conv in iter_conversations(*a):
            read.append(conv.id)
            yield conv

    monkeypatch.setattr(prepare_mod, "iter_conversations", counted)
    at_shard: list[int] = []
    write_docs = prepare_build.write_docs
    monkeypatch.setattr(prepare_build, "write_docs", lambda *a: at_shard.append(len(read)) or write_docs(*a))
    data = build_prepared(cfg, qtok, "qwen3", tmp_path / "rows", cache_inputs(cfg, qtok, "qwen3"), workers=1)
    n_read = len(read)
    convs, _ = read_source_conversations(cfg)
    train = [c for c in convs if not is_heldout(c, cfg.data.heldout_fraction)]
    n_heldout = len(convs) - len(train)
    assert len(at_shard) == -(-len(train) // 8) >= 10 and n_read == len(convs) == 120
    for k, n in enumerate(at_shard):
        assert n <= 8 * (k + 2) + n_heldout, (k, at_shard)
    docs, _ = prepare_build.cut_conversations(train, ChatFormat(qtok, "qwen3"), prepare_build.CutRule(256, "split", 9, {}))
    ids, mask, doc = pack_documents(docs, 256, qtok.pad_token_id, min_room=9)
    assert torch.equal(data.input_ids, ids) and torch.equal(data.loss_mask, mask) and torch.equal(data.document_ids, doc)
    assert data.stats["train_conversations"] == len(train) and len(data.heldout) == n_heldout


def test_template_variables_are_part_of_the_cache_key_and_reach_the_workers(tmp_path, qtok, tiny_jsonl, monkeypatch):
    plain = cache_inputs(_cfg(tmp_path, tiny_jsonl), qtok, "qwen3")
    off = cache_inputs(_cfg(tmp_path, tiny_jsonl, "data.chat_template_kwargs={enable_thinking: false}"), qtok, "qwen3")
    assert off["chat_template_kwargs"] == {"enable_thinking": False} and cache_key(plain) != cache_key(off)
    seen = []
    monkeypatch.setattr(prepare_build, "ChatFormat", lambda tok, fam, template_kwargs: seen.append(template_kwargs)
                        or ChatFormat(tok, fam, template_kwargs=template_kwargs))
    load_prepared(_cfg(tmp_path, tiny_jsonl, "data.chat_template_kwargs={enable_thinking: false}"), qtok, "qwen3")
    assert seen == [{"enable_thinking": False}]


def test_shard_reader_keeps_few_files_open(tmp_path, monkeypatch):
    """More shards than OPEN_SHARDS (a 1M-conversation build has ~2,000): every document read back
    right, with at most OPEN_SHARDS shards' files open at once."""
    monkeypatch.setattr(prepare_build.ShardReader, "OPEN_SHARDS", 3)
    rng = random.Random(5)
    shards = [[Document([rng.randint(0, 999) for _ in range(n)], [bool(rng.getrandbits(1)) for _ in range(n)])
               for n in (rng.randint(1, 40) for _ in range(rng.randint(0, 6)))] for _ in range(12)]
    names = [prepare_build.shard_name(i) for i in range(len(shards))]
    for name, docs in zip(names, shards):
        prepare_build.write_docs(tmp_path, name, docs, {})
    reader = prepare_build.ShardReader(tmp_path, names)
    flat = [d for docs in shards for d in docs]
    order = list(range(len(flat)))
    rng.shuffle(order)
    for i in order:
        ids, mask = reader.doc(i)
        assert ids.tolist() == flat[i].input_ids and mask.tolist() == flat[i].loss_mask
        assert len(reader._open) <= 3
    reader.close()
