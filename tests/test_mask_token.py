"""The mask token of a tokenizer that has none (SmolLM2: issue 25), and model.mask_token_id honoured:
an unused added special token is chosen automatically, the trainer uses the configured id over
the rule, and an id that occurs in the training data is refused naming the key (exit 2)."""
from __future__ import annotations

from dflash_train.targets import choose_mask_token_id
from trainrun import run_train, tiny_overrides


class _Tok:
    """A tokenizer with no mask, no reserved token, no spare embedding row: StarCoder-era specials."""

    mask_token_id = None
    bos_token_id, eos_token_id, pad_token_id, unk_token_id = 1, 2, 0, None
    chat_template = "{{ '<|im_start|>' }}{{ message }}{{ '<|im_end|>' }}"

    def __init__(self):
        names = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<file_sep>", "<empty_output>"]
        self.vocab = {n: i for i, n in enumerate(names)} | {"a": 6, "b": 7}
        self.added_tokens_decoder = {i: _Added(n) for i, n in enumerate(names)}

    def get_vocab(self):
        return dict(self.vocab)

    def __len__(self):
        return len(self.vocab)


class _Added:
    special = True

    def __init__(self, content: str):
        self.content = content

    def __str__(self) -> str:
        return self.content


def test_unused_special_token_is_the_mask():
    tok = _Tok()
    # bos/eos/pad and the template's tokens are in use; the highest spare special token wins
    assert choose_mask_token_id(tok, len(tok)) == 5
    tok.chat_template += "<empty_output>"
    assert choose_mask_token_id(tok, len(tok)) == 4


def test_configured_mask_token_is_used_and_checked_against_the_data(train_setup, tmp_path):
    target_dir, jsonl, _ = train_setup
    from transformers import AutoTokenizer

    common = AutoTokenizer.from_pretrained(str(target_dir))(" the", add_special_tokens=False).input_ids[0]
    run = tmp_path / "clash"
    r = run_train(run, tiny_overrides(target_dir, jsonl, **{"model.mask_token_id": common, "train.max_steps": 2}))
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"model.mask_token_id={common} occurs" in r.stderr and "Traceback" not in r.stderr
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").glob("step-*"))

    unused = AutoTokenizer.from_pretrained(str(target_dir)).convert_tokens_to_ids("<|fim_pad|>")
    run = tmp_path / "ok"
    r = run_train(run, tiny_overrides(target_dir, jsonl, **{"model.mask_token_id": unused, "train.max_steps": 2}))
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"mask token {unused}" in (run / "logs" / "train.log").read_text()
