"""DFlash 2: parity with the reference (PyPI dflash 0.1.0, dflash.model.DFlash2DraftModel),
block-local convolutions in training, and a fresh DFlash 2 drafter == the DFlash 1 drafter."""
from __future__ import annotations

import pytest
import torch

from dflash_train.model import DFlashDrafter, DrafterConfig
from dflash_train.model.dflash2 import DFlash2Drafter, build_drafter

H, K, BS, CTX, V = 32, 2, 4, 9, 50
DF2 = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 6, "selector_top_k": 5}


def reference_model(layer_types, sliding_window, seed=0, **df2):
    from transformers import Qwen3Config
    from dflash.model import DFlash2DraftModel

    cfg = Qwen3Config(
        vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=256,
        use_sliding_window=sliding_window is not None, sliding_window=sliding_window,
        layer_types=list(layer_types), num_target_layers=8,
        dflash_config={"target_layer_ids": [1, 5], "block_size": BS, "mask_token_id": 49, **DF2, **df2},
    )
    ref = DFlash2DraftModel(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # random everywhere (convolutions far from the identity), norms away from 1
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return ref


def our_config(layer_types, sliding_window, **df2) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=H, num_layers=len(layer_types), num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
        layer_types=list(layer_types), sliding_window=sliding_window, block_size=BS, mask_token_id=49,
        target_layer_ids=[1, 5], num_target_layers=8, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=V,
        architecture="dflash2", **{**DF2, **df2},
    )


def ours_from(ref, layer_types, sliding_window, **df2) -> DFlash2Drafter:
    ours = build_drafter(our_config(layer_types, sliding_window, **df2)).eval()
    assert isinstance(ours, DFlash2Drafter)
    sd = {k: v for k, v in ref.state_dict().items() if not k.startswith("rotary_emb.")}
    ours.load_state_dict(sd, strict=True)
    return ours


CASES = [(("full_attention",), None), (("sliding_attention",), 3),
         (("full_attention", "sliding_attention"), 5)]


@pytest.mark.parametrize("layer_types,W", CASES)
def test_forward_matches_reference(layer_types, W):
    ref = reference_model(layer_types, W)
    ours = ours_from(ref, layer_types, W)
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(1, CTX + BS, K * H, generator=g)
    noise = torch.randn(1, BS, H, generator=g)
    with torch.no_grad():
        want = ref(position_ids=torch.arange(CTX + BS)[None], noise_embedding=noise, target_hidden=feats[:, :CTX])
        cache = ours.new_cache()
        ours.extend_context(cache, feats[:, :CTX], 0)
        got_inf = ours.draft_block(cache, noise, CTX)
        # the last block of a generation is shorter than bs: the convolution sees just those tokens
        short = ref(position_ids=torch.arange(CTX + 3)[None], noise_embedding=noise[:, :3], target_hidden=feats[:, :CTX])
        got_short = ours.draft_block(cache, noise[:, :3], CTX)
        got_train = ours(noise, torch.tensor([[CTX]]), torch.tensor([[True]]), torch.zeros(1, CTX + BS, dtype=torch.long),
                         features=feats, backend="sdpa")
    torch.testing.assert_close(got_inf, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_short, short, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_train, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", [2, 3])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_selector_path_matches_reference(kernel, temperature):
    """propose(): logits through the output head (multiplier, soft-cap), then the path; sampled
    paths with the same torch.multinomial draws (the same global seed)."""
    ref = reference_model(("full_attention",), None, seed=7, conv_kernel_size=kernel)
    ref.config.dflash_config.update(output_multiplier=0.8, final_logit_softcapping=4.0)
    ours = ours_from(ref, ("full_attention",), None, conv_kernel_size=kernel)
    g = torch.Generator().manual_seed(8)
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g))
    hidden = torch.randn(3, BS - 1, H, generator=g)
    anchors = torch.randint(0, V, (3,), generator=g)
    torch.manual_seed(11)
    want = ref.propose(hidden, anchors, head, temperature)
    logits = torch.tanh(head(hidden) * 0.8 / 4.0) * 4.0  # what our targets' logits() apply
    torch.manual_seed(11)
    got = ours.candidate_selector.select(hidden, logits, anchors, temperature)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if temperature > 0:
        torch.testing.assert_close(got[2], want[2], atol=1e-5, rtol=1e-5)
    else:
        assert got[2] is None and want[2] is None
    # the pair term matters here: the path is not just the unary argmax everywhere
    unary_argmax = logits.argmax(-1)
    if temperature == 0:
        assert not torch.equal(got[0], unary_argmax)


