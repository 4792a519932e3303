"""train.jsonl -> ModelOpt offline DFlash dumps (run with /work/main/.venv/bin/python), the shared dumper.

One `torch.save` dict per row, `<out>/f_<row:06d>.pt`, in the format nvidia-modelopt 0.47.0's
`OfflineSupervisedDataset` reads (modelopt/torch/speculative/eagle/utils.py; the trainer takes it
with `data.offline_data_path=<out>`, which sets data.mode offline and loads the target without its
decoder layers, `load_vlm_or_llm(num_hidden_layers=0)`):
  input_ids          [seq] int64
  loss_mask          [seq] int64 (0/1; read because the recipe sets answer_only_loss)
  aux_hidden_states  [seq, 576] float32 = HF output_hidden_states[16] = the OUTPUT of decoder layer 15
                     (ModelOpt target_layer_ids [15], online it takes hidden_states[lid + 1]: check_layers.py)
  hidden_states      [seq, 576] float32: read ONLY for self-logit distillation (modeling_dflash.py
                     DFlashBaseModelOutput.from_offline_dict, need_logits), i.e. ModelOpt's own defaults
                     (--kd): then the last decoder layer's output before the final norm, with
                     hidden_states_prenorm True (ModelOpt re-applies the norm, then its lm_head); in our
                     recipe (CE to the data tokens) the aux tensor again, never read, and the dump stops
                     after layer 15.

usage: dump_features.py --train TRAIN_JSONL --target TARGET_DIR --out OUT_DIR [--kd] [--layer 15]
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kd", action="store_true", help="also the last layer, pre-norm (self-logit distillation)")
    ap.add_argument("--layer", type=int, default=15, help="ModelOpt / z-lab target layer id (HF index + 1)")
    a = ap.parse_args()
    rows = read_rows(a.train)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    n = tokens = 0
    stats: dict = {}
    for i, (row, feats) in enumerate(iter_hidden_states(a.target, rows, [a.layer + 1], prenorm_last=a.kd, stats=stats)):
        ids = torch.tensor(row["input_ids"], dtype=torch.long)
        aux = feats[:, 0, :].contiguous()
        torch.save({"input_ids": ids, "loss_mask": torch.tensor(row["loss_mask"], dtype=torch.long),
                    "aux_hidden_states": aux, "hidden_states": feats[:, 1, :].contiguous() if a.kd else aux,
                    "hidden_states_prenorm": bool(a.kd)}, out / f"f_{i:06d}.pt")
        n += 1
        tokens += int(ids.numel())
    ru = resource.getrusage(resource.RUSAGE_SELF)
    info = {"rows": n, "tokens": tokens, "seconds": time.perf_counter() - t0, "layer_id": a.layer, "kd": a.kd,
            "threads": torch.get_num_threads(), "cpu_s": ru.ru_utime + ru.ru_stime, **stats}
    (out / "dump.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info))


if __name__ == "__main__":
    main()
