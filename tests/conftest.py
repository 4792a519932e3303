"""Shared fixtures: tiny random targets (built offline, cached per session)
and a small deterministic JSONL of conversations."""
from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from pathlib import Path

import pytest

# test-only knobs (tests/hooks/dflash_test_hooks.py): importable here, and installed at start-up
# in every subprocess through sitecustomize (inactive unless a DFLASH_TEST_* variable is set)
HOOKS = Path(__file__).resolve().parent / "hooks"
sys.path.insert(0, str(HOOKS))
os.environ["PYTHONPATH"] = os.pathsep.join([str(HOOKS), *filter(None, [os.environ.get("PYTHONPATH")])])

# Under pytest-xdist (make test: two workers) each worker's vLLM engines get their own share of the
# cores: an engine binds its OpenMP threads to every core it may use ("auto"), and two engines spinning
# on the same two cores slow each other far more than one core each does. A user's setting stays.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
    _cores, _n, _i = sorted(os.sched_getaffinity(0)), int(os.environ["PYTEST_XDIST_WORKER_COUNT"]), int(_WORKER[2:])
    _share = _cores[_i * len(_cores) // _n:(_i + 1) * len(_cores) // _n] or [_cores[_i % len(_cores)]]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, _share))

# CI=true: a skip for something `make test` installs (vLLM, dflash, sshd, the data packages,
# py-spy's ptrace...) fails instead (tests/ci_skips.py); every skip is listed with its reason (-ra)
from ci_skips import pytest_make_collect_report, pytest_runtest_makereport  # noqa: E402,F401
from shared_once import build_once  # noqa: E402

_SUBJECTS = ["the sea", "a robot", "Paris", "python code", "the moon", "a small cat", "speculative decoding",
             "the library", "a train", "the weather"]
_ASKS = ["Tell me about {s}.", "Write a short poem about {s}.", "What is special about {s}?",
         "Explain {s} in simple words.", "Could you summarize what you know about {s}, please?"]
_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Accepted tokens are kept and the first mismatch is replaced.",
    "The waves roll in and out again under a wide blue sky.",
    "It depends on the details, so let me think step by step.",
    "Once upon a time there was a little robot who wanted to read.",
    "A small draft model proposes several tokens at once.",
    "The capital of France is Paris, a city of art and light.",
    "Training requires data, a loss function, an optimizer and patience.",
    "for i in range(10): print(i)",
    "Thank you very much, you are welcome!",
]


def tiny_conversations(n: int = 24, seed: int = 0) -> list[dict]:
    """`n` deterministic ShareGPT-shape conversations (`id`, `conversations`);
    every third one has two user/assistant exchanges, every fifth a system turn."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        turns = []
        if i % 5 == 4:
            turns.append({"from": "system", "value": "You are a helpful assistant."})
        for _ in range(2 if i % 3 == 2 else 1):
            s = rng.choice(_SUBJECTS)
            turns.append({"from": "human", "value": rng.choice(_ASKS).format(s=s)})
            k = rng.randint(2, 4)
            turns.append({"from": "gpt", "value": f"About {s}: " + " ".join(rng.choice(_SENTENCES) for _ in range(k))})
        out.append({"id": f"tiny-{i:04d}", "conversations": turns})
    return out


def write_tiny_jsonl(path: Path, n: int = 24, seed: int = 0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(c) + "\n" for c in tiny_conversations(n, seed)))
    return path


# The longest test files first (measured: `pytest --durations`, docs/benchmarks.md): make test's two
# workers take whole files in collection order (--dist loadfile --no-loadscope-reorder), and a long
# file picked up last would leave one worker running alone at the end. test_engine_vllm.py builds the
# session's accepting export and shared engine run (tests/engine_fixtures.py) first; the files the other
# worker takes next need neither, so it does not sit on the build's lock (test_suites.py, test_k_auto.py,
# test_serve_lookup.py and test_vllm_lookup_plugin.py read them).
LONGEST_FIRST = ["test_engine_vllm.py", "test_deploy_flow.py", "test_regenerate_endpoints.py", "test_suites.py",
                 "test_k_auto.py", "test_train_resume.py", "test_model_compile.py",
                 "test_target_tensor_parallel.py", "test_no_data_loss.py", "test_compare.py", "test_storage_faults.py"]


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """One intra-op thread per test process: on a shared 2-core box tiny models
    run several times faster than with two (make test also sets OMP_NUM_THREADS=1)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_target_factory(tmp_path_factory):
    """factory(family="qwen3"|"llama"|"gemma3", **kw) -> Path of a tiny random
    HF directory; each distinct (family, kw) is built once per session."""
    from tiny_target import make_tiny_target

    cache: dict = {}

    def make(family: str = "qwen3", **kw) -> Path:
        key = (family, tuple(sorted(kw.items())))
        if key not in cache:
            # a string value (an alphabet) by its hash: a path vLLM and HF take as a plain directory
            name = family + "".join(f"-{k}{v if not isinstance(v, str) else hashlib.sha1(v.encode()).hexdigest()[:8]}"
                                    for k, v in sorted(kw.items()))
            # one build per test run, shared by the xdist workers (tests/shared_once.py)
            built = build_once(tmp_path_factory, f"tiny-targets/{name}",
                               lambda d: make_tiny_target(d / name, family=family, **kw))
            cache[key] = built / name
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_target_dir(tiny_target_factory) -> Path:
    """A tiny random qwen3 target directory (4 layers, hidden 64, ~480-token BPE)."""
    return tiny_target_factory("qwen3")


@pytest.fixture
def tiny_jsonl(tmp_path) -> Path:
    """A JSONL file of 24 deterministic ShareGPT-shape conversations."""
    return write_tiny_jsonl(tmp_path / "tiny.jsonl")


@pytest.fixture(scope="module")
def train_setup(tiny_target_factory, tmp_path_factory, request):
    """(tiny qwen3 target dir, 40-conversation JSONL, a scratch dir for the test module): what the
    modules that run `dflash-train train` share."""
    root = tmp_path_factory.mktemp(request.module.__name__.removeprefix("test_"))
    jsonl = write_tiny_jsonl(root / "conv.jsonl", n=40)
    return tiny_target_factory("qwen3"), jsonl, root


# the engine tests' shared drafter that accepts in vLLM (tests/engine_fixtures.py)
from engine_fixtures import accepting_export, served_accepting, speaking_llama  # noqa: E402,F401
