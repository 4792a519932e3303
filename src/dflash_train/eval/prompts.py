"""Evaluation prompts: THE held-out prompts of a run (`eval_prompts`: what `eval --prompts
heldout`, `compare`, the demo and the in-training eval all score), a prompts file, and their
token ids in the run's chat format (`targets.chat_template.prompt_format`: the run's template and
``data.chat_template_kwargs``)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from dflash_train.config import RunConfig
from dflash_train.data.heldout import heldout_conversations
from dflash_train.errors import UserError
from dflash_train.targets.chat_template import prompt_format


def heldout_prompts(heldout: Sequence[Any], num_prompts: int) -> list[str]:
    """First user turns of held-out conversations (data.sources.Conversation or ShareGPT/messages dicts)."""
    out: list[str] = []
    for conv in heldout:
        text = _first_user_text(conv)
        if text and text.strip():
            out.append(text)
        if len(out) >= num_prompts:
            break
    return out


def _first_user_text(conv: Any) -> str | None:
    if hasattr(conv, "prompt"):
        try:
            return conv.prompt
        except StopIteration:
            return None
    if isinstance(conv, str):
        return conv
    if isinstance(conv, dict):
        if isinstance(conv.get("prompt"), str):
            return conv["prompt"]
        turns = conv.get("messages") or conv.get("conversations") or []
        for t in turns:
            role = t.get("role", t.get("from"))
            if role in ("user", "human"):
                return t.get("content", t.get("value"))
    return None


def read_prompts_file(path: str | Path, num_prompts: int | None = None) -> list[str]:
    """JSONL, one {"prompt": "..."} per line (blank lines ignored). Errors name the file and line."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"prompts file not found: {p}")
    out: list[str] = []
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{p}: cannot read: {e}") from None
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise UserError(f"{p}:{i}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
            raise UserError(f'{p}:{i}: expected an object with a non-empty string "prompt"')
        out.append(obj["prompt"])
        if num_prompts is not None and len(out) >= num_prompts:
            break
    if not out:
        raise UserError(f"{p}: no prompts")
    return out


def encode_prompts(target, prompts: Sequence[str],
                   run_cfg: RunConfig | None = None) -> tuple[list[list[int]], list[int]]:
    """(token ids of each prompt as one formatted user turn, stop token ids), in the chat format of
    the run `run_cfg` (`prompt_format`; None: the template without variables)."""
    fmt = prompt_format(target, run_cfg)
    ids = [fmt.prompt_ids([{"role": "user", "content": p}]) for p in prompts]
    return ids, fmt.stop_token_ids()


def pick_eval_prompts(heldout: Sequence[Any], num_prompts: int, target, max_prompt_tokens: int,
                      run_cfg: RunConfig | None = None) -> list[str]:
    """The first `num_prompts` held-out prompts whose formatted prompt (the run's format) fits
    `max_prompt_tokens` (the row length the drafter trained at): tau is measured where the drafter
    was trained, and a 4000-token ShareGPT paste does not dominate the eval's time."""
    out: list[str] = []
    for conv in heldout:  # read as far as needed: a prepared directory's file is not loaded whole
        text = _first_user_text(conv)
        if not text or not text.strip():
            continue
        ids, _ = encode_prompts(target, [text], run_cfg)
        if ids and len(ids[0]) <= max_prompt_tokens:
            out.append(text)
        if len(out) >= num_prompts:
            break
    return out


def eval_prompts(cfg, target, num_prompts: int | None = None) -> list[str]:
    """THE held-out eval prompts of a run (config `cfg`): the first `num_prompts` (default
    ``eval.num_prompts``) held-out prompts whose formatted form fits ``data.max_tokens``. Every
    evaluation of a run calls this: `dflash-train eval --prompts heldout`, `compare`, the demo and
    the in-training eval, so they all score the same prompts; the conversations are
    `data.heldout.heldout_conversations`. Raises data.DataError when they cannot be read."""
    n = cfg.eval.num_prompts if num_prompts is None else int(num_prompts)
    return pick_eval_prompts(heldout_conversations(cfg, target), n, target, cfg.data.max_tokens, cfg)
