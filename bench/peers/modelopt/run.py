"""ModelOpt (nvidia-modelopt 0.47.0) DFlash on CPU, on the peers' common work.

    .venv-peers/modelopt/bin/python bench/peers/modelopt/run.py DATA_DIR OUT_DIR
        [--steps N] [--seconds S] [--seed K] [--peer-defaults] [--seq-len L] [--threads T]
        [--data-mode pretokenized|template]

1. data prep: DATA_DIR/train.jsonl -> OUT_DIR/data/train.jsonl (the rows as they are: ModelOpt's
   online mode reads "messages"; our collator hook reads input_ids/loss_mask) and a check that
   ModelOpt's own LanguageDataCollator with smollm2_generation.jinja yields the same input_ids and
   loss mask for every row that is not a later piece of a cut conversation.
2. train: train_entry.py (vendored examples/speculative_decoding/main.py, in-process HF target =
   online features: no feature dump) with /usr/bin/time -v -> OUT_DIR/ckpt
3. export: vendored scripts/export_hf_checkpoint.py -> OUT_DIR/export (z-lab DFlash dir for vLLM)
4. OUT_DIR/result.json

--offline (issue 48: every trainer offline, one dumper): step 2 trains from OUT_DIR/features (or
--features DIR), written first by dump_features.py in the project venv (its time and CPU seconds as
feature_dump_seconds / feature_dump_cpu_seconds); the trainer then loads the target without its
decoder layers (ModelOpt's offline path). Format read from the 0.47.0 wheel, not yet run here.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

MAIN_PY = Path(__file__).resolve().parents[3] / ".venv" / "bin" / "python"

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
RECIPE_REL = "modelopt_recipes/general/speculative_decoding/dflash.yaml"
MASK_ID = 16          # <empty_output>
TARGET_LAYER = 15     # output of decoder layer 15 = HF hidden_states[16]; ModelOpt indexes [lid + 1]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("data_dir")
    p.add_argument("out_dir")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (max_steps; sets the LR schedule)")
    p.add_argument("--seconds", type=float, default=0.0, help="stop after S s of training (0 = no cap)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer-defaults", action="store_true",
                   help="ModelOpt's dflash.yaml recipe for loss/decay/anchors/batching/lr (not ours)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="training_seq_len (pad target); default 192 (ours), 4096 with --peer-defaults")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    p.add_argument("--data-mode", choices=("pretokenized", "template"), default="pretokenized")
    p.add_argument("--offline", action="store_true",
                   help="train from features dumped by the shared dumper (dump_features.py: layer 15; with "
                        "--peer-defaults also the last layer for its KD loss) instead of running the target "
                        "every step: data.offline_data_path, ModelOpt's own offline mode")
    p.add_argument("--features", type=Path, default=None, help="with --offline: reuse this finished dump")
    p.add_argument("--keep-rope-bug", action="store_true",
                   help="do not pin the draft RoPE to the target's (ModelOpt then trains at theta 10000)")
    p.add_argument("--logging-steps", type=int, default=10)
    return p.parse_args()


def target_dir(data_dir: Path) -> str:
    for c in (data_dir / "target_dir.txt", ROOT / "runs/peers/data/target_dir.txt"):
        if c.exists():
            return c.read_text().strip()
    raise SystemExit("no target_dir.txt next to train.jsonl nor in runs/peers/data/")


def prep_data(data_dir: Path, out: Path) -> tuple[int, int, list[dict]]:
    rows = [json.loads(l) for l in (data_dir / "train.jsonl").open() if l.strip()]
    (out / "data").mkdir(parents=True, exist_ok=True)
    n_tok = 0
    with (out / "data" / "train.jsonl").open("w") as f:
        for r in rows:
            f.write(json.dumps({"id": r["id"], "input_ids": r["input_ids"], "loss_mask": r["loss_mask"],
                                "messages": r["messages"]}, ensure_ascii=False) + "\n")
            n_tok += len(r["input_ids"])
    return len(rows), n_tok, rows


def check_template(rows: list[dict], tdir: str, template: Path) -> dict:
    """ModelOpt's own collator (answer_only_loss, DFlash's unshifted labels) on each row's messages vs
    the row's input_ids / loss_mask. Later pieces of a cut conversation (piece > 0) start mid-text and
    cannot come from rendering messages: skipped. Piece 0 of a cut one is compared as a prefix."""
    import transformers
    from modelopt.torch.utils.plugins.transformers_dataset import LanguageDataCollator
    tok = transformers.AutoTokenizer.from_pretrained(tdir)
    col = LanguageDataCollator(tokenizer=tok, train_len=4096, chat_template=template.read_text(),
                               answer_only_loss=True, shift_labels=False, return_labels=True)
    res = {"checked": 0, "equal": 0, "differ": 0, "skipped_later_pieces": 0, "first_differ": None}
    for r in rows:
        if r.get("piece", 0) > 0:
            res["skipped_later_pieces"] += 1
            continue
        b = col([{"messages": r["messages"]}])
        n = len(r["input_ids"])
        ids = b["input_ids"][0][:n].tolist()
        mask = (b["labels"][0][:n] != -100).long().tolist()
        res["checked"] += 1
        if ids == r["input_ids"] and mask == list(r["loss_mask"]):
            res["equal"] += 1
        else:
            res["differ"] += 1
            if res["first_differ"] is None:
                j = next((i for i in range(n) if ids[i] != r["input_ids"][i] or mask[i] != r["loss_mask"][i]), n)
                res["first_differ"] = {"id": r["id"], "at": j, "ours": r["input_ids"][j:j + 5],
                                       "ours_mask": r["loss_mask"][j:j + 5], "modelopt": ids[j:j + 5],
                                       "modelopt_mask": mask[j:j + 5]}
    return res


def overrides(a, tdir: str, out: Path, seq_len: int) -> list[str]:
    arch = {"num_hidden_layers": 1, "target_layer_ids": [TARGET_LAYER], "head_dim": 64,
            "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-6}
    if not a.keep_rope_bug:
        # hf_dflash.py:433 copies rope_theta from the base config only if the base config has that
        # attribute; transformers 5's LlamaConfig keeps it in rope_parameters only, so the draft
        # would train at Qwen3Config's default theta 10000 while the exporter writes the target's
        # 100000 (what vLLM serves). Pin the target's RoPE.
        arch["rope_parameters"] = {"rope_theta": 100000.0, "rope_type": "default"}
    o = [
        f"model.model_name_or_path={tdir}",
        (f"data.offline_data_path={a.features_dir}" if a.offline else f"data.data_path={out / 'data' / 'train.jsonl'}"),
        f"data.chat_template={HERE / 'smollm2_generation.jinja'}",
        f"training.output_dir={out / 'ckpt'}",
        f"training.training_seq_len={seq_len}",
        f"training.seed={a.seed}", f"training.data_seed={a.seed}",
        f"training.logging_steps={a.logging_steps}",
        "training.save_strategy='no'",  # quoted: OmegaConf reads a bare no as False
        # CPU / parity overrides (NOTES.md)
        "training.bf16=false", "training.tf32=false", "training.report_to=none",
        "training.ar_validate_steps=0", "training.dataloader_num_workers=0",
        "dflash.dflash_use_torch_compile=false",
        "dflash.dflash_block_size=8", f"dflash.dflash_mask_token_id={MASK_ID}",
        "dflash.dflash_architecture_config=" + json.dumps(arch).replace(" ", ""),
    ]
    if a.steps:
        o.append(f"training.max_steps={a.steps}")
    else:
        o.append("training.num_train_epochs=1")
    if not a.peer_defaults:  # ours: configs/cpu-demo.yaml train.*
        o += [
            "training.per_device_train_batch_size=4",
            "training.learning_rate=1e-3",
            "training.lr_scheduler_type=cosine_with_min_lr",
            'training.lr_scheduler_kwargs={"min_lr_rate":0.1}',
            "training.warmup_steps=0.02",   # transformers 5: a float < 1 is a ratio of max_steps
            "training.adam_beta1=0.9", "training.adam_beta2=0.95", "training.weight_decay=0.0",
            "training.max_grad_norm=1.0",
            "dflash.dflash_num_anchors=24",
            "dflash.dflash_self_logit_distillation=false",   # CE to the data tokens
            "dflash.dflash_loss_objective=dpace", "dflash.dflash_dpace_alpha=0.5",
        ]
    return o


def main():
    a = parse()
    data_dir, out = Path(a.data_dir).resolve(), Path(a.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    seq_len = a.seq_len or (4096 if a.peer_defaults else 192)
    py = sys.executable
    import modelopt
    import importlib.metadata as md
    recipe = Path(modelopt.__file__).resolve().parent.parent / RECIPE_REL
    tdir = target_dir(data_dir)
    result = {"peer": "modelopt", "peer_version": md.version("nvidia-modelopt"),
              "command": " ".join(shlex.quote(x) for x in [py] + sys.argv), "error": None,
              "feature_dump_seconds": 0.0,
              "feature_dump_how": "none: ModelOpt online mode runs the frozen HF target in the training "
                                  "process each step (train_seconds includes that target forward)"}

    t = time.perf_counter()
    n_rows, n_tok, rows = prep_data(data_dir, out)
    result["data_prep_seconds"] = round(time.perf_counter() - t, 3)
    result["rows"], result["row_tokens"] = n_rows, n_tok
    result["longest_row"] = max(len(r["input_ids"]) for r in rows)
    t = time.perf_counter()
    result["template_check"] = check_template(rows, tdir, HERE / "smollm2_generation.jinja")
    result["template_check_seconds"] = round(time.perf_counter() - t, 3)
    del rows
    if result["longest_row"] > seq_len:
        print(f"note: rows up to {result['longest_row']} tokens are truncated to training_seq_len={seq_len}")

    if a.offline:
        kd = bool(a.peer_defaults)  # ModelOpt's own loss distils the target's logits: the last layer too
        if a.features is not None:
            a.features_dir = a.features.resolve()
            result["feature_dump_reused"] = str(a.features_dir)
        else:
            a.features_dir = out / "features"
            cmd = [str(MAIN_PY), str(HERE / "dump_features.py"), "--train", str(out / "data" / "train.jsonl"),
                   "--target", tdir, "--out", str(a.features_dir), "--layer", str(TARGET_LAYER)] + (["--kd"] if kd else [])
            with (out / "dump.log").open("w") as log:
                q = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS=str(a.threads)), stdout=log,
                                   stderr=subprocess.STDOUT)
            if q.returncode != 0:
                raise SystemExit(f"feature dump failed (see {out / 'dump.log'})")
        dump = json.loads((a.features_dir / "dump.json").read_text())
        if dump.get("kd") != kd:
            raise SystemExit(f"{a.features_dir}: dumped with kd={dump.get('kd')}, this run needs kd={kd}")
        result.update(feature_dump=dump, feature_dump_seconds=dump["seconds"], feature_dump_cpu_seconds=dump["cpu_s"],
                      feature_dump_how="the shared dumper (bench/peers/features.py), stopping after layer 15"
                                       + (" (all layers: the KD loss needs the target's last layer)" if kd else ""))
    stats_path = out / "train_stats.json"
    ov = overrides(a, tdir, out, seq_len)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    cmd = ["/usr/bin/time", "-v", py, str(HERE / "train_entry.py"), str(stats_path), "offline" if a.offline else a.data_mode,
           str(a.seconds), "--config", str(recipe)] + ov
    result["train_command"] = " ".join(shlex.quote(x) for x in cmd)
    print("+", result["train_command"], flush=True)
    t = time.perf_counter()
    with (out / "train.log").open("w") as log:
        p = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    result["train_process_seconds"] = round(time.perf_counter() - t, 3)
    logtxt = (out / "train.log").read_text(errors="replace")
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", logtxt)
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
    result["peak_rss_mb"] = round(int(m.group(1)) / 1024, 1) if m else stats.get("peak_rss_mb")
    result["peak_rss_how"] = "/usr/bin/time -v of the training process (target + draft, one process)"
    result["steps"] = stats.get("steps")
    result["train_seconds"] = None if stats.get("train_seconds") is None else round(stats["train_seconds"], 3)
    result["supervised_tokens"] = stats.get("supervised_tokens")
    result["supervised_tokens_how"] = (
        "counted in the run: a hook on HFDFlashModel._compute_loss sums, per forward, the (anchor, "
        "block position) pairs whose loss weight is non-zero before the position weighting, i.e. "
        "block kept * position 1..7 * label index < training_seq_len * loss_mask[anchor+k] (the "
        "mask ModelOpt itself builds; anchors are drawn per step among loss_mask==1 positions "
        "<= seq_len-8, min(num_anchors, valid-1) per sample)")
    result["anchors"] = stats.get("anchors")
    result["real_tokens_seen"], result["padded_tokens_seen"] = stats.get("real_tokens"), stats.get("padded_tokens")
    if p.returncode != 0 or stats.get("error"):
        err = stats.get("error")
        if not err:
            tail = [l for l in logtxt.splitlines() if l.strip() and not l.startswith("\t")]
            err = next((l for l in reversed(tail) if re.match(r"^\w*(Error|Exception)", l)), f"exit {p.returncode}")
        result["error"] = f"train: {err}"

    hf = stats.get("hf_args", {})
    result["settings"] = {
        "mode": "peer-defaults (ModelOpt dflash.yaml)" if a.peer_defaults else "ours (configs/cpu-demo.yaml)",
        "loss": ("KD: soft CE to the target's softmax logits (dflash_self_logit_distillation)"
                 if stats.get("self_logit_distillation") else "CE to the data tokens"),
        "position_weights": stats.get("loss_objective"),
        "dpace_alpha": 0.5 if stats.get("loss_objective") == "dpace" else None,
        "anchors_per_sample": stats.get("num_anchors"),
        "batching": (f"{hf.get('per_device_train_batch_size')} documents per step, each right-padded "
                     f"(or cut) to training_seq_len={seq_len}, no packing"),
        "lr": hf.get("learning_rate"), "lr_schedule": hf.get("lr_scheduler_type"),
        "lr_scheduler_kwargs": hf.get("lr_scheduler_kwargs"), "warmup_steps": hf.get("warmup_steps"),
        "optimizer": stats.get("optimizer"), "hf_optim": hf.get("optim"),
        "max_grad_norm": hf.get("max_grad_norm"),
        "vocab_for_loss": "full 49,152 (ModelOpt has no vocab subset)",
        "target_dtype": stats.get("target_dtype"), "draft_dtype": stats.get("draft_dtype"),
        "draft_config": stats.get("draft_config"),
        "draft_rope_theta_effective": stats.get("draft_rope_theta_effective"), "target_layer_ids_modelopt": stats.get("target_layer_ids"),
        "hf_hidden_states_index": [i + 1 for i in (stats.get("target_layer_ids") or [])],
        "mask_token_id": stats.get("mask_token_id"), "device": stats.get("device"),
        "threads": stats.get("torch_threads"), "data_mode": a.data_mode,
        "trainable_params": stats.get("draft_trainable_params"),
        "hf_args": hf,
    }
    result["loss_log_tail"] = stats.get("loss_log", [])[-3:]

    if result["error"] is None:
        exp = out / "export"
        cmd = [py, str(HERE / "vendor" / "scripts" / "export_hf_checkpoint.py"),
               "--model_path", str(out / "ckpt"), "--export_path", str(exp)]
        result["export_command"] = " ".join(shlex.quote(x) for x in cmd)
        t = time.perf_counter()
        with (out / "export.log").open("w") as log:
            q = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        result["export_seconds"] = round(time.perf_counter() - t, 3)
        if q.returncode != 0:
            tail = (out / "export.log").read_text(errors="replace").strip().splitlines()
            result["error"] = f"export: {tail[-1] if tail else q.returncode}"
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: result[k] for k in ("steps", "train_seconds", "supervised_tokens", "peak_rss_mb",
                                              "error")}))
    return 0 if result["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
