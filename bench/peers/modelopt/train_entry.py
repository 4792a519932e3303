"""Runs the vendored ModelOpt trainer (vendor/main.py, HF Trainer) in this process, with
measuring hooks and the few CPU/parity patches listed in NOTES.md. Called by run.py:

    python train_entry.py STATS_JSON DATA_MODE SECONDS --config RECIPE key=value ...

STATS_JSON   where the measurements go (train seconds, steps, supervised tokens, peak RSS)
DATA_MODE    "pretokenized": batches built from the rows' own input_ids/loss_mask (exact same
             tokens as our trainer, also for the cut pieces of long conversations);
             "offline": ModelOpt's offline dataset over the .pt dumps of dump_features.py (the same rows);
             "template": ModelOpt's own LanguageDataCollator rendering "messages" with the
             {% generation %} chat template (only equal for uncut documents)
SECONDS      0 = no time cap, else stop at the first step boundary past it (training time)
the rest     passed to vendor/main.py unchanged (its --config + OmegaConf dotlist overrides)

None of the hooks changes what the peer computes: they time, count and stop.
"""
from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "vendor"))  # main.py imports eagle_utils, fsdp2_buffer_patch, scripts.*

stats_path, data_mode, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
sys.argv = [str(HERE / "vendor" / "main.py")] + sys.argv[4:]

import torch  # noqa: E402
import transformers  # noqa: E402

from modelopt.torch.speculative.plugins import hf_dflash  # noqa: E402

import main as mo_main  # noqa: E402  (vendor/main.py)

STATS = {"supervised_tokens": 0, "anchors": 0, "forward_calls": 0, "real_tokens": 0,
         "padded_tokens": 0, "loss_log": [], "train_seconds": None, "steps": 0,
         "target_dtype": None, "draft_dtype": None, "draft_config": None}

# ---- count the (anchor, block position) predictions that carry loss: the same mask as
# HFDFlashModel._compute_loss builds (block kept * in bounds * position > 0 * loss_mask).
_orig_compute_loss = hf_dflash.HFDFlashModel._compute_loss


def _counting_compute_loss(self, logits, input_ids, anchor_positions, block_keep_mask, loss_mask,
                           base_logits=None):
    with torch.no_grad():
        bsz, seq_len = input_ids.shape
        bs = self.dflash_block_size
        idx = anchor_positions.unsqueeze(-1) + torch.arange(bs, device=input_ids.device).view(1, 1, -1)
        valid = idx < seq_len
        lm = torch.gather(loss_mask.unsqueeze(1).expand(-1, idx.shape[1], -1), 2, idx.clamp(max=seq_len - 1))
        w = block_keep_mask.unsqueeze(-1).float() * valid.float() * lm
        w[..., 0] = 0
        STATS["supervised_tokens"] += int((w > 0).sum().item())
        STATS["anchors"] += int(block_keep_mask.sum().item())
        STATS["forward_calls"] += 1
    return _orig_compute_loss(self, logits, input_ids, anchor_positions, block_keep_mask, loss_mask,
                              base_logits)


hf_dflash.HFDFlashModel._compute_loss = _counting_compute_loss


# ---- data: pretokenized rows -> the batch LanguageDataCollator would give (right padding to
# training_seq_len with the pad id, attention_mask, unshifted labels = input_ids with -100 off the
# answer), i.e. what ModelOpt's collator produces for DFlash (shift_labels=False).
class PretokenizedCollator:
    def __init__(self, tokenizer, train_len):
        self.pad = tokenizer.pad_token_id
        self.train_len = train_len

    def __call__(self, examples):
        L = self.train_len
        ids = torch.full((len(examples), L), self.pad, dtype=torch.long)
        att = torch.zeros((len(examples), L), dtype=torch.long)
        labels = torch.full((len(examples), L), -100, dtype=torch.long)
        for i, ex in enumerate(examples):
            x = list(ex["input_ids"])[:L]
            m = list(ex["loss_mask"])[:L]
            n = len(x)
            ids[i, :n] = torch.tensor(x)
            att[i, :n] = 1
            lab = torch.tensor(x)
            lab[torch.tensor(m) == 0] = -100
            labels[i, :n] = lab
        STATS["real_tokens"] += int(att.sum())
        STATS["padded_tokens"] += int(att.numel())
        return {"input_ids": ids, "attention_mask": att, "labels": labels}


