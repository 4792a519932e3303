"""Preflight of a new release, run INSIDE the new code's interpreter.

`dflash-train deploy` sends this file on stdin to the job's own Python on the
job's host: ``PYTHONPATH=<release>/src[:job's PYTHONPATH] python - --release-src
<release>/src --run-dir RUN_DIR``, in the job's working directory, i.e. the
exact interpreter, environment and cwd the restarted job will get. It imports
nothing from the deploying code, only from the NEW release, and prints one
JSON verdict on stdout: ``{"ok": bool, "checks": [{"name", "ok", "detail"}...]}``.

Checks, in order (a failed check marks the verdict not ok; later checks that
depend on it are skipped):

1. compile   every .py file of the release byte-compiles (py_compile)
2. import    every module of the package imports in this fresh interpreter,
             and `dflash_train` really comes from the release (not shadowed)
3. config    RUN_DIR/config.yaml validates against the NEW schema (load_config),
             and the job's own command line (--config + overrides, resolved in
             the job's cwd by the new code, i.e. what the restart will run)
             gives exactly that config (no silent mid-run config change from
             a changed default or an edited config file)
4. features  what the config needs exists here: CUDA when the run trains on
             cuda (device=cuda, or auto on a CUDA host), flex attention's
             create_block_mask on that torch when on cuda, bf16 support
5. checkpoint the latest checkpoint's model.safetensors loads STRICTLY into
             the new code's drafter, built from the checkpoint's own
             drafter_config (manifest meta) through the new DrafterConfig:
             every key and shape, then load_state_dict(strict=True)

Usable by hand too: ``python src/dflash_train/deploy/preflight.py --release-src
DIR/src --run-dir RUN_DIR`` (with PYTHONPATH=DIR/src).
"""
from __future__ import annotations

import argparse
import json
import os
import py_compile
import sys
import time
import traceback
from pathlib import Path

try:  # installed by deploy's bootstrap (deploy/command.py: shipped_script)
    rundir = sys.modules["dflash_train_shipped_rundir"]
except KeyError:  # imported from the package
    from dflash_train import rundir


class Verdict:
    def __init__(self) -> None:
        self.checks: list[dict] = []
        self._t = time.monotonic()

    def add(self, name: str, ok: bool, detail: str = "", **extra) -> bool:
        now = time.monotonic()
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail, "seconds": round(now - self._t, 3), **extra})
        self._t = now
        return ok

    @property
    def ok(self) -> bool:
        return all(c["ok"] for c in self.checks)


def _short_exc(e: BaseException, limit: int = 1500) -> str:
    text = "".join(traceback.format_exception_only(type(e), e)).strip()
    return text if len(text) <= limit else text[:limit] + "..."


def check_compile(v: Verdict, pkg: Path) -> bool:
    files = sorted(pkg.rglob("*.py"))
    errors = []
    for f in files:
        try:
            py_compile.compile(str(f), doraise=True)
        except py_compile.PyCompileError as e:
            errors.append(str(e.msg).strip())
        except OSError as e:
            errors.append(f"{f}: {e}")
    if not files:
        return v.add("compile", False, f"no .py files under {pkg}")
    if errors:
        return v.add("compile", False, f"{len(errors)} of {len(files)} files do not compile: " + " | ".join(errors[:5]))
    return v.add("compile", True, f"{len(files)} files byte-compiled")


def check_import(v: Verdict, src: Path) -> bool:
    import importlib
    import pkgutil

    try:  # the NEW release's package, imported only once check 1 passed (the module doc): never at the top
        import dflash_train
    except BaseException as e:  # noqa: BLE001
        return v.add("import", False, f"import dflash_train failed: {_short_exc(e)}")
    got = Path(dflash_train.__file__).resolve().parent
    want = (src / "dflash_train").resolve()
    if got != want:
        return v.add("import", False, f"dflash_train is imported from {got}, not from the release {want} (shadowed on sys.path)")
    names = ["dflash_train"]
    failed: list[str] = []

    def onerror(name: str) -> None:
        e = sys.exc_info()[1]
        failed.append(f"{name}: {_short_exc(e, 400) if e else 'import failed'}")

    for m in pkgutil.walk_packages(dflash_train.__path__, "dflash_train.", onerror=onerror):
        names.append(m.name)
    for name in names:
        if name.endswith(".__main__") or name == "dflash_train.deploy.preflight":
            continue
        try:
            importlib.import_module(name)
        except BaseException as e:  # noqa: BLE001 - SystemExit/KeyboardInterrupt from module level too
            failed.append(f"{name}: {_short_exc(e, 400)}")
    if failed:
        return v.add("import", False, f"{len(failed)} of {len(names)} modules fail to import: " + " | ".join(failed[:5]))
    for must in ("dflash_train.cli", "dflash_train.config"):
        if must not in names:
            return v.add("import", False, f"the release has no {must}")
    return v.add("import", True, f"{len(names)} modules imported from {want}")


