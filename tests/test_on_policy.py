"""train.anchors=on_policy (model/on_policy.py): the anchors are the ones greedy speculative
decoding with the current drafter visits; checked against the decoding walk, against real
speculative decoding, and as a user runs it (phase switch, metrics, bit-exact resume)."""
from __future__ import annotations

import pytest
import torch

from dflash_train.config import ModelConfig, TargetConfig
from dflash_train.eval.replay import walk_acceptance
from dflash_train.eval.specdec import speculative_generate
from dflash_train.model import DFlashDrafter, DrafterConfig
from dflash_train.model.loss import sample_anchors
from dflash_train.model.on_policy import on_policy_anchors, on_policy_metrics, valid_anchor_mask, visited_anchors
from dflash_train.targets import load_target
from specdec_fakes import bias_target_towards, slot_prediction
from trainrun import losses, metrics, run_train, tiny_overrides


def decoding_visits(row: list[int], start: int, end: int, drafts) -> list[int]:
    """The anchors `walk_acceptance` (the decoding walk) visits on row[:end+1] from `start`."""
    visits = []

    def propose(s):
        visits.append(s)
        return drafts[s]

    walk_acceptance(row[:end + 1], start, propose)
    return visits


def test_visited_anchors_are_the_decoding_walks_anchors():
    B, T, bs1 = 3, 40, 3
    ids = torch.randint(0, 4, (B, T), generator=torch.Generator().manual_seed(1))  # small vocab: many matches
    lm = torch.zeros(B, T, dtype=torch.bool)
    docs = torch.zeros(B, T, dtype=torch.int32)
    spans = {0: [(3, 15), (22, 39)], 1: [(0, 39)], 2: [(5, 9), (10, 30)]}  # (first, last) supervised
    docs[0, 18:] = 1
    docs[2, 10:] = 1  # two documents back to back, both fully supervised
    docs[2, 31:] = -1  # padding
    for b, ss in spans.items():
        for a, e in ss:
            lm[b, a:e + 1] = True
    drafts = torch.randint(0, 4, (B, T, bs1), generator=torch.Generator().manual_seed(2))
    ok = valid_anchor_mask(lm, docs)
    got = visited_anchors(ids, ok, drafts)
    for b, ss in spans.items():
        want = []
        for a, e in ss:
            want += decoding_visits(ids[b].tolist(), a, e, drafts[b].tolist())
        assert sorted(torch.nonzero(got[b]).flatten().tolist()) == want, (b, want)
    assert got.sum() < ok.sum()  # some drafts were accepted: not every anchor is visited


def test_on_policy_anchors_take_every_visited_position_first():
    torch.manual_seed(0)
    lm = torch.ones(2, 30, dtype=torch.bool)
    docs = torch.zeros(2, 30, dtype=torch.int32)
    visited = torch.rand(2, 30) < 0.3
    visited[:, -1] = False
    a, v = sample_anchors(lm, docs, 14, 4, torch.Generator().manual_seed(5), offset=(~visited).float())
    for b in range(2):
        chosen = set(a[b][v[b]].tolist())
        assert set(torch.nonzero(visited[b]).flatten().tolist()) <= chosen
        assert len(chosen) == 14 and a[b][v[b]].tolist() == sorted(chosen)
    # without an offset the draw is the uniform one it always was
    a0, v0 = sample_anchors(lm, docs, 14, 4, torch.Generator().manual_seed(5))
    a1, v1 = sample_anchors(lm, docs, 14, 4, torch.Generator().manual_seed(5), offset=torch.zeros(2, 30))
    assert torch.equal(a0, a1) and torch.equal(v0, v1)


def test_on_policy_tau_equals_real_speculative_decoding(tiny_target_factory):
    """On the target's own greedy answers the on-policy walk IS decoding: tokens per step equal."""
    t = load_target(TargetConfig(path=str(tiny_target_factory("qwen3")), device="cpu", dtype="float32"))
    bias_target_towards(t, 100, alpha=5.0, anti=1.0)
    mask = next(m for m in range(t.vocab_size) if slot_prediction(t, m) == 100)
    dr = DFlashDrafter(DrafterConfig.from_target(ModelConfig(num_layers=2, block_size=8, mask_token_id=mask,
                                                             layer_types=["full_attention"]), t), seed=0).eval()
    acc_all, sums = [], {"op_visited": 0, "op_candidates": 0}
    for text in ["Hello! How can I help", "The quick brown fox"]:
        x = t.tokenizer(text, return_tensors="pt").input_ids
        out, acc = speculative_generate(dr, t, x, 20, [])
        acc_all += acc
        T, n = out.shape[1], x.shape[1]
        lm = torch.zeros(1, T, dtype=torch.bool)
        lm[0, n:] = True  # the answer is supervised, as in a regenerated conversation
        doc = torch.zeros(1, T, dtype=torch.int32)
        feats = t.capture(out, doc, dr.cfg.target_layer_ids)
        _, _, s = on_policy_anchors(dr, t, out, lm, doc, feats, 8, torch.Generator().manual_seed(0))
        for k in sums:
            sums[k] += int(s[k])
    assert max(acc_all) > 2  # the drafter gets blocks accepted: the walk skips anchors
    assert on_policy_metrics(sums)["on_policy_tau"] == pytest.approx(sum(acc_all) / len(acc_all), abs=1e-12)


