"""The GPU speed paths, on CPU: compiled BlockMask == eager BlockMask, compiled drafter layers
that take a new mask every step without recompiling, activation checkpointing (same loss and
gradients, really recomputed), and `train.compile=true` through the real CLI with no recompile
after the first step."""
from __future__ import annotations

import subprocess

import pytest
import torch
from torch._dynamo.utils import counters

from dflash_train.model import dflash_loss, document_ids_from_lengths, sample_anchors
from dflash_train.model import masks as M
from dflash_train.model.dflash2 import build_drafter
from test_model_fakes import FakeTarget, batch, packed_row, tiny_config
from trainrun import REPO, env, tiny_overrides, train_cmd

BLOCK_MASK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                     "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
DF2 = {"architecture": "dflash2", "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 6,
       "selector_top_k": 5}


def graphs() -> int:
    """Graphs dynamo has compiled in this process so far (a recompile adds one)."""
    return counters["stats"]["unique_graphs"]


def step_inputs(seed: int, B: int, T: int, A: int, lengths):
    g = torch.Generator().manual_seed(seed)
    anchors = torch.sort(torch.randint(0, T - 1, (B, A), generator=g), dim=1).values
    valid = torch.rand(B, A, generator=g) > 0.2  # some padding blocks
    docs = document_ids_from_lengths(torch.tensor(lengths), T).expand(B, T).clone()  # with -1 padding
    return anchors, valid, docs


def test_compiled_block_mask_equals_eager():
    """What CUDA training builds (create_block_mask compiled, as `_compile=True` does) equals the eager
    build, field by field, for both layer types; a new step (new anchors, so a new mask_mod closure)
    reuses the compiled graph. Odd lengths, so the mask is padded to whole 128-blocks. simdlen=1:
    inductor's vectorised CPU code for that padding fails on bool vectors (torch 2.13), a CPU-only
    code generator that CUDA (Triton) never uses."""
    B, T, A, bs, W = 2, 61, 7, 5, 5
    with torch._inductor.config.patch({"cpp.simdlen": 1}):
        for lt in (M.FULL, M.SLIDING):
            for step in range(2):
                anchors, valid, docs = step_inputs(step, B, T, A, [20, 30, 6])
                mod = M.dflash_mask_mod(anchors, valid, docs, bs, lt, W, T)
                before = graphs()
                eager = M.flex_block_mask(mod, B, A * bs, T + A * bs)
                compiled = M.flex_block_mask(mod, B, A * bs, T + A * bs, compile=True)
                if step:
                    assert graphs() == before, f"{lt}: a new step recompiled create_block_mask"
                assert compiled.seq_lengths == eager.seq_lengths and compiled.BLOCK_SIZE == eager.BLOCK_SIZE
                for name in BLOCK_MASK_FIELDS:
                    want, got = getattr(eager, name), getattr(compiled, name)
                    assert want is not None and torch.equal(got, want), (lt, step, name)


def test_build_masks_compiles_only_on_request_or_cuda():
    anchors, valid, docs = step_inputs(0, 1, 16, 2, [16])
    before = graphs()
    M.build_masks([M.FULL], anchors, valid, docs, 4, None, "flex")  # CPU: eager by default
    assert graphs() == before


def test_compiled_flex_layers_take_a_new_block_mask_each_step_without_recompiling():
    """The CUDA layout (flex BlockMask into compiled layers), forward only: CPU flex has no
    backward. Steps after the first reuse the graphs and equal the eager SDPA forward."""
    d = build_drafter(tiny_config(("full_attention", "sliding_attention"), sliding_window=3, init_std=0.2))
    d.prepare_for_training(compile=True, activation_checkpointing=False)
    eager = build_drafter(d.cfg)
    B, T, A = 2, 40, 6
    for step in range(3):
        anchors, valid, docs = step_inputs(step, B, T, A, [14, 20, 3])
        g = torch.Generator().manual_seed(100 + step)
        feats, embeds = torch.randn(B, T, 64, generator=g), torch.randn(B, A * 4, 32, generator=g)
        before = graphs()
        with torch.no_grad():
            got = d(embeds, anchors, valid, docs, features=feats, backend="flex")
            want = eager(embeds, anchors, valid, docs, features=feats, backend="sdpa")
        if step:
            assert graphs() == before, f"step {step} recompiled"
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def loss_setup(architecture: str, layer_types=("full_attention", "sliding_attention")):
    kw = DF2 if architecture == "dflash2" else {}
    cfg = tiny_config(layer_types, sliding_window=3, init_std=0.2, **kw)
    d = build_drafter(cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # off the identity convolutions and unit norms: every term matters
        for p in d.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    t = FakeTarget(vocab_size=50, hidden_size=32, embed_scale=32**0.5)
    ids, lm, docs = batch([packed_row([18, 14], 40, seed=1), packed_row([40], 40, seed=2)])
    feats = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(3))
    anchors = sample_anchors(lm, docs, 9, 4, torch.Generator().manual_seed(0))
    return d, (t, ids, lm, docs, feats, 9, None), anchors


