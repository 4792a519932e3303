"""The peer comparison's harness (bench/peers/, issue 48) kept honest where it can be without the
peers' venvs: every trainer runs on one core of its own with one thread and its CPU seconds are
measured; the LR horizon rule is the same for every row and a run that stops before its budget is
flagged; the documents the peers read are the ones dflash-train trains on, token for token; the
shared feature dumper stops after the captured layer and gives HF's tensors; the draft vocabulary
the harness adds to an export is the one dflash-train's own export writes, loads in our loader and
decodes identically wherever the drafter's choices lie inside the set; the table shows the seeds'
spread. No training, no vLLM: seconds each."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
PEERS = REPO / "bench" / "peers"
sys.path.insert(0, str(PEERS))

import bench  # noqa: E402
import draft_vocab  # noqa: E402
import features  # noqa: E402
import harness  # noqa: E402


def _ours_run():
    spec = importlib.util.spec_from_file_location("peers_ours_run", PEERS / "ours" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------- cores and CPU seconds


def test_more_trainers_than_cores_is_refused_in_one_line():
    assert harness.cores_for(2, {5, 0}) == [0, 5]
    with pytest.raises(SystemExit, match=r"--parallel 2: .*1 core.*at most 1 at a time"):
        harness.cores_for(2, {3})
    with pytest.raises(SystemExit):
        bench.Bench(bench.parse(["--parallel", str(len(os.sched_getaffinity(0)) + 1), "--out", "/tmp/x"]))


BUSY_CHILD = "import json, os, time\nt = time.process_time()\nwhile time.process_time() - t < 0.25: pass\n" \
             "print(json.dumps(sorted(os.sched_getaffinity(0))))\n"


def test_run_pinned_one_core_one_thread_and_cpu_of_the_whole_tree(tmp_path):
    (tmp_path / "child.py").write_text(BUSY_CHILD)
    (tmp_path / "parent.py").write_text(textwrap.dedent(f"""
        import json, os, subprocess, sys, time
        t = time.process_time()
        while time.process_time() - t < 0.25: pass
        child = subprocess.run([sys.executable, {str(tmp_path / 'child.py')!r}], capture_output=True, text=True)
        print(json.dumps({{"affinity": sorted(os.sched_getaffinity(0)), "child": json.loads(child.stdout),
                          "omp": os.environ.get("OMP_NUM_THREADS"), "mkl": os.environ.get("MKL_NUM_THREADS")}}))
    """))
    core = max(os.sched_getaffinity(0))
    m = harness.run_pinned([sys.executable, str(tmp_path / "parent.py")], tmp_path / "log.txt", core)
    assert m["rc"] == 0 and m["core"] == core and m["threads"] == 1
    out = json.loads((tmp_path / "log.txt").read_text().strip().splitlines()[-1])
    assert out == {"affinity": [core], "child": [core], "omp": "1", "mkl": "1"}
    # user + system of the parent AND its child (0.25 s of busy loop each), never more than one core's worth
    assert m["cpu_s"] >= 0.45 and m["cpu_s"] == pytest.approx(m["user_s"] + m["sys_s"])
    assert m["cpu_s"] <= m["wall_s"] * 1.05


FAKE_TRAINER = textwrap.dedent("""
    import json, os, sys, time
    args = sys.argv[1:]
    run = args[1]
    opt = lambda k, d=None: args[args.index(k) + 1] if k in args else d
    t0 = time.time()
    t = time.process_time()
    while time.process_time() - t < 0.1: pass
    os.makedirs(run, exist_ok=True)
    seconds = float(opt("--seconds", 0) or 0)
    steps = int(opt("--steps", 1))
    short = "--peer-defaults" in args  # this fake stops early in the peer-defaults mode
    json.dump({"peer": "fake", "argv": args, "affinity": sorted(os.sched_getaffinity(0)),
               "omp": os.environ.get("OMP_NUM_THREADS"), "start": t0, "end": time.time(),
               "train_seconds": (seconds * (0.5 if short else 1.0)) or 1.0, "steps": steps,
               "supervised_tokens": 100 * steps, "error": None}, open(os.path.join(run, "result.json"), "w"))
