"""The side-by-side table: dflash-train and the peer trainers on the same work, judged in vLLM
(issue 48: equal cores measured, the recipe apart from the serving, a judge a reader trusts).

    .venv/bin/python bench/peers/bench.py --out runs/peers48 [--limit 800] [--seconds 600]
        [--seeds 0 1 2 3] [--trainers dflash-train,speculators,specforge,modelopt] [--parallel 2]
        [--peer-defaults] [--budgets seconds,tokens] [--k 3] [--num-prompts 64] [--mtbench 8]
        [--humaneval 8] [--max-new-tokens 64] [--no-judge] [--dry-run]

(`make peers-bench` runs it with the recorded budget; docs/peers-harness.md says why each rule is
what it is.) Steps, each skipped when its output exists (a killed run resumes where it stopped):
1. data: `make demo`'s data step (`dflash-train regenerate`, the target's own answers through
   vLLM) into OUT/data, then bench/peers/data.py: the documents of the first --limit
   conversations as OUT/d{limit}/train.jsonl (every trainer gets the same token ids; dflash-train
   gets data.limit and builds the same documents itself, tests/test_peers_harness.py checks it);
2. features, once per trainer (every trainer offline): dflash-train `precompute`, the shared
   dumper bench/peers/features.py for speculators (all 30 layers: its labels are the target's
   argmax), SpecForge and ModelOpt (stop after layer 15; ModelOpt's own defaults distil the
   target's logits, so their dump runs all layers too). Each dump runs pinned to one core; its
   wall and CPU seconds are reported in every row that trains from it (charged to each, reused or not);
3. the same wall-clock: every variant (dflash-train's recipe; dflash-train at the peers' loss,
   train.vocab_subset=0; each peer with our recipe; --peer-defaults: each peer's own) trains
   --seconds of training for each seed, --parallel at a time, each on ONE core of its own
   (harness.run_pinned: taskset, 1 OMP thread, CPU seconds of its process tree beside the wall).
   The LR horizon is `harness.horizon_steps`: the steps the variant reaches in the budget at its
   pace x 1.25, for every row alike, so the clock ends each run; the pace is measured first by a
   --calibrate-second run of every variant, pinned as the real ones (OUT/calib, OUT/pace.json),
   then by each finished seed; a run that stopped early is flagged in the table;
4. the same supervised predictions: the fewest (anchor, block position) predictions any common
   variant made at seed 0 in step 3 is the budget; every variant trains for the steps that give
   it as many, at every seed (features reused);
5. serving: every export twice, over the whole vocabulary and over ONE draft vocabulary (the ids
   of dflash-train's subset export, draft_vocab.py adds its lm_head rows + d2t to every export
   that has none; ours trained with the subset is exported both ways by ours/run.py);
6. bench/peers/judge.py: plain + n-gram once (OUT/judge/base.json), then every export at each
   k on 64 held-out prompts + 8 MT-Bench + 8 HumanEval, --parallel engines at a time, each bound
   to its own core; tau per group;
7. OUT/table.md + OUT/table.json: a row per (variant, budget, serving) with the seeds' mean,
   spread and values, and the per-seed rows.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PY = REPO / ".venv" / "bin" / "python"
sys.path.insert(0, str(HERE))
import harness  # noqa: E402

# how each trainer is started: the peers' own scripts install and use their own venvs
TRAINERS = {
    "dflash-train": [str(PY), str(HERE / "ours" / "run.py")],
    "speculators": ["bash", str(HERE / "speculators" / "run.sh")],
    "specforge": ["bash", str(HERE / "specforge" / "run.sh")],
    "modelopt": ["bash", str(HERE / "modelopt" / "run.sh")],
}
INSTALL = {name: HERE / name / "install.sh" for name in ("speculators", "specforge", "modelopt")}
# seconds per optimizer step, 1 thread, two trainers at a time on 2 cores (docs/benchmarks.md, issue 36):
# the pace a variant's horizon is set from until this run has measured it (OUT/pace.json)
STEP_SECONDS = {"dflash-train": 0.46, "dflash-train-vs0": 2.9, "speculators": 2.45, "specforge": 2.24,
                "modelopt": 5.4, "speculators-peerdefaults": 18.2, "specforge-peerdefaults": 2.28,
                "modelopt-peerdefaults": 2.92}
# ModelOpt's own defaults at sequence length 192: at its 4,096 a step pads ~150 real tokens to 4,096
# (~60 s, all of 600 s inside its 100 warmup steps): a cost of a default, not a recipe
PEER_DEFAULT_FLAGS = {"modelopt": ["--seq-len", "192"]}
# the trainers that train offline only when told (speculators and SpecForge always read dumps)
OFFLINE_FLAGS = {"modelopt": ["--offline"]}
CALIBRATION_HORIZON = 100000  # the calibration runs' horizon: never reached, the clock ends them
# the estimate of --dry-run (seconds): a run's start-up + export, an engine start, judge tok/s on one core
RUN_OVERHEAD_S, ENGINE_START_S, JUDGE_TOKENS_PER_S = 90.0, 60.0, 17.0
DUMP_S = {"dflash-train": 200.0, "speculators": 510.0, "specforge": 280.0, "modelopt": 280.0, "modelopt-kd": 510.0}


def variants(trainers: list[str], peer_defaults: bool, ours_full_loss: bool = True) -> list[dict]:
    """The rows' trainings: {"tag", "trainer", "flags", "common"} (common: our recipe where the
    trainer can express it, the rows the supervised-prediction budget is taken over)."""
    out = []
    for n in trainers:
        if n == "dflash-train":
            out.append({"tag": n, "trainer": n, "flags": ["--offline"], "common": True})
            if ours_full_loss:
                out.append({"tag": n + "-vs0", "trainer": n, "flags": ["--offline", "--set", "train.vocab_subset=0"],
                            "common": True})
        else:
            out.append({"tag": n, "trainer": n, "flags": list(OFFLINE_FLAGS.get(n, [])), "common": True})
    if peer_defaults:
        out += [{"tag": n + "-peerdefaults", "trainer": n, "common": False,
                 "flags": ["--peer-defaults"] + PEER_DEFAULT_FLAGS.get(n, []) + OFFLINE_FLAGS.get(n, [])}
                for n in trainers if n != "dflash-train"]
    return out


def feature_key(v: dict) -> str:
    """Which dump a variant trains from: one per trainer, ModelOpt's own defaults apart (their KD
    loss reads the target's last layer as well)."""
    return "modelopt-kd" if v["trainer"] == "modelopt" and "--peer-defaults" in v["flags"] else v["trainer"]


