"""`dflash-train compare`: an A/B of training recipes on the user's own config and data,
scored by greedy acceptance on held-out prompts with prompt lookup beside it.

    dflash-train compare --config my.yaml --out runs/ab \\
        --variant base --variant dpace:train.loss=dpace --variant muon:train.optimizer=muon

Each variant is a real `dflash-train train` run (its own subprocess and run dir
OUT/NAME: base config + the shared overrides + the variant's). A variant that
was stopped (Ctrl-C, `dflash-train stop`) resumes from its checkpoint the next
time the same command runs; a finished one is not trained again. Then each is
scored on the same held-out prompts (`eval.prompts.eval_prompts` of the base config,
what `eval`, the demo and the in-training eval score):

* tau: acceptance length of greedy speculative decoding, by replay
  (eval/replay.py; tests/test_eval_replay.py holds it equal to real decoding);
  the target's greedy outputs are decoded once and cached in OUT;
* prompt lookup (n = 3..1, k = block_size - 1 draft tokens) on the same outputs;
* with `data.regenerated` set (target-written answers), the same two on the
  first training answers: a high tau there and a low one held out is memorisation;
* `--decode`: real speculative decoding besides, with wall-clock tok/s of plain,
  DFlash and prompt-lookup decoding, each checked lossless (what `eval` reports).
* `--engine`: each variant's export served by vLLM on the same prompts (engine/measure.py):
  the engine's tau and tok/s for DFlash, with plain vLLM and vLLM's n-gram measured once,
  and lossless against plain vLLM. The figure that decides a recipe.
* `--k N`: every variant (and the n-gram beside them) scored and served with N draft tokens per
  step, so drafters of different block sizes meet at the k a deployment serves them at.
* `--seeds 0,1,2`: every variant trained once per seed (run dir OUT/NAME-seedS, `train.seed=S`),
  and judged by its difference to the first variant paired by seed (seeds.py): at small budgets
  the seed moves tau as much as a lever does.

The table is printed and written to OUT/compare.json (with --seeds, the paired summary to
OUT/compare-seeds.json).
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from dflash_train.checkpoint.source import resolve_drafter_source
from dflash_train.config import ConfigError, RunConfig, load_config
from dflash_train.data.sources import read_conversations
from dflash_train.engine.k_sweep import check_k
from dflash_train.engine.measure import export_block_size, serve_methods, summarise
from dflash_train.errors import UserError
from dflash_train.eval.ngram import PromptLookup
from dflash_train.eval.prompts import encode_prompts, eval_prompts
from dflash_train.eval.replay import replay_acceptance
from dflash_train.eval.source import load_drafter
from dflash_train.eval.specdec import plain_generate
from dflash_train.eval.tau import evaluate_tau
from dflash_train.export import export_checkpoint
from dflash_train.model.acceptance import walk_acceptance
from dflash_train.results import fmt, lossless_cell
from dflash_train.rundir import read_metrics, read_record
from dflash_train.seeds import paired_summary, run_name
from dflash_train.targets import load_target, served_target_dir

RESULTS_FILE = "compare.json"
SEEDS_FILE = "compare-seeds.json"
FINISHED = ("max_steps", "time budget")  # stop reasons of a run that used its whole budget


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...]


def split_overrides(text: str) -> list[str]:
    """`a=1,b=[1,2]` -> ["a=1", "b=[1,2]"]: commas inside brackets or quotes belong to the value."""
    out, cur, depth, quote = [], "", 0, None
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        cur += ch
    if cur.strip():
        out.append(cur.strip())
    return [x for x in out if x]


def parse_variants(specs: Sequence[str]) -> list[Variant]:
    """NAME or NAME:key=value,key=value. Names are run-dir names, so plain and unique."""
    out: list[Variant] = []
    for spec in specs:
        name, _, rest = spec.partition(":")
        name = name.strip()
        if not name or not all(c.isalnum() or c in "-_." for c in name) or name.startswith("."):
            raise UserError(f"--variant {spec!r}: the name before ':' must be letters, digits, '-', '_' or '.'")
        if any(v.name == name for v in out):
            raise UserError(f"--variant {spec!r}: the name {name!r} is used twice")
        overrides = split_overrides(rest)
        bad = [x for x in overrides if "=" not in x]
        if bad:
            raise UserError(f"--variant {spec!r}: {bad[0]!r} is not section.key=value")
        out.append(Variant(name, tuple(overrides)))
    if not out:
        raise UserError("compare needs at least one --variant")
    return out


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


# --------------------------------------------------------------------------- training


def _run_record(run_dir: Path) -> dict:
    return read_record(run_dir) or {}


def _train_stats(run_dir: Path) -> dict[str, Any]:
    steps = [r for r in read_metrics(run_dir) if "loss" in r]
    if not steps:
        return {"steps": 0}
    last = steps[-1]
    return {"steps": last.get("step"),
            "train_s": last["time"] - steps[0]["time"],
            "tok_s": _mean([r["tokens_per_s"] for r in steps[len(steps) // 2:]]),
            "expected_tau_train": last.get("expected_tau"),
            "acc": {k: round(v, 3) for k, v in last.items() if k.startswith("acc_")}}


class _ForwardSignals:
    """While a variant trains, SIGINT/SIGTERM go to it (it checkpoints at a step boundary)
    and compare stops after it, without scoring a half-trained variant."""

    def __init__(self) -> None:
        self.child: subprocess.Popen | None = None
        self.signal: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self):
        for s in (signal.SIGINT, signal.SIGTERM):
            self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.signal = signum
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def train_variant(config: Path, shared: Sequence[str], v: Variant, run_dir: Path, fwd: _ForwardSignals) -> None:
    """Train (or resume) one variant to the end of its budget; skip it when it already got there."""
    if _run_record(run_dir).get("stop_reason") in FINISHED:
        print(f"[{v.name}] already trained ({run_dir})", flush=True)
        return
    cmd = [sys.executable, "-m", "dflash_train.cli", "train", "--config", str(config), "--run-dir", str(run_dir),
           *shared, *v.overrides]
    print(f"[{v.name}] training: {' '.join(cmd[3:])}", flush=True)
    fwd.child = subprocess.Popen(cmd, env=dict(os.environ))
    code = fwd.child.wait()
    fwd.child = None
    if fwd.signal is not None:
        raise UserError(f"stopped by {signal.Signals(fwd.signal).name} while training {v.name!r}; its checkpoint "
                        f"is in {run_dir}; run the same command again to resume")
    if code != 0:
        raise UserError(f"variant {v.name!r}: training exited with code {code} (log: {run_dir / 'logs' / 'train.log'})")
    reason = _run_record(run_dir).get("stop_reason")
    if reason not in FINISHED:
        raise UserError(f"variant {v.name!r}: training stopped early ({reason}); run the same command again to resume")


# --------------------------------------------------------------------------- scoring


def greedy_outputs(target, prompts: Sequence[str], max_new_tokens: int, cache_dir: Path,
                   run_cfg: RunConfig | None = None) -> list[tuple[list[int], int]]:
    """(prompt + greedy new tokens, prompt length) per prompt in the run's chat format, cached by
    prompts, length, target and the prompt token ids (a changed template or template variable: new)."""
    ids, stops = encode_prompts(target, prompts, run_cfg)
    key = hashlib.sha256(json.dumps([list(prompts), max_new_tokens, str(target), ids]).encode()).hexdigest()[:16]
    f = cache_dir / f"greedy-{key}.json"
    if f.exists():
        return [(list(s), int(n)) for s, n in json.loads(f.read_text())]
    out = []
    for p in ids:
        seq = plain_generate(target, torch.tensor([p], device=target.device), max_new_tokens, stops)[0].tolist()
        out.append((seq, len(p)))
    f.write_text(json.dumps(out))
    return out


def training_answers(target, regenerated: str, n: int, run_cfg: RunConfig | None = None) -> list[tuple[list[int], int]]:
    """The first n target-written training answers as (prompt + answer ids, prompt length), the
    prompts in the run's chat format."""
    convs, _ = read_conversations(f"jsonl:{regenerated}", n)
    convs = convs[:n]
    ids, _ = encode_prompts(target, [c.prompt for c in convs], run_cfg)
    return [(p + target.tokenizer(c.reference, add_special_tokens=False).input_ids, len(p))
            for c, p in zip(convs, ids)]