def split_train_args(args: list[str]) -> tuple[str | None, list[str]]:
    """(--config value, positional overrides) of `dflash-train train` arguments."""
    config, overrides, i = None, [], 0
    takes_value = {"--config", "-c", "--run-dir", "--resume"}
    while i < len(args):
        a = args[i]
        if a in takes_value:
            if a in ("--config", "-c") and i + 1 < len(args):
                config = args[i + 1]
            i += 2
            continue
        if a.startswith("--config="):
            config = a.split("=", 1)[1]
        elif not a.startswith("-"):
            overrides.append(a)
        i += 1
    return config, overrides


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_config(v: Verdict, run_dir: Path, train_args: list[str] | None = None):
    """RUN_DIR/config.yaml under the new schema; and the job's own command
    line (what the restart will resolve, in this cwd) must give the same config."""
    from dflash_train.config import load_config  # the NEW release's schema, after the import check

    path = rundir.RunDir(run_dir).config
    if not path.is_file():
        v.add("config", False, f"{path} missing (the trainer writes it at start)")
        return None
    try:
        cfg = load_config(path, [])
    except BaseException as e:  # noqa: BLE001 - ConfigError or anything the new schema raises
        v.add("config", False, f"{path} does not validate against the new schema: {e}")
        return None
    detail = f"{path} validates (hash {cfg.hash() if hasattr(cfg, 'hash') else '?'})"
    if train_args is not None:
        cfile, overrides = split_train_args(train_args)
        try:
            again = load_config(cfile, overrides)
        except BaseException as e:  # noqa: BLE001
            v.add("config", False, f"the job's command line (--config {cfile}, {len(overrides)} overrides) no longer "
                                   f"resolves under the new code: {e}")
            return None
        a, b = _flat(cfg.model_dump(mode="json")), _flat(again.model_dump(mode="json"))
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        if diff:
            shown = ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in diff[:6])
            v.add("config", False, f"restarting with the job's command line would change the run's config ({shown}"
                                   f"{' ...' if len(diff) > 6 else ''}): a changed default in the new code or an edited "
                                   f"config file; the restart must resolve to {path}")
            return None
        detail += "; the job's command line resolves to the same config"
    v.add("config", True, detail)
    return cfg


def check_features(v: Verdict, cfg) -> bool:
    try:
        import torch
    except BaseException as e:  # noqa: BLE001
        return v.add("features", False, f"torch does not import: {_short_exc(e)}")
    notes = [f"torch {torch.__version__}"]
    cuda_ok = torch.cuda.is_available()
    want = getattr(getattr(cfg, "train", None), "device", "auto")
    tdev = getattr(getattr(cfg, "target", None), "device", "auto")
    on_cuda = want == "cuda" or tdev == "cuda" or (want == "auto" and cuda_ok)
    if (want == "cuda" or tdev == "cuda") and not cuda_ok:
        return v.add("features", False, "the config trains on cuda (train.device/target.device=cuda) but torch.cuda.is_available() is False here")
    if on_cuda:
        notes.append(f"cuda {torch.version.cuda}, {torch.cuda.device_count()} device(s)")
        try:
            from torch.nn.attention.flex_attention import create_block_mask  # noqa: F401
        except BaseException as e:  # noqa: BLE001
            return v.add("features", False, f"flex attention (create_block_mask) is not importable on this torch: {_short_exc(e)}")
        notes.append("flex attention ok")
        if getattr(cfg.train, "dtype", "float32") == "bfloat16" and not torch.cuda.is_bf16_supported():
            return v.add("features", False, "train.dtype=bfloat16 but this GPU does not support bf16")
    else:
        notes.append("cpu")
    if getattr(cfg.train, "compile", False) and not hasattr(torch, "compile"):
        return v.add("features", False, "train.compile=true but this torch has no torch.compile")
    return v.add("features", True, ", ".join(notes))


def snapshot_checkpoint(run_dir: Path, explicit: str | None, scratch: Path, tries: int = 8):
    """(name, snapshot dir) of the latest (or given) checkpoint, hard-linked into
    `scratch` so that the running job's checkpoint retention cannot delete it
    while we read it (committed checkpoint files are never modified, only
    removed). None if the run has no checkpoint."""
    import shutil

    last_err = None
    for _ in range(tries):
        ckpt = Path(explicit) if explicit else rundir.latest_checkpoint(run_dir)
        if ckpt is None:
            return None
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        try:
            for name in (rundir.MANIFEST_FILE, rundir.MODEL_FILE):
                try:
                    os.link(ckpt / name, scratch / name)
                except OSError as e:
                    if isinstance(e, FileNotFoundError):
                        raise
                    shutil.copy2(ckpt / name, scratch / name)
            return ckpt.name, scratch
        except FileNotFoundError as e:  # removed by retention between resolve and link: take the new latest
            last_err = e
            if explicit:
                break
            time.sleep(0.2)
    raise FileNotFoundError(f"checkpoint kept disappearing while snapshotting it: {last_err}")