def train_command(v: dict, data: Path, run: Path, seed: int, steps: int | None, seconds: float | None,
                  features: Path | None) -> list[str]:
    """The trainer's command for one run: 1 thread (the core is the pool's), the variant's flags,
    the shared features where the trainer reads them."""
    cmd = TRAINERS[v["trainer"]] + [str(data), str(run), "--seed", str(seed), "--threads", "1"] + v["flags"]
    cmd += ["--steps", str(steps)] if steps else []
    cmd += ["--seconds", f"{seconds:g}"] if seconds else []
    if features is not None:
        cmd += {"dflash-train": ["--features"], "speculators": ["--reuse-data"], "specforge": ["--features"],
                "modelopt": ["--features"]}[v["trainer"]] + [str(features)]
    return cmd


def features_of(trainer: str, run: Path) -> Path | None:
    """Where a finished run of `trainer` left the features later runs reuse."""
    p = {"dflash-train": run / "features", "speculators": run / "data", "specforge": run / "features",
         "modelopt": run / "features"}.get(trainer)
    return p if p is not None and p.is_dir() else None


class Bench:
    def __init__(self, a):
        self.a = a
        self.out = a.out
        self.cores = harness.cores_for(a.parallel)
        self.pool = harness.CorePool(self.cores)
        self.pace_file = self.out / "pace.json"
        self.pace = harness.read_json(self.pace_file) or {}
        self.features: dict[str, Path] = {}

    def step_seconds(self, tag: str) -> float:
        return self.pace.get(tag) or STEP_SECONDS[tag]

    def run(self, v: dict, run: Path, seed: int, steps: int | None, seconds: float | None) -> dict:
        """One pinned trainer run; its result.json plus the harness's measurement ("harness")."""
        res_file, done = run / "result.json", run / "bench.json"
        if done.is_file():  # finished before (a resumed bench): the row as it was written
            return json.loads(done.read_text())
        cmd = train_command(v, self.data, run, seed, steps, seconds, self.features.get(feature_key(v)))
        with self.pool.core() as core:
            m = harness.run_pinned(cmd, run.parent / f"{run.name}.log", core, threads=1)
        run.mkdir(parents=True, exist_ok=True)
        (run / "harness.json").write_text(json.dumps(m, indent=1) + "\n")
        r = json.loads(res_file.read_text()) if res_file.is_file() else {
            "peer": v["trainer"], "error": f"exit {m['rc']}, no result.json (see {run.parent / (run.name + '.log')})"}
        r = dict(r, harness=m, tag=v["tag"], seed=seed, horizon=steps, budget_seconds=seconds)
        log = next((p for p in (run / "logs" / "train.log", run / "train.log") if p.is_file()), None)
        tv = harness.time_v(log.read_text(errors="replace")) if log is not None and v["trainer"] != "dflash-train" else None
        if tv is not None:  # the peer's /usr/bin/time -v around its training process
            r["train_time_v"] = tv
        if seconds and harness.stopped_early(r, seconds):
            r["stopped_early"] = f"training ended at {r.get('train_seconds') or 0:.0f} s of {seconds:g} s"
        if not r.get("error"):  # a failed run is run again by the next bench
            done.write_text(json.dumps(r, indent=1, default=str) + "\n")
        pace = harness.measured_pace(r)
        if seconds and pace and not r.get("error"):
            self.pace[v["tag"]] = pace
            self.pace_file.write_text(json.dumps(self.pace, indent=1) + "\n")
        return r

    def features_stage(self, vs: list[dict]) -> dict[str, dict]:
        """One feature dump per trainer (and per feature_key): a 1-step run that writes them, pinned."""
        todo = list({feature_key(v): v for v in reversed(vs)}.values())[::-1]  # the first variant of each key

        def one(v):
            key = feature_key(v)
            run = self.out / "features" / key
            r = self.run(v, run, 0, 1, None)
            f = features_of(v["trainer"], run)
            if f is not None:
                self.features[key] = f
            return key, r

        with ThreadPoolExecutor(len(self.cores)) as ex:
            return dict(ex.map(one, todo))

    def calibrate_stage(self, vs: list[dict]) -> dict[str, dict]:
        """Every variant trains --calibrate seconds (a horizon it never reaches), pinned and two at
        a time as the budgeted runs will: its pace (training clock / steps) into OUT/pace.json."""
        def one(v):
            return v["tag"], self.run(v, self.out / "calib" / v["tag"], 0, CALIBRATION_HORIZON, self.a.calibrate)

        with ThreadPoolExecutor(len(self.cores)) as ex:
            return dict(ex.map(one, vs))

    def seconds_stage(self, vs: list[dict]) -> dict[str, dict]:
        jobs = sorted(((v, s) for v in vs for s in self.a.seeds), key=lambda j: j[1])  # every seed 0 first

        def one(job):
            v, s = job
            steps = harness.horizon_steps(self.a.seconds, self.step_seconds(v["tag"]))
            return f"{v['tag']}/seconds/s{s}", self.run(v, self.sec_dir / v["tag"] / f"seed{s}", s, steps, self.a.seconds)

        with ThreadPoolExecutor(len(self.cores)) as ex:
            return dict(ex.map(one, jobs))

    def tokens_stage(self, vs: list[dict], runs: dict[str, dict]) -> tuple[int | None, dict[str, dict]]:
        first = {v["tag"]: runs.get(f"{v['tag']}/seconds/s{self.a.seeds[0]}") for v in vs if v["common"]}
        ok = {t: r for t, r in first.items() if r and not r.get("error") and r.get("supervised_tokens")}
        if not ok:
            return None, {}
        budget = min(r["supervised_tokens"] for r in ok.values())
        jobs = sorted(((v, s) for v in vs if v["tag"] in ok for s in self.a.seeds), key=lambda j: j[1])

        def one(job):
            v, s = job
            r0 = ok[v["tag"]]
            steps = max(1, round(budget / (r0["supervised_tokens"] / r0["steps"])))
            return f"{v['tag']}/tokens/s{s}", self.run(v, self.tok_dir / v["tag"] / f"seed{s}", s, steps, None)

        with ThreadPoolExecutor(len(self.cores)) as ex:
            return budget, dict(ex.map(one, jobs))

    def exports(self, runs: dict[str, dict]) -> dict[str, Path]:
        """{"TAG/BUDGET/sSEED/full|dv": export dir}: each training served over the whole vocabulary
        and over the one draft vocabulary (draft_vocab.py adds it where the export has none)."""
        import torch
        from draft_vocab import add_draft_vocab, draft_vocab_ids, target_lm_head

        dirs = {}
        for key, r in runs.items():
            if r.get("error"):
                continue
            tag, budget, seed = key.split("/")
            run = (self.sec_dir if budget == "seconds" else self.tok_dir) / tag / seed.replace("s", "seed", 1)
            if (run / "export-full").is_dir():  # ours with the subset: exported both ways by ours/run.py
                dirs[f"{key}/full"], dirs[f"{key}/dv"] = run / "export-full", run / "export"
            elif (run / "export").is_dir():
                dirs[f"{key}/full"] = run / "export"
        ref = next((d for k, d in sorted(dirs.items()) if k.endswith("/dv")), None)
        if ref is None:
            print("no draft-vocabulary export of dflash-train: the exports are served over the whole vocabulary only",
                  file=sys.stderr)
            return dirs
        ids = draft_vocab_ids(ref)
        (self.out / "draft_vocab.json").write_text(json.dumps({"from": str(ref), "ids": ids.tolist()}) + "\n")
        for k, d in list(dirs.items()):
            if k.endswith("/dv") and not torch.equal(draft_vocab_ids(d), ids):
                print(f"{k}: its draft vocabulary differs from {ref}'s (same data should give the same set)",
                      file=sys.stderr)
        head = None
        for k in [k for k in dirs if k.endswith("/full")]:
            dv_key = k[:-len("full")] + "dv"
            if dv_key in dirs:
                continue
            out = dirs[k].parent / "export-dv"
            if not (out / "model.safetensors").is_file():
                head = head if head is not None else target_lm_head((self.data / "target_dir.txt").read_text().strip())
                try:
                    add_draft_vocab(dirs[k], out, ids, head, ids_from=str(ref), force=True)
                except (ValueError, OSError) as e:
                    print(f"{k}: no draft-vocabulary export: {e}", file=sys.stderr)
                    continue
            dirs[dv_key] = out
        return dirs

    def judge(self, exports: dict[str, Path]) -> dict:
        """Plain + n-gram once, then each export in its own judge process, --parallel at a time,
        each engine bound to its own core."""
        from judge import judge as judge_fn

        a, jdir = self.a, self.out / "judge"
        base_file = jdir / "base.json"
        base = judge_fn(self.data, {}, a.k, a.num_prompts, a.max_new_tokens, mtbench=a.mtbench, humaneval=a.humaneval,
                        base_file=base_file, log=lambda m: print(m, file=sys.stderr, flush=True))

        def one(item):
            name, export = item
            f = jdir / (name.replace("/", "__") + ".json")
            if not f.is_file():
                cmd = [str(PY), str(HERE / "judge.py"), str(self.data), "--export", f"{name}={export}", "--k",
                       *map(str, a.k), "--num-prompts", str(a.num_prompts), "--mtbench", str(a.mtbench),
                       "--humaneval", str(a.humaneval), "--max-new-tokens", str(a.max_new_tokens), "--base",
                       str(base_file), "--no-base-rows", "--out", str(f)]
                with self.pool.core() as core:
                    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=str(core))
                    harness.run_pinned(cmd, jdir / "logs" / (f.stem + ".log"), core, env=env, threads=1)
            got = harness.read_json(f)
            return got["rows"] if got else [{"trainer": name, "k": k, "group": "all", "error": "judge failed"}
                                             for k in a.k]

        with ThreadPoolExecutor(len(self.cores)) as ex:
            rows = [r for rs in ex.map(one, sorted(exports.items())) for r in rs]
        return dict(base, rows=base["rows"] + rows)

    def main(self) -> int:
        a = self.a
        vs = variants(a.trainers, a.peer_defaults, not a.no_full_loss)
        if a.dry_run:
            print(estimate(vs, a))
            return 0
        for n in {v["trainer"] for v in vs}:
            if n in INSTALL and subprocess.run(["bash", str(INSTALL[n])], capture_output=True).returncode != 0:
                print(f"{n}: install failed (bash {INSTALL[n]})", file=sys.stderr)
        self.data = ensure_data(self.out, a.limit)
        self.sec_dir, self.tok_dir = self.out / f"s{a.seconds:g}", self.out / f"s{a.seconds:g}-tokens"
        feats = self.features_stage(vs)
        calib = self.calibrate_stage(vs) if a.calibrate else {}
        runs = self.seconds_stage(vs) if "seconds" in a.budgets else {}
        budget, tok = self.tokens_stage(vs, runs) if "tokens" in a.budgets else (None, {})
        runs.update(tok)
        exports = self.exports(runs)  # (cheap: the draft vocabulary added where an export has none)
        judged = {"rows": []} if a.no_judge else self.judge(exports)
        table = build_table(runs, judged, a.k, budget, feats)
        (self.out / "table.json").write_text(json.dumps({"runs": runs, "features": feats, "calibration": calib,
                                                         "pace": self.pace, "judge": judged,
                                                         "tokens_budget": budget, "args": vars(a)},
                                                        indent=1, default=str) + "\n")
        (self.out / "table.md").write_text(table)
        print(table)
        return 0


