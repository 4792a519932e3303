"""train.jsonl -> SpecForge offline DFlash feature files (run with /work/main/.venv/bin/python).

One `torch.save` dict per row, `<out>/f_<row:06d>.ckpt`:
  input_ids [seq] int64, loss_mask [seq] int64 (0/1), hidden_states [seq, 576] float32
hidden_states = HF output_hidden_states[16] = the OUTPUT of decoder layer 15 (z-lab / SpecForge
target layer id 15: specforge/modeling/draft/dflash.py extract_context_feature uses hidden_states[id + 1]).
The format is what specforge/algorithms/common/dflash_family_data.py normalize_offline_sample reads.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/peers: the shared features.py
from features import iter_hidden_states, read_rows  # noqa: E402

LAYER_ID = 15            # z-lab / SpecForge / dflash-train id
HF_INDEX = LAYER_ID + 1  # HF output_hidden_states index


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--limit", type=int, default=0)
    a = ap.parse_args()
    rows = read_rows(a.train)
    if a.limit:
        rows = rows[: a.limit]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    n = tokens = 0
    stats: dict = {}
    for i, (row, feats) in enumerate(iter_hidden_states(a.target, rows, [HF_INDEX], stats=stats)):
        ids = torch.tensor(row["input_ids"], dtype=torch.long)
        mask = torch.tensor(row["loss_mask"], dtype=torch.long)
        hs = feats[:, 0, :].contiguous()  # [seq, hidden]
        assert hs.shape[0] == ids.shape[0] == mask.shape[0], (hs.shape, ids.shape, mask.shape)
        torch.save({"input_ids": ids, "loss_mask": mask, "hidden_states": hs}, out / f"f_{i:06d}.ckpt")
        n += 1
        tokens += int(ids.numel())
    dt = time.perf_counter() - t0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    info = {"rows": n, "tokens": tokens, "seconds": dt, "hf_index": HF_INDEX, "layer_id": LAYER_ID,
            "threads": torch.get_num_threads(), "cpu_s": ru.ru_utime + ru.ru_stime, **stats}
    (out / "dump.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info))


if __name__ == "__main__":
    main()
