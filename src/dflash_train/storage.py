"""Storage faults as one line: a write the file system refuses (a full disk, a read-only or
vanished directory, a failing device) becomes a `StorageError`, a UserError whose message
names the cause and the path, e.g. ``no space left on device while writing
RUN/checkpoints/step-00000500/model.safetensors``; the CLI prints it as one line and exits 2.

Libraries hide the OSError in two places, both recognised here (`os_error_in`):
safetensors' Rust writer raises ``SafetensorError: ... (os error 28)``, and torch.save into a
file object raises ``RuntimeError: [enforce fail at inline_container.cc:...] unexpected pos``
while the OSError of the file's write() is its ``__context__``.

What the code around a write keeps valid when it fails is decided there (temp file + rename:
rundir/files.py; checkpoints: checkpoint/manager.py; a training run: train/faults.py)."""
from __future__ import annotations

import errno
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from dflash_train.errors import UserError

# Rust's std::io::Error prints "... (os error N)"; safetensors puts that into its message
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


class StorageError(UserError):
    """A write the file system refused. `path`: what was being written; `errno`: the cause."""

    def __init__(self, message: str, path: Path | str | None = None, errno_: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.errno = errno_


def cause_of(e: OSError) -> str:
    """The cause in the words of the C library, lower case: "no space left on device",
    "read-only file system", "permission denied", "disk quota exceeded", ..."""
    if e.errno == errno.ENOENT:  # on a write: the directory went away under the process
        return "no such file or directory (was the directory removed?)"
    if e.errno:
        return os.strerror(e.errno).lower()
    return str(e).lower() or type(e).__name__


def os_error_in(e: BaseException) -> OSError | None:
    """The OSError behind `e`: `e` itself, the write() error torch.save's zip writer turned into
    a RuntimeError, or the errno in a Rust library's "(os error N)"; None for anything else."""
    if isinstance(e, OSError):
        return e
    if isinstance(e, RuntimeError) and isinstance(e.__context__, OSError):
        return e.__context__
    m = _RUST_OS_ERROR.search(str(e))
    if m:
        n = int(m.group(1))
        return OSError(n, os.strerror(n))
    return None


def storage_error(e: OSError, path: Path | str, doing: str = "writing", error: type[StorageError] = StorageError,
                  hint: str | None = None) -> StorageError:
    """`error` ("CAUSE while DOING PATH[; HINT]") for the OSError `e`."""
    msg = f"{cause_of(e)} while {doing} {path}" + (f"; {hint}" if hint else "")
    return error(msg, path, e.errno)


@contextmanager
def writing(path: Path | str, doing: str = "writing", error: type[StorageError] = StorageError,
            hint: str | None = None) -> Iterator[None]:
    """Raise a storage failure inside the block as `error` naming `path` (the file the user knows,
    e.g. the checkpoint's final name rather than its temp dir), `hint` appended; other exceptions
    pass unchanged."""
    try:
        yield
    except StorageError:
        raise
    except Exception as e:  # noqa: BLE001 - only storage failures are translated, the rest re-raised
        err = os_error_in(e)
        if err is None:
            raise
        raise storage_error(err, path, doing, error, hint) from None
