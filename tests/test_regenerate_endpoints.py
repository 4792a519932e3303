"""`dflash-train regenerate --endpoint URL` / `--local-servers N` (issue 37): the answers written by
real vLLM servers on 127.0.0.1 (CPU, a tiny float32 target, one thread each), driven through the
CLI as a user runs it, servers killed with real SIGKILLs mid-run.

The tiny target's end-of-turn logit is boosted so that about a third of its answers end at the
stop token (the stop id must be left out of the stored ids). Greedy float32: every answer's token
ids must equal what our in-process path (`regenerate` without --endpoint) writes.

Each vLLM start costs ~30-60 s on 2 shared cores: two servers start once per module, one restart,
two local servers once.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from conftest import write_tiny_jsonl
from dflash_train.engine.local_servers import SERVER_MODULE, free_port
from dflash_train.engine.vllm_process import REPO_VENV

VLLM_PY = Path(os.environ.get("DFLASH_TRAIN_VLLM_PYTHON") or REPO_VENV / "bin" / "python")
if not VLLM_PY.is_file() and os.environ.get("CI"):
    raise RuntimeError("CI must have vLLM installed (make test installs .venv-vllm)")
pytestmark = pytest.mark.skipif(not VLLM_PY.is_file(), reason="vLLM not installed: run `make vllm`")

N, TOKENS = 48, 48
# wide lines: rich wraps at 80 columns when not on a terminal
# VLLM_ENABLE_V1_MULTIPROCESSING=0, vLLM's own switch: each server's model runs in its engine-core process, one
# interpreter fewer per server start (ready in 55 s instead of 83 s, measured on 2 busy cores)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "250", "CUDA_VISIBLE_DEVICES": "",  # CPU placement
       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


class Server:
    """A vLLM server started by hand, as docs/fleet.md does, with one thread."""

    def __init__(self, model: Path, log: Path):
        self.model, self.log, self.port, self.proc = model, log, free_port(), None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {**ENV, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        env.pop("PYTHONPATH", None)
        with open(self.log, "a") as lf:
            self.proc = subprocess.Popen(
                [str(VLLM_PY), "-m", SERVER_MODULE, "--model", str(self.model), "--host", "127.0.0.1", "--port",
                 str(self.port), "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "16",
                 "--enforce-eager", "--seed", "0"],
                stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, timeout: float = 400) -> None:
        import urllib.request

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"{self.url} not ready in {timeout} s: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL the whole process group: the API server, its engine core and workers."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.proc is not None:
            assert_group_gone(self.proc.pid)


def assert_group_gone(pgid: int, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while True:
        alive = [ln for ln in subprocess.run(["ps", "-eo", "pgid=,stat="], capture_output=True, text=True)
                 .stdout.splitlines() if ln.split()[0] == str(pgid) and not ln.split()[1].startswith("Z")]
        if not alive:
            return
        assert time.monotonic() < end, f"processes of group {pgid} still running: {alive}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def target(tiny_target_factory, tmp_path_factory) -> Path:
    """The tiny Llama vLLM serves (2 heads of 32), its end-of-turn logit boosted x3."""
    import torch
    from safetensors.torch import load_file, save_file

    src = tiny_target_factory("llama", hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32)
    out = tmp_path_factory.mktemp("eot-boosted") / "target"
    shutil.copytree(src, out)
    sd = load_file(out / "model.safetensors")
    eot = json.loads((out / "config.json").read_text())["eos_token_id"]
    with torch.no_grad():
        sd["lm_head.weight"][eot] *= 3.0
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_tiny_jsonl(tmp_path_factory.mktemp("regen-data") / "conv.jsonl", n=N)


def args(target: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dflash_train.cli", "regenerate", f"target.path={target}",
            f"data.source=jsonl:{data}", f"data.limit={N}", "data.max_tokens=128", "--out", str(out),
            "--max-new-tokens", str(TOKENS), *extra]


def run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    lf = open(log, "w")
    # Ctrl-C's default action, as in a terminal, also when the suite itself runs in the background
    # (a shell starts background jobs with SIGINT ignored, and children inherit that)
    return subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, text=True, env=ENV,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def _engines(lines: list[bytes]) -> set[str]:
    engines = set()
    for line in lines:
        try:
            engines.add(json.loads(line)["regenerated"]["engine"])
        except (ValueError, KeyError, TypeError):  # a line still being written
            pass
    return engines


def wait_for_records(out: Path, n: int, proc: subprocess.Popen, log: Path, timeout: float = 300,
                     engine: str | None = None) -> None:
    """Until `out` holds n records (and, with `engine`, one answered by that endpoint)."""
    def ready() -> bool:
        lines = out.read_bytes().splitlines() if out.is_file() else []
        return len(lines) >= n and (engine is None or engine in _engines(lines))

    end = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"exited {proc.returncode} before {n} records: {log.read_text()[-3000:]}"
        assert time.monotonic() < end, log.read_text()[-3000:]
        time.sleep(0.05)


@pytest.fixture(scope="module")
def servers(target, tmp_path_factory):
    logs = tmp_path_factory.mktemp("servers")
    fleet = [Server(target, logs / "a.log"), Server(target, logs / "b.log")]
    try:
        for s in fleet:
            s.start()
        for s in fleet:
            s.wait_ready()
        yield fleet
    finally:
        for s in fleet:
            s.kill()


@pytest.fixture(scope="module")
def in_process(target, data, tmp_path_factory) -> dict[str, dict]:
    """What our in-process path (HF, float32, greedy) writes for the same conversations."""
    out = tmp_path_factory.mktemp("in-process") / "regen.jsonl"
    r = run(args(target, data, out))
    assert r.returncode == 0, r.stderr[-3000:]
    recs = {rec["id"]: rec for rec in records(out)}
    finished = [r for r in recs.values() if r["regenerated"]["finished"]]
    assert len(finished) >= 5 and any(r["regenerated"]["new_tokens"] < TOKENS for r in finished)
    return recs


def check_against_in_process(recs: list[dict], in_process: dict[str, dict], target: Path) -> None:
    """Every answer exactly once, each equal to the in-process one: token ids, text, finished."""
    from transformers import AutoTokenizer

    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids)) and set(ids) == set(in_process)
    tok = AutoTokenizer.from_pretrained(target)
    eot = json.loads((target / "config.json").read_text())["eos_token_id"]
    for r in recs:
        mine, ref = r["regenerated"], in_process[r["id"]]["regenerated"]
        assert mine["token_ids"] == ref["token_ids"], r["id"]
        assert eot not in mine["token_ids"] and mine["new_tokens"] == len(mine["token_ids"])
        assert mine["finished"] == ref["finished"]
        assert r["conversations"] == in_process[r["id"]]["conversations"]
        assert r["conversations"][-1]["value"] == tok.decode(mine["token_ids"], skip_special_tokens=True).strip()


def test_sampled_answers_are_seeded_per_conversation_alike_on_any_endpoint(servers, in_process, target, data, tmp_path):
    """--temperature / --top-p: one seed per conversation (train.seed, its id), so a request
    answered by another endpoint, in another batch, or by a rerun is the same sample."""
    a, b = servers
    sampled = ["--temperature", "0.8", "--top-p", "0.9"]
    runs = []
    for name, extra in (("both", ["--endpoint", a.url, "--endpoint", b.url, "--max-in-flight", "4"]),
                        ("one", ["--endpoint", a.url, "--max-in-flight", "1"])):
        r = run(args(target, data, tmp_path / f"{name}.jsonl", *sampled, *extra))
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append({rec["id"]: rec["regenerated"] for rec in records(tmp_path / f"{name}.jsonl")})
    both, one = runs
    assert both.keys() == one.keys() and all(both[k]["token_ids"] == one[k]["token_ids"] for k in both)
    assert {r["engine"] for r in both.values()} == {a.url, b.url}
    assert all(r["temperature"] == 0.8 and r["top_p"] == 0.9 for r in both.values())
    greedy = {k: r["regenerated"]["token_ids"] for k, r in in_process.items()}
    assert sum(both[k]["token_ids"] != greedy.get(k) for k in both) > len(both) // 2


def test_two_servers_one_killed_mid_run_every_answer_once_and_equal_to_in_process(servers, in_process, target, data,
                                                                                  tmp_path):
    a, b = servers
    out, log = tmp_path / "regen.jsonl", tmp_path / "cli.log"
    p = start(args(target, data, out, "--endpoint", a.url, "--endpoint", b.url + "/v1", "--max-in-flight", "1"), log)
    try:
        wait_for_records(out, 4, p, log, engine=b.url)  # b has answered before it dies
        b.kill()
        assert p.wait(180) == 0, log.read_text()[-3000:]
    finally:
        p.kill()
    text = log.read_text()
    assert f"endpoint {b.url} failed" in text and "Traceback" not in text
    recs = records(out)
    check_against_in_process(recs, in_process, target)
    by = Counter(r["regenerated"]["engine"] for r in recs)
    assert by[a.url] > by[b.url] > 0, by  # b answered until it died, a took over its work


def test_free_port_is_below_the_ephemeral_range_and_free():
    """CI once lost a server start to "Address already in use": a port-0 pick is also what the kernel
    hands any other process's port-0 bind or outgoing connection before our server binds it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports) and len(ports) > 1, ports
    held = socket.socket()
    held.bind(("127.0.0.1", 0))  # what an engine's own port-0 bind takes
    try:
        assert held.getsockname()[1] >= low
        for p in ports:  # each still binds: nothing else took it
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))
    finally:
        held.close()


