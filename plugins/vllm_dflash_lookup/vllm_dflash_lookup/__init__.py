"""vLLM plugin: DFlash drafts with prompt lookup. Loaded by vLLM's `vllm.general_plugins` entry
point in every vLLM process; acts only where DFLASH_LOOKUP asks it to:

* ``off`` (or unset): nothing is patched, vLLM runs exactly as without the plugin;
* ``gate``: per request and step, lookup's continuation replaces the drafter's block when its match
  is at least DFLASH_LOOKUP_MIN_MATCH tokens (default 3); past a shorter continuation the drafter's
  own tokens stay;
* ``seed``: the block's mask slots get lookup's proposal before the drafter's forward (a drafter
  trained with ``model.block_seeds: prompt_lookup`` keeps, corrects or fills them);
* ``seed+gate``: both.

Verification stays vLLM's, so every mode is lossless. Pinned: on a vLLM version it was not tested
with, it logs one line naming both versions and patches nothing.

DFLASH_LOOKUP_RECORD=FILE: every process that installs the patches appends one JSON line to FILE
(pid, modes, min match), so a caller can check that the plugin acted in vLLM's engine process, not
only that it is installed (serve-bench's worker does).
"""
from __future__ import annotations

import json
import logging
import os

__version__ = "0.1.0"
TESTED_VLLM = ("0.32.0",)
MODES = {"off": frozenset(), "gate": frozenset({"gate"}), "seed": frozenset({"seed"}),
         "seed+gate": frozenset({"seed", "gate"}), "gate+seed": frozenset({"seed", "gate"})}
DEFAULT_MIN_MATCH = 3

logger = logging.getLogger("vllm.dflash_lookup")
_registered = False


def settings(env=os.environ) -> tuple[frozenset[str], int]:
    """(modes, gate threshold) from the environment; a value it does not know is an error (a typo
    must not silently serve DFlash alone)."""
    raw = env.get("DFLASH_LOOKUP", "off").strip().lower() or "off"
    if raw not in MODES:
        raise ValueError(f"DFLASH_LOOKUP={raw!r}: expected one of {', '.join(MODES)}")
    min_match = int(env.get("DFLASH_LOOKUP_MIN_MATCH", DEFAULT_MIN_MATCH))
    if min_match < 1:
        raise ValueError(f"DFLASH_LOOKUP_MIN_MATCH={min_match}: must be at least 1")
    return MODES[raw], min_match


def supported(version: str) -> bool:
    """The release part only: vLLM's CPU and CUDA builds of one release carry local tags (+cpu, +cu130)."""
    return version.split("+", 1)[0] in TESTED_VLLM


def register() -> bool:
    """The entry point. True when the patches are in place in this process."""
    global _registered
    modes, min_match = settings()
    if not modes:
        return False
    import vllm

    if not supported(vllm.__version__):
        logger.warning("dflash-lookup %s: vLLM %s is not a version it was tested with (%s); serving without it",
                       __version__, vllm.__version__, ", ".join(TESTED_VLLM))
        return False
    if not _registered:  # vLLM may call general plugins more than once per process
        from . import runner

        runner.install(modes, min_match)
        _registered = True
        logger.info("dflash-lookup %s on: %s, min match %d", __version__, "+".join(sorted(modes)), min_match)
        record = os.environ.get("DFLASH_LOOKUP_RECORD")
        if record:
            with open(record, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "modes": sorted(modes), "min_match": min_match}) + "\n")
    return True
