"""The one drafter source: a run dir, checkpoint or export -> its run config (found by ONE rule,
`checkpoint.source.run_config_of`: the run dir, else the export's parent, else the run of the
checkpoint it was exported from), its target, its held-out prompts and the drafter built from its
weights. What `eval`, `serve-bench`, the suites, the demo and compare start from; reading the
files is checkpoint/source.py's (no reader imports the export writer)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_train.checkpoint.source import DrafterSource, resolve_drafter_source, run_config_of
from dflash_train.config import RunConfig, TargetConfig
from dflash_train.data.sources import DataError
from dflash_train.errors import UserError
from dflash_train.eval.prompts import eval_prompts
from dflash_train.model.dflash2 import build_drafter


def load_drafter(src: DrafterSource, device: Any = None, seed: int | None = 0, untrained: bool = False):
    """The drafter of `src` (its weights unless `untrained`: random init of the same shape, `seed`),
    on `device`, in eval mode; weights that do not fit its config are one line."""
    model = build_drafter(src.config, seed=seed)
    if not untrained:
        missing, unexpected = model.load_state_dict(src.state_dict, strict=False)
        if missing or unexpected:
            raise UserError(f"{src.path}: weights do not fit the drafter config: missing {missing[:4]}, "
                            f"unexpected {unexpected[:4]}")
    if device is not None:
        model.to(device)
    return model.eval()


def heldout_from_run(run_cfg: RunConfig | None, target, num_prompts: int) -> list[str]:
    """`eval_prompts` of the run: the prompts the in-training eval, the demo and compare score."""
    if run_cfg is None:
        raise UserError("--prompts heldout needs the run's config.yaml (give --drafter RUN_DIR or a checkpoint "
                        "inside one), or pass --prompts FILE.jsonl")
    d = run_cfg.data
    try:
        prompts = eval_prompts(run_cfg, target, num_prompts)
    except DataError as e:
        raise UserError(f"cannot read held-out conversations: {e}; pass --prompts FILE.jsonl") from None
    if not prompts:
        raise UserError(f"the run's data ({d.source}, heldout_fraction={d.heldout_fraction}) has no held-out "
                        f"conversation whose prompt fits data.max_tokens={d.max_tokens}; pass --prompts FILE.jsonl")
    return prompts


@dataclass
class OpenedDrafter:
    """A drafter found on disk with its run config (None: none found) and its target's config."""

    src: DrafterSource
    run_cfg: RunConfig | None
    target: TargetConfig  # the run's own target config when it names the same path

    @property
    def target_path(self) -> str:
        return self.target.path

    def heldout(self, target, num_prompts: int) -> list[str]:
        """The run's held-out prompts, encoded by `target`'s tokenizer (a loaded target or a tokenizer shim)."""
        return heldout_from_run(self.run_cfg, target, num_prompts)

    def check_fits(self, tgt) -> None:
        """One line when the drafter was made for another vocabulary or another target's shape."""
        c = self.src.config
        if c.vocab_size and c.vocab_size != tgt.vocab_size:
            raise UserError(f"drafter {self.src.path} was made for a vocabulary of {c.vocab_size}, "
                            f"target {self.target_path} has {tgt.vocab_size}")
        if c.hidden_size != tgt.hidden_size or max(c.target_layer_ids) >= tgt.num_layers:
            raise UserError(f"drafter {self.src.path} (hidden {c.hidden_size}, target layers "
                            f"{c.target_layer_ids}) does not fit target {self.target_path} "
                            f"(hidden {tgt.hidden_size}, {tgt.num_layers} layers)")

    def drafter(self, device: Any = None, seed: int | None = 0, untrained: bool = False):
        return load_drafter(self.src, device, seed, untrained)


def open_drafter(path: str | Path, target: str | None = None, prefer_best: bool = False) -> OpenedDrafter:
    """`path` (run dir, checkpoint or export) with its run config and its target: `target` if given,
    else the one the drafter records, else the run's. No target anywhere: one line."""
    src = resolve_drafter_source(path, prefer_best=prefer_best)
    run_cfg = run_config_of(src)
    target_path = target or src.target_path or (run_cfg.target.path if run_cfg else None)
    if not target_path:
        raise UserError(f"{src.path}: no target recorded; pass --target")
    if run_cfg is not None and run_cfg.target.path == target_path:
        tcfg = run_cfg.target
    else:
        tcfg = TargetConfig(path=target_path)
    return OpenedDrafter(src, run_cfg, tcfg)