def test_convolutions_stay_inside_each_block_when_anchors_are_packed():
    """Anchors 2 apart with bs 4 (blocks overlap in position): each block of the packed forward
    equals that block run alone; with the taps allowed to cross blocks (a row = one block) it differs."""
    ref = reference_model(("full_attention", "sliding_attention"), 5, seed=3)
    ours = ours_from(ref, ("full_attention", "sliding_attention"), 5)
    T = 16
    g = torch.Generator().manual_seed(4)
    feats = torch.randn(1, T, K * H, generator=g)
    anchors = torch.tensor([[2, 4, 6, 11]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    embeds = torch.randn(1, anchors.shape[1] * BS, H, generator=g)
    docs = torch.zeros(1, T, dtype=torch.long)
    with torch.no_grad():
        packed = ours(embeds, anchors, valid, docs, features=feats, backend="sdpa")
        for i in range(anchors.shape[1]):
            alone = ours(embeds[:, i * BS:(i + 1) * BS], anchors[:, i:i + 1], valid[:, :1], docs, features=feats,
                         backend="sdpa")
            torch.testing.assert_close(packed[:, i * BS:(i + 1) * BS], alone, atol=1e-5, rtol=1e-5)
        for layer in ours.layers:  # the leak this guards against: one conv over the whole packed row
            layer.block_size = anchors.shape[1] * BS
        leaky = ours(embeds, anchors, valid, docs, features=feats, backend="sdpa")
    assert not torch.allclose(leaky[:, BS:], packed[:, BS:], atol=1e-3)


def test_fresh_dflash2_computes_what_dflash1_computes():
    import dataclasses

    cfg2 = our_config(("full_attention", "sliding_attention"), 5)
    cfg1 = dataclasses.replace(cfg2, architecture="dflash", conv_kernel_size=None, conv_group_size=None,
                               selector_rank=None, selector_top_k=None)
    d1, d2 = build_drafter(cfg1, seed=5), build_drafter(cfg2, seed=5)
    assert type(d1) is DFlashDrafter and type(d2) is DFlash2Drafter
    sd1, sd2 = d1.state_dict(), d2.state_dict()
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    extra = sorted(set(sd2) - set(sd1))
    assert extra == sorted(
        [f"layers.{i}.{c}_conv.{p}" for i in range(2) for c in ("attention", "mlp")
         for p in ("base_kernel", "kernel_projection.weight")]
        + [f"candidate_selector.{n}.weight" for n in ("predecessor_codebook", "successor_codebook", "hidden_projection")])
    g = torch.Generator().manual_seed(6)
    feats = torch.randn(2, 14, K * H, generator=g)
    anchors = torch.tensor([[1, 3, 8], [0, 5, 6]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    embeds = torch.randn(2, 3 * BS, H, generator=g)
    docs = torch.zeros(2, 14, dtype=torch.long)
    with torch.no_grad():
        h1 = d1(embeds, anchors, valid, docs, features=feats, backend="sdpa")
        h2 = d2(embeds, anchors, valid, docs, features=feats, backend="sdpa")
    torch.testing.assert_close(h2, h1, atol=1e-6, rtol=1e-6)


def test_config_switch_and_its_errors():
    with pytest.raises(ValueError, match="conv_group_size"):
        our_config(("full_attention",), None, conv_group_size=5)
    with pytest.raises(ValueError, match="apply to architecture dflash2 only"):
        DrafterConfig(**{**our_config(("full_attention",), None).to_dict(), "architecture": "dflash"})
    with pytest.raises(ValueError, match="unknown architecture"):
        DrafterConfig(**{**our_config(("full_attention",), None).to_dict(), "architecture": "dflash3"})
    d = our_config(("full_attention",), None).to_dict()
    for k in DF2:
        d[k] = None
    filled = DrafterConfig(**d)  # defaults of the published checkpoints
    assert (filled.conv_kernel_size, filled.conv_group_size, filled.selector_rank, filled.selector_top_k) == (2, 16, 256, 16)


# --------------------------------------------------------------------------- training: selector loss, gradients, metrics


def loss_setup(top_k=4, softcap=6.0, seed=0):
    import torch.nn.functional as F  # noqa: F401
    from test_model_fakes import FakeTarget, batch, packed_row

    from dflash_train.model import sample_anchors

    t = FakeTarget(vocab_size=V, hidden_size=H, embed_scale=H**0.5, output_multiplier=0.7,
                   final_logit_softcapping=softcap, trainable=True)
    cfg = our_config(("full_attention", "sliding_attention"), 3, selector_top_k=top_k, init_std=0.2)
    d = build_drafter(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # move everything off the identity / tiny init, so every term matters
        for name, p in d.named_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    ids, lm, docs = batch([packed_row([18, 14], 40, seed=1), packed_row([40], 40, seed=2)])
    feats = torch.randn(2, 40, K * H, generator=torch.Generator().manual_seed(3))
    anchors = sample_anchors(lm, docs, 9, BS, torch.Generator().manual_seed(0))
    return t, d, ids, lm, docs, feats, anchors


def naive_selector(d, t, ids, lm, docs, feats, anchors, gamma):
    """Row by row from the definition: full logits, top-k, gold put in place of the weakest
    candidate when missing, teacher-forced predecessor, plain CE; and the metrics."""
    import torch.nn.functional as F

    from dflash_train.model import make_blocks

    sel = d.candidate_selector
    block_ids, labels, weights, sup = make_blocks(ids, lm, docs, *anchors, BS, d.cfg.mask_token_id, gamma)
    hid = d(t.embed(block_ids), *anchors, docs, features=feats, backend="sdpa")
    B, A = anchors[0].shape
    h = hid.view(B, A, BS, H)[:, :, 1:]
    logits = t.logits(h)
    num, den, hits, correct, rows, inserted = 0.0, 0.0, 0, 0, 0, 0
    path_acc = arg_acc = blocks = 0
    for b in range(B):
        for a in range(A):
            if sup[b, a].any():
                blocks += 1
            prev_tf = prev_walk = block_ids.view(B, A, BS)[b, a, 0]
            walk_alive = arg_alive = True
            for k in range(BS - 1):
                y, w, s = labels[b, a, k], weights[b, a, k], bool(sup[b, a, k])
                u, c = torch.topk(logits[b, a, k], sel.top_k)
                proj = sel.hidden_projection(h[b, a, k])
                pair = lambda p, cands: (sel.predecessor_codebook.weight[p] * proj) @ sel.successor_codebook.weight[cands].T
                cl, ul = c.clone(), u.clone()
                if y not in c:
                    cl[-1], ul[-1] = y, logits[b, a, k, y]
                    inserted += int(s)
                scores = ul + pair(prev_tf, cl)
                num = num + w * F.cross_entropy(scores[None], (cl == y).nonzero()[0])
                den += float(w)
                strict = u + pair(prev_tf, c)
                rows += int(s)
                hits += int(s and y in c)
                correct += int(s and c[strict.argmax()] == y)
                walk = c[(u + pair(prev_walk, c)).argmax()]
                walk_alive = walk_alive and s and bool(walk == y)
                arg_alive = arg_alive and s and bool(c[0] == y)
                path_acc += int(walk_alive)
                arg_acc += int(arg_alive)
                prev_tf, prev_walk = y, walk
    metrics = {"selector_topk_recall": hits / rows, "selector_accuracy": correct / rows,
               "selector_path_tau": 1 + path_acc / blocks, "argmax_path_tau": 1 + arg_acc / blocks}
    return num / den, metrics, inserted, rows - hits


def test_selector_loss_and_metrics_match_a_naive_implementation_with_gold_insertion():
    from dflash_train.model import dflash_loss
    from dflash_train.model.dflash2 import selector_metrics

    t, d, ids, lm, docs, feats, anchors = loss_setup(top_k=12)
    gamma = 3.0
    base = dflash_loss(d, t, ids, lm, docs, feats, 9, None, gamma=gamma, anchors=anchors, selector_loss_weight=0.0)
    full = dflash_loss(d, t, ids, lm, docs, feats, 9, None, gamma=gamma, anchors=anchors, chunk_blocks=2,
                       selector_loss_weight=0.5)
    want, want_metrics, inserted, missing = naive_selector(d, t, ids, lm, docs, feats, anchors, gamma)
    assert inserted > 3 and missing == inserted  # the gold-insertion path is exercised
    assert missing < int(full.extra["sel_rows"])  # and the plain one too
    torch.testing.assert_close(full.loss - base.loss, 0.5 * want, atol=1e-5, rtol=1e-5)
    got_metrics = selector_metrics(full.extra)
    for k, v in want_metrics.items():
        assert abs(got_metrics[k] - v) < 1e-9, (k, got_metrics[k], v)
    assert all(v.device.type == "cpu" and isinstance(v, torch.Tensor) for v in full.extra.values())


def test_every_dflash2_parameter_gets_a_gradient_and_the_target_none():
    from dflash_train.model import dflash_loss

    t, d, ids, lm, docs, feats, anchors = loss_setup()
    d2 = build_drafter(d.cfg, seed=0)  # a FRESH drafter: identity convolutions, small selector
    for model in (d, d2):
        model.zero_grad()
        out = dflash_loss(model, t, ids, lm, docs, feats, 9, torch.Generator().manual_seed(0), chunk_blocks=2)
        out.loss.backward()
        for n, p in model.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, n
    assert t.embedding.weight.grad is None and t.head.grad is None


def test_selector_with_a_vocab_subset():
    """train.vocab_subset: the whole (shuffled) vocabulary as the subset == no subset; a real subset ranks
    only its ids (candidates mapped back to token ids), rows whose gold is outside weigh 0."""
    from dflash_train.model import dflash_loss

    t, d, ids, lm, docs, feats, anchors = loss_setup(top_k=6)
    kw = dict(anchors=anchors, selector_loss_weight=1.0)
    with torch.no_grad():
        full = dflash_loss(d, t, ids, lm, docs, feats, 9, None, **kw)
        # the whole vocabulary in a shuffled order: the head's rows are permuted, so only a correct
        # mapping of the candidates back to token ids gives the same loss and metrics
        perm = torch.randperm(V, generator=torch.Generator().manual_seed(0))
        everything = dflash_loss(d, t, ids, lm, docs, feats, 9, None, vocab_subset=perm, **kw)
        torch.testing.assert_close(everything.loss, full.loss, atol=1e-6, rtol=1e-6)
        assert all(torch.equal(everything.extra[k], full.extra[k]) for k in full.extra)
        subset = torch.cat([torch.unique(ids)[::2], torch.tensor([V - 1])]).sort().values
        part = dflash_loss(d, t, ids, lm, docs, feats, 9, None, vocab_subset=subset, chunk_blocks=1, **kw)
        part0 = dflash_loss(d, t, ids, lm, docs, feats, 9, None, vocab_subset=subset, anchors=anchors,
                            selector_loss_weight=0.0)
    assert torch.isfinite(part.loss) and part.loss > part0.loss
    assert part.extra["sel_topk_hits"] > 0 and part.extra["sel_topk_hits"] <= full.extra["sel_rows"]
    # a hit means the gold token id itself is among the (mapped back) candidates: never an out-of-subset gold
    assert part.extra["sel_rows"] == full.extra["sel_rows"]


# --------------------------------------------------------------------------- export


def test_export_loads_in_the_reference_dflash2_model(tmp_path):
    import json

    from safetensors import safe_open

    from dflash_train.checkpoint.source import load_export
    from dflash_train.export import write_export
    from dflash_train.report import model_card

    layer_types = ("full_attention", "sliding_attention")
    ref0 = reference_model(layer_types, 5, seed=9)
    ours = ours_from(ref0, layer_types, 5)
    out = write_export(ours.cfg, ours.state_dict(), tmp_path / "export")
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["DFlash2DraftModel"]
    assert {k: c["dflash_config"][k] for k in DF2} == DF2
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    # the published checkpoints' names (codebooks without ".weight")
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.1.mlp_conv.base_kernel"} <= names
    from dflash.model import DFlash2DraftModel

    ref, info = DFlash2DraftModel.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ref.eval()
    assert ref.candidate_selector.top_k == DF2["selector_top_k"]
    g = torch.Generator().manual_seed(10)
    feats = torch.randn(1, CTX, K * H, generator=g)
    noise = torch.randn(1, BS, H, generator=g)
    with torch.no_grad():
        want = ref(position_ids=torch.arange(CTX + BS)[None], noise_embedding=noise, target_hidden=feats)
        cache = ours.new_cache()
        ours.extend_context(cache, feats, 0)
        torch.testing.assert_close(ours.draft_block(cache, noise, CTX), want, atol=1e-5, rtol=1e-5)
    cfg2, sd2 = load_export(out)  # and back
    assert cfg2.architecture == "dflash2" and {k: getattr(cfg2, k) for k in DF2} == DF2
    assert set(sd2) == set(ours.state_dict())
    back = build_drafter(cfg2)
    back.load_state_dict(sd2, strict=True)
    card = model_card(ours.cfg, {}, None, "x")
    assert "DFlash2DraftModel.from_pretrained" in card and "#35371" in card and "#52816" in card