def sh(cmd: list[str], log: Path) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    with log.open("w") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode


def ensure_data(out: Path, limit: int) -> Path:
    full = out / "data"
    full.mkdir(parents=True, exist_ok=True)
    if not (full / "regenerated.complete").is_file():
        rc = sh([str(REPO / ".venv" / "bin" / "dflash-train"), "regenerate", "-c", str(REPO / "configs" / "cpu-demo.yaml"),
                 "--out", str(full / "regenerated.jsonl"), "--max-new-tokens", "128", "--engine", "vllm"], full / "regenerate.log")
        if rc != 0:
            raise SystemExit(f"data step failed: {full / 'regenerate.log'}")
        (full / "regenerated.complete").write_text("")
    data = out / f"d{limit}"
    if not (data / "data.json").is_file():
        rc = sh([str(PY), str(HERE / "data.py"), "--regenerated", str(full / "regenerated.jsonl"), "--out", str(data),
                 "--limit", str(limit)], out / f"d{limit}.log")
        if rc != 0:
            raise SystemExit(f"peer data failed: {out / f'd{limit}.log'}")
    return data


def estimate(vs: list[dict], a) -> str:
    """Wall-clock of the whole table on len(cores) = --parallel cores (--dry-run)."""
    n_seeds, par = len(a.seeds), a.parallel
    dump = sum(DUMP_S.get(t, 0.0) + RUN_OVERHEAD_S for t in {feature_key(v) for v in vs}) / par
    sec = len(vs) * n_seeds * (a.seconds + RUN_OVERHEAD_S) / par if "seconds" in a.budgets else 0.0
    sec += len(vs) * (a.calibrate + RUN_OVERHEAD_S) / par if a.calibrate else 0.0
    # the tokens budget: ~ModelOpt's reach (the slowest); the others' share of it at their pace (issue 36's
    # 67.8K run: ours 141 s, ours vs0 302 s, speculators 263 s, SpecForge 309 s, ModelOpt = its seconds run)
    frac = {"dflash-train": 0.25, "dflash-train-vs0": 0.5, "speculators": 0.45, "specforge": 0.5, "modelopt": 0.0}
    tok = sum(n_seeds * (frac.get(v["tag"], 0.5) * a.seconds + RUN_OVERHEAD_S) for v in vs if v["common"]) / par \
        if "tokens" in a.budgets else 0.0
    trainings = len(vs) * n_seeds * ("seconds" in a.budgets) + sum(v["common"] for v in vs) * n_seeds * ("tokens" in a.budgets)
    exports = 2 * trainings
    prompts = a.num_prompts + a.mtbench + a.humaneval
    per_method = prompts * 0.85 * a.max_new_tokens / JUDGE_TOKENS_PER_S
    judge = 0.0 if a.no_judge else \
        (3 * per_method + ENGINE_START_S * 3) + exports * len(a.k) * (per_method + ENGINE_START_S) / par
    total = dump + sec + tok + judge
    lines = [f"plan: {len(vs)} variants x {n_seeds} seeds x {len(a.budgets)} budget(s) = {trainings} trainings, "
             f"{exports} exports x k {a.k} judged on {prompts} prompts (<= {a.max_new_tokens} tokens), "
             f"{par} core(s)",
             f"  features {dump / 60:.0f} min, seconds budget {sec / 60:.0f} min, tokens budget {tok / 60:.0f} min, "
             f"judge {judge / 60:.0f} min: about {total / 3600:.1f} h"]
    for v in vs:
        lines.append(f"  {v['tag']}: {' '.join(v['flags']) or '(our recipe pinned)'}")
    return "\n".join(lines)


