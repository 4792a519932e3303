"""`regenerate --endpoint URL`: answers written by OpenAI-compatible servers (`vllm serve`,
SGLang), any number of them, through ``POST /v1/completions``.

The prompt goes out as token ids (our chat format applied, exactly as the in-process path does)
and the answer comes back as the server's own token ids (``"return_token_ids": true``, which
vLLM 0.32's and SGLang's /v1/completions have): the text is never tokenized again. Each request
stops at the chat format's stop ids (``stop_token_ids``); a server returns the stop id that
ended the answer, which the caller drops like the in-process path does.

`Fleet` keeps at most ``max_in_flight`` requests in flight per endpoint (one thread each; the
server batches them). A request that fails because its server failed (connection refused or
reset, timeout, HTTP 5xx / 408 / 429, a reply that is not JSON) goes back to the shared queue
with a backoff and is taken by another endpoint; the failed endpoint is re-probed with backoff
(``GET /v1/models``) and rejoins when it answers. A request a server refuses (another HTTP 4xx)
would be refused by every server: one line, the run stops. No endpoint up for ``wait_s`` seconds:
`EndpointError` (one line). Standard library only (urllib + threads): no HTTP client dependency.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import queue
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from http.client import HTTPException
from typing import Callable, ContextManager, Iterator, Sequence

from dflash_train.errors import UserError

MODELS, COMPLETIONS = "/v1/models", "/v1/completions"
PROBE_TIMEOUT_S = 10.0
MAX_BACKOFF_S = 30.0
# a request that made this many servers fail is not retried again (a request that crashes servers)
MAX_ATTEMPTS = 8


class EndpointError(UserError):
    """An endpoint problem the user fixes (bad URL, unreachable, refused, all down): one line, exit 2."""


class Unavailable(Exception):
    """The server failed (not the request): retry elsewhere."""


class Refused(Exception):
    """The server refused this request (HTTP 4xx): every server would."""


def endpoint_base(url: str) -> str:
    """``http://host:port`` (+ any path prefix) of an --endpoint value; a pasted OpenAI base URL
    (``.../v1``) is accepted. Raises EndpointError for anything that is not an http(s) URL."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise EndpointError(f"--endpoint {url!r}: not an http(s) URL (e.g. http://10.0.0.5:8000)")
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        raise EndpointError(f"--endpoint {url!r}: the port is not a number") from None
    path = parts.path.rstrip("/")
    path = path[:-3] if path.endswith("/v1") else path
    return f"{parts.scheme}://{parts.netloc}{path}"


def _http(url: str, body: dict | None, timeout: float) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        detail = _error_message(e)
        if e.code >= 500 or e.code in (408, 429):
            raise Unavailable(f"HTTP {e.code} {detail}") from None
        raise Refused(f"HTTP {e.code} {detail}") from None
    except (urllib.error.URLError, OSError, HTTPException) as e:
        reason = getattr(e, "reason", None) or e
        raise Unavailable(str(reason) or type(reason).__name__) from None
    try:
        return json.loads(raw)
    except ValueError:
        raise Unavailable(f"a reply that is not JSON from {url}") from None


def _error_message(e: urllib.error.HTTPError) -> str:
    """The server's own error message (vLLM, SGLang: {"error": {"message"}} or {"message"})."""
    try:
        obj = json.loads(e.read() or b"{}")
        err = obj.get("error", obj)
        msg = err.get("message") if isinstance(err, dict) else err
        return " ".join(str(msg or e.reason).split())[:300]
    except (ValueError, OSError, AttributeError):
        return str(e.reason)


@dataclass
class Served:
    model: str
    max_model_len: int | None


def probe(base: str, timeout: float = PROBE_TIMEOUT_S) -> Served:
    """The model an endpoint serves (``GET /v1/models``). Raises Unavailable / Refused."""
    obj = _http(base + MODELS, None, timeout)
    models = obj.get("data") if isinstance(obj, dict) else None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise Refused(f"{base}{MODELS} lists no model (is this an OpenAI-compatible server?)")
    n = models[0].get("max_model_len")
    return Served(str(models[0]["id"]), int(n) if isinstance(n, int) else None)


@dataclass
class Sampling:
    max_new_tokens: int
    stop_token_ids: list[int]
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0  # with the conversation id: one seed per request, the same on every endpoint

    def request_seed(self, key: str) -> int:
        """A stable per-conversation seed: a request retried on another endpoint (or by a rerun)
        asks for the same sample."""
        return int(hashlib.sha256(f"{self.seed}:{key}".encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


def completion_body(model: str, prompt_ids: Sequence[int], s: Sampling, key: str) -> dict:
    body = {"model": model, "prompt": list(prompt_ids), "max_tokens": s.max_new_tokens,
            "temperature": s.temperature, "stop_token_ids": list(s.stop_token_ids), "return_token_ids": True,
            # the server would otherwise fill unset fields from the model's generation_config
            "top_p": s.top_p if s.temperature > 0 else 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
            "n": 1, "stream": False}
    if s.temperature > 0:
        body["seed"] = s.request_seed(key)
    return body


def complete(base: str, model: str, prompt_ids: Sequence[int], s: Sampling, key: str,
             timeout: float) -> tuple[list[int], str]:
    """One answer: (the server's token ids, its finish_reason). Raises Unavailable / Refused."""
    obj = _http(base + COMPLETIONS, completion_body(model, prompt_ids, s, key), timeout)
    try:
        choice = obj["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise Unavailable(f"a completion without choices from {base}") from None
    ids = choice.get("token_ids")
    if not isinstance(ids, list):
        raise Refused(f"{base} returned no token ids: it must support \"return_token_ids\" on /v1/completions "
                      "(vLLM 0.32 and SGLang's OpenAI server have it)")
    return [int(t) for t in ids], str(choice.get("finish_reason"))


# --------------------------------------------------------------------------- the fleet


@dataclass
class FleetSpec:
    """What `regenerate` answers through: the --endpoint URLs and/or `start`, a context manager
    that starts servers and yields their URLs (local servers: started only when answers are
    needed, stopped on the way out)."""
    urls: Sequence[str] = ()
    start: Callable[[], ContextManager[list[str]]] | None = None
    max_in_flight: int = 64
    wait_s: float = 120.0

    def __post_init__(self):
        self.urls = [endpoint_base(u) for u in self.urls]  # a bad URL: one line before any work
        if self.max_in_flight < 1:
            raise EndpointError(f"--max-in-flight {self.max_in_flight}: must be >= 1")
        if not self.wait_s >= 0:
            raise EndpointError(f"--endpoint-wait {self.wait_s}: must be >= 0 seconds")


@dataclass
class Job:
    key: str
    prompt_ids: list[int]
    attempts: int = 0
    last_error: str = ""


@dataclass
class Answer:
    key: str
    token_ids: list[int]
    finish_reason: str
    endpoint: str


class _Endpoint:
    def __init__(self, base: str, served: Served):
        self.base, self.served = base, served
        self.up = threading.Event()
        self.up.set()
        self.answered = self.failures = self.in_flight = 0
        self.last_error = ""
        self.lock = threading.Lock()


class _Pending:
    """Jobs waiting for a worker; a retried job becomes eligible only after its backoff."""

    def __init__(self):
        self._heap: list[tuple[float, int, Job]] = []
        self._seq = 0
        self._cv = threading.Condition()

    def put(self, job: Job, delay: float = 0.0) -> None:
        with self._cv:
            heapq.heappush(self._heap, (time.monotonic() + delay, self._seq, job))
            self._seq += 1
            self._cv.notify()

    def get(self, timeout: float) -> Job | None:
        end = time.monotonic() + timeout
        with self._cv:
            while True:
                now = time.monotonic()
                if self._heap and self._heap[0][0] <= now:
                    return heapq.heappop(self._heap)[2]
                if now >= end:
                    return None
                self._cv.wait(min(self._heap[0][0] if self._heap else end, end) - now)


def backoff(attempt: int) -> float:
    return min(MAX_BACKOFF_S, 0.5 * 2 ** max(attempt - 1, 0))


class Fleet:
    """Answers prompts through endpoints (module docstring). `connect()` first: every endpoint
    must answer at the start (one line naming the one that does not)."""

    def __init__(self, urls: Sequence[str], max_in_flight: int = 64, wait_s: float = 120.0,
                 log: Callable[[str], None] = print, request_timeout: float = 600.0):
        self.urls = list(dict.fromkeys(endpoint_base(u) for u in urls))  # one server named twice is one
        self.max_in_flight, self.wait_s, self.log = max_in_flight, wait_s, log
        self.request_timeout = request_timeout
        self.endpoints: list[_Endpoint] = []
        self._stop = threading.Event()

    def connect(self) -> list[Served]:
        if not self.urls:
            raise EndpointError("no endpoint to answer through (--endpoint URL or --local-servers N)")
        found: dict[str, Served | str] = {}

        def one(base: str) -> None:
            try:
                found[base] = probe(base)
            except (Unavailable, Refused) as e:
                found[base] = str(e)

        threads = [threading.Thread(target=one, args=(u,), daemon=True) for u in self.urls]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for u in self.urls:
            if isinstance(found[u], str):
                raise EndpointError(f"--endpoint {u}: {found[u]} (is the server up? `curl {u}{MODELS}`)")
        self.endpoints = [_Endpoint(u, found[u]) for u in self.urls]
        return [e.served for e in self.endpoints]

    def check_context(self, need: int) -> None:
        """Every endpoint must hold the longest prompt plus max_new_tokens (one line, not a
        refusal per request halfway through the run)."""
        for e in self.endpoints:
            if e.served.max_model_len is not None and e.served.max_model_len < need:
                raise EndpointError(f"--endpoint {e.base} serves max_model_len {e.served.max_model_len} < {need} "
                                    "(the longest prompt + --max-new-tokens): restart it with "
                                    f"--max-model-len {need} or more, or lower --max-new-tokens")

    def counts(self) -> str:
        return "  ".join(f"{_short(e.base)} {e.answered}" + ("" if e.up.is_set() else " (down)")
                         for e in self.endpoints)

    def answer(self, jobs: Sequence[Job], sampling: Sampling) -> Iterator[Answer]:
        """Yields one Answer per job as they come back (any order). Raises EndpointError when no
        endpoint is up for `wait_s` seconds, when a server refuses a request, or when one request
        made MAX_ATTEMPTS servers fail."""
        pending, results = _Pending(), queue.Queue()
        for j in jobs:
            pending.put(j)
        self._stop.clear()
        # interleaved: the first requests spread over the endpoints (see also _least_loaded)
        workers = [threading.Thread(target=self._work, args=(e, pending, results, sampling), daemon=True,
                                    name=f"endpoint-{i}-{k}")
                   for k in range(self.max_in_flight) for i, e in enumerate(self.endpoints)]
        for w in workers:
            w.start()
        left, down_since = len(jobs), None
        try:
            while left:
                try:
                    item = results.get(timeout=0.5)
                except queue.Empty:
                    item = None
                if isinstance(item, Exception):
                    raise item
                if item is not None:
                    left -= 1
                    yield item
                if any(e.up.is_set() for e in self.endpoints):
                    down_since = None
                elif down_since is None:
                    down_since = time.monotonic()
                elif time.monotonic() - down_since > self.wait_s:
                    last = "; ".join(f"{e.base}: {e.last_error}" for e in self.endpoints)
                    raise EndpointError(f"every endpoint has been down for {self.wait_s:.0f} s ({last}): restart a "
                                        "server and rerun the same command, it goes on from there")
        finally:
            self._stop.set()  # workers and probers end; requests still in flight are abandoned

    def _work(self, ep: _Endpoint, pending: _Pending, results: queue.Queue, s: Sampling) -> None:
        while not self._stop.is_set():
            if not ep.up.wait(0.5):
                continue
            if not self._least_loaded(ep):
                self._stop.wait(0.05)
                continue
            job = pending.get(0.5)
            if job is None:
                continue
            with ep.lock:
                ep.in_flight += 1
            try:
                ids, reason = complete(ep.base, ep.served.model, job.prompt_ids, s, job.key, self.request_timeout)
            except Refused as e:
                results.put(EndpointError(f"--endpoint {ep.base} refused conversation {job.key}: {e}"))
                return
            except Unavailable as e:
                job.attempts += 1
                job.last_error = f"{ep.base}: {e}"
                if job.attempts >= MAX_ATTEMPTS:
                    results.put(EndpointError(f"conversation {job.key} failed on {job.attempts} attempts "
                                              f"(last {job.last_error}); a rerun goes on with the others"))
                    return
                pending.put(job, backoff(job.attempts))
                self._mark_down(ep, str(e))
                continue
            finally:
                with ep.lock:
                    ep.in_flight -= 1
            with ep.lock:
                ep.answered += 1
            results.put(Answer(job.key, ids, reason, ep.base))

    def _least_loaded(self, ep: _Endpoint) -> bool:
        """A worker takes a job only for an endpoint with the fewest requests in flight among
        those up: fewer jobs than slots (a small run, the tail of a long one, an endpoint back
        from a failure) spread over every endpoint instead of filling the first one."""
        return ep.in_flight <= min((e.in_flight for e in self.endpoints if e.up.is_set()), default=0)

    def _mark_down(self, ep: _Endpoint, reason: str) -> None:
        with ep.lock:
            ep.failures += 1
            ep.last_error = reason
            if not ep.up.is_set():
                return
            ep.up.clear()
        self.log(f"endpoint {ep.base} failed ({reason}): its requests go to the other endpoints; "
                 "re-probing it with backoff")
        threading.Thread(target=self._reprobe, args=(ep,), daemon=True, name=f"probe-{ep.base}").start()

    def _reprobe(self, ep: _Endpoint) -> None:
        attempt = 0
        while not self._stop.is_set():
            attempt += 1
            if self._stop.wait(backoff(attempt)):
                return
            try:
                served = probe(ep.base)
            except (Unavailable, Refused) as e:
                ep.last_error = str(e)
                continue
            ep.served = served
            ep.up.set()
            self.log(f"endpoint {ep.base} is back: answering again")
            return


def _short(base: str) -> str:
    return base.split("://", 1)[-1]

