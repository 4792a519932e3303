"""`evaluate_tau` and `dflash-train eval` on a tiny target: result keys, --json
prints exactly one JSON object, drafter from an export dir / run dir,
--untrained, held-out prompts, and one-line errors for bad inputs."""
from __future__ import annotations

import json

import pytest

from dflash_train.checkpoint.manager import CheckpointManager
from dflash_train.cli import UserError
from dflash_train.config import ModelConfig, RunConfig, TargetConfig, save_config
from dflash_train.eval.command import eval_command
from dflash_train.eval.prompts import encode_prompts, heldout_prompts, read_prompts_file
from dflash_train.eval.tau import evaluate_tau
from dflash_train.export import write_export
from dflash_train.model import DFlashDrafter, DrafterConfig
from dflash_train.targets import load_target




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
    # the prompt-lookup baseline on the same prompts, k = block_size - 1 draft tokens
    assert res["ngram_k"] == 3 and res["outputs_match_ngram"] is True and res["mismatched_prompts_ngram"] == []
    assert set(res["histogram_ngram"]) == {"1", "2", "3", "4"}
    assert sum(res["histogram_ngram"].values()) == res["steps_ngram"]
    assert res["tau_ngram"] == pytest.approx(
        sum(int(k) * v for k, v in res["histogram_ngram"].items()) / res["steps_ngram"])
    assert res["new_tokens_ngram"] == res["new_tokens"]  # greedy: the same outputs
    assert res["tokens_per_s_ngram"] > 0
    assert res["speedup_ngram"] == pytest.approx(res["tokens_per_s_ngram"] / res["tokens_per_s_plain"])
    # sampling runs too (no exactness check), and skipping the plain baseline works;
    # prompt lookup is greedy only: not measured at temperature > 0
    res = evaluate_tau(dr, t, ["Hello!"], 6, 0.8, 0, measure_plain=False)
    assert res["outputs_match"] is None and res["tokens_per_s_plain"] is None and res["tau"] >= 1
    assert res["tau_ngram"] is None and res["tokens_per_s_ngram"] is None and res["speedup_ngram"] is None
    # in-training shape: no plain decoding; prompt lookup measured (no speedup) or skipped
    res = evaluate_tau(dr, t, ["Hello!"], 6, 0.0, 0, measure_plain=False)
    assert res["tau_ngram"] >= 1 and res["speedup_ngram"] is None and res["outputs_match_ngram"] is None
    res = evaluate_tau(dr, t, ["Hello!"], 6, 0.0, 0, measure_plain=False, measure_ngram=False)
    assert res["tau_ngram"] is None and res["histogram_ngram"] is None and res["tau"] >= 1


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
    for k in ("tau", "histogram", "tokens_per_s_spec", "tokens_per_s_plain", "speedup", "tau_ngram",
              "histogram_ngram", "tokens_per_s_ngram", "speedup_ngram", "outputs_match_ngram"):
        assert k in obj
    assert obj["num_prompts"] == 2 and obj["outputs_match"] is True and obj["outputs_match_ngram"] is True
    assert obj["tau"] == pytest.approx(res["tau"]) and obj["tau_ngram"] == pytest.approx(res["tau_ngram"])
    assert obj["tau_ngram"] >= 1 and obj["tokens_per_s_ngram"] > 0 and obj["tokens_per_s_plain"] > 0
    assert obj["tokens_per_s_spec"] > 0
    # --untrained: same shape, fresh init; table output with all three methods
    eval_command(exp, str(tdir), str(prompts), 1, 6, 0.0, 1, True, False)
    out = capsys.readouterr().out
    assert "tau" in out and "DFlash drafter (untrained)" in out and "prompt lookup" in out
    assert "plain decoding" in out and "speedup" in out


def _run_on_forty_questions(tmp_path, tdir):
    """A run dir (not yet with its config.yaml) whose config trains on 40 short questions, 30 % held out."""
    run = tmp_path / "run"
    run.mkdir()
    data = tmp_path / "convs.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question number {i}: what is {i} plus {i}?"},
        {"from": "gpt", "value": f"It is {2 * i}."}]}) + "\n" for i in range(40)))
    rc = RunConfig()
    rc.target.path, rc.target.device = str(tdir), "cpu"
    rc.data.source, rc.data.heldout_fraction = f"jsonl:{data}", 0.3
    return run, data, rc


