"""Resident memory of what a trainer rank loads of the target: the whole model vs head only.

Each variant loads in a fresh subprocess (RSS is not returned to the OS after a free), and reports
psutil's RSS after the tokenizer (baseline) and after the load with every weight read once (the
safetensors are memory-mapped: a tensor counts once touched, as training touches the lm_head every
step); rss_mb is that difference, peak_rss_mb the peak (getrusage) minus the baseline, anon_mb
the difference without file-backed pages (memory-mapped safetensors pages the page cache shares).

usage: .venv/bin/python bench/target_memory.py TARGET [TARGET ...]   (a HF dir, a .gguf, embedded:gemma3-270m)
"""
from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import gc, json, resource, sys, psutil, torch, transformers
from dflash_train.config import TargetConfig
from dflash_train.targets import load_target, load_tokenizer
from dflash_train.targets.head_only import load_head_only_target
cfg = TargetConfig(path=sys.argv[2])
tok, _ = load_tokenizer(cfg)
gc.collect()
m0 = psutil.Process().memory_info()
base = m0.rss
t = load_head_only_target(cfg, "cpu", tok) if sys.argv[1] == "head" else load_target(cfg, device="cpu", tokenizer=tok)
with torch.no_grad():  # page every weight in (mmap-backed tensors count only once read, as training reads them)
    for p in t.model.parameters():
        p.sum()
gc.collect()
m1 = psutil.Process().memory_info()
rss = m1.rss
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
params = sum(p.numel() * p.element_size() for p in t.model.parameters())
print(json.dumps({"what": sys.argv[1], "rss_mb": round((rss - base) / 2**20, 1),
                  "peak_rss_mb": round((peak - base) / 2**20, 1),
                  "anon_mb": round(((m1.rss - m1.shared) - (m0.rss - m0.shared)) / 2**20, 1),
                  "param_mb": round(params / 2**20, 1), "decoder_layers": len(t.layers)}))
"""


def main() -> None:
    for target in sys.argv[1:]:
        for what in ("full", "head"):
            out = subprocess.run([sys.executable, "-c", CHILD, what, target], capture_output=True, text=True,
                                 check=True).stdout.strip().splitlines()[-1]
            print(json.dumps({"target": target, **json.loads(out)}))


if __name__ == "__main__":
    main()