if data_mode == "pretokenized":
    _orig_make = mo_main.make_speculative_data_module

    def _make_pretokenized(tokenizer, data_args, train_len=None, answer_only_loss=False, shift_labels=True):
        from modelopt.torch.utils.plugins.transformers_dataset import ShardedDataset
        assert data_args.mode == "online" and not shift_labels and answer_only_loss
        if tokenizer.pad_token_id is None:  # what LanguageDataCollator._post_process_tokenizer does
            tokenizer.pad_token_id = tokenizer.eos_token_id
        ds = ShardedDataset("json", data_files=data_args.data_path)
        return {"train_dataset": ds, "data_collator": PretokenizedCollator(tokenizer, train_len)}

    mo_main.make_speculative_data_module = _make_pretokenized
elif data_mode not in ("template", "offline"):  # offline: ModelOpt's own offline dataset (data.offline_data_path)
    raise SystemExit(f"unknown DATA_MODE {data_mode!r}")


# ---- timing, step count, time cap, loss log
class Measure(transformers.TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, **kw):
        self.t0 = time.perf_counter()
        m = model
        layers = getattr(m._base_model, "layers", None)  # offline: ModelOpt drops the decoder layers
        STATS["target_dtype"] = str(next((layers[0] if layers else m._base_model_lm_head).parameters()).dtype)
        STATS["draft_dtype"] = str(next(m.dflash_module.parameters()).dtype)
        STATS["draft_config"] = {k: getattr(m.dflash_config, k, None) for k in (
            "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "block_size",
            "target_layer_ids", "max_position_embeddings", "_attn_implementation", "rope_parameters")}

        STATS["target_layer_ids"] = list(m.target_layer_ids)
        STATS["mask_token_id"] = m.mask_token_id
        STATS["loss_objective"] = m.dflash_loss_objective
        STATS["self_logit_distillation"] = m.dflash_self_logit_distillation
        STATS["num_anchors"] = m._num_anchors
        STATS["draft_trainable_params"] = sum(p.numel() for p in m.parameters() if p.requires_grad)
        STATS["torch_threads"] = torch.get_num_threads()

    def on_step_end(self, args, state, control, **kw):
        STATS["steps"] = state.global_step
        if seconds > 0 and time.perf_counter() - self.t0 >= seconds:
            control.should_training_stop = True
        return control

    def on_log(self, args, state, control, logs=None, **kw):
        if logs:
            STATS["loss_log"].append({"step": state.global_step, **{k: v for k, v in logs.items()
                                                                   if isinstance(v, (int, float))}})

    def on_train_end(self, args, state, control, optimizer=None, lr_scheduler=None, model=None, **kw):
        STATS["train_seconds"] = time.perf_counter() - self.t0
        rot = getattr(getattr(model, "dflash_module", None), "rotary_emb", None)  # built lazily
        if rot is not None:  # theta the draft really trained with: inv_freq[1] = theta^(-2/head_dim)
            inv = rot.inv_freq.double()
            STATS["draft_rope_theta_effective"] = round(float(inv[1] ** (-inv.numel())), 3)
        STATS["steps"] = state.global_step
        if optimizer is not None:
            g = optimizer.param_groups[0]
            STATS["optimizer"] = {"class": type(getattr(optimizer, "optimizer", optimizer)).__name__,
                                  **{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()
                                     if k in ("betas", "eps", "weight_decay", "lr", "initial_lr")}}
        if lr_scheduler is not None:
            STATS["lr_scheduler"] = type(lr_scheduler).__name__


_Trainer = mo_main.EagleTrainerWithAccLog


class MeasuredTrainer(_Trainer):
    def __init__(self, *a, callbacks=None, **kw):
        super().__init__(*a, callbacks=list(callbacks or []) + [Measure()], **kw)
        STATS["hf_args"] = {k: str(getattr(self.args, k)) for k in (
            "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate",
            "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "max_steps", "num_train_epochs",
            "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "optim",
            "bf16", "fp16", "tf32", "seed", "training_seq_len", "answer_only_loss", "dataloader_drop_last")}
        STATS["device"] = str(self.args.device)


mo_main.EagleTrainerWithAccLog = MeasuredTrainer

# Python 3.11: dataclasses.make_dataclass (main.py:78) leaves HfTrainingArguments.__module__ ==
# "types", so Trainer.save_model's torch.save(self.args) (training_args.bin) raises
# "PicklingError: Can't pickle <class 'types.HfTrainingArguments'>". Python >= 3.12 sets the
# caller's module instead. Give it the module it lives in (importable as "main").
mo_main.HfTrainingArguments.__module__ = mo_main.__name__

error = None
try:
    mo_main.train()
except BaseException as e:  # record the exact error, then re-raise
    import traceback
    tb = traceback.extract_tb(e.__traceback__)[-1]
    error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} ({tb.filename}:{tb.lineno})"
    raise
finally:
    STATS["error"] = error
    STATS["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    Path(stats_path).write_text(json.dumps(STATS, indent=1, default=str))