def build_table(runs: dict[str, dict], judged: dict, ks: list[int], budget: int | None, feats: dict | None = None) -> str:
    """Markdown: one row per (variant, budget, serving) over its seeds (mean, spread, values),
    then one row per seed; the plain / n-gram rows first."""
    by: dict[tuple, dict] = {}
    for r in judged.get("rows", []):
        by[(r.get("trainer"), r.get("k"), r.get("group", "all"))] = r
    lines = [f"Supervised-prediction budget: {budget:,}" if budget else "Supervised-prediction budget: (not run)", ""]
    head = ["row", "seeds"] + [f"tau k{k} mean [min-max] (spread)" for k in ks] + \
        [f"k{ks[0]} {g}" for g in ("heldout", "mtbench", "humaneval")] + \
        ["lossless", "steps", "sup. predictions", "sup./s", "train s", "train CPU s", "dump s", "dump CPU s",
         "CPU/wall", "cores", "notes"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in ("plain vLLM", "vLLM n-gram"):
        cells = [label, ""]
        for k in ks:
            r = by.get((label, 0 if label == "plain vLLM" else k, "all"), {})
            cells.append(_f(r.get("tau")))
        for g in ("heldout", "mtbench", "humaneval"):
            cells.append(_f(by.get((label, 0 if label == "plain vLLM" else ks[0], g), {}).get("tau")))
        lines.append("| " + " | ".join(cells + [""] * (len(head) - len(cells))) + " |")
    groups: dict[str, list[tuple[str, dict]]] = {}
    for key, r in runs.items():
        tag, bud, seed = key.split("/")
        for serving in ("full", "dv"):
            groups.setdefault(f"{tag} / {bud} / {serving}", []).append((f"{key}/{serving}", r))
    per_seed = []
    for row, members in groups.items():
        taus = {k: [by.get((name, k, "all"), {}).get("tau") for name, _ in members] for k in ks}
        cells = [row, str(len(members))]
        for k in ks:
            s = harness.seed_stats(taus[k])
            cells.append(f"{_f(s['mean'])} [{_f(s['min'])}-{_f(s['max'])}] ({_f(s['spread'])})" if s["n"] else "")
        for g in ("heldout", "mtbench", "humaneval"):
            cells.append(_f(harness.seed_stats([by.get((n, ks[0], g), {}).get("tau") for n, _ in members])["mean"]))
        ll = [by.get((n, k, "all"), {}).get("lossless") for n, _ in members for k in ks]
        cells.append("yes" if ll and all(ll) else ("NO" if any(x is False for x in ll) else ""))
        rs = [r for _, r in members]

        def mean(f):
            return harness.seed_stats([f(r) for r in rs])["mean"]

        cells += [_f(mean(lambda r: r.get("steps")), 0), _f(mean(lambda r: r.get("supervised_tokens")), 0),
                  _f(mean(lambda r: r["supervised_tokens"] / r["train_seconds"]
                          if r.get("supervised_tokens") and r.get("train_seconds") else None), 0),
                  _f(mean(lambda r: r.get("train_seconds")), 0), _f(mean(train_cpu), 0),
                  _f(mean(lambda r: r.get("feature_dump_seconds")), 0), _f(mean(dump_cpu), 0),
                  _f(mean(lambda r: (r.get("harness") or {}).get("cpu_per_wall")), 2),
                  ",".join(sorted({str((r.get("harness") or {}).get("core")) for r in rs}))]
        notes = [r.get("error") or r.get("stopped_early") for r in rs if r.get("error") or r.get("stopped_early")]
        notes += [by.get((n, k, "all"), {}).get("error") for n, _ in members for k in ks
                  if by.get((n, k, "all"), {}).get("error")]
        cells.append("; ".join(str(x) for x in notes).replace("|", "/")[:300])
        lines.append("| " + " | ".join(cells) + " |")
        for name, r in members:
            per_seed.append("| " + " | ".join([name] + [_f(by.get((name, k, "all"), {}).get("tau")) for k in ks] + [
                _f(r.get("steps"), 0), _f(r.get("supervised_tokens"), 0), _f(r.get("train_seconds"), 0),
                _f(train_cpu(r), 0), _f((r.get("harness") or {}).get("cpu_s"), 0),
                str((r.get("harness") or {}).get("core", ""))]) + " |")
    lines += ["", "Per seed:", "", "| run / serving | " + " | ".join(f"tau k{k}" for k in ks)
              + " | steps | sup. predictions | train s | train CPU s | run CPU s (whole tree) | core |",
              "|" + "---|" * (len(ks) + 7)] + per_seed
    return "\n".join(lines) + "\n"


def train_cpu(r: dict) -> float | None:
    """CPU seconds of the training process alone (its /usr/bin/time), where the trainer reports it."""
    if r.get("train_process_cpu_seconds") is not None:
        return r["train_process_cpu_seconds"]
    return (r.get("train_time_v") or {}).get("cpu_s")


def dump_cpu(r: dict) -> float | None:
    if r.get("feature_dump_cpu_seconds") is not None:
        return r["feature_dump_cpu_seconds"]
    return (r.get("feature_dump") or {}).get("cpu_s")


def _f(v, nd: int = 3) -> str:
    if v is None:
        return ""
    return f"{v:,.{nd}f}" if isinstance(v, (int, float)) else str(v)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "peers48")
    ap.add_argument("--trainers", default=",".join(TRAINERS))
    ap.add_argument("--limit", type=int, default=800, help="conversations of the demo's data every trainer reads")
    ap.add_argument("--seconds", type=float, default=600, help="the training wall-clock budget per run")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--parallel", type=int, default=2, help="trainers (and engines) at a time, one core each")
    ap.add_argument("--peer-defaults", action="store_true", help="also each peer with its own defaults")
    ap.add_argument("--no-full-loss", action="store_true", help="leave out dflash-train at train.vocab_subset=0")
    ap.add_argument("--budgets", default="seconds,tokens", help="seconds, tokens or both")
    ap.add_argument("--calibrate", type=float, default=60,
                    help="seconds of training per variant to measure its pace before the budgeted runs (0: use "
                         "STEP_SECONDS until a seed has run)")
    ap.add_argument("--k", type=int, nargs="+", default=[3],
                    help="draft tokens a step served (k 7 doubles the judge's time; issue 36 found k 3 and k 7 within 0.01)")
    ap.add_argument("--num-prompts", type=int, default=64, help="held-out prompts the judge reads")
    ap.add_argument("--mtbench", type=int, default=8)
    ap.add_argument("--humaneval", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--no-judge", action="store_true",
                    help="train only (a session too short for the whole table: a later call over the same --out "
                         "resumes every finished run and judges)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and its time estimate, run nothing")
    a = ap.parse_args(argv)
    a.trainers = [n.strip() for n in a.trainers.split(",") if n.strip()]
    bad = [n for n in a.trainers if n not in TRAINERS]
    if bad:
        raise SystemExit(f"--trainers: unknown {bad}; choose from {', '.join(TRAINERS)}")
    a.budgets = [b.strip() for b in a.budgets.split(",") if b.strip()]
    if set(a.budgets) - {"seconds", "tokens"} or ("tokens" in a.budgets and "seconds" not in a.budgets):
        raise SystemExit("--budgets: seconds, or seconds,tokens (the tokens budget is read from the seconds runs)")
    return a


def main(argv=None) -> int:
    return Bench(parse(argv)).main()


if __name__ == "__main__":
    sys.exit(main())