def test_eval_command_run_dir_heldout(setup, tmp_path, capsys):
    t, dr, tdir, *_ = setup
    run, data, rc = _run_on_forty_questions(tmp_path, tdir)
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
    from dflash_train.eval.source import heldout_from_run

    assert heldout_from_run(rc, t, 2) == expect


def test_in_training_eval_scores_the_final_evals_prompts(setup, tmp_path):
    """The in-training eval of a run trained on regenerated answers picks the very prompts that
    `eval --prompts heldout`, compare and the demo score (`eval_prompts`): the held-out prompts of
    data.source, not those of the regenerated file (which holds other conversations)."""
    from dflash_train.data.sources import is_heldout, read_conversations
    from dflash_train.eval.in_training import HeldoutEval
    from dflash_train.eval.prompts import eval_prompts
    from dflash_train.eval.source import heldout_from_run
    from dflash_train.train.eval_hook import InTrainingEval

    t = setup[0]

    def convs(path, what):
        path.write_text("".join(json.dumps({"id": f"{what}{i}", "conversations": [
            {"from": "human", "value": f"{what} question {i}: what is {i} plus {i}?"},
            {"from": "gpt", "value": f"It is {2 * i}."}]}) + "\n" for i in range(40)))
        return path

    rc = RunConfig()
    rc.target.path, rc.target.device = str(setup[2]), "cpu"
    rc.data.source = f"jsonl:{convs(tmp_path / 'source.jsonl', 'source')}"
    rc.data.heldout_fraction = 0.3
    rc.data.regenerated = str(convs(tmp_path / "regenerated.jsonl", "regenerated"))
    rc.eval.every_steps, rc.eval.num_prompts = 2, 3
    source, _ = read_conversations(rc.data.source, None)
    want = [c.prompt for c in source if is_heldout(c, 0.3)][:3]
    regen, _ = read_conversations(f"jsonl:{rc.data.regenerated}", None)
    assert [c.prompt for c in regen if is_heldout(c, 0.3)][:3] != want  # the old in-training choice differed
    hook = InTrainingEval(rc, HeldoutEval(rc), is_leader=True)
    hook.pick_prompts(t)
    assert hook.prompts == want == eval_prompts(rc, t) == heldout_from_run(rc, t, 3)


def test_targets_implement_the_declared_target_interface(setup):
    """targets.Target is a DecodingTarget (model/target.py); the tests' FakeTarget is a TargetHead."""
    from test_model_fakes import FakeTarget

    from dflash_train.model.target import CapturingTarget, DecodingTarget, TargetHead

    assert isinstance(setup[0], DecodingTarget)
    fake = FakeTarget()
    assert isinstance(fake, TargetHead) and not isinstance(fake, CapturingTarget)


def test_eval_result_rows_join_one_table(setup):
    """`evaluate_tau`'s result as `results.MethodRow`s: drafter, prompt lookup, plain; a row measured
    in a serving engine is the same type and renders in the same columns."""
    from dflash_train.results import MethodRow, cells, eval_rows

    t, dr, *_ = setup
    res = evaluate_tau(dr, t, ["Hello there"], 6)
    rows = eval_rows(res, "DFlash drafter")
    assert [r.method for r in rows] == ["DFlash drafter", "prompt lookup (k=3)", "plain decoding"]
    assert rows[0].tau == res["tau"] and rows[0].lossless is True and rows[1].lossless is True
    assert cells(rows[-1])[1:] == ["1.000", format(res["tokens_per_s_plain"], ".2f"), "1.00", "-"]
    engine = MethodRow("vLLM dflash", 2.5, 120.0, 1.8, True, measured_by="vllm")
    assert cells(engine) == ["vLLM dflash", "2.500", "120.00", "1.80", "yes"]
    assert engine.to_dict()["measured_by"] == "vllm"