def check_checkpoint(v: Verdict, run_dir: Path, explicit: str | None, scratch: Path) -> bool:
    import shutil

    try:
        snap = snapshot_checkpoint(run_dir, explicit, scratch)
    except OSError as e:
        return v.add("checkpoint", False, f"cannot snapshot the latest checkpoint: {e}")
    if snap is None:
        return v.add("checkpoint", True, "no checkpoint yet: nothing to load (the job restarts from scratch)", skipped=True)
    try:
        return _check_checkpoint(v, snap[0], snap[1])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _check_checkpoint(v: Verdict, name: str, ckpt: Path) -> bool:
    try:
        man = rundir.read_manifest(ckpt)
    except rundir.CheckpointError as e:
        return v.add("checkpoint", False, f"{name}/{rundir.MANIFEST_FILE} unreadable: {e}")
    dcfg_dict = (man.get("meta") or {}).get("drafter_config")
    if not isinstance(dcfg_dict, dict):
        return v.add("checkpoint", False, f"{name}/{rundir.MANIFEST_FILE} has no meta.drafter_config: cannot build the drafter to check it")
    try:  # the NEW release's drafter (and torch), after the import check: a failure is this check's verdict
        import torch
        from safetensors import safe_open

        from dflash_train.model.dflash2 import build_drafter
        from dflash_train.model.drafter import DrafterConfig
    except BaseException as e:  # noqa: BLE001
        return v.add("checkpoint", False, f"the new code has no usable drafter (dflash_train.model.drafter): {_short_exc(e)}")
    try:
        dcfg = DrafterConfig.from_dict(dcfg_dict) if hasattr(DrafterConfig, "from_dict") else DrafterConfig(**dcfg_dict)
    except BaseException as e:  # noqa: BLE001
        return v.add("checkpoint", False, f"the checkpoint's drafter_config does not fit the new DrafterConfig: {_short_exc(e)}")
    try:
        with torch.device("meta"):
            model = build_drafter(dcfg)
    except BaseException as e:  # noqa: BLE001
        return v.add("checkpoint", False, f"the new DFlashDrafter cannot be built from the checkpoint's config: {_short_exc(e)}")
    want = {k: tuple(t.shape) for k, t in model.state_dict().items()}
    mf = ckpt / rundir.MODEL_FILE
    try:
        with safe_open(str(mf), framework="pt") as f:
            have = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except BaseException as e:  # noqa: BLE001
        return v.add("checkpoint", False, f"{mf}: cannot read: {_short_exc(e)}")
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want))
    shapes = sorted(f"{k}: checkpoint {list(have[k])} vs new code {list(want[k])}" for k in set(want) & set(have) if want[k] != have[k])
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing in checkpoint {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            parts.append(f"not in the new drafter {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
        if shapes:
            parts.append(f"shape mismatch {shapes[:4]}")
        return v.add("checkpoint", False, f"{name}/{rundir.MODEL_FILE} does not load strictly into the new drafter: " + "; ".join(parts))
    try:
        from safetensors.torch import load_file

        tensors = load_file(str(mf), device="cpu")
        model.load_state_dict(tensors, strict=True, assign=True)
    except BaseException as e:  # noqa: BLE001
        return v.add("checkpoint", False, f"strict load_state_dict of {name}/{rundir.MODEL_FILE} failed: {_short_exc(e)}")
    return v.add("checkpoint", True, f"{name}: {len(want)} tensors load strictly into the new drafter", step=man.get("step"))


def run(release_src: Path, run_dir: Path, checkpoint: str | None = None, train_args: list[str] | None = None) -> Verdict:
    v = Verdict()
    pkg = release_src / "dflash_train"
    if not pkg.is_dir():
        v.add("layout", False, f"{pkg} is not a directory")
        return v
    if not check_compile(v, pkg):
        return v
    if not check_import(v, release_src):
        return v
    cfg = check_config(v, run_dir, train_args)
    if cfg is None:
        return v
    if not check_features(v, cfg):
        return v
    check_checkpoint(v, run_dir, checkpoint, release_src.parent / ".preflight-checkpoint")
    return v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dflash-deploy-preflight")
    ap.add_argument("--release-src", required=True, help="the release's src dir (holding dflash_train/)")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--checkpoint", default=None, help="checkpoint dir (default: the run's latest)")
    ap.add_argument("--train-args", default=None, help="JSON list: the job's `train` arguments (after 'train')")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        train_args = json.loads(a.train_args) if a.train_args else None
        v = run(Path(a.release_src), Path(a.run_dir), a.checkpoint, train_args)
        out = {"ok": v.ok, "checks": v.checks}
    except BaseException as e:  # noqa: BLE001
        out = {"ok": False, "checks": [{"name": "preflight", "ok": False, "detail": f"preflight crashed: {_short_exc(e)}"}]}
    out["seconds"] = round(time.monotonic() - t0, 3)
    out["python"] = sys.executable
    # stdout may have been written to by imported modules: the verdict is the last line
    sys.stdout.write("\n" + json.dumps(out) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