def test_bad_or_unreachable_endpoint_or_bad_count_is_one_line(target, data, tmp_path):
    out = tmp_path / "regen.jsonl"
    port = free_port()
    for extra, says in ((["--endpoint", "ftp://127.0.0.1:1"],
                         "error: --endpoint 'ftp://127.0.0.1:1': not an http(s) URL"),
                        (["--endpoint", f"http://127.0.0.1:{port}"], f"error: --endpoint http://127.0.0.1:{port}: "),
                        (["--local-servers", str(len(os.sched_getaffinity(0)) + 1)], "error: --local-servers")):
        r = run(args(target, data, out, *extra))
        assert r.returncode == 2, r.stderr[-2000:]
        assert r.stderr.strip().splitlines()[-1].startswith(says), r.stderr[-2000:]
        assert "Traceback" not in r.stderr and not (out.is_file() and out.read_text())


def test_every_endpoint_down_stops_with_one_line_and_the_rerun_completes(servers, in_process, target, data, tmp_path):
    a = servers[0]
    out, log = tmp_path / "regen.jsonl", tmp_path / "cli.log"
    p = start(args(target, data, out, "--endpoint", a.url, "--max-in-flight", "1", "--endpoint-wait", "3"), log)
    try:
        wait_for_records(out, 4, p, log)
        a.kill()
        rc = p.wait(120)
    finally:
        p.kill()
    text = log.read_text()
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert rc == 2 and len(errors) == 1 and "every endpoint has been down for 3 s" in errors[0], text[-3000:]
    assert "Traceback" not in text
    kept = records(out)  # every line written parses: fsync'd records, no torn line
    assert 4 <= len(kept) < len(in_process)

    a.start()  # the same server again, same port
    a.wait_ready()
    r = run(args(target, data, out, "--endpoint", a.url))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"({len(kept)} already there" in r.stderr
    recs = records(out)
    assert recs[:len(kept)] == kept
    check_against_in_process(recs, in_process, target)