def test_the_step_trains_on_the_on_policy_anchors(monkeypatch):
    """train/step.py's on_policy=True anchors the loss where decoding goes (here a fixed walk)."""
    from types import SimpleNamespace

    import dflash_train.model.on_policy as op
    from dflash_train.config_sections import TrainConfig
    from dflash_train.model import dflash_loss
    from dflash_train.train.step import loss_and_backward
    from test_model_fakes import FakeTarget, batch, packed_row, tiny_drafter

    t = FakeTarget(vocab_size=50, hidden_size=32)
    d = tiny_drafter(block_size=4, std=0.1)
    ids, lm, docs = batch([packed_row([18, 14], 40, seed=1), packed_row([40], 40, seed=2)])
    feats = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(3))
    b = SimpleNamespace(input_ids=ids, loss_mask=lm, document_ids=docs, features=feats)
    cfg = TrainConfig(loss_gamma=3.0)
    # a walk that visits every third valid anchor (as a drafter accepting 2 tokens a step would)
    walk = lambda input_ids, ok, drafts: ok & (torch.arange(ok.shape[1]) % 3 == 0)  # noqa: E731
    monkeypatch.setattr(op, "visited_anchors", walk)
    got = loss_and_backward(d, t, b, cfg, 4, torch.Generator().manual_seed(7), on_policy=True)
    ok = op.valid_anchor_mask(lm, docs)
    assert int(got.extra["op_visited"]) == int(walk(ids, ok, None).sum()) < int(got.extra["op_candidates"])
    anchors, valid = sample_anchors(lm, docs, 4, 4, torch.Generator().manual_seed(7),
                                    offset=(~walk(ids, ok, None)).float())
    assert bool((anchors[valid] % 3 == 0).all())  # 4 picks among the visited ones
    want = dflash_loss(d, t, ids, lm, docs, feats, 4, None, gamma=3.0, anchors=(anchors, valid))
    uniform = dflash_loss(d, t, ids, lm, docs, feats, 4, torch.Generator().manual_seed(7), gamma=3.0)
    assert float(got.loss.detach()) == float(want.loss.detach()) != float(uniform.loss.detach())


RECIPE = {"train.anchors": "on_policy", "train.on_policy_start": 0.5, "train.max_steps": 6,
          "checkpoint.every_steps": 2}


@pytest.fixture(scope="module")
def setup(tiny_target_factory, tmp_path_factory):
    from conftest import write_tiny_jsonl

    root = tmp_path_factory.mktemp("on_policy")
    jsonl = write_tiny_jsonl(root / "conv.jsonl", n=40)
    target = tiny_target_factory("qwen3")
    rd = root / "reference"
    res = run_train(rd, tiny_overrides(target, jsonl, **RECIPE))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return target, jsonl, rd


def test_training_switches_to_on_policy_anchors_and_reports_it(setup, tmp_path):
    target, jsonl, rd = setup
    recs = {r["step"]: r for r in metrics(rd) if "loss" in r}
    assert sorted(recs) == list(range(1, 7))
    # steps 1-3 uniform (state.step 0..2 < 0.5 * 6), steps 4-6 on-policy
    assert all("on_policy_tau" not in recs[s] for s in (1, 2, 3))
    for s in (4, 5, 6):
        assert 1.0 <= recs[s]["on_policy_tau"] <= 8.0 and 0 < recs[s]["on_policy_visited_frac"] <= 1.0
    # the uniform phase is the uniform recipe's: same losses as a run without the option (after it,
    # a fresh drafter accepts almost nothing, so decoding visits nearly every anchor and the picks
    # rarely differ: test_the_step_trains_on_the_on_policy_anchors checks they are the ones used)
    plain = tmp_path / "uniform"
    res = run_train(plain, tiny_overrides(target, jsonl, **dict(RECIPE, **{"train.anchors": "uniform"})))
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = losses(plain), losses(rd)
    assert all(a[s] == b[s] for s in (1, 2, 3)), (a, b)


def test_resume_inside_the_on_policy_phase_is_bit_exact(setup, tmp_path):
    target, jsonl, reference = setup
    rd = tmp_path / "resumed"
    res = run_train(rd, tiny_overrides(target, jsonl, **RECIPE), resume=reference / "checkpoints" / "step-00000004")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got, want = losses(rd), losses(reference)
    assert sorted(got) == [5, 6] and all(got[s] == want[s] for s in got), (got, want)
