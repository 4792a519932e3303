"""In-training evaluation: tau by real speculative decoding every eval.every_steps,
logged in metrics.jsonl beside the prompt-lookup baseline's tau; the best
checkpoint is marked; eval work is not counted as trained tokens; a stop signal
during an eval pass still stops cleanly."""
from __future__ import annotations

import json
import signal

from trainrun import losses, metrics, run_train, signal_and_wait, start_train, tiny_overrides, wait_for


def _over(target, jsonl, **kw):
    base = {"eval.every_steps": 3, "eval.num_prompts": 2, "eval.max_new_tokens": 6, "data.heldout_fraction": 0.2,
            "train.max_steps": 6}
    base.update(kw)
    return tiny_overrides(target, jsonl, **base)


def test_eval_logs_tau_marks_best_and_excludes_eval_tokens(tiny_target_factory, tmp_path):
    from conftest import write_tiny_jsonl

    jsonl = write_tiny_jsonl(tmp_path / "conv.jsonl", n=40)
    target = tiny_target_factory("qwen3")
    with_eval, without = tmp_path / "with", tmp_path / "without"
    assert run_train(with_eval, _over(target, jsonl)).returncode == 0
    assert run_train(without, _over(target, jsonl, **{"eval.every_steps": 0})).returncode == 0
    evals = [r for r in metrics(with_eval) if r.get("eval")]
    assert [r["step"] for r in evals] == [3, 6]
    assert all(r["tau"] >= 1.0 for r in evals)
    # the prompt-lookup baseline beside tau: measured once (it does not change with training)
    assert evals[0]["tau_ngram"] >= 1.0 and all(r["tau_ngram"] == evals[0]["tau_ngram"] for r in evals)
    best = (with_eval / "checkpoints" / "best").resolve()
    best_step = max(evals, key=lambda r: (r["tau"], -r["step"]))["step"]
    assert best.name == f"step-{best_step:08d}" and (best / "manifest.json").is_file()
    # eval work neither changes training nor counts as trained tokens
    train_w = {r["step"]: (r["loss"], r["tokens"]) for r in metrics(with_eval) if not r.get("eval")}
    train_wo = {r["step"]: (r["loss"], r["tokens"]) for r in metrics(without)}
    assert train_w == train_wo


def test_signal_during_eval_pass_stops_cleanly(tiny_target_factory, tmp_path):
    from conftest import write_tiny_jsonl

    jsonl = write_tiny_jsonl(tmp_path / "conv.jsonl", n=40)
    target = tiny_target_factory("qwen3")
    rd = tmp_path / "run"
    over = _over(target, jsonl, **{"eval.every_steps": 2, "eval.max_new_tokens": 400, "eval.num_prompts": 4,
                                   "train.max_steps": 6})
    proc = start_train(rd, over, tmp_path / "log")
    wait_for(lambda: (rd / "logs" / "train.log").exists()
             and "eval at step 2" in (rd / "logs" / "train.log").read_text(), 180, what="eval pass")
    assert signal_and_wait(proc, signal.SIGTERM) == 0, (tmp_path / "log").read_text()[-3000:]
    run = json.loads((rd / "run.json").read_text())
    assert run["live"] is False
    stopped = run["step"]
    assert (rd / "checkpoints" / "latest").resolve().name == f"step-{stopped:08d}"
    res = run_train(rd, over)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(losses(rd)) == list(range(1, 7))
