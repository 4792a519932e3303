"""`dflash-train precompute`: the target's captured features written to disk, in the layout
pipeline/precomputed.py defines (and reads for `train` with `data.source=precomputed:DIR`).

Rows are captured one at a time (as the online pipeline does with
`pipeline.cache_features`), so in float32 the offline features equal the
online ones bit for bit. The index is written last: a directory without it
is incomplete, and the same command finishes it: a shard counts as done only when
its record matches this command's settings and rows and the file's sha256 (a shard
is written to a temp name and renamed, its record after it), so a run killed at any
point redoes at most the shards it was writing. Other settings' records are refused.

Under torchrun every rank loads the target and captures shards s with s % world == rank
(the single-process shard boundaries, so the files are the same bytes); ranks exchange
their outcome after each round of shards, so a rank that fails stops the others at the
next round instead of leaving them waiting, and rank 0 writes index.json last. A rank that
dies is torn down with the others by torchrun's agent on its node; ranks on other nodes wait
at most the process group's timeout (train/distributed.py).
"""
from __future__ import annotations

import hashlib
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from dflash_train.config import ConfigError
from dflash_train.data import load_prepared
from dflash_train.errors import UserError, first_line
from dflash_train.model.drafter import DrafterConfig
from dflash_train.model.objectives import Objective, capture_layer_ids
from dflash_train.pipeline.precomputed import FORMAT, PrecomputeError
from dflash_train.rundir import _replace, atomic_write_json, fsync_path, read_json, sha256_file
from dflash_train.storage import writing
from dflash_train.targets import load_target
from dflash_train.utils import save_safetensors

log = logging.getLogger("dflash_train")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
AGAIN = "index.json is written last, so the same command starts these features again once that is fixed"




class RankFailed(Exception):
    """Another rank's step failed: this rank stops too (its own message was printed there)."""

    def __init__(self, rank: int, message: str, user_error: bool) -> None:
        super().__init__(f"rank {rank} stopped the capture: {message}")
        self.user_error = user_error


class Ranks:
    """This process among the capturing ranks (`ctx`: train.distributed.DistContext, None alone).
    `step` is the one collective: every rank's outcome of a step, so a rank that raised stops
    the others at the next step rather than leaving them in a collective forever."""

    def __init__(self, ctx=None) -> None:
        self.rank = ctx.rank if ctx is not None else 0
        self.world = ctx.world_size if ctx is not None else 1

    def step(self, fn: Callable[[], Any]) -> list:
        if self.world == 1:
            return [fn()]
        try:
            mine, err = ("ok", fn()), None
        except Exception as e:  # noqa: BLE001 - sent to the other ranks, then raised here unchanged
            user = isinstance(e, (UserError, ConfigError))  # what the CLI prints as one line
            mine, err = ("error", str(e) if user else first_line(e), user), e
        outcomes: list = [None] * self.world
        dist.all_gather_object(outcomes, mine)
        failed = [(r, o) for r, o in enumerate(outcomes) if o[0] == "error"]
        if not failed:
            return [o[1] for o in outcomes]
        # a message is printed once: by the first rank that has it (a bad path fails every rank)
        if err is not None and not any(o[1] == mine[1] for r, o in failed if r < self.rank):
            raise err
        raise RankFailed(failed[0][0], failed[0][1][1], failed[0][1][2])


def capture_roles(cfg):
    """`cfg` for DistContext.from_env: every precompute rank has the one role, capturing (the
    training roles' pipeline.* checks must not refuse it), on target.device."""
    return cfg.model_copy(update={
        "pipeline": cfg.pipeline.model_copy(update={"target_ranks": 1, "target_tp_size": 1}),
        "train": cfg.train.model_copy(update={"device": cfg.target.device})})


def _rows_sha256(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().numpy())
    return h.hexdigest()


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _differences(old: dict, new: dict) -> str:
    """'dtype 'float32' there, 'bfloat16' now, target.path ...': what a leftover record has otherwise."""
    old, new = _flat(old), _flat(new)
    keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    return ", ".join(f"{k} {old.get(k)!r} there, {new.get(k)!r} now" for k in keys)


