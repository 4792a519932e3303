"""Export format: config.json fields (a valid transformers Qwen3Config with the
DFlash keys), tensor names (no "model." prefix, no embedding, no lm_head),
README model card from the run, source resolution (run dir / checkpoint /
best), refuse-overwrite, and the CLI's one-line errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_train.checkpoint.manager import CheckpointManager
from dflash_train.cli import UserError
from dflash_train.config import RunConfig, save_config
from dflash_train.checkpoint.source import load_export, resolve_drafter_source
from dflash_train.export import (
    expected_tensor_names,
    export_checkpoint,
    hf_config_dict,
    write_export,
)
from dflash_train.model import DFlashDrafter, DrafterConfig


def _cfg(**kw) -> DrafterConfig:
    base = dict(hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                layer_types=["full_attention", "sliding_attention", "full_attention"], sliding_window=7,
                block_size=10, mask_token_id=4, target_layer_ids=[1, 3, 5], num_target_layers=8,
                rope_theta=10000.0, max_position_embeddings=4096, vocab_size=300,
                input_embedding_scale=32 ** 0.5, output_multiplier=1.0, final_logit_softcapping=None)
    base.update(kw)
    return DrafterConfig(**base)


def _make_run(tmp_path: Path, steps=(5, 10), cfg: DrafterConfig | None = None, best: int | None = None) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    rc = RunConfig()
    rc.target.path = "/models/some-target"
    save_config(rc, run / "config.yaml")
    cfg = cfg or _cfg()
    mgr = CheckpointManager(run / "checkpoints", keep_last=5, async_save=False)
    drafters = {}
    for s in steps:
        d = DFlashDrafter(cfg, seed=s)
        drafters[s] = d
        mgr.save(s, d.state_dict(), {"optimizer": {}}, {"step": s, "drafter_config": cfg.to_dict(),
                                                        "target_path": "/models/some-target", "tokens": 1000 * s})
    mgr.wait()
    if best is not None:
        mgr.mark_best(best)
    mgr.close()
    lines = [{"step": s, "loss": 9.0 - s / 10, "loss_mean": 9.5 - s / 10, "tokens": 1000 * s, "acc_1": 0.01 * s}
             for s in range(1, max(steps) + 1)]
    lines.insert(7, {"step": 7, "tau": 1.25, "eval": True})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run, drafters


def test_config_json_fields_and_qwen3config(tmp_path):
    from transformers import Qwen3Config

    cfg = _cfg(output_multiplier=0.5, final_logit_softcapping=30.0)
    d = hf_config_dict(cfg)
    assert d["architectures"] == ["DFlashDraftModel"] and d["model_type"] == "qwen3"
    for k, v in [("num_hidden_layers", 3), ("hidden_size", 32), ("intermediate_size", 64),
                 ("num_attention_heads", 4), ("num_key_value_heads", 2), ("head_dim", 8), ("vocab_size", 300),
                 ("max_position_embeddings", 4096), ("num_target_layers", 8), ("block_size", 10),
                 ("sliding_window", 7), ("tie_word_embeddings", False), ("rope_theta", 10000.0)]:
        assert d[k] == v, k
    assert d["rms_norm_eps"] == pytest.approx(1e-6)
    assert d["layer_types"] == ["full_attention", "sliding_attention", "full_attention"]
    assert d["dflash_config"] == {"mask_token_id": 4, "target_layer_ids": [1, 3, 5],
                                  "input_embedding_scale": pytest.approx(32 ** 0.5),
                                  "output_multiplier": 0.5, "final_logit_softcapping": 30.0}
    q = Qwen3Config.from_dict(d)  # what transformers 5.x (and the reference) build from it
    assert q.rope_parameters["rope_theta"] == 10000.0
    assert q.sliding_window == 7 and q.layer_types == d["layer_types"]
    assert q.num_target_layers == 8 and q.block_size == 10 and q.tie_word_embeddings is False


def test_config_json_omits_unit_values():
    d = hf_config_dict(_cfg(layer_types=["full_attention"] * 3, sliding_window=None,
                            input_embedding_scale=1.0))
    assert d["dflash_config"] == {"mask_token_id": 4, "target_layer_ids": [1, 3, 5]}
    assert d["sliding_window"] is None and d["use_sliding_window"] is False


def test_weights_names_no_prefix_no_embedding(tmp_path):
    cfg = _cfg()
    sd = DFlashDrafter(cfg).state_dict()
    # a checkpoint that (wrongly) carried a prefix or the target's tensors is cleaned on export
    dirty = {"model." + k: v for k, v in sd.items()}
    dirty["model.embed_tokens.weight"] = torch.zeros(300, 32)
    out = write_export(cfg, dirty, tmp_path / "e")
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == set(expected_tensor_names(cfg))
    assert not any(k.startswith("model.") or "embed_tokens" in k or "lm_head" in k for k in tensors)
    assert tensors["fc.weight"].shape == (32, 3 * 32)
    assert tensors["layers.1.self_attn.q_norm.weight"].shape == (8,)
    for k, v in sd.items():
        assert torch.equal(tensors[k], v), k
    c, sd2 = load_export(out)
    assert c.to_dict() == cfg.to_dict()
    assert sorted(sd2) == sorted(sd)


def test_export_from_run_dir_latest_and_readme(tmp_path):
    run, drafters = _make_run(tmp_path)
    out = export_checkpoint(run, tmp_path / "out")
    cfg, sd = load_export(out)
    for k, v in drafters[10].state_dict().items():
        assert torch.equal(sd[k], v), k
    conf = json.loads((out / "config.json").read_text())
    assert conf["dflash_train"]["target_path"] == "/models/some-target"
    assert conf["dflash_train"]["step"] == 10
    readme = (out / "README.md").read_text()
    assert "steps: 10" in readme and "tokens trained: 10000" in readme
    assert "final loss: 8.5000" in readme  # loss_mean of the last logged step
    assert "1.250" in readme  # the measured tau from metrics.jsonl
    assert "--speculative-algorithm DFLASH" in readme
    assert '"method": "dflash"' in readme and '"num_speculative_tokens": 9' in readme
    assert "/models/some-target" in readme


def test_export_from_checkpoint_dir_and_best(tmp_path):
    run, drafters = _make_run(tmp_path, best=5)
    out = export_checkpoint(run / "checkpoints" / "step-00000005", tmp_path / "a")
    _, sd = load_export(out)
    assert torch.equal(sd["fc.weight"], drafters[5].state_dict()["fc.weight"])
    src = resolve_drafter_source(run / "best")
    assert src.step == 5 and src.kind == "checkpoint"
    src = resolve_drafter_source(run)
    assert src.step == 10
    src = resolve_drafter_source(out)
    assert src.kind == "export" and src.target_path == "/models/some-target"


def test_refuse_overwrite_and_force(tmp_path):
    run, _ = _make_run(tmp_path, steps=(3,))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    # a non-empty directory that is not a previous export is never replaced, --force or not
    for force in (False, True):
        with pytest.raises(UserError, match="not empty.*not a previous export.*--force or not"):
            export_checkpoint(run, out, force=force)
        assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    # a previous export: refused without --force, replaced with it
    out = tmp_path / "exp"
    export_checkpoint(run, out)
    with pytest.raises(UserError, match="previous export.*--force"):
        export_checkpoint(run, out)
    export_checkpoint(run, out, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left
    # an empty existing dir is fine
    (tmp_path / "empty").mkdir()
    export_checkpoint(run, tmp_path / "empty")


def test_bad_sources_are_clear_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        resolve_drafter_source(tmp_path / "nope")
    (tmp_path / "junk").mkdir()
    with pytest.raises(UserError, match="not a run dir"):
        resolve_drafter_source(tmp_path / "junk")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    (bad / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match="config.json"):
        resolve_drafter_source(bad)
    (bad / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(UserError, match="missing key"):
        load_export(bad)


def test_cli_export_errors_are_one_line(tmp_path):
    from typer.testing import CliRunner

    from dflash_train.cli import app

    r = CliRunner().invoke(app, ["export", str(tmp_path / "missing"), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2
    assert "Traceback" not in r.output
    run, _ = _make_run(tmp_path, steps=(2,))
    r = CliRunner().invoke(app, ["export", str(run), "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["export", str(run), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "--force" in r.output and "Traceback" not in r.output


def test_readme_uses_demo_summary(tmp_path):
    run, _ = _make_run(tmp_path, steps=(4,))
    (run / "summary.json").write_text(json.dumps({"tau_trained": 1.8125, "tau_untrained": 1.0}))
    out = export_checkpoint(run, tmp_path / "o")
    readme = (out / "README.md").read_text()
    assert "1.812" in readme or "1.813" in readme
    assert "untrained drafter of the same shape: 1.000" in readme
    assert json.loads((out / "config.json").read_text())["dflash_train"]["tau"] == 1.8125
