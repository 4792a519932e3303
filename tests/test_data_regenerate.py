"""regenerate: batched greedy with left padding, resumable output."""
from __future__ import annotations

import json

import pytest
import torch

from dflash_train.config import TargetConfig, load_config
from dflash_train.data import ChatFormat, load_prepared
from dflash_train.data.regenerate import BatchedEngine, InProcess, generate_answers, regenerate_conversations
from dflash_train.targets import load_target
from conftest import write_tiny_jsonl


@pytest.fixture(scope="module")
def gemma_tiny(tiny_target_factory):
    return load_target(TargetConfig(path=str(tiny_target_factory("gemma3"))), device="cpu")


def test_batched_left_padded_greedy_equals_one_by_one(gemma_tiny):
    t = gemma_tiny
    fmt = ChatFormat(t.tokenizer, t.family)
    prompts = [fmt.prompt_ids([{"role": "user", "content": q}]) for q in ("Hi", "Tell me about the sea, please.", "Why?")]
    assert len({len(p) for p in prompts}) == 3
    batched = generate_answers(t, fmt, prompts, 6, 0.0)
    single = [generate_answers(t, fmt, [p], 6, 0.0)[0] for p in prompts]
    assert batched == single
    # and equal to a plain greedy loop over full forwards
    ids = list(prompts[1])
    for _ in range(len(single[1][0])):
        with torch.no_grad():
            ids.append(int(t.model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert ids[len(prompts[1]):] == single[1][0]


def test_generation_runs_the_packed_head_and_gives_the_same_answers(gemma_tiny, tiny_target_factory, monkeypatch):
    t = gemma_tiny
    fmt = ChatFormat(t.tokenizer, t.family)
    prompts = [fmt.prompt_ids([{"role": "user", "content": q}]) for q in ("Hi", "Tell me about the sea, please.", "Why?")]
    head = t.model.get_output_embeddings()
    with t.packed_head_for_generate():
        swapped = t.model.get_output_embeddings()
    assert t.model.get_output_embeddings() is head  # restored on exit
    if swapped is head:
        pytest.skip("no oneDNN packing on this torch build: generation keeps F.linear")
    orig_ctx = t.packed_head_for_generate
    calls = []

    class spying:  # records that generation ran inside the swap
        def __enter__(self):
            self.cm = orig_ctx()
            out = self.cm.__enter__()
            calls.append(t.model.get_output_embeddings() is not head)
            return out

        def __exit__(self, *exc):
            return self.cm.__exit__(*exc)

    monkeypatch.setattr(t, "packed_head_for_generate", spying)
    packed = generate_answers(t, fmt, prompts, 6, 0.0)
    assert calls == [True] and t.model.get_output_embeddings() is head
    monkeypatch.setenv("DFLASH_TRAIN_PACKED_LM_HEAD", "0")
    plain_target = load_target(TargetConfig(path=str(tiny_target_factory("gemma3"))), device="cpu")
    with plain_target.packed_head_for_generate():
        assert plain_target.model.get_output_embeddings() is plain_target.model.lm_head
    assert generate_answers(plain_target, fmt, prompts, 6, 0.0) == packed


def test_regenerate_is_resumable(tmp_path, gemma_tiny, tiny_target_factory):
    src = write_tiny_jsonl(tmp_path / "src.jsonl", n=5)
    out = tmp_path / "regen.jsonl"
    over = [f"target.path={tiny_target_factory('gemma3')}", f"data.source=jsonl:{src}", "data.max_tokens=256"]
    c1 = regenerate_conversations(load_config(None, over), out, max_conversations=3, max_new_tokens=4, batch_size=2,
                                  temperature=0.0, answerer=InProcess(lambda: gemma_tiny))
    assert c1["written"] + c1["empty_answer"] == 3
    first = out.read_text().splitlines()
    # a torn last line (interrupted write) is cut off and that conversation redone
    with out.open("a") as f:
        f.write('{"id": "tiny-0003", "conversa')
    c2 = regenerate_conversations(load_config(None, over), out, InProcess(lambda: gemma_tiny), None, 4, 2, 0.0)
    assert c2["already_done"] == c1["written"] and c2["written"] + c2["empty_answer"] == 5 - c1["written"]
    lines = out.read_text().splitlines()
    assert lines[:len(first)] == first
    recs = [json.loads(x) for x in lines]
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids))
    for r in recs:
        assert [t["from"] for t in r["conversations"]][-1] == "gpt"
        assert r["regenerated"]["max_new_tokens"] == 4
    c3 = regenerate_conversations(load_config(None, over), out, InProcess(lambda: gemma_tiny), None, 4, 2, 0.0)
    assert c3["written"] == 0
    # the output trains: data.regenerated
    cfg = load_config(None, over + [f"data.regenerated={out}", "data.heldout_fraction=0", "model.block_size=2",
                                    f"data.cache_dir={tmp_path / 'cache'}"])
    data = load_prepared(cfg, gemma_tiny.tokenizer, "gemma3")
    assert data.stats["conversations_read"] == len(recs)


def _engine(generate, target, chunk: int = 1024) -> BatchedEngine:
    return BatchedEngine(generate, target.tokenizer, target.family, chunk)