def test_engine_rows_render_through_method_row():
    """An engine measurement's dict rows (serve-bench --json, summary.json) keep their keys; rendered,
    they are MethodRows measured by vLLM with the engine-only columns k and tokens per draft."""
    from dflash_train.engine.measure import summarise
    from dflash_train.results import ENGINE_COLUMNS, engine_cells, engine_rows

    out = [[1, 2, 3, 4]] * 2
    methods = [{"name": "plain", "outputs": out, "seconds": 2.0, "load_seconds": 1.0},
               {"name": "dflash", "k": 15, "outputs": out, "seconds": 1.0, "load_seconds": 1.0,
                "spec_decode_num_accepted_tokens": 4, "spec_decode_num_drafts": 2, "spec_decode_num_draft_tokens": 30}]
    rows = summarise(methods, num_prompts=2)
    assert {"method", "label", "k", "tau", "tokens_per_draft", "drafts", "draft_tokens", "accepted_tokens",
            "tokens_per_s", "speedup", "lossless"} <= set(rows[1])
    plain, dfl = engine_rows({"rows": rows})
    assert (dfl.method, dfl.measured_by, dfl.k, dfl.tokens_per_draft) == ("DFlash (vLLM)", "vllm", 15, 3.0)
    assert plain.reference and not dfl.reference
    assert ENGINE_COLUMNS == ("method", "k", "tau", "tokens/draft", "tok/s", "vs plain", "lossless")
    assert engine_cells(plain) == ["plain vLLM", "-", "1.000", "-", "4.00", "1.00", "yes"]
    assert engine_cells(dfl) == ["DFlash (vLLM)", "15", "3.000", "3.000", "8.00", "2.00", "yes"]
    assert engine_cells(plain, missing="n/a", speedup_suffix="x")[3:6] == ["n/a", "4.00", "1.00x"]


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


def test_demo_summary_and_report_compare_all_methods(setup, tmp_path):
    """The demo's summary.json content, terminal table and report.md: trained drafter,
    untrained drafter, prompt lookup and plain decoding side by side."""
    import io

    from rich.console import Console

    from dflash_train.demo import demo_summary, print_comparison
    from dflash_train.model import DFlashDrafter
    from dflash_train.report import write_report

    t, dr, *_ = setup
    prompts = ["Hello! How can I help", "one two one two one two"]
    res_t = evaluate_tau(dr, t, prompts, 8, 0.0, 0)
    untrained = DFlashDrafter(dr.cfg, seed=11).eval()
    res_u = evaluate_tau(untrained, t, prompts, 8, 0.0, 0, measure_plain=False, measure_ngram=False)
    summary = demo_summary(res_t, res_u, eval_prompts=2, eval_max_new_tokens=8, train_seconds=1.0,
                           export_dir=str(tmp_path / "export"))
    assert summary["tau_ngram"] == res_t["tau_ngram"] >= 1
    assert summary["tokens_per_s_ngram"] == res_t["tokens_per_s_ngram"] > 0
    assert summary["speedup_ngram"] == pytest.approx(res_t["tokens_per_s_ngram"] / res_t["tokens_per_s_plain"])
    assert summary["tokens_per_s_plain"] == res_t["tokens_per_s_plain"]
    assert summary["speedup_untrained"] == pytest.approx(res_u["tokens_per_s_spec"] / res_t["tokens_per_s_plain"])
    assert summary["eval_untrained"]["tokens_per_s_plain"] == res_t["tokens_per_s_plain"]
    json.dumps(summary)  # summary.json-able

    buf = io.StringIO()
    print_comparison(summary, Console(file=buf, width=200))
    text = buf.getvalue()
    for name in ("trained DFlash drafter", "untrained DFlash drafter", "prompt lookup", "plain decoding"):
        assert name in text
    assert f"{res_t['tau_ngram']:.3f}" in text and "speedup" in text and "no training" in text

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 2, "tau": 1.1, "tau_ngram": 1.2, "eval": True}) + "\n")
    report = write_report(run, summary).read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ") and "method" not in line]
    assert [r.split(" | ")[0] for r in rows] == ["| trained DFlash drafter",
                                                 "| untrained DFlash drafter (same shape, random weights)",
                                                 "| prompt lookup (n-gram drafting, no training)",
                                                 "| plain decoding (the target alone)"]
    assert f"| {res_t['tau_ngram']:.3f} | {res_t['tokens_per_s_ngram']:.2f} | {res_t['speedup_ngram']:.2f}x |" in report
    assert "| 1.000 |" in rows[3] and rows[3].endswith("| 1.00x |")
    assert "tau = tokens produced per forward pass" in report and "above 1 means faster" in report
    assert (run / "plots" / "tau.png").is_file()
    assert "blocks seeded by prompt lookup" not in report  # the seeding note only for a seeded drafter


