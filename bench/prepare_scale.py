"""The figures of docs/benchmarks.md "Preparing at scale (issue 47)", three steps:

  python bench/prepare_scale.py jsonl OUT.jsonl      the ShareGPT package's conversations written
                                                     twice (the second time under new ids): 34,780
  python bench/prepare_scale.py serial OUT.jsonl     CPU seconds of the serial parts of a 20K build
                                                     (reading the source; placing; writing rows)
  python bench/prepare_scale.py rss PREPARED_DIR     peak RSS: opening the rows (and prepare's counts
                                                     of them, what training reads), a batch, then a
                                                     scan of the mapped rows (what it no longer does)

The prepare-data and train commands themselves, run under /usr/bin/time -v, are in the doc.
"""
from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch

from dflash_train.config import load_config
from dflash_train.data import prepare, prepare_build, read_prepared
from dflash_train.data.prepare import build_prepared, cache_inputs, read_source_conversations
from dflash_train.data.prepared_store import count_rows
from dflash_train.data.sources import read_conversations
from dflash_train.targets import load_tokenizer

OVERRIDES = ["target.path=embedded:smollm2-135m-instruct", "data.limit=20000", "data.max_tokens=192",
             "data.long_rule=split", "model.block_size=8", "data.heldout_fraction=0.05"]


def write_jsonl(out: Path) -> None:
    convs, _ = read_conversations("sharegpt", None)
    with out.open("w") as f:
        for rep in range(2):
            for c in convs:
                j = c.to_json()
                if rep:
                    j["id"] = f"{j.get('id')}-dup"
                f.write(json.dumps(j, ensure_ascii=False) + "\n")
    print(f"{2 * len(convs)} conversations -> {out}")


def serial_parts(jsonl: Path) -> None:
    cfg = load_config(None, [f"data.source=jsonl:{jsonl}", *OVERRIDES])
    tok, fam = load_tokenizer(cfg.target)
    out = jsonl.parent / "serial-rows"
    work = out.parent / f".{out.name}.build"

    def stop(*a):
        raise KeyboardInterrupt  # keep the tokenised shards, stop before packing

    write_rows = prepare.write_rows
    prepare.write_rows = stop
    try:
        build_prepared(cfg, tok, fam, out, cache_inputs(cfg, tok, fam))
    except KeyboardInterrupt:
        pass
    prepare.write_rows = write_rows
    t = time.process_time()
    convs, _ = read_source_conversations(cfg)
    read_s = time.process_time() - t
    reader = prepare_build.ShardReader(work, sorted(p.name[:-5] for p in work.glob("shard-*.json")))
    t = time.process_time()
    prepare_build.place_documents(reader.lengths, cfg.data.max_tokens, cfg.model.block_size + 1)
    place_s = time.process_time() - t
    rows_dir = out.parent / "serial-rows-written"
    rows_dir.mkdir(exist_ok=True)
    t = time.process_time()
    n = prepare_build.write_rows(reader, rows_dir, cfg.data.max_tokens, 0, cfg.model.block_size + 1).rows
    rows_s = time.process_time() - t
    print(f"conversations {len(convs)}, documents {len(reader.lengths)}, rows {n}: read {read_s:.2f} CPU s, "
          f"place {place_s:.2f} CPU s, place + write rows {rows_s:.2f} CPU s")


def rss(path: Path) -> None:
    def mb() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    d = read_prepared(path)
    opened = mb()
    idx = torch.randint(0, d.num_rows, (4,))
    batch = d.input_ids[idx], d.loss_mask[idx], d.document_ids[idx]
    batched = mb()
    hits = int(d.counts.token_counts[49151]) if len(d.counts.token_counts) > 49151 else 0  # check_mask_unused's
    counted = mb()
    scan = count_rows(d.input_ids, d.loss_mask, d.document_ids)  # a chunked scan of the mapped rows
    print(f"{path}: rows {d.num_rows}, open {opened:.0f} MB, a batch of {len(batch[0])} {batched:.0f} MB, "
          f"prepare's counts ({hits} hits of id 49151, {d.counts.real_tokens} tokens) {counted:.0f} MB, "
          f"a scan of the rows ({scan.real_tokens} tokens) {mb():.0f} MB")


if __name__ == "__main__":  # the build's worker processes are spawned: they import this module again
    cmd, arg = sys.argv[1], Path(sys.argv[2])
    {"jsonl": write_jsonl, "serial": serial_parts, "rss": rss}[cmd](arg)