def test_a_rerun_with_only_too_long_prompts_left_starts_no_engine(tmp_path, gemma_tiny, tiny_target_factory):
    """What is left after a batched engine run are prompts too long to answer: the rerun answers
    nothing and never calls the engine (a vLLM start costs ~16 s for no answer)."""
    src = write_tiny_jsonl(tmp_path / "src.jsonl", n=4)
    out = tmp_path / "regen.jsonl"
    over = [f"target.path={tiny_target_factory('gemma3')}", f"data.source=jsonl:{src}", "data.max_tokens=256"]
    calls = []

    def engine(prompts, max_new_tokens, stops):
        calls.append(len(prompts))
        return [(list(p[-3:]), True) for p in prompts]  # the prompt's last tokens: some text

    c1 = regenerate_conversations(load_config(None, over), out, _engine(engine, gemma_tiny), 2, 4, 2, 0.0)
    assert calls == [2] and c1["written"] == 2
    short = over[:-1] + ["data.max_tokens=8"]  # the two conversations left have prompts too long now
    c2 = regenerate_conversations(load_config(None, short), out, _engine(engine, gemma_tiny), None, 4, 2, 0.0)
    assert calls == [2] and c2["written"] == 0 and c2["prompt_too_long"] == 2


def test_an_engine_run_cut_off_keeps_the_chunks_before_it(tmp_path, gemma_tiny, tiny_target_factory):
    """The engine answers a chunk of prompts per call and each chunk is written before the next:
    an engine that dies (a timeout, a kill) loses only its own chunk, and the rerun asks the
    engine for the rest alone."""
    from dflash_train.errors import UserError

    src = write_tiny_jsonl(tmp_path / "src.jsonl", n=5)
    out = tmp_path / "regen.jsonl"
    cfg = load_config(None, [f"target.path={tiny_target_factory('gemma3')}", f"data.source=jsonl:{src}",
                             "data.max_tokens=256"])
    calls = []

    def dies_on_second_call(prompts, max_new_tokens, stops):
        calls.append(len(prompts))
        if len(calls) == 2:
            raise UserError("vLLM did not finish within 1s")
        return [(list(p[-3:]), True) for p in prompts]

    with pytest.raises(UserError, match="did not finish"):
        regenerate_conversations(cfg, out, _engine(dies_on_second_call, gemma_tiny, 2), None, 4, 2, 0.0)
    assert calls == [2, 2] and len(out.read_text().splitlines()) == 2
    calls.clear()

    def answers(prompts, max_new_tokens, stops):
        calls.append(len(prompts))
        return [(list(p[-3:]), True) for p in prompts]

    c = regenerate_conversations(cfg, out, _engine(answers, gemma_tiny, 2), None, 4, 2, 0.0)
    assert calls == [2, 1] and c["already_done"] == 2 and c["written"] == 3
    ids = [json.loads(x)["id"] for x in out.read_text().splitlines()]
    assert len(ids) == 5 == len(set(ids))


def test_done_ids_count_answers_holding_unicode_line_separators(tmp_path):
    """An answer with U+2028 (ensure_ascii=False keeps it raw) is done: it used to be
    regenerated on every rerun, appending a duplicate and changing the training rows."""
    from dflash_train.data.regenerate import done_ids

    out = tmp_path / "regen.jsonl"
    out.write_text("".join(json.dumps({"id": f"a{i}", "conversations": [
        {"from": "human", "value": "q"}, {"from": "gpt", "value": f"x\u2028y\x85z{i}"}]}, ensure_ascii=False) + "\n"
        for i in range(3)), encoding="utf-8")
    assert done_ids(out) == {"a0", "a1", "a2"}


def test_generation_dtype_follows_the_cpus_native_bf16(tmp_path):
    """Batched answers through vLLM: bfloat16 on CPUs with native bf16 GEMMs, float32 elsewhere."""
    from dflash_train.engine.vllm_process import cpu_flags, generation_dtype

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu avx2\n")
    assert cpu_flags(info) == {"fpu", "sse", "avx", "avx2", "fma"}
    assert generation_dtype(cpu_flags(info)) == "float32"
    assert generation_dtype({"avx2", "avx512f", "avx512_bf16"}) == "bfloat16"
    assert generation_dtype({"amx_bf16", "amx_tile"}) == "bfloat16"
    assert cpu_flags(tmp_path / "missing") == set()


def test_a_timed_out_engine_takes_its_children_down(tmp_path, monkeypatch):
    """vLLM forks an engine core and workers; a timeout must kill them with the worker, not leave
    them computing (they once kept both cores busy for hours after the demo's data step timed out)."""
    import time
    from pathlib import Path

    from dflash_train.engine.vllm_process import generate_in_vllm
    from dflash_train.errors import UserError

    pid_file = tmp_path / "child.pid"
    fake = tmp_path / "python"  # stands in for the vLLM environment's interpreter
    fake.write_text(f"#!/bin/bash\nsleep 300 &\necho $! > {pid_file}\nwait\n")
    fake.chmod(0o755)
    monkeypatch.setenv("DFLASH_TRAIN_VLLM_PYTHON", str(fake))
    with pytest.raises(UserError, match="did not finish within 3s"):
        generate_in_vllm(tmp_path, [[1, 2]], [0], 4, dtype="float32", timeout_s=3)
    child = int(pid_file.read_text())

    def running(pid: int) -> bool:  # a killed child nobody has reaped yet is a zombie: not running
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False

    for _ in range(50):  # the kill is sent; give the kernel a moment
        if not running(child):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the engine's child {child} outlived the timeout")
