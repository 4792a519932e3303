"""The one base class for mistakes a user can fix: the CLI prints the message
(no traceback) and exits 2."""


class UserError(Exception):
    pass
