"""The peers' common input: the documents dflash-train trains on, one row each, before packing.

    .venv/bin/python bench/peers/data.py --regenerated runs/peers/data/regenerated.jsonl --out runs/peers/data

reads the target-written answers (`dflash-train regenerate`, `make demo`'s data step) with the
demo config's data settings and writes, with dflash-train's own functions (so every trainer sees
the token ids our trainer sees):

* train.jsonl: {"id", "input_ids", "loss_mask" (0/1), "messages"} per training document: the
  conversation in the target's chat template, cut at data.max_tokens (long_rule split), documents
  with fewer than block_size + 1 supervised tokens dropped, exactly as `build_prepared` does before
  it packs several documents into one row. "messages" is the whole conversation (for trainers that
  apply the chat template themselves); a cut conversation's later pieces carry "piece" > 0.
* heldout.jsonl: the held-out conversations' first user turns, {"id", "prompt"}: the prompts every
  drafter is judged on (what `dflash-train eval --prompts heldout` scores).
* target_dir.txt: the HF directory of the target (the converted GGUF vLLM serves).
* data.json: counts, the regenerated file and data.limit (what dflash-train is given too).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflash_train.config import load_config
from dflash_train.data.packing import cut_document
from dflash_train.data.prepare import min_supervised_for, read_source_conversations
from dflash_train.data.sources import is_heldout
from dflash_train.data.template import ChatFormat, TemplateMismatch
from dflash_train.targets import served_target_dir
from dflash_train.targets import load_tokenizer

REPO = Path(__file__).resolve().parents[2]


def write_peer_data(regenerated: Path, out: Path, config: Path, limit: int | None = None) -> dict:
    """`limit`: the first conversations of `regenerated` only (data.limit, which every trainer is
    then given: a budget smaller than the demo's needs less data, and the peers' features less disk)."""
    # the first `limit` conversations of the file and no more (the demo's data.domain_prompts would add theirs)
    overrides = [f"data.regenerated={Path(regenerated).resolve()}", "data.domain_prompts={}"] + \
        ([f"data.limit={limit}"] if limit else [])
    cfg = load_config(config, overrides)
    tok, family = load_tokenizer(cfg.target)
    fmt = ChatFormat(tok, family)
    convs, _ = read_source_conversations(cfg)
    min_sup = min_supervised_for(cfg)
    out.mkdir(parents=True, exist_ok=True)
    counts = {"regenerated": str(Path(regenerated).resolve()), "limit": cfg.data.limit, "conversations": len(convs), "train_documents": 0, "heldout": 0, "template_mismatch": 0,
              "dropped_short": 0, "tokens": 0, "supervised_tokens": 0}
    with (out / "train.jsonl").open("w") as tf, (out / "heldout.jsonl").open("w") as hf:
        for conv in convs:
            if is_heldout(conv, cfg.data.heldout_fraction):
                hf.write(json.dumps({"id": conv.id, "prompt": conv.prompt}, ensure_ascii=False) + "\n")
                counts["heldout"] += 1
                continue
            try:
                enc = fmt.encode(conv.messages)
            except TemplateMismatch:
                counts["template_mismatch"] += 1
                continue
            pieces, _ = cut_document(enc.input_ids, enc.loss_mask, cfg.data.max_tokens, cfg.data.long_rule)
            for i, p in enumerate(pieces):
                if p.supervised < min_sup:
                    counts["dropped_short"] += 1
                    continue
                row = {"id": conv.id, "piece": i, "input_ids": list(p.input_ids), "loss_mask": [int(m) for m in p.loss_mask],
                       "messages": conv.messages}
                tf.write(json.dumps(row, ensure_ascii=False) + "\n")
                counts["train_documents"] += 1
                counts["tokens"] += len(p.input_ids)
                counts["supervised_tokens"] += int(sum(p.loss_mask))
    (out / "target_dir.txt").write_text(str(served_target_dir(cfg.target.path)) + "\n")
    (out / "data.json").write_text(json.dumps(counts, indent=1) + "\n")
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--regenerated", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "cpu-demo.yaml")
    ap.add_argument("--limit", type=int, default=None, help="the first N conversations only (data.limit)")
    a = ap.parse_args()
    print(json.dumps(write_peer_data(a.regenerated, a.out, a.config, a.limit)))


if __name__ == "__main__":
    main()
