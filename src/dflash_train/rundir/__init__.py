"""The run-directory protocol: the ONE definition of what is on disk in a run dir and
what "live" and "valid" mean. Standard library only (psutil when present), because
`deploy` ships this package's source to the job's host next to its agent
(deploy/command.py `shipped_script`, in the order of MODULES), which runs whatever
dflash_train version is installed there: `status`, `stop`, `deploy` and resume agree by
construction.

    layout.py       the names (run.json, config.yaml, checkpoints/, logs/, ...) and `RunDir`
    files.py        atomic writes, permissions, JSON, THE hashing of files (sha256_file, sha256_tree)
    process.py      a pid's start time; `liveness` of a run.json record
    record.py       run.json: `read_record`, `check_not_busy`, the trainer's `RunRecord`
    metrics.py      metrics.jsonl reading
    checkpoints.py  checkpoint layout, links, manifests, verification, resume selection
    stop.py         stop-and-confirm (`stop` and deploy's agent)

Every write is atomic (temp file + fsync + rename + directory fsync), so readers never
see a torn record. Liveness: on the recording host the pid exists, is not a zombie and
its start time equals the recorded create_time within START_TIME_TOLERANCE_S.
"""
from __future__ import annotations

# the modules in the order deploy ships them (each imports only those before it)
MODULES = ("layout", "files", "process", "record", "metrics", "checkpoints", "stop")

from .layout import *  # noqa: E402,F401,F403
from .files import *  # noqa: E402,F401,F403
from .files import _replace  # noqa: E402,F401
from .process import *  # noqa: E402,F401,F403
from .record import *  # noqa: E402,F401,F403
from .metrics import *  # noqa: E402,F401,F403
from .checkpoints import *  # noqa: E402,F401,F403
from .stop import *  # noqa: E402,F401,F403
