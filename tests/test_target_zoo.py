"""The target zoo: every decoder family users train drafters for, one short test each.

For each tiny random target (tests/zoo.py, built offline):
* capture equals the model's own output_hidden_states for the chosen layers, and
  each packed document equals that document run alone (families with linear
  attention capture each document in its own forward, logged once);
* GPT-OSS loads with the eager attention implementation (no sdpa: attention sinks);
* the mask-token rule gives a valid id that is none of the chat's own tokens;
* the chat template's assistant-only loss mask round-trips (masked span = answer + end of turn);
* speculative decoding equals plain greedy decoding;
* a few training steps run and the export passes the SGLang/vLLM loader check
  (Gemma-family targets: with the embedding-scale warning).
docs/target-families.md is the table of what this covers.
"""
from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from conftest import write_tiny_jsonl
from zoo import available, build_zoo_target

from dflash_train.config import ModelConfig, TargetConfig, load_config
from dflash_train.data.template import ChatFormat
from dflash_train.eval.specdec import plain_generate, speculative_generate
from dflash_train.checkpoint.source import load_export
from dflash_train.export import export_checkpoint, serving_warnings
from dflash_train.model import DFlashDrafter, DrafterConfig
from dflash_train.serving_check import check_export, target_facts
from dflash_train.targets import load_target

LAYERS = [1, 2]
CONVERSATION = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is Paris."},
                {"role": "user", "content": "Thank you!"},
                {"role": "assistant", "content": "You are welcome."}]


def _hidden_states(t, x: torch.Tensor):
    with torch.no_grad():
        return t.model(input_ids=x, output_hidden_states=True).hidden_states


@pytest.mark.parametrize("family", available())
def test_family(family, tmp_path, caplog):
    tdir = build_zoo_target(tmp_path / family, family)
    with caplog.at_level(logging.INFO, logger="dflash_train.targets.loading"):
        t = load_target(TargetConfig(path=str(tdir), device="cpu", dtype="float32"))
    if family == "gpt_oss":
        assert t.model.config._attn_implementation == "eager"
    n_tok = len(t.tokenizer)

    # capture: packed documents (and padding) == each document alone == output_hidden_states
    g = torch.Generator().manual_seed(0)
    lens, T = [9, 6], 19
    ids = torch.zeros(1, T, dtype=torch.long)
    doc = torch.full((1, T), -1, dtype=torch.long)
    docs, p = [], 0
    for d, n in enumerate(lens):
        x = torch.randint(10, n_tok, (n,), generator=g)
        ids[0, p:p + n], doc[0, p:p + n] = x, d
        docs.append((p, x))
        p += n
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dflash_train.targets.loading"):
        feats = t.capture(ids, doc, LAYERS)
        t.capture(ids, doc, LAYERS)
    for p, x in docs:
        hs = _hidden_states(t, x[None])
        ref = torch.cat([hs[i + 1] for i in LAYERS], dim=-1)[0]
        torch.testing.assert_close(feats[0, p:p + len(x)], ref, atol=3e-5, rtol=1e-4)
    assert torch.all(feats[0, p + len(x):] == 0)
    said = [r for r in caplog.records if "captured in its own forward" in r.getMessage()]
    assert len(said) == (1 if t.per_document_capture else 0)
    assert t.per_document_capture == ("linear_attention" in t.layer_types)

    # mask token: a valid id, none of the chat's own tokens
    fmt = ChatFormat(t.tokenizer, t.family)
    chat_ids = set(fmt.stop_token_ids()) | {t.tokenizer.bos_token_id, t.tokenizer.pad_token_id}
    assert 0 <= t.mask_token_id < t.vocab_size and t.mask_token_id not in chat_ids

    # the loss mask of the chat format round-trips
    enc = fmt.encode(CONVERSATION)
    spans, cur = [], []
    for i, m in zip(enc.input_ids, enc.loss_mask):
        if m:
            cur.append(i)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    got = [t.tokenizer.decode(s) for s in spans]
    answers = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert len(got) == 2 and all(a.startswith(b) and a[len(b):] in fmt.eot_strings for a, b in zip(got, answers)), got

    # speculative decoding == plain greedy decoding (an untrained drafter: mostly rejections, so the
    # target cache is rolled back nearly every step - the linear-attention state included)
    cfg = DrafterConfig.from_target(ModelConfig(num_layers=1, block_size=4, target_layer_ids=LAYERS), t)
    dr = DFlashDrafter(cfg, seed=0).eval()
    prompt = torch.tensor([fmt.prompt_ids(CONVERSATION[:1])])
    spec, acc = speculative_generate(dr, t, prompt, 12)
    assert torch.equal(spec, plain_generate(t, prompt, 12)) and 1 + sum(acc) == 12

    # a few training steps, then an export that passes the loader check
    from dflash_train.train.run import run_training

    jsonl = write_tiny_jsonl(tmp_path / "data.jsonl", n=8)
    rc = load_config(None, [f"target.path={tdir}", f"data.source=jsonl:{jsonl}", "data.limit=8",
                            "data.max_tokens=48", "data.heldout_fraction=0.0", f"data.cache_dir={tmp_path / 'dc'}",
                            "model.num_layers=1", "model.block_size=4", f"model.target_layer_ids={LAYERS}",
                            "train.max_steps=2", "train.batch_size=2", "train.num_anchors=4", "eval.every_steps=0",
                            "logging.tensorboard=false", "logging.every_steps=1", "logging.progress=plain", "checkpoint.every_steps=2",
                            "target.device=cpu", "train.device=cpu"])
    assert run_training(rc, tmp_path / "run", resume="never", argv=["test"], target=t) == 0
    recs = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2] and all(math.isfinite(r["loss"]) for r in recs)
    out = export_checkpoint(tmp_path / "run", tmp_path / "export")
    problems, warnings = check_export(out, target_facts(str(tdir)))
    assert problems == []
    ecfg, sd = load_export(out)
    assert ecfg.serving_dtype == "float32" and ecfg.hidden_size == t.hidden_size
    assert bool(warnings) == (t.embed_scale != 1.0) == bool(serving_warnings(ecfg))
