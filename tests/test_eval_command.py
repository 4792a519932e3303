"""`evaluate_tau` and `dflash-train eval` on a tiny target: result keys, --json
prints exactly one JSON object, drafter from an export dir / run dir,
--untrained, held-out prompts, and one-line errors for bad inputs."""
from __future__ import annotations

import json

import pytest

from dflash_train.checkpoint.manager import CheckpointManager
from dflash_train.cli import UserError
from dflash_train.config import ModelConfig, RunConfig, TargetConfig, save_config
from dflash_train.eval.command import encode_prompts, eval_command, evaluate_tau, heldout_prompts, read_prompts_file
from dflash_train.export import write_export
from dflash_train.model import DFlashDrafter, DrafterConfig
from dflash_train.target import load_target




@pytest.fixture(scope="module")
def setup(tiny_target_factory, tmp_path_factory):
    tdir = tiny_target_factory("qwen3")
    t = load_target(TargetConfig(path=str(tdir), device="cpu", dtype="float32"))
    cfg = DrafterConfig.from_target(ModelConfig(num_layers=1, block_size=4), t)
    dr = DFlashDrafter(cfg, seed=3).eval()
    root = tmp_path_factory.mktemp("evalcmd")
    exp = write_export(cfg, dr.state_dict(), root / "export", provenance={"target_path": str(tdir)})
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello! How can I help"}) + "\n\n"
                       + json.dumps({"prompt": "Tell me about the sea."}) + "\n")
    return t, dr, tdir, exp, prompts, root


def test_evaluate_tau_keys_and_match(setup):
    t, dr, *_ = setup
    res = evaluate_tau(dr, t, ["Hello! How can I help", "What is two plus two?"], 10, 0.0, 0)
    for k in ("tau", "histogram", "tokens_per_s_spec", "tokens_per_s_plain", "speedup", "num_prompts", "outputs_match"):
        assert k in res
    assert res["outputs_match"] is True and res["num_prompts"] == 2
    assert set(res["histogram"]) == {"1", "2", "3", "4"}
    assert sum(res["histogram"].values()) == res["steps"]
    assert res["tau"] == pytest.approx(sum(int(k) * v for k, v in res["histogram"].items()) / res["steps"])
    assert res["tokens_per_s_spec"] > 0 and res["tokens_per_s_plain"] > 0
    # sampling runs too (no exactness check), and skipping the plain baseline works
    res = evaluate_tau(dr, t, ["Hello!"], 6, 0.8, 0, measure_plain=False)
    assert res["outputs_match"] is None and res["tokens_per_s_plain"] is None and res["tau"] >= 1


def test_prompts_formatted_as_one_user_turn(setup):
    t, *_ = setup
    ids, stops = encode_prompts(t, ["Hi there"])
    text = t.tokenizer.decode(ids[0])
    assert text == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    assert t.tokenizer.convert_tokens_to_ids("<|im_end|>") in stops


def test_eval_command_json_export_dir(setup, capsys):
    t, dr, tdir, exp, prompts, _ = setup
    res = eval_command(exp, None, str(prompts), 8, 8, 0.0, 0, False, True)
    out = capsys.readouterr().out.strip()
    obj = json.loads(out)  # exactly one JSON object on stdout
    assert out.count("\n") == 0
    for k in ("tau", "histogram", "tokens_per_s_spec", "tokens_per_s_plain", "speedup"):
        assert k in obj
    assert obj["num_prompts"] == 2 and obj["outputs_match"] is True
    assert obj["tau"] == pytest.approx(res["tau"])
    # --untrained: same shape, fresh init; table output
    eval_command(exp, str(tdir), str(prompts), 1, 6, 0.0, 1, True, False)
    assert "tau" in capsys.readouterr().out


def test_eval_command_run_dir_heldout(setup, tmp_path, capsys):
    t, dr, tdir, *_ = setup
    run = tmp_path / "run"
    run.mkdir()
    data = tmp_path / "convs.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question number {i}: what is {i} plus {i}?"},
        {"from": "gpt", "value": f"It is {2 * i}."}]}) + "\n" for i in range(40)))
    rc = RunConfig()
    rc.target.path = str(tdir)
    rc.target.device = "cpu"
    rc.data.source = f"jsonl:{data}"
    rc.data.heldout_fraction = 0.3
    # a demo run trains on regenerated answers; held-out prompts still come from the source
    regen = tmp_path / "regenerated.jsonl"
    regen.write_text(json.dumps({"id": "r0", "conversations": [{"from": "human", "value": "hi"},
                                                             {"from": "gpt", "value": "hello"}]}) + "\n")
    rc.data.regenerated = str(regen)
    save_config(rc, run / "config.yaml")
    mgr = CheckpointManager(run / "checkpoints", keep_last=2, async_save=False)
    mgr.save(4, dr.state_dict(), {}, {"step": 4, "drafter_config": dr.cfg.to_dict(), "target_path": str(tdir)})
    mgr.close()
    res = eval_command(run, None, "heldout", 2, 6, 0.0, 0, False, True)
    obj = json.loads(capsys.readouterr().out)
    assert obj["num_prompts"] == 2 and obj["step"] == 4 and obj["outputs_match"] is True
    assert res["target"] == str(tdir)
    from dflash_train.data.sources import is_heldout, read_conversations

    convs, _ = read_conversations(f"jsonl:{data}", None)
    expect = [c.prompt for c in convs if is_heldout(c, 0.3)][:2]  # all short: none skipped for length
    from dflash_train.eval import command as C

    assert C._heldout_from_run(rc, t, 2) == expect


def test_heldout_prompts_shapes():
    from dflash_train.data.sources import Conversation

    convs = [Conversation("a", [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
                                {"role": "assistant", "content": "x"}]),
             {"conversations": [{"from": "human", "value": "u2"}, {"from": "gpt", "value": "y"}]},
             {"messages": [{"role": "user", "content": "u3"}]}]
    assert heldout_prompts(convs, 5) == ["u1", "u2", "u3"]
    assert heldout_prompts(convs, 2) == ["u1", "u2"]


def test_prompt_file_errors_name_file_and_line(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "ok"}) + "\n" + "{broken\n")
    with pytest.raises(UserError, match=r"p\.jsonl:2: not valid JSON"):
        read_prompts_file(p)
    p.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"text": "x"}) + "\n")
    with pytest.raises(UserError, match=r"p\.jsonl:2: expected an object"):
        read_prompts_file(p)
    with pytest.raises(UserError, match="prompts file not found"):
        read_prompts_file(tmp_path / "none.jsonl")
    p.write_text("\n")
    with pytest.raises(UserError, match="no prompts"):
        read_prompts_file(p)
    p.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": "b"}) + "\n")
    assert read_prompts_file(p, 1) == ["a"]


def test_cli_eval_errors_one_line(setup, tmp_path):
    from typer.testing import CliRunner

    from dflash_train.cli import app

    _, _, _, exp, _, _ = setup
    r = CliRunner().invoke(app, ["eval", "--drafter", str(tmp_path / "nope"), "--json"])
    assert r.exit_code == 2 and "drafter path not found" in r.output and "Traceback" not in r.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1, 2]\n")
    r = CliRunner().invoke(app, ["eval", "--drafter", str(exp), "--prompts", str(bad), "--json"])
    assert r.exit_code == 2 and "bad.jsonl:1" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["eval", "--drafter", str(exp), "--prompts", "heldout"])
    assert r.exit_code == 2 and "heldout" in r.output and "Traceback" not in r.output
