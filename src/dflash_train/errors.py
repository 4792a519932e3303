"""The one base class for mistakes a user can fix: the CLI prints the message
(no traceback) and exits 2."""


class UserError(Exception):
    pass


def first_line(e: BaseException) -> str:
    """``Type: first line of the message``: a library's exception inside a one-line user error."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")
