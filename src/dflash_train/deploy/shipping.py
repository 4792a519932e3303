"""What `deploy` sends to the job's host: scripts for ``python -`` that carry the
run-directory protocol (the rundir package, standard library only) with them, so the
far end's own dflash_train (another version, or the code under test) never decides
"live" or "valid"."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from dflash_train import rundir

HERE = Path(__file__).resolve().parent
SHIPPED_RUNDIR = "dflash_train_shipped_rundir"


def shipped_script(path: Path, helpers: Sequence[Path] = ()) -> str:
    """A script for ``python -`` on the far end: it installs this package's rundir (the
    run-directory protocol, standard library only) as the package SHIPPED_RUNDIR, module by
    module in the order of rundir.MODULES, then runs `path` as __main__. The far end's own
    dflash_train (another version, or the code under test) is never what decides "live" or
    "valid". Each of `helpers` (standard library + rundir only) is installed as the module
    ``dflash_train_shipped_<stem>`` before `path` runs."""
    pkg = HERE.parent / "rundir"
    lines = [
        "import sys, types",
        f"_p = types.ModuleType({SHIPPED_RUNDIR!r})",
        f"_p.__path__ = []; _p.__package__ = {SHIPPED_RUNDIR!r}; _p.__file__ = {str(pkg / '__init__.py')!r}",
        f"sys.modules[{SHIPPED_RUNDIR!r}] = _p",
        "def _load(name, src, file):",
        f"    m = types.ModuleType({SHIPPED_RUNDIR!r} + '.' + name)",
        f"    m.__package__ = {SHIPPED_RUNDIR!r}; m.__file__ = file",
        "    sys.modules[m.__name__] = m",
        "    exec(compile(src, file, 'exec'), m.__dict__)",
        "    setattr(_p, name, m)",
    ]
    for name in rundir.MODULES:
        f = pkg / f"{name}.py"
        lines.append(f"_load({name!r}, {f.read_text()!r}, {str(f)!r})")
    init = pkg / "__init__.py"
    lines.append(f"exec(compile({init.read_text()!r}, {str(init)!r}, 'exec'), _p.__dict__)")
    for h in helpers:
        name = f"dflash_train_shipped_{Path(h).stem}"
        lines += [f"_h = types.ModuleType({name!r}); _h.__file__ = {str(h)!r}; sys.modules[{name!r}] = _h",
                  f"exec(compile({Path(h).read_text()!r}, {str(h)!r}, 'exec'), _h.__dict__)"]
    lines.append(f"exec(compile({Path(path).read_text()!r}, {str(path)!r}, 'exec'), {{'__name__': '__main__'}})")
    return "\n".join(lines) + "\n"


AGENT_SRC = shipped_script(HERE / "agent.py", helpers=(HERE / "releases.py",))
PREFLIGHT_SRC = shipped_script(HERE / "preflight.py")
