"""The data package's one error: unusable training data, one line naming the file or source (a
ConfigError, so the CLI prints it and exits 2)."""
from __future__ import annotations

from dflash_train.config import ConfigError


class DataError(ConfigError):
    """Unusable training data (the message names the file/source)."""