def test_local_servers_answer_and_stop_and_ctrl_c_leaves_no_server(servers, target, data, tmp_path):
    for s in servers:  # the cores go to the local servers
        s.kill()
    out, log = tmp_path / "regen.jsonl", tmp_path / "cli.log"
    # Ctrl-C while the servers start: they are stopped, nothing is written
    p = start(args(target, data, out, "--local-servers", "2"), log)
    try:
        while "started 2 local vLLM server(s)" not in log.read_text():
            assert p.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(3)  # engine cores being spawned
        p.send_signal(signal.SIGINT)
        assert p.wait(60) == 130
    finally:
        p.kill()
    text = log.read_text()
    pids = [int(x) for x in re.findall(r"\(pid (\d+),", text)]
    assert len(pids) == 2 and "stopped 2 local vLLM server(s)" in text, text[-3000:]
    for pid in pids:
        assert_group_gone(pid)
    assert not (out.is_file() and out.read_text())
    kept = re.search(r"local vLLM server logs kept in (\S+)", text)
    assert kept and Path(kept[1]).is_dir()
    shutil.rmtree(kept[1])

    r = run(args(target, data, out, "--local-servers", "2", "--max-in-flight", "4"), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    text = r.stdout + r.stderr
    placed = re.findall(r"\(pid (\d+), cores (\d[\d,]*)\)", text)
    pids = [int(pid) for pid, _ in placed]
    assert len(pids) == 2 and len({cores for _, cores in placed}) == 2, text[-3000:]  # the cores split
    for pid in pids:
        assert_group_gone(pid)
    m = re.search(r"wrote (\d+) answers .*\((\d+) already there, (\d+) prompts too long, (\d+) empty\)", r.stderr)
    assert m and int(m[1]) + int(m[4]) == N, r.stderr[-2000:]
    recs = records(out)
    assert len({r["id"] for r in recs}) == len(recs) == int(m[1])
    assert len({r["regenerated"]["engine"] for r in recs}) == 2  # both servers answered
