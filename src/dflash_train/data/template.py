"""Chat formatting and the assistant-only loss mask.

Two formats:

* ``template``: the tokenizer's own ``chat_template`` (Qwen, Llama, ...), or the
  one ``target.chat_template`` names (targets/chat_template.py puts it on the tokenizer).
* ``gemma``: built in, for tokenizers without a template that know Gemma's
  turn tokens (the Gemma 3 GGUF ships none)::

      <bos><start_of_turn>user\\n{user}<end_of_turn>\\n<start_of_turn>model\\n{answer}<end_of_turn>\\n ...

  A system text is folded into the first user turn as ``{system}\\n\\n{user}``
  (what Gemma's own template does).

Template variables: ``template_kwargs`` (``data.chat_template_kwargs``, e.g.
``{"enable_thinking": False}``) go into EVERY rendering, the prompts `prompt_text` gives
regenerate and evaluation and the training rows `encode` builds. A template that reads the clock
(``strftime_now``: gpt-oss's "Current date", Llama 3.2's "Today Date" unless ``date_string`` is
given) renders the day it runs: set ``date_string`` where the template has it, so prompts rendered
for regenerate one day and rows prepared the next are the same text (transformers passes template
variables as plain data, so the clock itself cannot be set from here; gpt-oss has no such variable).

Rows and prompts are one rendering: the template is rendered with a unique placeholder per
message and the texts are put back, so a row's text up to an answer is exactly the prompt
`prompt_text` gives for the messages before it (for a conversation of one exchange, what
regenerate asked the target), whatever the template does to message contents.

Reasoning blocks (``<think>...</think>``, Qwen3 and its kind). What the target sees at serving
time with the same variables decides; each answer holds exactly one reasoning block or none,
never an empty one beside it:

* Each assistant turn opens with the template's generation prompt for that turn (rendered with
  ``template_kwargs``) where the template's own rendering of the turn differs from it only by an
  empty reasoning block: Qwen3 renders a last assistant turn as ``<think>\\n\\n</think>\\n\\n``
  + answer whatever its reasoning, and an earlier one without any block.
* Thinking off (the generation prompt ends with an empty block, Qwen3 with
  ``enable_thinking: false``): the empty block is the PROMPT, unsupervised, as the target sees it
  when serving; an answer that holds a reasoning block anyway loses it (the target, served so,
  writes none), only the text after its ``</think>`` is kept.
* Thinking on (the generation prompt ends before any block): the answer as the target wrote it,
  its own ``<think>...</think>`` once, supervised with the rest; an answer without one gets no
  empty block.
* Other differences between a rendered turn and the generation prompt are the template's and are
  kept, unsupervised (gpt-oss renders ``<|channel|>final<|message|>`` after its generation prompt
  ``<|start|>assistant``).

Earlier turns of a multi-turn row are rendered as the template renders history, with the
opening above; a template that strips earlier turns' reasoning does not here (the placeholder
hides it): every answer keeps what the target wrote.

Loss mask: the tokens of each assistant answer's text plus the end-of-turn token
right after it (``<end_of_turn>``, ``<|im_end|>``, ``<|eot_id|>``, ``<|return|>``, the eos
token, ...), nothing of the prompt. The formatted text is cut into segments at the
answer boundaries and each segment is tokenised on its own (no special tokens added),
so decoding the masked span of an answer gives exactly ``answer + end-of-turn``. A
conversation whose answers cannot be located in the rendered template, or that the
template refuses (``raise_exception``: Gemma's alternating roles), is skipped
(``template_mismatch``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from dflash_train.data.sources import DataError

_EOT_CANDIDATES = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<|return|>", "<|endoftext|>", "</s>")

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_EMPTY_BLOCK = re.compile(r"\s*<think>\s*</think>\s*")


def _is_empty_block(text: str) -> bool:
    return bool(_EMPTY_BLOCK.fullmatch(text))


def _ends_with_empty_block(text: str) -> bool:
    i = text.rfind(_THINK_OPEN)
    return i >= 0 and _is_empty_block(text[i:])


def _without_reasoning(answer: str) -> str:
    """The answer after its leading reasoning block (unchanged when it has none)."""
    if answer.lstrip().startswith(_THINK_OPEN) and _THINK_CLOSE in answer:
        return answer.split(_THINK_CLOSE, 1)[1].lstrip("\n")
    return answer


class TemplateMismatch(Exception):
    pass


@dataclass
class Encoded:
    input_ids: list[int]
    loss_mask: list[bool]


class ChatFormat:
    """Formats conversations (lists of {"role", "content"}) for one tokenizer."""

    def __init__(self, tokenizer, family: str | None = None, template_kwargs: dict[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.family = family
        self.template_kwargs = dict(template_kwargs or {})
        vocab = tokenizer.get_vocab()
        if getattr(tokenizer, "chat_template", None):
            self.kind = "template"
        elif family == "gemma3" or ("<start_of_turn>" in vocab and "<end_of_turn>" in vocab):
            self.kind = "gemma"
        else:
            raise DataError(
                f"the tokenizer has no chat_template and family {family!r} has no built-in chat format "
                "(built in: gemma3); use a tokenizer with a chat template"
            )
        eos = getattr(tokenizer, "eos_token", None)
        cands = list(_EOT_CANDIDATES) + ([eos] if eos else [])
        self.eot_strings = list(dict.fromkeys(c for c in cands if c in vocab))
        self.bos = getattr(tokenizer, "bos_token", None) or "<bos>"

    # ------------------------------------------------------------------ segments

    def _gemma_segments(self, messages: list[dict[str, str]], generation_prompt: bool) -> list[tuple[str, bool]]:
        segs: list[tuple[str, bool]] = [(self.bos, False)]
        system = None
        for m in messages:
            role, text = m["role"], m["content"]
            if role == "system":
                system = text
            elif role == "user":
                if system is not None:
                    text, system = f"{system}\n\n{text}", None
                segs.append((f"<start_of_turn>user\n{text}<end_of_turn>\n", False))
            else:
                segs.append(("<start_of_turn>model\n", False))
                segs.append((f"{text}<end_of_turn>", True))
                segs.append(("\n", False))
        if generation_prompt:
            segs.append(("<start_of_turn>model\n", False))
        return segs

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                      **self.template_kwargs)
        except TemplateError as e:  # the template's raise_exception: it refuses this conversation
            raise TemplateMismatch(f"the chat template refuses the conversation: {e}") from None

    def _placeholders(self, messages: list[dict[str, str]]) -> tuple[list[str], list[dict[str, str]]]:
        # a unique placeholder per message: answer boundaries are then exact whatever the template adds
        marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
        return marks, [{"role": m["role"], "content": mk} for m, mk in zip(messages, marks)]

    def _opening(self, held: list[dict[str, str]], rendered: str, at: int) -> tuple[int, str, bool]:
        """How the assistant turn whose placeholder starts at `rendered[at]` opens (module
        docstring): (where its opening starts, the opening text, whether that opening closes
        the reasoning: thinking off)."""
        base = self._render(held, False)
        gen = self._render(held, True)
        if not (held and rendered.startswith(base) and gen.startswith(base) and len(base) <= at):
            return at, "", False
        s, g = rendered[len(base):at], gen[len(base):]
        if s != g and not ((s.startswith(g) and _is_empty_block(s[len(g):]))
                           or (g.startswith(s) and _is_empty_block(g[len(s):]))):
            return at, "", _ends_with_empty_block(s)  # the template's own difference (gpt-oss): kept
        return len(base), g, _ends_with_empty_block(g)

    def _template_segments(self, messages: list[dict[str, str]]) -> list[tuple[str, bool]]:
        marks, held = self._placeholders(messages)
        rendered = self._render(held, False)
        pieces: list[tuple[str, bool]] = []
        pos = 0
        for i, mk in enumerate(marks):
            at = rendered.find(mk, pos)
            if at < 0:
                if messages[i]["role"] == "assistant":
                    raise TemplateMismatch(f"answer {i} not rendered by the chat template")
                continue
            text, sup = messages[i]["content"], messages[i]["role"] == "assistant"
            if sup:
                cut, opening, closed = self._opening(held[:i], rendered, at)
                if cut < pos:
                    raise TemplateMismatch(f"answer {i}: the generation prompt does not follow the rendered history")
                pieces.append((rendered[pos:cut] + opening, False))
                if closed:
                    text = _without_reasoning(text)
            else:
                pieces.append((rendered[pos:at], False))
            pieces.append((text, sup))
            pos = at + len(mk)
        pieces.append((rendered[pos:], False))
        if any(mk in p for p, _ in pieces for mk in marks):
            raise TemplateMismatch("the chat template repeats a message")
        # attach the end-of-turn token that follows each answer
        out: list[tuple[str, bool]] = []
        for text, sup in pieces:
            if out and out[-1][1] and not sup:
                for eot in self.eot_strings:
                    if text.startswith(eot):
                        out[-1] = (out[-1][0] + eot, True)
                        text = text[len(eot):]
                        break
            out.append((text, sup))
        return [(t, sup) for t, sup in out if t]

    def segments(self, messages: list[dict[str, str]]) -> list[tuple[str, bool]]:
        """The formatted conversation as (text, supervised) pieces; adjacent
        unsupervised pieces are merged (tokenised together)."""
        raw = self._gemma_segments(messages, False) if self.kind == "gemma" else self._template_segments(messages)
        out: list[tuple[str, bool]] = []
        for text, sup in raw:
            if out and not sup and not out[-1][1]:
                out[-1] = (out[-1][0] + text, False)
            else:
                out.append((text, sup))
        return out

    # ------------------------------------------------------------------ encode

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def encode(self, messages: list[dict[str, str]]) -> Encoded:
        """Token ids and the assistant-only loss mask of a whole conversation.
        Raises TemplateMismatch when an answer cannot be located."""
        segs = self.segments(messages)
        ids: list[int] = []
        mask: list[bool] = []
        for (_, sup), toks in zip(segs, self._tokenize([s for s, _ in segs])):
            ids.extend(toks)
            mask.extend([sup] * len(toks))
        return Encoded(ids, mask)

    def prompt_text(self, messages: list[dict[str, str]]) -> str:
        """The formatted prompt (conversation so far + the generation prompt, with
        ``template_kwargs``): a row's text up to the answer that follows `messages`.
        `messages` should end with a user turn."""
        if self.kind == "gemma":
            return "".join(s for s, _ in self._gemma_segments(messages, True))
        marks, held = self._placeholders(messages)
        text = self._render(held, True)
        for m, mk in zip(messages, marks):
            text = text.replace(mk, m["content"], 1)
        return text

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return self._tokenize([self.prompt_text(messages)])[0]

    def stop_token_ids(self) -> list[int]:
        """Token ids that end an assistant turn (for generation)."""
        ids = []
        for s in self.eot_strings + [getattr(self.tokenizer, "eos_token", None) or ""]:
            if s:
                i = self.tokenizer.convert_tokens_to_ids(s)
                if isinstance(i, int) and i not in ids and i != getattr(self.tokenizer, "unk_token_id", None):
                    ids.append(i)
        return ids