def test_demo_summary_of_a_seeded_drafter_shows_its_masks_only_tau(setup, tmp_path):
    """A prompt-lookup-seeded drafter: evaluate_tau adds its masks-only tau (what engines that
    do not seed get); the demo table and report name the seeding and show that figure."""
    import dataclasses
    import io

    from rich.console import Console

    from dflash_train.demo import demo_summary, print_comparison
    from dflash_train.model import DFlashDrafter
    from dflash_train.report import write_report

    t, dr, *_ = setup
    seeded = DFlashDrafter(dataclasses.replace(dr.cfg, block_seeds="prompt_lookup"), seed=3).eval()
    prompts = ["one two one two one two", "Hello! How can I help"]
    res_t = evaluate_tau(seeded, t, prompts, 8, 0.0, 0)
    assert res_t["block_seeds"] == "prompt_lookup" and res_t["outputs_match"] is True
    assert res_t["tau_unseeded"] >= 1
    masks = evaluate_tau(dr, t, prompts, 8, 0.0, 0, measure_plain=False, measure_ngram=False)
    assert masks["tau_unseeded"] is None and masks["block_seeds"] == "none"
    # same weights: the masks-only tau of the seeded drafter is the unseeded drafter's tau
    assert res_t["tau_unseeded"] == pytest.approx(masks["tau"])
    res_u = evaluate_tau(seeded, t, prompts, 8, 0.0, 0, measure_plain=False, measure_ngram=False)
    summary = demo_summary(res_t, res_u, eval_prompts=2, eval_max_new_tokens=8, train_seconds=1.0)
    assert summary["tau_trained_unseeded"] == res_t["tau_unseeded"]
    buf = io.StringIO()
    print_comparison(summary, Console(file=buf, width=200))
    text = buf.getvalue()
    assert "seeded by prompt lookup" in text and "masks only" in text
    assert f"{res_t['tau_unseeded']:.3f}" in text
    run = tmp_path / "run"
    run.mkdir()
    report = write_report(run, summary).read_text()
    assert "same drafter from masks only" in report and "blocks seeded by prompt lookup" in report


def test_eval_and_serve_bench_find_one_run_config_for_an_export_in_its_run(setup, tmp_path):
    """One rule (checkpoint.source.run_config_of) finds the run config of a drafter: an export at
    RUN/export (no run dir of its own) has its parent's config, so `eval` and `serve-bench` (which
    both open a drafter through eval.source.open_drafter) score the same held-out prompts. No vLLM."""
    from dflash_train.checkpoint.source import resolve_drafter_source, run_config_of
    from dflash_train.engine import serve_bench
    from dflash_train.eval import command
    from dflash_train.eval.source import heldout_from_run, open_drafter

    t, dr, tdir, *_ = setup
    run, data, rc = _run_on_forty_questions(tmp_path, tdir)
    save_config(rc, run / "config.yaml")
    exp = write_export(dr.cfg, dr.state_dict(), run / "export", provenance={"target_path": str(tdir)})
    src = resolve_drafter_source(exp)
    assert src.kind == "export" and src.run_dir is None  # only the rule's parent step finds the run
    assert run_config_of(src) is not None and run_config_of(src).data.source == rc.data.source
    assert command.open_drafter is serve_bench.open_drafter is open_drafter  # both commands use the one rule
    d = open_drafter(exp)
    assert d.run_cfg.data.source == rc.data.source and d.target == rc.target  # the run's own target config
    expect = heldout_from_run(rc, t, 3)
    assert len(expect) == 3 and d.heldout(t, 3) == expect
    # an export elsewhere that records its source checkpoint: found through that run
    elsewhere = write_export(dr.cfg, dr.state_dict(), tmp_path / "out",
                             provenance={"target_path": str(tdir), "source": str(run / "checkpoints" / "step-4")})
    assert open_drafter(elsewhere).heldout(t, 3) == expect
    # no run anywhere: none, and held-out prompts are one line
    lone = write_export(dr.cfg, dr.state_dict(), tmp_path / "lone" / "x", provenance={"target_path": str(tdir)})
    assert open_drafter(lone).run_cfg is None
    with pytest.raises(UserError, match="--prompts heldout needs"):
        open_drafter(lone).heldout(t, 3)
