"""SpecForge 0.2.0 DFlash on CPU, on the peer-comparison data (issue 36).

    bench/peers/specforge/run.sh DATA_DIR OUT_DIR [--steps N] [--seconds S] [--seed K] [--peer-defaults]
                                                  [--limit ROWS] [--threads T] [--features DIR]

1. features: DATA_DIR/train.jsonl -> OUT_DIR/features/f_*.ckpt ({input_ids, loss_mask, hidden_states =
   HF hidden_states[16] = output of layer 15}) with the shared bench/peers/features.py, run by
   /work/main/.venv/bin/python (dump_features.py); timed apart. --features DIR reuses a finished dump.
2. draft config: OUT_DIR/draft_config.json, z-lab DFlashDraftModel layout derived from the target's
   config.json (1 layer, block 8, full attention, dflash_config.target_layer_ids [15], mask 16).
3. train: `specforge train -c OUT_DIR/run.yaml` in-process through train_wrap.py (SPECFORGE_DEVICE=cpu),
   under /usr/bin/time -v (peak RSS).
4. export: `specforge export --to hf --checkpoint <ckpt> --draft-config OUT_DIR/draft_config.json
   --output-dir OUT_DIR/export` (a z-lab dir that vLLM 0.32 loads as method "dflash").
5. OUT_DIR/result.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
SF_VENV = REPO / ".venv-peers" / "specforge"
SF_PY = SF_VENV / "bin" / "python"
SF_CLI = SF_VENV / "bin" / "specforge"
MAIN_PY = REPO / ".venv" / "bin" / "python"
PEER_VERSION = "0.2.0"

BLOCK_SIZE = 8
LAYER_ID = 15
MASK_ID = 16
MAX_LEN = 192  # train.jsonl documents are already cut at data.max_tokens = 192 (bench/peers/data.py)


def draft_config(target_dir: Path) -> dict:
    t = json.loads((target_dir / "config.json").read_text())
    rope = t.get("rope_parameters") or {"rope_theta": t.get("rope_theta", 10000.0), "rope_type": "default"}
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "num_hidden_layers": 1,
        "hidden_size": t["hidden_size"],
        "intermediate_size": t["intermediate_size"],
        "num_attention_heads": t["num_attention_heads"],
        "num_key_value_heads": t["num_key_value_heads"],
        "head_dim": t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"],
        "hidden_act": "silu",
        "rms_norm_eps": t["rms_norm_eps"],
        "rope_theta": rope["rope_theta"],
        "rope_parameters": rope,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "vocab_size": t["vocab_size"],
        "max_position_embeddings": t["max_position_embeddings"],
        "initializer_range": 0.02,
        "num_target_layers": t["num_hidden_layers"],
        "block_size": BLOCK_SIZE,
        "layer_types": ["full_attention"],
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 1,
        "tie_word_embeddings": False,
        "use_cache": True,
        "pad_token_id": t.get("pad_token_id", 0),
        "bos_token_id": t.get("bos_token_id"),
        "eos_token_id": t.get("eos_token_id"),
        "dtype": "float32",
        "torch_dtype": "float32",
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": [LAYER_ID]},
    }


# (ours = dflash-train's configs/cpu-demo.yaml where SpecForge has the knob; peer = SpecForge's schema defaults,
#  specforge/config/schema.py TrainingConfig / DataConfig)
OURS = {"training.batch_size": 4, "training.num_anchors": 24, "training.loss_type": "dpace",
        "training.dpace_alpha": 0.5, "training.learning_rate": 1.0e-3, "training.lr_scheduler": "cosine",
        "training.warmup_ratio": 0.02, "training.max_grad_norm": 1.0}
PEER = {"training.batch_size": 1, "training.num_anchors": 512, "training.loss_type": "dflash",
        "training.learning_rate": 1.0e-4, "training.lr_scheduler": "cosine", "training.warmup_ratio": 0.015,
        "training.max_grad_norm": 0.5}


def yaml_text(d: dict, indent: int = 0) -> str:
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out.append(" " * indent + f"{k}:")
            out.append(yaml_text(v, indent + 2))
        else:
            out.append(" " * indent + f"{k}: {json.dumps(v)}")
    return "\n".join(out)


def count_rows(path: Path) -> int:
    with open(path) as f:
        return sum(1 for line in f if line.strip())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--steps", type=int, default=9000, help="optimizer steps (the LR schedule's horizon)")
    ap.add_argument("--seconds", type=float, default=0.0, help="stop after S seconds of training (0 = none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peer-defaults", action="store_true")
    ap.add_argument("--limit", type=int, default=0, help="first ROWS rows only (quick checks)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument("--features", type=Path, default=None, help="reuse this feature dir (skip the dump)")
    ap.add_argument("--target", type=Path, default=None, help="default: DATA_DIR/target_dir.txt")
    a = ap.parse_args()

    out = a.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    data_dir = a.data_dir.resolve()
    target = (a.target or Path((data_dir / "target_dir.txt").read_text().strip())).resolve()
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "MKL_NUM_THREADS": str(a.threads),
           "SPECFORGE_DEVICE": "cpu", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    result = {"peer": "specforge", "peer_version": PEER_VERSION, "mode": "peer-defaults" if a.peer_defaults else "ours",
              "steps": 0, "train_seconds": None, "data_prep_seconds": None, "feature_dump_seconds": None,
              "supervised_tokens": None, "supervised_tokens_how": None, "peak_rss_mb": None, "settings": None,
              "command": " ".join(shlex.quote(x) for x in [str(HERE / "run.sh"), *sys.argv[1:]]),
              "threads": a.threads, "error": None}

    def finish(err: str | None = None) -> int:
        result["error"] = err
        (out / "result.json").write_text(json.dumps(result, indent=1))
        print(json.dumps({k: v for k, v in result.items() if k != "settings"}, indent=1))
        return 0 if err is None else 1

    # -- 1. data prep + features -------------------------------------------------------------------
    t0 = time.perf_counter()
    train = data_dir / "train.jsonl"
    if a.limit:
        lines = [line for line in open(train) if line.strip()][: a.limit]
        train = out / "train.limited.jsonl"
        train.write_text("".join(lines))
    n_rows = count_rows(train)
    (out / "draft_config.json").write_text(json.dumps(draft_config(target), indent=1))
    result["data_prep_seconds"] = time.perf_counter() - t0
    if a.features is not None:
        feat = a.features.resolve()
        dump = json.loads((feat / "dump.json").read_text())
        result["feature_dump_seconds"] = dump["seconds"]
        result["feature_dump_reused"] = str(feat)
    else:
        feat = out / "features"
        cmd = [str(MAIN_PY), str(HERE / "dump_features.py"), "--train", str(train), "--target", str(target),
               "--out", str(feat)]
        result["feature_dump_seconds"], err = run_logged(cmd, env, out / "dump.log")
        if err:
            return finish(f"feature dump: {err}")
        dump = json.loads((feat / "dump.json").read_text())
    result["feature_dump"] = dump

    # -- 2. run config -------------------------------------------------------------------------------
    knobs = PEER if a.peer_defaults else OURS
    batch = knobs["training.batch_size"]
    epochs = max(1, math.ceil(a.steps * batch / max(1, n_rows)) + 1)  # max_steps / seconds end the run
    ckpt_dir = out / "ckpt"
    cfg = {
        "run_id": "sf",
        "output_dir": str(ckpt_dir),
        "model": {"target_model_path": str(target), "draft_model_config": str(out / "draft_config.json"),
                  "torch_dtype": "float32", "mask_token_id": MASK_ID},
        "data": {"hidden_states_path": str(feat), "max_length": 2048 if a.peer_defaults else MAX_LEN,
                 "dataloader_num_workers": 1},
        "training": {"strategy": "dflash", "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD",
                     "max_steps": a.steps, "num_epochs": epochs, "seed": a.seed, "log_interval": 10,
                     "save_interval": 0},
        "deployment": {"trainer": {"nproc_per_node": 1}},
    }
    for k, v in knobs.items():
        cfg["training"][k.split(".", 1)[1]] = v
    (out / "run.yaml").write_text(yaml_text(cfg) + "\n")

    # -- 3. train --------------------------------------------------------------------------------------
    stats_path = out / "train_stats.json"
    train_cmd = [str(SF_PY), str(HERE / "train_wrap.py"), str(stats_path), str(a.seconds), "--",
                 "train", "-c", str(out / "run.yaml")]
    timed = ["/usr/bin/time", "-v", *train_cmd]
    result["train_command"] = "SPECFORGE_DEVICE=cpu OMP_NUM_THREADS=%d " % a.threads + " ".join(map(shlex.quote, timed))
    t2 = time.perf_counter()
    with open(out / "train.log", "w") as log:
        p = subprocess.run(timed, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    result["train_process_seconds"] = time.perf_counter() - t2
    logtext = (out / "train.log").read_text()
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", logtext)
    if m:
        result["peak_rss_mb"] = int(m.group(1)) / 1024
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
    result["steps"] = stats.get("steps", 0)
    result["train_seconds"] = stats.get("fit_seconds")
    result["supervised_tokens"] = stats.get("supervised_tokens")
    result["supervised_tokens_how"] = (
        "sum over every micro-batch of metrics['accuracy_denom'] returned by SpecForge's own "
        "OnlineDFlashModel.forward (= weight_mask.sum(): kept anchor blocks x block positions 1..7 whose label "
        "lies in the row and has loss_mask 1; position 0, the anchor, carries none), counted by train_wrap.py")
    result["time_budget_hit"] = stats.get("time_budget_hit")
    losses = stats.get("losses") or []
    if losses:
        k = max(1, len(losses) // 10)
        result["loss_first"] = sum(losses[:k]) / k
        result["loss_last"] = sum(losses[-k:]) / k
    if result["train_seconds"]:
        result["steps_per_second"] = result["steps"] / result["train_seconds"]
        result["supervised_tokens_per_second"] = (result["supervised_tokens"] or 0) / result["train_seconds"]
    result["settings"] = {
        "loss": ("CE to the data tokens, mean over supervised positions (loss_type dflash), no position decay "
                 "(loss_decay_gamma unset)") if a.peer_defaults else
                ("D-PACE (loss_type dpace, alpha 0.5) on CE to the data tokens, full vocab, sum / batch size"),
        "position_decay": None if a.peer_defaults else "D-PACE suffix weights (no exp decay)",
        "anchors_per_sample": knobs["training.num_anchors"],
        "anchor_rule": "uniform random among positions i with loss_mask[i] and loss_mask[i+1] (no replacement), "
                       "min(num_anchors, valid) per sample",
        "batching": f"{batch} sample(s) per step, right-padded to the longest (no packing); "
                    f"data.max_length {cfg['data']['max_length']}",
        "lr": knobs["training.learning_rate"],
        "schedule": f"linear warmup {knobs['training.warmup_ratio']:.3f} of {a.steps} steps, cosine to 0",
        "optimizer": "AdamW (torch defaults betas 0.9/0.999, eps 1e-8), weight decay 0, fp32 master params "
                     f"(BF16Optimizer class even in fp32), grad clip {knobs['training.max_grad_norm']}",
        "dtype": "float32", "attention": "sdpa, full attention, dense bool mask",
        "block_size": BLOCK_SIZE, "layers": 1, "target_layer_ids": [LAYER_ID], "mask_token_id": MASK_ID,
        "seed": a.seed, "run_yaml": cfg,
    }
    if p.returncode != 0:
        errs = [re.sub(r"^\[rank\d+\]:\s*", "", l).strip() for l in logtext.splitlines()
                if re.search(r"^(\[rank\d+\]:\s*)?[\w.]*(Error|Exception|Interrupt)\b", l)]
        return finish(f"train: {(errs or ['rc %d (see train.log)' % p.returncode])[-1]}")

    # -- 4. export ---------------------------------------------------------------------------------------
    latest = ckpt_dir / "sf-latest"
    ckpts = sorted(ckpt_dir.glob("sf-step*"), key=lambda q: int(re.sub(r"\D", "", q.name.split("step")[-1]) or 0))
    ckpt = latest if latest.exists() else (ckpts[-1] if ckpts else None)
    if ckpt is None:
        return finish("export: no checkpoint under " + str(ckpt_dir))
    exp_cmd = [str(SF_CLI), "export", "--to", "hf", "--checkpoint", str(ckpt), "--draft-config",
               str(out / "draft_config.json"), "--output-dir", str(out / "export")]
    result["export_command"] = " ".join(map(shlex.quote, exp_cmd))
    result["export_seconds"], err = run_logged(exp_cmd, env, out / "export.log")
    return finish(f"export: {err}" if err else None)


def run_logged(cmd: list[str], env: dict, log: Path) -> tuple[float, str | None]:
    """Run `cmd`, its output to `log`: (seconds, None) or (seconds, the last line of its stderr)."""
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    log.write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        return seconds, (p.stderr.strip().splitlines() or [f"rc {p.returncode}"])[-1]
    return seconds, None


if __name__ == "__main__":
    raise SystemExit(main())