def ngram_tau(outputs, k: int) -> float:
    acc: list[int] = []
    for seq, n in outputs:
        acc += walk_acceptance(seq, n, PromptLookup(seq, k))
    return _mean(acc)


def drafter_tau(drafter, target, outputs, seeded: bool | None = None, k: int | None = None) -> float:
    acc: list[int] = []
    for seq, n in outputs:
        acc += replay_acceptance(drafter, target, seq, n, seeded, k=k)
    return _mean(acc)


def score_variant(run_dir: Path, target, held, seen, prompts, max_new_tokens: int, decode: bool,
                  k: int | None = None, run_cfg: RunConfig | None = None) -> dict[str, Any]:
    """k: draft tokens per block scored (None: block_size - 1), the --k the engine serves at;
    `run_cfg`: whose chat format `decode` renders `prompts` in."""
    src = resolve_drafter_source(run_dir)
    drafter = load_drafter(src, target.device)
    k = k or int(src.config.block_size) - 1
    row: dict[str, Any] = {"tau_heldout": drafter_tau(drafter, target, held, k=k), "tau_ngram_heldout": ngram_tau(held, k)}
    if src.config.block_seeds != "none":  # what engines that do not seed the blocks get from it
        row["tau_heldout_unseeded"] = drafter_tau(drafter, target, held, seeded=False, k=k)
    if seen:
        row.update(tau_train_answers=drafter_tau(drafter, target, seen, k=k), tau_ngram_train_answers=ngram_tau(seen, k))
    if decode:
        r = evaluate_tau(drafter, target, prompts, max_new_tokens, run_cfg=run_cfg)
        row["decode"] = {key: r[key] for key in ("tau", "tau_ngram", "tokens_per_s_plain", "tokens_per_s_spec",
                                                  "tokens_per_s_ngram", "speedup", "speedup_ngram",
                                                  "outputs_match", "outputs_match_ngram")}
    return row


