"""The one base class for mistakes a user can fix: the CLI prints the message
(no traceback) and exits 2; a file the user named that is missing or does not parse, as one
such line (`parse_file`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable


class UserError(Exception):
    pass


def first_line(e: BaseException) -> str:
    """``Type: first line of the message``: a library's exception inside a one-line user error."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def parse_file(path: Path, parse: Callable[[str], Any], error: Callable[[str], Exception], missing: str,
               invalid: Callable[[Exception], str], parse_errors: tuple[type[Exception], ...]) -> Any:
    """`parse` of the text of `path`; raises `error(missing)` when `path` is not a file and
    `error(invalid(e))` when parsing raises one of `parse_errors` (no traceback chained)."""
    path = Path(path)
    if not path.is_file():
        raise error(missing)
    try:
        return parse(path.read_text())
    except parse_errors as e:
        raise error(invalid(e)) from None