""")


def test_bench_gives_every_trainer_one_core_one_thread_and_one_horizon_rule(tmp_path, monkeypatch):
    fake = tmp_path / "fake_trainer.py"
    fake.write_text(FAKE_TRAINER)
    for name in bench.TRAINERS:
        monkeypatch.setitem(bench.TRAINERS, name, [sys.executable, str(fake)])
    par = min(2, len(os.sched_getaffinity(0)))
    a = bench.parse(["--out", str(tmp_path / "out"), "--seconds", "60", "--seeds", "0", "1", "--parallel", str(par),
                     "--trainers", "dflash-train,modelopt", "--peer-defaults"])
    b = bench.Bench(a)
    b.data = tmp_path / "data"
    b.sec_dir, b.tok_dir = a.out / "s60", a.out / "s60-tokens"
    vs = bench.variants(a.trainers, a.peer_defaults)
    assert {v["tag"] for v in vs} == {"dflash-train", "dflash-train-vs0", "modelopt", "modelopt-peerdefaults"}
    assert next(v for v in vs if v["tag"] == "dflash-train-vs0")["flags"][-2:] == ["--set", "train.vocab_subset=0"]
    calib = b.calibrate_stage(vs)  # every variant's pace, measured pinned before the budgeted runs
    assert set(calib) == {v["tag"] for v in vs} and all(r["horizon"] == bench.CALIBRATION_HORIZON for r in calib.values())
    assert all(b.pace[t] == pytest.approx(harness.measured_pace(r)) for t, r in calib.items())
    runs = b.seconds_stage(vs)
    assert len(runs) == len(vs) * 2
    for key, r in runs.items():
        tag = key.split("/")[0]
        h = r["harness"]
        assert r["affinity"] == [h["core"]] and h["core"] in b.cores, key  # one core, the pool's
        assert r["omp"] == "1" and r["argv"][r["argv"].index("--threads") + 1] == "1", key
        # one rule for every row: the horizon a quarter past the budget's reach at the pace known then
        # (the calibration's until a seed of the variant has run, then that seed's)
        allowed = {harness.horizon_steps(60, harness.measured_pace(calib[tag]))}
        if key.endswith("/s1"):
            allowed.add(harness.horizon_steps(60, harness.measured_pace(runs[key[:-1] + "0"])))
        assert r["horizon"] in allowed, key
        assert r["argv"][r["argv"].index("--seconds") + 1] == "60"
        assert bool(r.get("stopped_early")) == tag.endswith("-peerdefaults"), key  # flagged, not silent
        assert h["cpu_s"] > 0.08 and h["cpu_per_wall"] <= 1.05
    # runs that overlapped in time ran on different cores
    spans = [(r["start"], r["end"], r["harness"]["core"]) for r in runs.values()]
    for i, (s1, e1, c1) in enumerate(spans):
        for s2, e2, c2 in spans[i + 1:]:
            if s1 < e2 and s2 < e1:
                assert c1 != c2
    # the measured pace (training clock / steps) is what later runs' horizons are set from
    assert json.loads((a.out / "pace.json").read_text())["dflash-train"] in {
        harness.measured_pace(runs[f"dflash-train/seconds/s{s}"]) for s in (0, 1)}
    # a second bench over the same OUT resumes: the rows as written, no trainer started again
    monkeypatch.setattr(harness, "run_pinned", lambda *a, **k: pytest.fail("ran a finished run again"))
    assert json.loads(json.dumps(b.seconds_stage(vs), default=str)) == json.loads(json.dumps(runs, default=str))
    monkeypatch.undo()
    for name in bench.TRAINERS:
        monkeypatch.setitem(bench.TRAINERS, name, [sys.executable, str(fake)])
    # the tokens budget: the fewest predictions of a common row at seed 0, the same for every seed
    budget, tok = b.tokens_stage(vs, runs)
    assert budget == min(r["supervised_tokens"] for k, r in runs.items() if k.endswith("/s0") and "peerdefaults" not in k)
    assert all("--seconds" not in r["argv"] for r in tok.values()) and not any("peerdefaults" in k for k in tok)


def test_train_commands_share_features_and_threads(tmp_path):
    vs = {v["tag"]: v for v in bench.variants(list(bench.TRAINERS), True)}
    f = tmp_path / "f"
    ours = bench.train_command(vs["dflash-train-vs0"], tmp_path, tmp_path / "r", 3, 100, 600, f)
    assert ours[ours.index("--threads") + 1] == "1" and "--offline" in ours and ours[-2:] == ["--features", str(f)]
    assert bench.train_command(vs["speculators"], tmp_path, tmp_path / "r", 0, 5, None, f)[-2:] == ["--reuse-data", str(f)]
    assert "--seconds" not in bench.train_command(vs["specforge"], tmp_path, tmp_path / "r", 0, 5, None, None)
    mo = bench.train_command(vs["modelopt-peerdefaults"], tmp_path, tmp_path / "r", 0, 5, 600, f)
    assert mo[mo.index("--seq-len") + 1] == "192" and "--offline" in mo and mo[-2:] == ["--features", str(f)]
    # every trainer offline: one dump per trainer, ModelOpt's own (KD) defaults apart
    assert all("--offline" in v["flags"] for t, v in vs.items() if t.startswith(("dflash-train", "modelopt")))
    assert {bench.feature_key(v) for v in vs.values()} == {"dflash-train", "speculators", "specforge", "modelopt",
                                                            "modelopt-kd"}


def test_time_v_and_seed_stats():
    text = "x\n\tUser time (seconds): 12.50\n\tSystem time (seconds): 0.75\n\tPercent of CPU this job got: 99%\n" \
           "\tMaximum resident set size (kbytes): 2048\n"
    assert harness.time_v(text) == {"user_s": 12.5, "sys_s": 0.75, "cpu_percent": 99.0, "max_rss_kb": 2048.0,
                                    "cpu_s": 13.25}
    assert harness.time_v("nothing") is None
    s = harness.seed_stats([1.1, 1.2, None, 1.15, 1.05])
    assert s["n"] == 4 and s["spread"] == pytest.approx(0.15) and s["mean"] == pytest.approx(1.125)
    assert harness.stopped_early({"train_seconds": 512}, 600) and not harness.stopped_early({"train_seconds": 601}, 600)
    assert not harness.stopped_early({"train_seconds": 570, "stopped_by": "seconds"}, 600)
    assert harness.stopped_early({"train_seconds": 570, "stopped_by": "steps"}, 600)


def test_table_shows_every_seed_and_the_spread():
    runs, rows = {}, [{"trainer": "plain vLLM", "k": 0, "group": "all", "tau": 1.0}]
    for s, (full, dv) in enumerate([(1.10, 1.16), (1.08, 1.16), (1.12, 1.12), (1.09, 1.12)]):
        runs[f"dflash-train/seconds/s{s}"] = {"steps": 100, "supervised_tokens": 1000, "train_seconds": 600,
                                              "harness": {"core": s % 2, "cpu_s": 590, "cpu_per_wall": 0.98}}
        rows += [{"trainer": f"dflash-train/seconds/s{s}/full", "k": 3, "group": "all", "tau": full, "lossless": True},
                 {"trainer": f"dflash-train/seconds/s{s}/dv", "k": 3, "group": "all", "tau": dv, "lossless": True}]
    md = bench.build_table(runs, {"rows": rows}, [3], 1000)
    row = next(line for line in md.splitlines() if line.startswith("| dflash-train / seconds / dv |"))
    assert "| 4 | 1.140 [1.120-1.160] (0.040) |" in row and "| yes |" in row and "| 0,1 |" in row
    assert sum(line.startswith("| dflash-train/seconds/s") for line in md.splitlines()) == 8


# ----------------------------------------------------------------------------- the documents


@pytest.fixture(scope="module")
def peer_data(tmp_path_factory, tiny_target_factory):
    """(tiny target dir, bench/peers/data.py's output dir, the run config file) on 60 conversations
    cut at 48 tokens (so some documents are later pieces of a cut conversation)."""
    from conftest import write_tiny_jsonl
    from data import write_peer_data
    from dflash_train.config import load_config, save_config

    tmp = tmp_path_factory.mktemp("peer_data")
    target = tiny_target_factory("qwen3")
    cfg = load_config(REPO / "configs" / "cpu-demo.yaml",
                      [f"target.path={target}", f"data.cache_dir={tmp / 'cache'}", "data.max_tokens=48"])
    save_config(cfg, tmp / "cfg.yaml")
    conv = write_tiny_jsonl(tmp / "regenerated.jsonl", n=60)
    counts = write_peer_data(conv, tmp / "d", tmp / "cfg.yaml", limit=50)
    (tmp / "d" / "target_dir.txt").write_text(str(target) + "\n")
    assert counts["train_documents"] > 20
    return target, tmp / "d", tmp / "cfg.yaml"


def _rows(d: Path) -> list[dict]:
    return [json.loads(line) for line in (d / "train.jsonl").read_text().splitlines()]


def test_peer_documents_equal_ours_token_for_token(peer_data):
    """bench/peers/data.py's train.jsonl (what every peer reads) and the documents dflash-train
    packs from the overrides ours/run.py gives it: the same multiset of (input_ids, loss_mask)."""
    from dflash_train.config import load_config
    from dflash_train.data.prepare import load_prepared
    from dflash_train.targets import load_tokenizer

    _, d, cfg_file = peer_data
    rows = _rows(d)
    assert any(r["piece"] > 0 for r in rows)  # cut documents too
    ours = load_config(cfg_file, _ours_run().train_overrides(json.loads((d / "data.json").read_text()), 10, 0, 600, []))
    tok, family = load_tokenizer(ours.target)
    prep = load_prepared(ours, tok, family)
    docs = []
    for r in range(prep.num_rows):
        ids = prep.document_ids[r]
        for doc in sorted(set(ids.tolist()) - {-1}):
            sel = ids == doc
            docs.append((prep.input_ids[r][sel].tolist(), prep.loss_mask[r][sel].int().tolist()))
    peer = [(r["input_ids"], r["loss_mask"]) for r in rows]
    assert sorted(map(repr, docs)) == sorted(map(repr, peer))


def _module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_peer_files_hold_the_documents_as_given(peer_data, tmp_path, monkeypatch):
    """What the harness writes for each peer from train.jsonl, in the project venv: SpecForge's
    .ckpt (input_ids, loss_mask, features of the captured layer), speculators' hs files (token_ids,
    which its trainer checks against its dataset's input_ids) and ModelOpt's data file (the rows
    its pretokenized collator batches): the same tokens and masks, row for row."""
    from safetensors.torch import load_file

    target, d, _ = peer_data
    rows = _rows(d)[:12]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sf = _module(PEERS / "specforge" / "dump_features.py", "peers_sf_dump")
    monkeypatch.setattr(sf, "HF_INDEX", 2)  # the tiny target has 4 layers (SmolLM2: 16 = layer 15's output)
    monkeypatch.setattr(sys, "argv", ["x", "--train", str(tmp_path / "train.jsonl"), "--target", str(target),
                                      "--out", str(tmp_path / "sf")])
    sf.main()
    info = json.loads((tmp_path / "sf" / "dump.json").read_text())
    assert info["rows"] == len(rows) and info["layers_run"] == 2 and info["cpu_s"] > 0
    for i, r in enumerate(rows):
        f = torch.load(tmp_path / "sf" / f"f_{i:06d}.ckpt")
        assert f["input_ids"].tolist() == r["input_ids"] and f["loss_mask"].tolist() == r["loss_mask"]
        assert f["hidden_states"].shape == (len(r["input_ids"]), 64)

    order = tmp_path / "order.jsonl"
    order.write_text("".join(json.dumps({"idx": i, "input_ids": r["input_ids"]}) + "\n" for i, r in enumerate(rows)))
    sp = _module(PEERS / "speculators" / "dump_features.py", "peers_sp_dump")
    monkeypatch.setattr(sys, "argv", ["x", str(target), str(order), str(tmp_path / "sp"), "2"])
    sp.main()
    for i, r in enumerate(rows):
        f = load_file(str(tmp_path / "sp" / f"hs_{i}.safetensors"))
        assert f["token_ids"].tolist() == r["input_ids"] and f["hidden_states"].shape == (len(r["input_ids"]), 2, 64)

    mo = _module(PEERS / "modelopt" / "run.py", "peers_mo_run")
    (tmp_path / "mo").mkdir()
    (tmp_path / "mo_in").mkdir()
    (tmp_path / "mo_in" / "train.jsonl").write_text((tmp_path / "train.jsonl").read_text())
    n, _, _ = mo.prep_data(tmp_path / "mo_in", tmp_path / "mo")
    got = _rows(tmp_path / "mo" / "data")
    assert n == len(rows) and [(g["input_ids"], g["loss_mask"]) for g in got] == [(r["input_ids"], r["loss_mask"]) for r in rows]


# ----------------------------------------------------------------------------- the feature dumper


def test_dumper_stops_after_the_captured_layer_and_gives_hf_tensors(tiny_target_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_target_dir), dtype=torch.float32).eval()
    L = len(model.model.layers)
    calls = [0] * L
    hooks = [layer.register_forward_hook(lambda m, i, o, j=j: calls.__setitem__(j, calls[j] + 1))
             for j, layer in enumerate(model.model.layers)]
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(5, 300, (n,), generator=g).tolist()} for n in (7, 19, 12)]
    stats: dict = {}
    got = list(features.iter_hidden_states(None, rows, [2], model=model, stats=stats, batch_tokens=40))
    assert stats == {"layers_run": 2, "num_layers": L} and calls[2:] == [0] * (L - 2) and calls[1] > 0
    for h in hooks:
        h.remove()
    with torch.no_grad():
        for row, f in got:
            ref = model(input_ids=torch.tensor([row["input_ids"]]), output_hidden_states=True).hidden_states
            assert f.shape == (len(row["input_ids"]), 1, model.config.hidden_size)
            torch.testing.assert_close(f[:, 0], ref[2][0], rtol=1e-5, atol=1e-5)
    last = {}
    h = model.model.layers[-1].register_forward_hook(lambda m, i, o: last.__setitem__("x", o[0] if isinstance(o, tuple) else o))
    stats = {}
    (row, f), = features.iter_hidden_states(None, rows[:1], [1], prenorm_last=True, model=model, stats=stats)
    assert stats["layers_run"] == L
    torch.testing.assert_close(f[:, 1], last["x"][0])
    h.remove()
    with pytest.raises(ValueError):
        features.hf_layers_needed([L], False, L)  # HF's last entry is post-norm: ask prenorm_last


# ----------------------------------------------------------------------------- the draft vocabulary


def test_added_draft_vocabulary_is_ours_and_decodes_identically_inside_the_set(tmp_path, tiny_target_dir):
    from safetensors.torch import load_file

    from dflash_train.checkpoint.source import load_export, resolve_drafter_source
    from dflash_train.config import ModelConfig, TargetConfig
    from dflash_train.eval import specdec
    from dflash_train.eval.source import load_drafter
    from dflash_train.export import write_export
    from dflash_train.model import DFlashDrafter, DrafterConfig
    from dflash_train.serving_check import check_export, target_facts
    from dflash_train.targets import load_target

    t = load_target(TargetConfig(path=str(tiny_target_dir), device="cpu", dtype="float32"))
    facts = target_facts(str(tiny_target_dir))
    cfg = DrafterConfig.from_target(ModelConfig(num_layers=1, block_size=4, target_layer_ids=[1]), t)
    assert cfg.draft_vocab_size == 0  # as trained with train.vocab_subset=0
    sd = DFlashDrafter(cfg, seed=0).state_dict()
    write_export(cfg, sd, tmp_path / "full", target=facts)

    prompts = [t.tokenizer(x, return_tensors="pt").input_ids for x in
               ("The quick brown fox", "Write a short poem about the sea.", "What is two plus two?")]
    eos = [t.tokenizer.eos_token_id]

    def decode(export):
        drafter = load_drafter(resolve_drafter_source(export))
        drafted, orig = [], specdec.DrafterProposer.draft

        def record(self, *a, **k):
            block, q = orig(self, *a, **k)
            drafted.append(block[0, 1:].tolist())
            return block, q
        specdec.DrafterProposer.draft = record
        try:
            outs = [specdec.speculative_generate(drafter, t, x, 20, eos) for x in prompts]
        finally:
            specdec.DrafterProposer.draft = orig
        return [(o.tolist(), acc) for o, acc in outs], drafted

    full_out, full_drafts = decode(tmp_path / "full")
    chosen = sorted({i for d in full_drafts for i in d})
    g = torch.Generator().manual_seed(1)
    ids = torch.tensor(sorted(set(chosen) | set(torch.randint(0, t.vocab_size, (40,), generator=g).tolist())))
    head = draft_vocab.target_lm_head(tiny_target_dir)
    assert torch.equal(head, t.lm_head_weight)
    draft_vocab.add_draft_vocab(tmp_path / "full", tmp_path / "dv", ids, head, ids_from="test")

    # what our loader check and our loader read: the same drafter, drafting over the set
    assert check_export(tmp_path / "dv", facts) == ([], [])
    c_full, sd_full = load_export(tmp_path / "full")
    c_dv, sd_dv = load_export(tmp_path / "dv")
    assert c_dv.draft_vocab_size == len(ids) and sd_dv.pop("draft_vocab").tolist() == ids.tolist()
    assert sd_dv.keys() == sd_full.keys() and all(torch.equal(sd_dv[k], sd_full[k]) for k in sd_full)
    assert draft_vocab.draft_vocab_ids(tmp_path / "dv").tolist() == ids.tolist()

    # the same tensors dflash-train's own export of a drafter with that draft vocabulary writes
    from dataclasses import replace
    own_cfg = replace(cfg, draft_vocab_size=len(ids))
    own = DFlashDrafter(own_cfg, seed=0)
    own.load_state_dict(dict(sd, draft_vocab=ids))
    write_export(own_cfg, own.state_dict(), tmp_path / "own", target=facts, lm_head_weight=t.lm_head_weight)
    w_own, w_dv = load_file(str(tmp_path / "own" / "model.safetensors")), load_file(str(tmp_path / "dv" / "model.safetensors"))
    assert w_own.keys() == w_dv.keys() and all(torch.equal(w_own[k], w_dv[k]) for k in w_own)
    assert json.loads((tmp_path / "own" / "config.json").read_text())["draft_vocab_size"] == \
        json.loads((tmp_path / "dv" / "config.json").read_text())["draft_vocab_size"]

    # our decoder: every choice of the full drafter lies in the set -> the same drafts, outputs, acceptance
    dv_out, dv_drafts = decode(tmp_path / "dv")
    assert dv_drafts == full_drafts and dv_out == full_out
    # a set without one of them: the drafts change there, the output (lossless) does not
    missing = ids[ids != chosen[0]]
    draft_vocab.add_draft_vocab(tmp_path / "full", tmp_path / "dv2", missing, head)
    dv2_out, dv2_drafts = decode(tmp_path / "dv2")
    assert dv2_drafts != full_drafts and [o for o, _ in dv2_out] == [o for o, _ in full_out]
    assert all(chosen[0] not in d for d in dv2_drafts)

    # vLLM's DFlash head (qwen3_dflash.py compute_logits): draft_vocab_size rows, then d2t to target ids
    h = torch.randn(64, cfg.hidden_size, generator=g)
    w = load_file(str(tmp_path / "dv" / "model.safetensors"))
    vllm_ids = torch.arange(len(ids)) + w["d2t"]
    vllm_pick = vllm_ids[(h @ w["lm_head.weight"].T).argmax(-1)]
    full_logits = h @ head.T
    ours_pick = DFlashDrafter(c_dv, seed=0).eval()
    ours_pick.draft_vocab.copy_(ids)
    assert torch.equal(vllm_pick, ours_pick.restrict_logits(full_logits.clone()).argmax(-1))

    with pytest.raises(ValueError, match="already"):
        draft_vocab.add_draft_vocab(tmp_path / "dv", tmp_path / "again", ids, head)
    with pytest.raises(ValueError, match="sorted"):
        draft_vocab.add_draft_vocab(tmp_path / "full", tmp_path / "bad", ids.flip(0), head)


def test_draft_vocab_on_a_speculators_layout_config(tmp_path):
    """speculators' exports keep the model's fields under transformer_layer_config; vLLM's
    update_dflash reads draft_vocab_size from the top level, where the harness writes it."""
    from safetensors.torch import load_file, save_file

    exp = tmp_path / "spec"
    exp.mkdir()
    (exp / "config.json").write_text(json.dumps({"speculators_model_type": "dflash", "draft_vocab_size": 50,
                                                 "transformer_layer_config": {"vocab_size": 50, "hidden_size": 4}}))
    save_file({"fc.weight": torch.ones(4, 4), "layers.0.mlp.up_proj.weight": torch.ones(8, 4)}, str(exp / "model.safetensors"))
    (exp / "config.py").write_text("# kept\n")
    head = torch.randn(50, 4)
    draft_vocab.add_draft_vocab(exp, tmp_path / "dv", torch.tensor([1, 7, 49]), head)
    c = json.loads((tmp_path / "dv" / "config.json").read_text())
    w = load_file(str(tmp_path / "dv" / "model.safetensors"))
    assert c["draft_vocab_size"] == 3 and c["speculators_model_type"] == "dflash"
    assert w["d2t"].tolist() == [1, 6, 47] and torch.equal(w["lm_head.weight"], head[[1, 7, 49]])
    assert (tmp_path / "dv" / "config.py").read_text() == "# kept\n"


# ----------------------------------------------------------------------------- the judge


def test_judge_prompts_and_groups(tmp_path, tiny_target_dir):
    """The judge's prompts: `make demo`'s held-out ones (of the run's source conversations, never more
    than asked or than there are), then MT-Bench's first turns and HumanEval, in the target's chat format; tau per group from the worker's per-prompt
    counters, lossless against the base plain outputs."""
    from conftest import write_tiny_jsonl
    from dflash_train.config import load_config, save_config
    from judge import group_rows, judge_prompts

    cfg = load_config(REPO / "configs" / "cpu-demo.yaml", [f"target.path={tiny_target_dir}"])
    save_config(cfg, tmp_path / "cfg.yaml")
    conv = write_tiny_jsonl(tmp_path / "regenerated.jsonl", n=200)
    (tmp_path / "data.json").write_text(json.dumps({"regenerated": str(conv)}))
    _, p = judge_prompts(tmp_path, 64, 3, 2, config=tmp_path / "cfg.yaml")
    n = p["counts"]["heldout"]
    assert 0 < n <= 64 and p["counts"]["mtbench"] == 3 and p["counts"]["humaneval"] == 2
    assert p["groups"] == ["heldout"] * n + ["mtbench"] * 3 + ["humaneval"] * 2 and len(p["ids"]) == n + 5
    assert p["asked"]["heldout"] == 64 and all(isinstance(i, int) for ids in p["ids"] for i in ids)

    groups = ["heldout", "heldout", "mtbench", "humaneval"]
    outs = [[1, 2, 3, 4], [5, 6, 7], [8, 9], [10, 11, 12]]
    per = [{"seconds": 1.0, "spec_decode_num_drafts": d, "spec_decode_num_draft_tokens": 3 * d,
            "spec_decode_num_accepted_tokens": a, "accepted_in_output": a} for d, a in ((2, 1), (1, 0), (1, 1), (1, 0))]
    dflash = {"name": "dflash", "k": 3, "outputs": outs, "per_prompt": per, "seconds": 4.0, "load_seconds": 1.0,
              **{c: sum(x[c] for x in per) for c in per[0] if c.startswith("spec_")},
              "accepted_in_output": 2}
    rows = group_rows([dflash], groups, outs, {"trainer": "x"})
    by = {r["group"]: r for r in rows}
    assert set(by) == {"all", "heldout", "mtbench", "humaneval"} and all(r["lossless"] for r in rows)
    # tau = new tokens / verify steps (new = output tokens - one prompt token each, as summarise counts)
    assert by["heldout"]["tau"] == pytest.approx((4 + 3 - 2) / (4 + 3 - 2 - 1))
    assert by["mtbench"]["prompts"] == 1 and by["all"]["prompts"] == 4
    assert not group_rows([dflash], groups, [o[:-1] for o in outs], {})[0]["lossless"]


def test_bench_serves_every_training_both_ways(tmp_path, tiny_target_dir):
    """Bench.exports: ours trained with the subset is served as exported (its draft vocabulary) and
    over the whole vocabulary (export-full); every other export gets the draft vocabulary of ours
    added (export-dv), the same ids for every row."""
    from dataclasses import replace

    from dflash_train.config import ModelConfig, TargetConfig
    from dflash_train.export import write_export
    from dflash_train.model import DFlashDrafter, DrafterConfig
    from dflash_train.serving_check import target_facts
    from dflash_train.targets import load_target

    t = load_target(TargetConfig(path=str(tiny_target_dir), device="cpu", dtype="float32"))
    facts = target_facts(str(tiny_target_dir))
    cfg = DrafterConfig.from_target(ModelConfig(num_layers=1, block_size=4, target_layer_ids=[1]), t)
    ids = torch.tensor([2, 5, 9, 40, 100])
    a = bench.parse(["--out", str(tmp_path / "out"), "--seconds", "60", "--parallel", "1"])
    b = bench.Bench(a)
    b.data = tmp_path / "data"
    b.data.mkdir()
    (b.data / "target_dir.txt").write_text(f"{tiny_target_dir}\n")
    b.sec_dir, b.tok_dir = a.out / "s60", a.out / "s60-tokens"
    runs = {}
    for tag in ("dflash-train", "dflash-train-vs0", "speculators"):
        run = b.sec_dir / tag / "seed0"
        if tag == "dflash-train":
            dv = DFlashDrafter(replace(cfg, draft_vocab_size=len(ids)), seed=0)
            dv.draft_vocab.copy_(ids)
            write_export(dv.cfg, dv.state_dict(), run / "export", target=facts, lm_head_weight=t.lm_head_weight)
            write_export(cfg, DFlashDrafter(cfg, seed=0).state_dict(), run / "export-full", target=facts)
        else:
            write_export(cfg, DFlashDrafter(cfg, seed=1).state_dict(), run / "export", target=facts)
        runs[f"{tag}/seconds/s0"] = {"steps": 1}
    runs["specforge/seconds/s0"] = {"error": "train: failed"}
    dirs = b.exports(runs)
    assert set(dirs) == {f"{t}/seconds/s0/{s}" for t in ("dflash-train", "dflash-train-vs0", "speculators")
                         for s in ("full", "dv")}
    assert dirs["dflash-train/seconds/s0/dv"].name == "export" and dirs["dflash-train/seconds/s0/full"].name == "export-full"
    for k, d in dirs.items():
        if k.endswith("/dv"):
            assert draft_vocab.draft_vocab_ids(d).tolist() == ids.tolist(), k
        else:
            assert "draft_vocab_size" not in json.loads((d / "config.json").read_text()), k
    assert json.loads((a.out / "draft_vocab.json").read_text())["ids"] == ids.tolist()