# --------------------------------------------------------------------------- the command


def print_table(results: dict[str, dict], decode: bool, engine: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="recipe A/B: tau = tokens per target forward (greedy); prompt lookup = no training")
    cols = ["variant", "steps", "train s", "tok/s", "tau held-out", "(masks only)", "prompt lookup",
            "tau train answers", "prompt lookup (train)"]
    if decode:
        cols += ["tok/s plain", "tok/s DFlash", "tok/s lookup", "lossless"]
    if engine:
        cols += ["k", "tau vLLM", "vLLM n-gram", "tok/s vLLM", "vs plain vLLM", "lossless vLLM"]
    for c in cols:
        t.add_column(c, justify="left" if c == "variant" else "right")

    def f(v, spec=".2f"):
        return fmt(v, spec, "-")

    for name, r in results.items():
        cells = [name, str(r.get("steps") or 0), f(r.get("train_s"), ".0f"), f(r.get("tok_s"), ".0f"),
                 f(r.get("tau_heldout")), f(r.get("tau_heldout_unseeded")), f(r.get("tau_ngram_heldout")),
                 f(r.get("tau_train_answers")),
                 f(r.get("tau_ngram_train_answers"))]
        if decode:
            d = r.get("decode") or {}
            cells += [f(d.get("tokens_per_s_plain"), ".1f"), f(d.get("tokens_per_s_spec"), ".1f"),
                      f(d.get("tokens_per_s_ngram"), ".1f"),
                      "-" if not d else lossless_cell(bool(d.get("outputs_match")) and bool(d.get("outputs_match_ngram")))]
        if engine:
            cells += [str(r.get("k_engine") or "-"), f(r.get("tau_engine"), ".3f"), f(r.get("tau_engine_ngram"), ".3f"),
                      f(r.get("tokens_per_s_engine"), ".1f"), f(r.get("speedup_engine")),
                      lossless_cell(r.get("lossless_engine"), "-")]
        t.add_row(*cells)
    Console(width=200).print(t)


def engine_scores(target_path: str, target, prompts, max_new_tokens: int, out: Path,
                  names: Sequence[str], k: int | None = None, run_cfg: RunConfig | None = None) -> dict[str, dict]:
    """Every variant's export in vLLM: {name: {tau_engine, tokens_per_s_engine, speedup_engine, lossless_engine,
    tau_engine_ngram, tokens_per_s_engine_plain, k_engine}}; plain vLLM and its n-gram are served once.
    k: draft tokens per step for every variant and n-gram (None: each variant's block_size - 1,
    n-gram at the first variant's); the prompts in the chat format of `run_cfg`."""
    ids, stops = encode_prompts(target, prompts, run_cfg)
    target_dir = served_target_dir(target_path)
    exports = {n: export_checkpoint(out / n, out / n / "export", force=True) for n in names}
    first = next(iter(exports.values()))
    # one worker job (one vLLM import): plain and n-gram once, then each variant's DFlash
    served = [first, first, *exports.values()]
    ks = [k or export_block_size(e) - 1 for e in served]
    res, _ = serve_methods(first, target_dir, ids, stops, max_new_tokens, ["plain", "ngram"] + ["dflash"] * len(exports),
                           ks=ks, exports=served, log=lambda m: print(m, flush=True))
    plain, ngram, *variants = summarise(res["methods"], len(ids))
    scores = {}
    for n, d in zip(exports, variants):
        scores[n] = {"tau_engine": d["tau"], "tokens_per_s_engine": d["tokens_per_s"], "speedup_engine": d["speedup"],
                     "lossless_engine": d["lossless"], "tau_engine_ngram": ngram["tau"],
                     "tokens_per_s_engine_ngram": ngram["tokens_per_s"],
                     "tokens_per_s_engine_plain": plain["tokens_per_s"], "k_engine": d["k"]}
    return scores


