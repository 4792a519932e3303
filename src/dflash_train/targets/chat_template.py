"""The chat template a target's tokenizer renders with: its own, or the file `target.chat_template` names.

`target.chat_template` is a path to one of:

* a Jinja file (``.jinja``, ``.j2`` or any other text file): the template itself;
* a ``tokenizer_config.json`` (any ``.json``): its ``chat_template`` key, a string or the list form
  ``[{"name": ..., "template": ...}]`` (the entry named ``default``);
* a ``.gguf`` file: its ``tokenizer.chat_template`` metadata;
* a tokenizer directory: its ``chat_template.jinja``, else its ``tokenizer_config.json``.

The text must compile as transformers compiles a chat template (its own Jinja environment). A
missing file, an unreadable one, a JSON without the key or a template that does not compile raises
`TargetError` naming the file (one line, exit 2). The template replaces the tokenizer's own, so
the prepared-data cache (which hashes the tokenizer's template) follows it.

`prompt_format` is THE rendering of a conversation as a prompt for a run's evaluation and serving
(eval, serve-bench, the suites, the k sweep, compare, the demo): the template above with the run's
``data.chat_template_kwargs``, as regenerate's prompts and the training rows were rendered.
"""
from __future__ import annotations

import json
from pathlib import Path

from dflash_train.config import RunConfig
from dflash_train.data.template import ChatFormat
from dflash_train.errors import first_line
from dflash_train.targets.model import TargetError


def _from_json(path: Path) -> str:
    try:
        obj = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TargetError(f"{path}: not a readable JSON file ({first_line(e)})") from None
    tpl = obj.get("chat_template") if isinstance(obj, dict) else None
    if isinstance(tpl, list):  # the named-templates form: the default one is the chat template
        tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(tpl, str) or not tpl.strip():
        raise TargetError(f"{path}: no chat_template (a string, or a list with a 'default' entry) in this JSON file")
    return tpl


def _from_gguf(path: Path) -> str:
    import gguf

    try:
        field = gguf.GGUFReader(str(path)).fields.get("tokenizer.chat_template")
        tpl = bytes(field.parts[field.data[0]]).decode() if field is not None else None
    except Exception as e:  # noqa: BLE001 - a user's broken file: one line naming it
        raise TargetError(f"{path}: cannot read this GGUF file's metadata ({first_line(e)})") from None
    if not tpl:
        raise TargetError(f"{path}: this GGUF file carries no tokenizer.chat_template")
    return tpl


def _from_text(path: Path) -> str:
    try:
        tpl = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise TargetError(f"{path}: not a readable template file ({first_line(e)})") from None
    if not tpl.strip():
        raise TargetError(f"{path}: empty chat template file")
    return tpl


def read_chat_template(spec: str) -> str:
    """The template text `spec` (module docstring) names, checked to compile."""
    path = Path(spec).expanduser()
    if path.is_dir():
        for name in ("chat_template.jinja", "tokenizer_config.json"):
            if (path / name).is_file():
                path = path / name
                break
        else:
            raise TargetError(f"target.chat_template={spec}: the directory holds neither chat_template.jinja "
                              "nor tokenizer_config.json")
    if not path.is_file():
        raise TargetError(f"target.chat_template={spec}: file not found")
    suffix = path.suffix.lower()
    tpl = _from_json(path) if suffix == ".json" else _from_gguf(path) if suffix == ".gguf" else _from_text(path)
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(tpl)
    except TemplateError as e:
        line = f" line {e.lineno}" if getattr(e, "lineno", None) else ""
        raise TargetError(f"{path}: the chat template does not parse as Jinja ({first_line(e)}{line})") from None
    return tpl


def apply_chat_template_override(tokenizer, spec: str | None):
    """`tokenizer` with the template `spec` names in place of its own (unchanged when None)."""
    if spec:
        tokenizer.chat_template = read_chat_template(spec)
    return tokenizer


def prompt_format(target, run_cfg: RunConfig | None = None) -> ChatFormat:
    """The chat format a run's prompts are evaluated and served in. `target`: a loaded target or a
    tokenizer shim (anything with .tokenizer and .family); its template is already
    ``target.chat_template``'s when it was loaded from the run's target config (`load_target` /
    `load_tokenizer` put it on the tokenizer). The run's ``data.chat_template_kwargs`` go into every
    prompt, so a Qwen3 target trained with thinking off is asked with thinking off (its prompts end
    with the empty think block, as the training rows' prompts do). `run_cfg` None (a drafter whose
    run config is not found): the template without variables."""
    kwargs = run_cfg.data.chat_template_kwargs if run_cfg is not None else None
    return ChatFormat(target.tokenizer, target.family, template_kwargs=kwargs)
