"""The field's benchmark suites: their problems (data/benchmarks.py, read from installed PyPI
packages), the prompts decoded (every turn) and the groups a result is reported by.

DFlash papers and their peers report tau and speedup per suite (z-lab's table: GSM8K, MATH-500,
HumanEval, MBPP, MT-Bench, Alpaca). These are the suites a package on PyPI ships:

* ``mtbench``: MT-Bench, 80 two-turn questions in 8 categories. Both turns run: the second question
  follows the target's OWN first answer (greedy, written by the same engine that is measured), as
  z-lab's script does with its decoded first answer.
* ``humaneval``: HumanEval, 164 problems.

A math suite (GSM8K or MATH-500 test problems): no package on PyPI ships the problems. Checked (the
wheels' file lists; each either loads the data from a hub at run time or carries only task
configs, adapters or a sample): aviary-gsm8k 0.37.0, nvidia-simple-evals 26.3 (MATH-500 task
configs, data fetched by URL), evalscope 1.14.1 (``_meta/gsm8k.json`` / ``math_500.json``: one
sample each), opencompass 0.5.4 (GSM8K configs only), gsm-infinite 0.2.0, ai4math 0.1.0,
llm-evaluation-in-reasoning 1.4.2, slm-eval 0.0.1, gradeschoolmathsolver 0.9.1, and the reference
``dflash`` 0.1.0 (its benchmark loads ``openai/gsm8k`` and ``HuggingFaceH4/MATH-500`` from the hub).
MT-Bench's ``math`` and ``reasoning`` categories are the math rows we can report; a user with the
problems on disk passes them as ``--prompts FILE.jsonl``.

Prompt formats are z-lab's benchmark script's (``dflash/benchmark.py``): HumanEval is wrapped in
"Write a solution to the following problem and make sure that it passes the tests:" and a python
fence; MT-Bench turns are sent as they are. Each user turn is formatted with the target's chat
format. ``--num-prompts N`` takes N items per suite in z-lab's order (the file's order shuffled
with ``random.Random(42)``), so a capped run scores the same items as their script does and MT-Bench's
first items spread over its categories.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

from dflash_train.data.benchmarks import SuiteItem, load_humaneval, load_mtbench
from dflash_train.errors import UserError

# suites the field reports that no PyPI package ships: named in the refusal, not silently unknown
UNSHIPPED = {"gsm8k": "GSM8K", "math500": "MATH-500", "mbpp": "MBPP", "alpaca": "Alpaca"}

# z-lab's script shuffles each dataset with this seed before taking --max-samples
ZLAB_ORDER_SEED = 42

LOADERS: dict[str, Callable[[], list[SuiteItem]]] = {"mtbench": load_mtbench, "humaneval": load_humaneval}
SUITE_NAMES = tuple(LOADERS)


def parse_suites(spec: str) -> list[str]:
    """``"mtbench,humaneval"`` -> the suite names, in order, once each. A name that is not a suite
    here is one UserError naming it and the valid names (before any model or engine is loaded)."""
    names = list(dict.fromkeys(n.strip().lower() for n in spec.split(",") if n.strip()))
    if not names:
        raise UserError(f"--suite is empty: choose from {', '.join(SUITE_NAMES)}")
    for name in names:
        if name in UNSHIPPED:
            raise UserError(f"--suite {name}: no PyPI package ships the {UNSHIPPED[name]} problems (see "
                            f"dflash_train/eval/suites.py); choose from {', '.join(SUITE_NAMES)}, or pass "
                            "the problems as --prompts FILE.jsonl")
        if name not in LOADERS:
            raise UserError(f"--suite {name}: unknown suite; choose from {', '.join(SUITE_NAMES)}")
    return names


def suite_names(suite: str | None, prompts: str | None) -> list[str] | None:
    """The `--suite` option parsed (None without it); given with a prompts file as well, one line:
    they are two sources of prompts."""
    if suite is None:
        return None
    names = parse_suites(suite)
    if prompts not in (None, "heldout"):
        raise UserError(f"--suite {suite} and --prompts {prompts}: give one source of prompts")
    return names


def load_suite(name: str, limit: int | None = None) -> list[SuiteItem]:
    """The suite's items in z-lab's order (module docstring), the first `limit` of them."""
    items = LOADERS[name]()
    order = list(range(len(items)))
    random.Random(ZLAB_ORDER_SEED).shuffle(order)
    return [items[i] for i in order[:limit]]


# ----------------------------------------------------------------- prompts and groups


@dataclass(frozen=True)
class SuitePrompt:
    """One prompt the engine decodes: a turn of a suite item with the conversation before it."""
    item: SuiteItem
    turn: int  # 1-based
    messages: tuple[dict, ...]  # the chat so far, ending with this turn's user message


def first_turns(items: Sequence[SuiteItem]) -> list[SuitePrompt]:
    return [SuitePrompt(it, 1, ({"role": "user", "content": it.turns[0]},)) for it in items]


def later_turn(prompt: SuitePrompt, answer: str) -> SuitePrompt | None:
    """The item's next turn after `answer` (the target's own answer to `prompt`), or None after its last."""
    if prompt.turn >= len(prompt.item.turns):
        return None
    messages = prompt.messages + ({"role": "assistant", "content": answer},
                                  {"role": "user", "content": prompt.item.turns[prompt.turn]})
    return SuitePrompt(prompt.item, prompt.turn + 1, messages)


def all_turns(items: Sequence[SuiteItem], answer: Callable[[list[SuitePrompt]], list[str]]) -> list[SuitePrompt]:
    """Every turn of every item: turn t + 1 follows `answer`'s (the target's greedy) reply to turn t.
    `answer` is called once per turn depth with the prompts that have a later turn."""
    out: list[SuitePrompt] = []
    current = first_turns(items)
    while current:
        out += current
        need = [p for p in current if p.turn < len(p.item.turns)]
        replies = answer(need) if need else []
        current = [nxt for p, a in zip(need, replies) if (nxt := later_turn(p, a)) is not None]
    return out


@dataclass(frozen=True)
class Group:
    suite: str
    category: str | None  # None: the whole suite
    indices: tuple[int, ...]  # into the prompt list

    @property
    def label(self) -> str:
        return self.suite if self.category is None else f"  {self.suite}/{self.category}"


def groups_of(prompts: Sequence[SuitePrompt]) -> list[Group]:
    """One group per suite (in the order given), then per category for suites that have them."""
    out: list[Group] = []
    for suite in dict.fromkeys(p.item.suite for p in prompts):
        idx = [i for i, p in enumerate(prompts) if p.item.suite == suite]
        out.append(Group(suite, None, tuple(idx)))
        for cat in sorted({prompts[i].item.category for i in idx if prompts[i].item.category}):
            out.append(Group(suite, cat, tuple(i for i in idx if prompts[i].item.category == cat)))
    return out


def describe(prompts: Sequence[SuitePrompt]) -> list[dict]:
    """The prompts as `--json` lists them (suite, item id, category, turn), in output order."""
    return [{"suite": p.item.suite, "id": p.item.item_id, "category": p.item.category, "turn": p.turn}
            for p in prompts]