def run_compare(config: Path, variant_specs: Sequence[str], shared: Sequence[str], out: Path,
                num_prompts: int = 12, max_new_tokens: int = 64, decode: bool = False,
                num_train_answers: int | None = None, engine: bool = False,
                engine_k: int | None = None, seeds: Sequence[int] | None = None) -> dict[str, dict]:
    variants = parse_variants(variant_specs)
    if not Path(config).is_file():
        raise UserError(f"--config {config}: no such file")
    if seeds is not None and any(x.split("=", 1)[0].strip() == "train.seed" for x in shared):
        raise UserError("--seeds sets train.seed for every run; drop train.seed=... from the overrides")
    # every variant's config is checked before anything trains: a typo in the last one costs nothing
    for v in variants:
        try:
            vcfg = load_config(config, [*shared, *v.overrides])
        except ConfigError as e:
            one_line = " ".join(x.strip() for x in str(e).splitlines() if x.strip())
            raise UserError(f"variant {v.name!r}: {one_line}") from None
        check_k(engine_k, vcfg.model.block_size, f"--k (variant {v.name!r})")
    cfg = load_config(config, list(shared))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # one run per variant, or per variant and seed (the seed last: it wins over the variant's own)
    runs = [(v, None, v) for v in variants] if seeds is None else \
        [(v, s, Variant(run_name(v.name, s), (*v.overrides, f"train.seed={s}"))) for v in variants for s in seeds]
    with _ForwardSignals() as fwd:
        for _, _, r in runs:
            train_variant(Path(config), shared, r, out / r.name, fwd)

    target = load_target(cfg.target)
    prompts = eval_prompts(cfg, target, num_prompts)  # the run's held-out prompts, as eval and the demo score
    if not prompts:
        raise UserError(f"{config}: no held-out prompt fits data.max_tokens={cfg.data.max_tokens} "
                        f"(raise data.heldout_fraction or data.max_tokens)")
    print(f"scoring on {len(prompts)} held-out prompts x {max_new_tokens} greedy tokens of the target", flush=True)
    held = greedy_outputs(target, prompts, max_new_tokens, out, cfg)
    seen = training_answers(target, cfg.data.regenerated, num_train_answers or num_prompts, cfg) \
        if cfg.data.regenerated else []
    results: dict[str, dict] = {}
    for v, seed, r in runs:
        run_dir = out / r.name
        t0 = time.perf_counter()
        row = {"variant": v.name, "seed": seed, "overrides": [*shared, *r.overrides], **_train_stats(run_dir)}
        row.update(score_variant(run_dir, target, held, seen, prompts, max_new_tokens, decode, engine_k, cfg))
        row.update(num_prompts=len(held), max_new_tokens=max_new_tokens, score_s=time.perf_counter() - t0)
        results[r.name] = row
        print(f"[{r.name}] tau held-out {row['tau_heldout']:.3f} (prompt lookup {row['tau_ngram_heldout']:.3f}), "
              f"scored in {row['score_s']:.0f}s", flush=True)
    if engine:
        for name, row in engine_scores(cfg.target.path, target, prompts, max_new_tokens, out,
                                       [r.name for _, _, r in runs], k=engine_k, run_cfg=cfg).items():
            results[name].update(row)
            print(f"[{name}] vLLM: tau {row['tau_engine']:.3f} (n-gram {row['tau_engine_ngram']:.3f}), "
                  f"{row['tokens_per_s_engine']:.1f} tok/s (plain {row['tokens_per_s_engine_plain']:.1f}), "
                  f"lossless {row['lossless_engine']}", flush=True)
    (out / RESULTS_FILE).write_text(json.dumps(results, indent=2, default=str) + "\n")
    if seeds is not None:
        (out / SEEDS_FILE).write_text(json.dumps(seed_summaries(results, variants, seeds), indent=2) + "\n")
    return results


def seed_summaries(results: dict[str, dict], variants: Sequence[Variant], seeds: Sequence[int]) -> dict[str, dict]:
    """{measure: paired_summary} for held-out replay tau and, when served, the engine's tau."""
    out = {}
    for key in ("tau_heldout", "tau_engine"):
        if all(key in results[run_name(v.name, s)] for v in variants for s in seeds):
            out[key] = paired_summary({v.name: {s: results[run_name(v.name, s)][key] for s in seeds}
                                       for v in variants}, seeds)
    return out
