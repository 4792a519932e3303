"""Chat formatting and the assistant-only loss mask.

Two formats:

* ``template``: the tokenizer's own ``chat_template`` (Qwen, Llama, ...).
* ``gemma``: built in, for tokenizers without a template that know Gemma's
  turn tokens (the Gemma 3 GGUF ships none)::

      <bos><start_of_turn>user\\n{user}<end_of_turn>\\n<start_of_turn>model\\n{answer}<end_of_turn>\\n ...

  A system text is folded into the first user turn as ``{system}\\n\\n{user}``
  (what Gemma's own template does).

Loss mask: the tokens of each assistant answer's text plus the end-of-turn
token right after it (``<end_of_turn>``, ``<|im_end|>``, ``<|eot_id|>``, the
eos token, ...). The formatted text is cut into segments at the answer
boundaries (for ``template`` the answers are located in the rendered text in
order) and each segment is tokenised on its own (no special tokens added), so
decoding the masked span of an answer gives exactly ``answer + end-of-turn``.
A conversation whose answers cannot be located in the rendered template is
skipped (``template_mismatch``).
"""
from __future__ import annotations

from dataclasses import dataclass

from dflash_train.data.sources import DataError

_EOT_CANDIDATES = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "</s>")


class TemplateMismatch(Exception):
    pass


@dataclass
class Encoded:
    input_ids: list[int]
    loss_mask: list[bool]


class ChatFormat:
    """Formats conversations (lists of {"role", "content"}) for one tokenizer."""

    def __init__(self, tokenizer, family: str | None = None):
        self.tokenizer = tokenizer
        self.family = family
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

    def _template_segments(self, messages: list[dict[str, str]]) -> list[tuple[str, bool]]:
        # Render with a unique placeholder per message, then put the texts
        # back: answer boundaries are then exact whatever the template adds.
        marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
        rendered = self.tokenizer.apply_chat_template(
            [{"role": m["role"], "content": mk} for m, mk in zip(messages, marks)], tokenize=False)
        pieces: list[tuple[str, int | None]] = []
        rest = rendered
        for i, mk in enumerate(marks):
            at = rest.find(mk)
            if at < 0:
                if messages[i]["role"] == "assistant":
                    raise TemplateMismatch(f"answer {i} not rendered by the chat template")
                continue
            pieces.append((rest[:at], None))
            pieces.append((messages[i]["content"], i))
            rest = rest[at + len(mk):]
        pieces.append((rest, None))
        if any(mk in p for p, _ in pieces for mk in marks):
            raise TemplateMismatch("the chat template repeats a message")
        segs = [(text, idx is not None and messages[idx]["role"] == "assistant") for text, idx in pieces]
        # attach the end-of-turn token that follows each answer
        out: list[tuple[str, bool]] = []
        for text, sup in segs:
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
        """The formatted prompt (conversation so far + the generation prompt).
        `messages` should end with a user turn."""
        if self.kind == "gemma":
            return "".join(s for s, _ in self._gemma_segments(messages, True))
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

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
