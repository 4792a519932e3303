"""Training prompts in the benchmark suites' domains, from sources that ship on PyPI.

The embedded target copies a lot on the suites: it rewrites a HumanEval stub before
solving it, it repeats the passage an MT-Bench extraction question gives it. A drafter
trained on ShareGPT chat alone never sees that, so vLLM's n-gram drafting beats it there
(docs/benchmarks.md). These prompts put those domains into the data; the target writes
the answers (`dflash-train regenerate`, the demo), as for ShareGPT. Never a suite's own
problems: the code comes from pure-Python libraries, the passages from ShareGPT answers.

``data.domain_prompts`` (appended after ``data.source``'s conversations; the hash split
holds some out, like every conversation):

* ``code``: public functions with a docstring of ``more-itertools``, ``boltons`` and
  ``toolz`` (their installed sources, parsed with `ast`, never imported), as a stub -
  signature and docstring - under one of a few "complete this function" instructions,
  but none named like a function of HumanEval's problems. The reference answer is the
  function's own source.
* ``passages``: a paragraph of a ShareGPT answer (training conversations only, English
  prose, one paragraph of 200-450 characters) under an extraction / rewriting / summarising instruction.
  The reference answer is the passage itself.

Deterministic: the same installed packages and counts give the same prompts and ids.
"""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import itertools
import logging
import re
import textwrap
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Iterator

from dflash_train.data.benchmarks import load_humaneval
from dflash_train.data.sources import Conversation, DataError, is_heldout, read_conversations
from dflash_train.errors import UserError

log = logging.getLogger(__name__)
CODE_PACKAGES = {"more_itertools": "more-itertools", "boltons": "boltons", "toolz": "toolz"}
MAX_STUB_CHARS = 360   # ~123 tokens with the chat format: the stub and ~70 answer tokens fit a 192-token row
DOC_LINES = 12

CODE_INSTRUCTIONS = (
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{stub}```\n",
    "Complete the following Python function:\n\n```python\n{stub}```",
    "Implement the function below.\n```python\n{stub}```",
)
PASSAGE_INSTRUCTIONS = (
    "Extract the names of the people, places, products and organizations mentioned in the following text. "
    "Present them as a JSON object.\n\n{text}",
    "Rewrite the following paragraph in a more formal tone:\n\n{text}",
    "Summarize the following text in two sentences.\n\n{text}",
    "Correct any grammatical errors in the following text and return the corrected text:\n\n{text}",
    "Turn the following text into a bulleted list of its main points:\n\n{text}",
    "Rewrite the following text so that a ten-year-old can understand it:\n\n{text}",
)


def _pick(options: tuple[str, ...], key: str) -> str:
    return options[int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") % len(options)]


def _package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"data.domain_prompts code: the package {CODE_PACKAGES[module]} is not installed "
                        f"(make install puts it in .venv; or drop `code` from data.domain_prompts)")
    return Path(next(iter(spec.submodule_search_locations)))


def _stub(lines: list[str], fn: ast.FunctionDef) -> str | None:
    """`def ...:` and as much of its docstring as fits MAX_STUB_CHARS (at most DOC_LINES
    lines), dedented; None when even the signature and a line do not fit."""
    head = textwrap.dedent("\n".join(lines[fn.lineno - 1:fn.body[0].lineno - 1])).rstrip()
    doc = [line.rstrip() for line in (ast.get_docstring(fn) or "").splitlines()[:DOC_LINES]]
    while doc:
        body = "\n".join(("    " + line).rstrip() for line in ['"""', *doc, '"""'])
        stub = head + "\n" + body + "\n"
        if len(stub) <= MAX_STUB_CHARS:
            return stub
        doc.pop()
    return None


def humaneval_names() -> set[str]:
    """The functions HumanEval's problems define: a stub of that name never enters training
    (more-itertools has an ``is_prime(n)``, HumanEval/31 too)."""
    return {m.group(1) for item in load_humaneval() for m in re.finditer(r"^def (\w+)\(", item.turns[0], re.M)}


def code_conversations() -> Iterator[Conversation]:
    """Every usable stub of the code packages, in a fixed order (package, file, line), but
    those named like a HumanEval function (decontamination)."""
    try:
        banned = humaneval_names()
    except UserError as e:
        raise DataError(f"data.domain_prompts code: cannot decontaminate against HumanEval: {e}") from None
    for module in CODE_PACKAGES:
        root = _package_dir(module)
        for path in sorted(root.rglob("*.py")):
            if "test" in path.name:
                continue
            src = path.read_text(encoding="utf-8")
            lines = src.splitlines()
            for fn in ast.walk(ast.parse(src)):
                if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("_") or fn.decorator_list \
                        or fn.name in banned:
                    continue
                if not (fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant)
                        and isinstance(fn.body[0].value.value, str)) or len(fn.body) < 2:
                    continue
                doc = ast.get_docstring(fn) or ""
                if len(doc) < 40:
                    continue
                stub = _stub(lines, fn)
                if stub is None:
                    continue
                cid = f"code:{module}/{path.relative_to(root).as_posix()}:{fn.name}:{fn.lineno}"
                solution = textwrap.dedent("\n".join(lines[fn.lineno - 1:fn.end_lineno]))
                yield Conversation(cid, [
                    {"role": "user", "content": _pick(CODE_INSTRUCTIONS, cid).format(stub=stub)},
                    {"role": "assistant", "content": f"```python\n{solution}\n```"}])


def _paragraph(answer: str) -> str | None:
    for para in answer.split("\n\n"):
        para = para.strip()
        if 200 <= len(para) <= 450 and "\n" not in para and sum(c.isascii() for c in para) >= 0.98 * len(para) \
                and para.count(" ") >= 25:  # one paragraph of prose
            return para
    return None


def passage_conversations(source: str, count: int, skip: int, heldout_fraction: float) -> Iterator[Conversation]:
    """Up to `count` passage prompts from the answers of `source`'s training conversations
    after its first `skip` (those the run reads as conversations of its own)."""
    convs, _ = read_conversations(source, skip + 6 * count)
    made = 0
    for conv in convs[skip:]:
        if made >= count or is_heldout(conv, heldout_fraction):
            continue
        para = _paragraph(conv.reference)
        if para is None:
            continue
        cid = f"passage:{conv.id}"
        yield Conversation(cid, [{"role": "user", "content": _pick(PASSAGE_INSTRUCTIONS, cid).format(text=para)},
                                 {"role": "assistant", "content": para}])
        made += 1


def domain_conversations(domains: dict[str, int], source: str, skip: int,
                         heldout_fraction: float) -> list[Conversation]:
    """The prompts of ``data.domain_prompts`` ({domain: count}; the config checks the names), each
    domain in turn."""
    out: list[Conversation] = []
    for name, count in domains.items():
        if name == "code":
            got = list(itertools.islice(code_conversations(), count))
        else:
            got = list(passage_conversations(source, count, skip, heldout_fraction))
        if len(got) < count:
            log.info("data.domain_prompts %s: %d prompts (%d asked; that is all the sources hold)", name, len(got), count)
        out += got
    return out


def domains_identity(domains: dict[str, int]) -> str | None:
    """What the prompts depend on besides the counts (the cache key): the code packages' versions."""
    if "code" not in domains:
        return None
    parts = []
    for dist in CODE_PACKAGES.values():
        try:
            parts.append(f"{dist}=={version(dist)}")
        except PackageNotFoundError:
            parts.append(f"{dist} missing")
    return ",".join(parts)
