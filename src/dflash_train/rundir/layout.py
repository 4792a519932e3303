"""THE names of a run directory, and `RunDir`: the paths of one run dir. No other module
of src spells a run-dir name. Standard library only.

    RUN_DIR/run.json          live record of the trainer (record.py)
    RUN_DIR/.run.lock         flock held by the trainer for its lifetime
    RUN_DIR/config.yaml       resolved config (read by config.read_run_config)
    RUN_DIR/metrics.jsonl     one JSON object per logged step (metrics.py)
    RUN_DIR/checkpoints/step-NNNNNNNN/{model.safetensors, state.pt, manifest.json}
    RUN_DIR/checkpoints/latest, best   relative symlinks, replaced atomically
    RUN_DIR/logs/             train.log (train.rankN.log under torchrun), tensorboard/, deploy-ID.log
    RUN_DIR/releases/         code releases kept by `deploy`
    RUN_DIR/report.md         the run's report
"""
from __future__ import annotations

import re
from pathlib import Path

RUN_FILE = "run.json"
LOCK_FILE = ".run.lock"
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
CHECKPOINTS_DIR = "checkpoints"
LOGS_DIR = "logs"
TRAIN_LOG = "train.log"
TENSORBOARD_DIR = "tensorboard"
RELEASES_DIR = "releases"
REPORT_FILE = "report.md"
FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
REQUIRED_FILES = (MODEL_FILE, STATE_FILE)
LATEST = "latest"
BEST = "best"
TMP_PREFIX = ".tmp-"

_STEP_RE = re.compile(r"^step-(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step-{int(step):08d}"


def parse_step(name: str) -> int | None:
    """Step number of a ``step-NNNNNNNN`` directory name, else None."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


class _Inside:
    """A read-only `RunDir` attribute: the path of one name inside the run dir (or inside
    another such attribute's path, `under`)."""

    def __init__(self, name: str, under: str = "path") -> None:
        self.name, self.under = name, under

    def __set_name__(self, owner, attr: str) -> None:
        self.attr = attr

    def __get__(self, rd, owner=None):
        return self if rd is None else getattr(rd, self.under) / self.name

    def __set__(self, rd, value) -> None:
        raise AttributeError(f"RunDir.{self.attr} is read-only")


class RunDir:
    """The paths of one run directory: ``RunDir(path).config``, ``.checkpoint(120)``, ..."""

    record = _Inside(RUN_FILE)
    lock = _Inside(LOCK_FILE)
    config = _Inside(CONFIG_FILE)
    metrics = _Inside(METRICS_FILE)
    checkpoints = _Inside(CHECKPOINTS_DIR)
    logs = _Inside(LOGS_DIR)
    tensorboard = _Inside(TENSORBOARD_DIR, under="logs")
    releases = _Inside(RELEASES_DIR)
    report = _Inside(REPORT_FILE)

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def train_log(self, rank: int = 0, leader: bool = True) -> Path:
        return self.logs / (TRAIN_LOG if leader else f"train.rank{rank}.log")

    def deploy_log(self, release_id: str) -> Path:
        return self.logs / f"deploy-{release_id}.log"

    def release(self, release_id: str) -> Path:
        return self.releases / release_id

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / step_dir_name(step)

    def writes(self) -> tuple[Path, ...]:
        """The directories the trainer writes in: the run dir, checkpoints/ and logs/."""
        return self.path, self.checkpoints, self.logs

    def exists(self) -> bool:
        """A directory holding run.json, config.yaml or checkpoints/ (what `dflash-train train`
        creates). `export` never writes over one."""
        p = self.path
        return p.is_dir() and (self.record.is_file() or self.config.is_file() or self.checkpoints.is_dir())


def is_run_dir(path: Path) -> bool:
    """A directory holding run.json, config.yaml or checkpoints/ (what `dflash-train train`
    creates). `export` never writes over one."""
    return RunDir(path).exists()


def run_dir_of_checkpoint(ckpt: Path) -> Path | None:
    """RUN_DIR for RUN_DIR/checkpoints/step-N (None if the layout differs)."""
    ckpt = Path(ckpt).resolve()
    return ckpt.parent.parent if ckpt.parent.name == CHECKPOINTS_DIR else None
