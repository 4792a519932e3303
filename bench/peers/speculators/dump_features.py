"""Write speculators' on-disk hidden states with the shared HF dumper (run with /work/main/.venv/bin/python).

speculators' trainer (train/data.py ArrowDataset + hs_connectors FileTransfer) reads, for row i of the SAVED
(shuffled) prepare-data dataset, `<data>/hidden_states/hs_{i}.safetensors` with
  hidden_states [seq, n_aux + 1, hidden]: the aux layers, then the LAST decoder layer's output BEFORE the
                final norm (the trainer applies the verifier's norm + lm_head itself to get its labels),
  token_ids     [seq]: must equal the row's input_ids (else the sample is dropped).
Aux id convention: speculators/vLLM aux id L = HF output_hidden_states[L] = output of decoder layer L-1.

usage: dump_features.py TARGET_DIR ORDER_JSONL OUT_DIR AUX_ID [AUX_ID ...]
ORDER_JSONL: one {"idx": i, "input_ids": [...]} per line, in the saved dataset's order.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/peers
from features import iter_hidden_states  # noqa: E402


def main() -> None:
    target, order, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    aux_ids = [int(a) for a in sys.argv[4:]]
    out.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in open(order, encoding="utf-8") if line.strip()]
    torch.set_num_threads(int(os.environ.get("DUMP_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))))
    t0 = time.perf_counter()
    n_tok = 0
    stats: dict = {}
    for row, feats in iter_hidden_states(target, rows, hf_indices=aux_ids, prenorm_last=True,
                                         dtype=torch.float32, stats=stats):
        ids = torch.tensor(row["input_ids"], dtype=torch.long)
        assert feats.shape == (ids.numel(), len(aux_ids) + 1, feats.shape[-1]), feats.shape
        save_file({"hidden_states": feats.contiguous(), "token_ids": ids},
                  str(out / f"hs_{row['idx']}.safetensors"))
        n_tok += ids.numel()
    dt = time.perf_counter() - t0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"rows": len(rows), "tokens": n_tok, "seconds": dt, "cpu_s": ru.ru_utime + ru.ru_stime,
                      "threads": torch.get_num_threads(), **stats}))


if __name__ == "__main__":
    main()
