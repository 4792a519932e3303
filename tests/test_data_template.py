"""Chat formats and the assistant-only loss mask (round trip per template)."""
from __future__ import annotations

import copy

import pytest
from transformers import AutoTokenizer

from dflash_train.data import ChatFormat, DataError, TemplateMismatch
from dflash_train.data.sources import normalize_item
from conftest import tiny_conversations

EOT = {"qwen3": "<|im_end|>", "llama": "<|eot_id|>", "gemma3": "<end_of_turn>"}


@pytest.fixture(scope="module")
def toks(tiny_target_factory):
    return {f: AutoTokenizer.from_pretrained(str(tiny_target_factory(f))) for f in EOT}


def _runs(ids, mask):
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def _convs():
    out = [normalize_item(c)[0] for c in tiny_conversations(12)]
    out.append(normalize_item({"conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": "assistant"},
        {"from": "gpt", "value": "user model assistant"}, {"from": "human", "value": "Héllo 你好 🙂"},
        {"from": "gpt", "value": "Ünïcödé → 好的 🙂\n  indented\tline"}]})[0])
    return out


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3"])
def test_loss_mask_round_trip(toks, family):
    tok = toks[family]
    fmt = ChatFormat(tok, family)
    assert fmt.kind == ("gemma" if family == "gemma3" else "template")
    for conv in _convs():
        enc = fmt.encode(conv.messages)
        assert len(enc.input_ids) == len(enc.loss_mask)
        answers = [m["content"] for m in conv.messages if m["role"] == "assistant"]
        spans = [tok.decode(r) for r in _runs(enc.input_ids, enc.loss_mask)]
        assert spans == [a + EOT[family] for a in answers]
        # the whole sequence decodes to the formatted text
        full = tok.decode(enc.input_ids)
        if family != "gemma3":
            assert full == tok.apply_chat_template(conv.messages, tokenize=False)
        else:
            assert full == "".join(s for s, _ in fmt.segments(conv.messages))


def test_gemma_builtin_format(toks):
    fmt = ChatFormat(toks["gemma3"], "gemma3")
    msgs = [{"role": "system", "content": "Sys."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"},
            {"role": "assistant", "content": "Sure"}]
    text = "".join(s for s, _ in fmt.segments(msgs))
    assert text == ("<bos><start_of_turn>user\nSys.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
                    "<start_of_turn>user\nAgain<end_of_turn>\n<start_of_turn>model\nSure<end_of_turn>\n")
    assert fmt.prompt_text(msgs[:2]) == "<bos><start_of_turn>user\nSys.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    tok = toks["gemma3"]
    assert fmt.stop_token_ids()[0] == tok.convert_tokens_to_ids("<end_of_turn>")


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3"])
def test_prompt_ids_prefix_of_training_ids(toks, family):
    """What eval/regenerate feed the target is exactly the training prefix before the answer."""
    fmt = ChatFormat(toks[family], family)
    for conv in _convs():
        first = conv.first_exchange()
        prompt = [m for m in first.messages if m["role"] != "assistant"]
        p = fmt.prompt_ids(prompt)
        enc = fmt.encode(first.messages)
        assert enc.input_ids[:len(p)] == p
        assert not any(enc.loss_mask[:len(p)]) and enc.loss_mask[len(p)]


def test_no_template_no_builtin_is_an_error(toks):
    tok = copy.deepcopy(toks["qwen3"])
    tok.chat_template = None
    with pytest.raises(DataError, match="no chat_template"):
        ChatFormat(tok, "qwen3")


def test_template_that_drops_answers_is_a_mismatch(toks):
    tok = copy.deepcopy(toks["qwen3"])
    tok.chat_template = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
    fmt = ChatFormat(tok, "qwen3")
    with pytest.raises(TemplateMismatch):
        fmt.encode([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