class _Shards:
    """The shards of one precompute directory: which are done, and capturing the others."""

    def __init__(self, out: Path, settings: dict, data, target, layer_ids: list[int], dtype: str) -> None:
        self.out, self.settings, self.data, self.target = out, settings, data, target
        self.layer_ids, self.dtype = layer_ids, DTYPES[dtype]
        self.per_shard, self.num_rows = settings["rows_per_shard"], settings["num_rows"]
        self.count = -(-self.num_rows // self.per_shard)

    def refuse_other_settings(self) -> None:
        """A leftover directory of other settings is never mixed into this one."""
        for side in sorted(self.out.glob("shard-*.json")):
            rec = read_json(side)
            if isinstance(rec, dict) and "settings" in rec and rec["settings"] != self.settings:
                raise PrecomputeError(f"{side}: left by a precompute with other settings "
                                      f"({_differences(rec['settings'], self.settings)}); use another --out, "
                                      f"or delete {self.out} to start again")

    def get(self, s: int, progress: Callable[[int], None] | None = None) -> dict:
        """Shard s's record: the one on disk when it is complete, else captured now."""
        start = s * self.per_shard
        stop = min(self.num_rows, start + self.per_shard)
        d = self.data
        rows = (d.input_ids[start:stop], d.loss_mask[start:stop].to(torch.uint8),
                d.document_ids[start:stop].to(torch.int32))
        rec = {"file": f"shard-{s:05d}.safetensors", "start": start, "rows": stop - start,
               "rows_sha256": _rows_sha256(*rows), "settings": self.settings}
        side = self.out / f"shard-{s:05d}.json"
        old = read_json(side)
        if isinstance(old, dict) and {k: old.get(k) for k in rec} == rec:
            f = self.out / rec["file"]
            if f.is_file() and sha256_file(f) == old.get("sha256"):
                if progress:
                    progress(rec["rows"])
                return old
        elif isinstance(old, dict) and old.get("settings") == self.settings:
            raise PrecomputeError(f"{side}: its rows differ from the data of this config (data.* changed since "
                                  f"it was written); use another --out, or delete {self.out} to start again")
        return self._capture(rec, rows, side, progress)

    def _capture(self, rec: dict, rows: tuple, side: Path, progress) -> dict:
        ids, mask, docs = rows
        feats = []
        for j in range(rec["rows"]):
            with torch.inference_mode():
                f = self.target.capture(ids[j:j + 1].to(self.target.device), docs[j:j + 1].to(self.target.device),
                                        self.layer_ids)
            feats.append(f.to(self.dtype).cpu())
            if progress:
                progress(j + 1)
        path = self.out / rec["file"]
        tmp = self.out / f".{rec['file']}.partial"
        # save_safetensors: umask-respecting permissions (save_file alone creates 0600); the temp name
        # + rename: a shard under its own name is whole (its record, written next, says it is done)
        with writing(path, hint=AGAIN):
            try:
                save_safetensors({"input_ids": ids.contiguous(), "loss_mask": mask.contiguous(),
                                  "document_ids": docs.contiguous(), "features": torch.cat(feats).contiguous()}, tmp)
                fsync_path(tmp)
            except BaseException:
                tmp.unlink(missing_ok=True)  # a full disk gets the space back
                raise
            _replace(tmp, path)
        rec = dict(rec, sha256=sha256_file(path), bytes=path.stat().st_size)
        with writing(side, hint=AGAIN):
            atomic_write_json(side, rec)
        return rec


def precompute_features(cfg, out: Path, dtype: str = "bfloat16", rows_per_shard: int = 256,
                        progress=None, ctx=None) -> Path:
    """Capture the features of `cfg`'s data into `out`; under torchrun (`ctx` distributed) every
    rank calls it. `progress(done, total)`: rows done by all ranks (call it on one rank)."""
    if dtype not in DTYPES:
        raise PrecomputeError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if rows_per_shard < 1:
        raise PrecomputeError(f"--rows-per-shard {rows_per_shard}: use 1 or more")
    out, ranks = Path(out), Ranks(ctx)

    def make_dir() -> None:
        if ranks.rank:
            return
        if (out / "index.json").exists():
            raise PrecomputeError(f"{out} already holds precomputed features (index.json); choose another --out")
        # a refused write is one line; without index.json (written last) nothing here reads as features
        with writing(out, "creating", hint=AGAIN):
            out.mkdir(parents=True, exist_ok=True)

    ranks.step(make_dir)
    job: dict[str, Any] = {}

    def load() -> None:
        # each rank its own GPU under torchrun (the device DistContext chose the backend for)
        device = None
        if ranks.world > 1 and cfg.target.device != "cpu" and torch.cuda.is_available():
            device = torch.device("cuda", ctx.local_rank)
        target = load_target(cfg.target, device=device)
        # the drafter's layers, plus (for train.loss distill / lk_*) the final hidden state: layer id
        # == the target's layer count, H more channels per token (see docs/architecture.md)
        layer_ids = capture_layer_ids(DrafterConfig.from_target(cfg.model, target).target_layer_ids,
                                      target.num_layers, Objective.from_train_config(cfg.train))
        data = load_prepared(cfg, target.tokenizer, target.family)
        settings = {"format": FORMAT, "target": cfg.target.model_dump(), "layer_ids": list(layer_ids),
                    "dtype": dtype, "rows_per_shard": rows_per_shard, "num_rows": data.num_rows,
                    "max_tokens": data.max_tokens}
        job.update(data=data, target=target, shards=_Shards(out, settings, data, target, list(layer_ids), dtype))
        if ranks.rank == 0:
            job["shards"].refuse_other_settings()

    ranks.step(load)
    shards, data = job["shards"], job["data"]
    n, records, done = data.num_rows, [], 0
    # rounds of one shard per rank: shard s on rank s % world, each outcome shared before the next
    for first in range(0, shards.count, ranks.world):
        s, base = first + ranks.rank, done
        mine = (lambda j: progress(base + j, n)) if progress else None
        got = ranks.step(lambda: shards.get(s, mine) if s < shards.count else None)
        records += [r for r in got if r is not None]
        done += sum(r["rows"] for r in got if r is not None)
        if progress:
            progress(done, n)
    if ranks.rank == 0:
        _write_index(cfg, out, job, records)
    return out


def _write_index(cfg, out: Path, job: dict, records: list[dict]) -> None:
    for rec in records:
        f = out / rec["file"]
        # another node's shard that is absent here: --out is not on storage every node shares
        if not f.is_file() or f.stat().st_size != rec["bytes"]:
            seen = "of another size" if f.is_file() else "not found"
            raise PrecomputeError(f"{f}: recorded as written but {seen} here; under torchrun on several nodes "
                                  "--out must be a directory all nodes share")
    data, settings = job["data"], job["shards"].settings
    index = {
        "format": FORMAT,
        "target": cfg.target.path,
        "layer_ids": settings["layer_ids"],
        "hidden_size": job["target"].hidden_size,
        "dtype": settings["dtype"],
        "max_tokens": data.max_tokens,
        "num_rows": data.num_rows,
        "shards": [{k: r[k] for k in ("file", "start", "rows", "sha256")} for r in records],
        # "cache" says how this process got its rows (cache hit or miss), nothing about the features
        "data_stats": {k: v for k, v in data.stats.items() if k not in ("skipped_examples", "cache")},
        "heldout": [c.to_json() for c in data.heldout],
    }
    with writing(out / "index.json", hint=AGAIN):
        atomic_write_json(out / "index.json", index)


def precompute_command(cfg, out: Path, dtype: str, rows_per_shard: int, ctx=None) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    lead = ctx is None or ctx.rank == 0
    try:
        if not lead:  # the other ranks are quiet: rank 0 shows everyone's progress
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # "Loading weights" once, from rank 0
            precompute_features(cfg, out, dtype, rows_per_shard, ctx=ctx)
            return
        console = Console(stderr=True)
        with Progress(TextColumn("[bold]capturing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as bar:
            task = bar.add_task("rows", total=None)
            path = precompute_features(cfg, out, dtype, rows_per_shard, ctx=ctx,
                                       progress=lambda d, t: bar.update(task, completed=d, total=t))
    except RankFailed as e:
        if lead:  # the failing rank printed its error; rank 0's output says which rank it was
            print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2 if e.user_error else 1) from None
    index = json.loads((path / "index.json").read_text())
    console.print(f"wrote {index['num_rows']} rows in {len(index['shards'])} shard(s), layers {index['layer_ids']}, "
                  f"{index['dtype']} -> {path}\ntrain from it with: data.source=precomputed:{path}")