def loss_and_grads(d, args, anchors):
    d.zero_grad()
    out = dflash_loss(d, *args, anchors=anchors)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in d.named_parameters()}


def count_layer_calls(d) -> list[int]:
    calls = [0]
    for layer in d.layers:
        layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
def test_activation_checkpointing_same_loss_and_gradients_and_recomputes(architecture):
    d, args, anchors = loss_setup(architecture)
    calls = count_layer_calls(d)
    loss0, grads0 = loss_and_grads(d, args, anchors)
    assert calls[0] == len(d.layers)
    d.prepare_for_training(compile=False, activation_checkpointing=True)
    calls[0] = 0
    loss1, grads1 = loss_and_grads(d, args, anchors)
    assert calls[0] == 2 * len(d.layers)  # each layer ran again in the backward
    torch.testing.assert_close(loss1, loss0, atol=0, rtol=0)
    assert grads1.keys() == grads0.keys()
    for n in grads0:
        assert grads0[n].abs().sum() > 0, n
        torch.testing.assert_close(grads1[n], grads0[n], atol=1e-7, rtol=1e-6, msg=n)
    calls[0] = 0
    with torch.no_grad():  # nothing to recompute without a backward (on-policy drafting, evals)
        dflash_loss(d, *args, anchors=anchors)
    assert calls[0] == len(d.layers)


def test_compiled_checkpointed_layers_match_eager_and_recompute():
    """train.compile + train.activation_checkpointing together (the large-drafter setting): the
    compiled step runs twice per layer (forward, recompute), gradients equal the eager ones, and a
    second step compiles nothing new. One layer: each graph costs seconds of CPU compile."""
    d, args, anchors = loss_setup("dflash", ("full_attention",))
    loss0, grads0 = loss_and_grads(d, args, anchors)
    d.prepare_for_training(compile=True, activation_checkpointing=True)
    compiled_step, calls = d.layer_step, [0]

    def counted(*a):
        calls[0] += 1
        return compiled_step(*a)

    d.layer_step = counted
    for step in range(2):
        calls[0], before = 0, graphs()
        loss1, grads1 = loss_and_grads(d, args, anchors)
        assert calls[0] == 2 * len(d.layers)
        if step:
            assert graphs() == before, "the second step recompiled"
        torch.testing.assert_close(loss1, loss0, atol=1e-6, rtol=1e-5)
        for n in grads0:
            torch.testing.assert_close(grads1[n], grads0[n], atol=1e-6, rtol=1e-4, msg=n)


def test_train_compile_has_no_recompile_after_the_first_step(train_setup):
    """The real CLI with train.compile=true (inductor on CPU) for 6 steps, TORCH_LOGS=recompiles
    plus dynamo's INFO lines (one "torchdynamo start tracing" per frame compiled, so the test
    fails if nothing was compiled). Warm-up = step 1: it compiles every graph (one per distinct
    guard set, e.g. the first layer, whose input needs no gradient, and the others). After the
    "step 1/6" line nothing may be traced again: no "Recompiling function", no "start tracing"."""
    target_dir, jsonl, root = train_setup
    overrides = tiny_overrides(target_dir, jsonl, **{
        "train.compile": True, "train.activation_checkpointing": True, "model.num_layers": 2,
        "train.max_steps": 6, "checkpoint.every_steps": 100})
    e = env()
    e["TORCH_LOGS"] = "recompiles,dynamo"
    res = subprocess.run(train_cmd(root / "compiled", overrides), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=600, env=e, cwd=REPO)
    assert res.returncode == 0, res.stdout[-3000:]
    lines = res.stdout.splitlines()
    steps = [i for i, line in enumerate(lines) if line.startswith("step ")]
    assert [lines[i].split()[1] for i in steps] == [f"{k}/6" for k in range(1, 7)], res.stdout[-3000:]
    traced = [i for i, line in enumerate(lines) if "torchdynamo start tracing" in line]
    assert traced and traced[0] < steps[0], "train.compile=true compiled nothing"
    late = [line for line in lines[steps[0]:] if "Recompiling function" in line or "start tracing" in line]
    assert not late, "\n".join(lines[steps[0]:])[-4000:]
