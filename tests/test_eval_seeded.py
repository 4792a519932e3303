"""A `block_seeds: prompt_lookup` drafter in real decoding: the prompt-lookup proposal sits in
its block inputs. A drafter whose layers add nothing (o_proj and down_proj zero) reads back
its own inputs through the tied head, so it drafts exactly the seeds: real speculative
decoding with it must give prompt lookup's acceptance lengths step for step, its output
must equal plain greedy, and replay (the training path, where seeds come from
`loss`/`on_policy`'s vectorised lookup) must agree with decoding."""
from __future__ import annotations

import pytest
import torch

from dflash_train.config import ModelConfig, TargetConfig
from dflash_train.eval.ngram import ngram_generate
from dflash_train.eval.replay import replay_acceptance
from dflash_train.eval.specdec import plain_generate, speculative_generate
from dflash_train.model import DFlashDrafter, DrafterConfig
from dflash_train.targets import load_target

PROMPTS = ["Hello! How can I help you today? Hello! How can I help", "The quick brown fox jumps. The quick"]


def copying_drafter(target, seeds: str) -> DFlashDrafter:
    cfg = DrafterConfig.from_target(ModelConfig(num_layers=1, block_size=6, block_seeds=seeds), target)
    dr = DFlashDrafter(cfg, seed=0).eval()
    with torch.no_grad():
        for layer in dr.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return dr


def test_seeded_copying_drafter_decodes_like_prompt_lookup(tiny_target_factory):
    t = load_target(TargetConfig(path=str(tiny_target_factory("gemma3")), device="cpu", dtype="float32"))
    seeded, masked = copying_drafter(t, "prompt_lookup"), copying_drafter(t, "none")
    ngram_steps = 0
    for text in PROMPTS:
        x = t.tokenizer(text, return_tensors="pt").input_ids
        plain = plain_generate(t, x, 24, [])
        out, acc = speculative_generate(seeded, t, x, 24, [])
        assert torch.equal(out, plain)
        look_out, look_acc = ngram_generate(t, x, 24, [], k=5)
        assert torch.equal(look_out, plain)
        assert acc == look_acc
        assert replay_acceptance(seeded, t, out[0].tolist(), x.shape[1]) == acc
        ngram_steps += sum(a > 1 for a in acc)
        # the same weights without seeds draft nothing the target accepts
        _, acc_masked = speculative_generate(masked, t, x, 24, [])
        assert set(acc_masked) == {1}
    assert ngram_steps > 0  # prompt lookup did accept drafts on these prompts


def test_eval_cli_on_a_seeded_export(tiny_target_factory, tmp_path):
    """The user's way: export the seeded drafter, `dflash-train eval --json` on it. The export
    records the seeding, eval decodes with it (the copying drafter = prompt lookup) and also
    reports the masks-only tau an engine that does not seed would get."""
    import json
    import subprocess

    from dflash_train.export import write_export
    from trainrun import CLI, REPO, env

    tdir = tiny_target_factory("gemma3")
    t = load_target(TargetConfig(path=str(tdir), device="cpu", dtype="float32"))
    dr = copying_drafter(t, "prompt_lookup")
    exp = write_export(dr.cfg, dr.state_dict(), tmp_path / "export", provenance={"target_path": str(tdir)})
    assert json.loads((exp / "config.json").read_text())["dflash_config"]["block_seeds"] == "prompt_lookup"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    r = subprocess.run([*CLI, "eval", "--drafter", str(exp), "--prompts",
                        str(prompts), "--max-new-tokens", "24", "--json"],
                       capture_output=True, text=True, timeout=300, env=env(), cwd=REPO)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["block_seeds"] == "prompt_lookup" and res["outputs_match"] is True
    assert res["tau"] == pytest.approx(res["tau_ngram"]) and res["tau"] > 1
    assert res["tau_unseeded"] == pytest.approx(1.0)
