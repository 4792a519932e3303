"""speculators 0.9.0 DFlash on CPU, on the peer comparison's common work (issue 36). Run by run.sh with the peer venv.

Stages (each timed apart):
 1. data prep   : DATA_DIR/train.jsonl -> {input_ids, loss_mask} JSONL -> `speculators prepare-data` (pre-tokenized
                  rows pass straight through, no vLLM render server; it writes a SHUFFLED HF dataset, seed 0)
 2. feature dump: bench/peers/features.py (project venv) -> <data>/hidden_states/hs_{i}.safetensors, i = row of the
                  SAVED dataset; hidden_states [seq, 2, 576] = HF output_hidden_states[16] (= output of decoder
                  layer 15 = our/z-lab id 15 = speculators/vLLM aux id 16) + the last layer before the final norm
 3. train       : train_wrap.py (speculators' own trainer + CPU monkeypatches), under /usr/bin/time -v
 4. export      : <save>/<epoch>/{config.json, model.safetensors} -> OUT_DIR/export (speculators format,
                  `speculators_model_type: dflash`, float32), which vLLM 0.32 loads as method "dflash".
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
PEER_PY = ROOT / ".venv-peers" / "speculators" / "bin" / "python"
PROJECT_PY = ROOT / ".venv" / "bin" / "python"
AUX_ID = 16          # speculators/vLLM aux id 16 == HF hidden_states[16] == output of decoder layer 15 (our id 15)
MASK_TOKEN_ID = 16   # <empty_output>
BLOCK = 8


def sh(cmd: list[str], log: Path, env: dict | None = None) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    dt = time.perf_counter() - t0
    if rc != 0:
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:]
        raise RuntimeError(f"{cmd[1] if len(cmd) > 1 else cmd[0]} exited {rc}: {tail[0] if tail else ''} (log {log})")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("data_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (also the LR-schedule horizon)")
    ap.add_argument("--seconds", type=float, default=None, help="training wall-clock budget, stops at a step end")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    ap.add_argument("--peer-defaults", action="store_true",
                    help="speculators' own loss/decay/anchors/batching/optimizer/schedule")
    ap.add_argument("--target", default=None, help="target HF dir (default: DATA_DIR/target_dir.txt)")
    ap.add_argument("--reuse-data", default=None,
                    help="a prepared dir (OUT_DIR/data of an earlier run on the same train.jsonl): skip stages 1-2")
    a = ap.parse_args()

    data_dir, out = Path(a.data_dir).resolve(), Path(a.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    target = a.target or (data_dir / "target_dir.txt").read_text().strip()
    threads = max(1, a.threads)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    result: dict = {"peer": "speculators", "peer_version": importlib.metadata.version("speculators"),
                    "mode": "peer-defaults" if a.peer_defaults else "common", "steps": 0, "train_seconds": None,
                    "data_prep_seconds": None, "feature_dump_seconds": None, "supervised_tokens": None,
                    "peak_rss_mb": None, "threads": threads, "target": target,
                    "command": shlex.join([str(HERE / "run.sh")] + sys.argv[1:]), "error": None}
    res_path = out / "result.json"

    def write():
        res_path.write_text(json.dumps(result, indent=1, default=str) + "\n")

    try:
        # ---- 1. data prep -------------------------------------------------------------------------------------
        src = data_dir / "train.jsonl"
        digest = hashlib.sha256(src.read_bytes()).hexdigest()[:16]
        if a.reuse_data:
            prep = Path(a.reuse_data).resolve()
            marker = json.loads((prep / "features.complete").read_text())
            if marker["train_jsonl_sha256_16"] != digest:
                raise RuntimeError(f"--reuse-data {prep} was built from another train.jsonl")
            result["data_prep_seconds"] = marker["data_prep_seconds"]
            result["feature_dump_seconds"] = marker["feature_dump_seconds"]
            result["data_reused_from"] = str(prep)
            result["feature_dump"] = marker.get("feature_dump")
        else:
            prep = out / "data"
            work = out / "work"
            work.mkdir(exist_ok=True)
            t0 = time.perf_counter()
            n_rows, max_len = 0, 0
            with open(src) as fi, open(work / "tok.jsonl", "w") as fo:
                for line in fi:
                    if line.strip():
                        r = json.loads(line)
                        fo.write(json.dumps({"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]}) + "\n")
                        n_rows += 1
                        max_len = max(max_len, len(r["input_ids"]))
            seq_length = max(2048, max_len)  # never truncate a row at prepare time
            sh([str(HERE.parents[2] / ".venv-peers/speculators/bin/speculators"), "prepare-data", "--model", target,
                "--data", str(work / "tok.jsonl"), "--output", str(prep), "--seq-length", str(seq_length),
                "--seed", "0", "--num-preprocessing-workers", "1", "--overwrite"], logs / "prepare_data.log", env)
            # the saved (shuffled) order: hs_{i} must be row i of THIS dataset
            from datasets import load_from_disk
            ds = load_from_disk(str(prep)).with_format(None)
            with open(work / "order.jsonl", "w") as fo:
                for i, r in enumerate(ds):
                    fo.write(json.dumps({"idx": i, "input_ids": r["input_ids"]}) + "\n")
            result["data_prep_seconds"] = time.perf_counter() - t0
            result["rows_in"], result["rows_prepared"] = n_rows, len(ds)
            # ---- 2. feature dump (project venv, the shared dumper) ---------------------------------------------
            denv = dict(env, DUMP_THREADS=str(threads))
            result["feature_dump_seconds"] = sh(
                [str(PROJECT_PY), str(HERE / "dump_features.py"), target, str(work / "order.jsonl"),
                 str(prep / "hidden_states"), str(AUX_ID)], logs / "dump_features.log", denv)
            # the dumper's own last line: rows, tokens, seconds, CPU seconds, decoder layers run
            dump_out = [ln for ln in (logs / "dump_features.log").read_text().splitlines() if ln.startswith("{")]
            result["feature_dump"] = json.loads(dump_out[-1]) if dump_out else None
            (prep / "features.complete").write_text(json.dumps({
                "train_jsonl_sha256_16": digest, "rows": len(ds), "aux_ids": [AUX_ID], "prenorm_last": True,
                "data_prep_seconds": result["data_prep_seconds"],
                "feature_dump_seconds": result["feature_dump_seconds"], "feature_dump": result["feature_dump"]}))
        write()

        # ---- 3. train -------------------------------------------------------------------------------------------
        from datasets import load_from_disk
        n_prepared = len(load_from_disk(str(prep)))
        steps = a.steps
        if steps is None and a.seconds is None:
            raise SystemExit("give --steps N and/or --seconds S")
        save = out / "checkpoints"
        if save.exists():
            shutil.rmtree(save)  # a fresh --save-path: resume would go through utils/util.py:17 "cuda:0"
        common_pins = [
            "--speculator-type", "dflash", "--verifier-name-or-path", target, "--data-path", str(prep),
            "--save-path", str(save), "--num-layers", "1", "--block-size", str(BLOCK),
            "--target-layer-ids", str(AUX_ID), "--full-attention-indices", "0",
            # vLLM 0.32 maps sliding_window_non_causal=False (the dflash default) to dflash_config.causal=True for
            # EVERY layer (transformers_utils/configs/speculators/algos.py:124), while speculators trains full-attention
            # layers bidirectionally (models/dflash/attention.py:43); True keeps vLLM non-causal = what was trained.
            "--sliding-window-non-causal",
            "--mask-token-id", str(MASK_TOKEN_ID), "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
            "--hidden-states-dtype", "float32", "--num-workers", "0", "--on-missing", "raise",
            "--seed", str(a.seed), "--log-freq", "10",
        ]
        if a.peer_defaults:
            recipe = []  # total-seq-len 8192, max-anchors 512, dpace/ce, muon, linear 1 % warmup, 20 epochs, 0.9 split
            if steps is None:
                steps_arg = []
            else:
                steps_arg = ["--max-steps", str(steps)]
        else:
            if steps is None:
                steps = 9000  # configs/cpu-demo.yaml train.max_steps: the schedule horizon when only --seconds is given
            # ours: 4 rows x 192 tokens = 768 tokens/step, 24 anchors/row = 96/step, D-PACE (alpha 0.5),
            # AdamW lr 1e-3, no weight decay, warmup 2 %, cosine. The one val row is never evaluated.
            recipe = ["--total-seq-len", "768", "--max-anchors", "96", "--loss-fn", "ce",
                      "--per-position-loss-weight", "dpace", "--dpace-alpha", "0.5",
                      "--optimizer", "adamw", "--lr", "1e-3", "--weight-decay", "0.0",
                      "--scheduler-type", "cosine", "--scheduler-warmup-ratio", "0.02",
                      "--epochs", "100000", "--train-data-ratio", repr((n_prepared - 0.5) / n_prepared)]
            steps_arg = ["--max-steps", str(steps)]
        train_args = common_pins + recipe + steps_arg
        tenv = dict(env, SPEC_STATS=str(out / "train_stats.json"), SPEC_THREADS=str(threads),
                    SPEC_SAVE_DTYPE="float32")
        if a.seconds is not None:
            tenv["SPEC_TRAIN_SECONDS"] = str(a.seconds)
        cmd = ["/usr/bin/time", "-v", str(PEER_PY), str(HERE / "train_wrap.py")] + train_args
        result["train_command"] = shlex.join(cmd)
        write()
        try:
            sh(cmd, logs / "train.log", tenv)
        finally:
            m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", (logs / "train.log").read_text(errors="replace"))
            if m:
                result["peak_rss_mb"] = int(m.group(1)) / 1024.0
        st = json.loads((out / "train_stats.json").read_text())
        rc = st["resolved_config"]
        result.update({
            "steps": st["steps"], "train_seconds": st["train_seconds"], "stopped_by": st["stopped_by"],
            "supervised_tokens": st["supervised_tokens"],
            "supervised_tokens_how": (
                "counted, not estimated: the sum over training steps of the nonzero entries of the aligned loss mask "
                "speculators' loss uses (models/dflash/core.py _backbone_forward: loss_mask at the block positions "
                "of each valid anchor, anchor slot 0 and padded anchors zeroed), read by wrapping "
                "speculators.models.dflash.core.compute_metrics during grad-enabled forwards"),
            "valid_anchors": st["anchors_valid"], "packed_tokens": st["packed_tokens"],
            "supervised_tokens_per_s": st["supervised_tokens"] / st["train_seconds"] if st["train_seconds"] else None,
            "steps_per_s": st["steps"] / st["train_seconds"] if st["train_seconds"] else None,
            "peak_rss_mb_ru_maxrss": st["peak_rss_mb"], "loss_first": st["loss"][:3], "loss_last": st["loss"][-3:],
            "batches_per_epoch": st["num_batches_per_epoch"], "lr_final": st["lr_final"],
            "settings": {
                "loss": f"{rc['loss_fn']} to the argmax of the target's logits (verifier norm + lm_head over the "
                        f"last pre-norm hidden state), full 49152 vocab, implementation {rc['loss_implementation']}",
                "position_decay": (f"dpace (alpha {rc['dpace_alpha']})" if rc["per_position_loss_weight"] == "dpace"
                                   else f"fixed-exp-decay gamma {rc['dflash_decay_gamma']}"),
                "anchors": f"max_anchors {rc['max_anchors']} per packed step, uniform over loss-mask positions "
                           f"(not in the last {BLOCK} positions of the packed row)",
                "batching": f"multipack: rows packed into one sequence of total_seq_len {rc['total_seq_len']} tokens "
                            f"per step (no padding rows), train_data_ratio {rc['train_data_ratio']:.6f}",
                "lr": rc["lr"], "schedule": f"{rc['scheduler_type']}, warmup "
                + (f"ratio {rc['scheduler_warmup_ratio']}" if rc["scheduler_warmup_ratio"] is not None else "1 %")
                + " to 0 at max_steps (or epochs x batches)",
                "optimizer": rc["optimizer"] + (" (torch AdamW betas 0.9/0.999, eps 1e-8)" if rc["optimizer"] == "adamw"
                                                else " (Muon on 2-D weights + AdamW on the rest)"),
                "weight_decay": rc["weight_decay"], "grad_clip": 1.0, "epochs_cap": rc["epochs"],
                "draft": f"{rc['num_layers']} qwen3 layer(s), block {rc['block_size']}, aux ids {rc['target_layer_ids']}"
                         f" (vLLM target_layer_ids {[i - 1 for i in rc['target_layer_ids']]}), mask {rc['mask_token_id']},"
                         f" full attention {rc['full_attention_indices']}, attn impl {rc['draft_attn_impl']}, float32",
                "seed": rc["seed"],
            },
        })
        # ---- 4. export --------------------------------------------------------------------------------------------
        ck = save / str(st["last_epoch"])
        exp = out / "export"
        if exp.exists():
            shutil.rmtree(exp)
        exp.mkdir()
        for name in ("config.json", "model.safetensors", "config.py"):
            if (ck / name).exists():
                shutil.copy2(ck / name, exp / name)
        result["export"] = str(exp)
    except BaseException as e:  # noqa: BLE001
        result["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
        write()
        raise
    write()
    print(json.dumps({k: result[k] for k in ("steps", "train_seconds", "supervised_tokens", "peak_rss_mb", "error")}))


if __name__ == "__main__":
    main()
