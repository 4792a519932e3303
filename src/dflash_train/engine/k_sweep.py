"""`--k auto` (serve-bench, `demo.serve_k: auto`): the draft length chosen by a short sweep in vLLM.

The best k is a property of the pair and the hardware, not of the drafter alone: each draft token
is accepted less often than the one before, while the target's verify forward grows with k + 1
query tokens (on CPU k 7 ran at 0.97x plain where k 3 ran at 1.08x, docs/benchmarks.md). So the
sweep measures it: one worker job serves plain vLLM once and the DFlash export once per candidate
k (vLLM fixes the speculative config when an engine starts, so every k is an engine start of its
own), on the first `SWEEP_PROMPTS` prompts with at most `SWEEP_TOKENS` new tokens, and picks the k
with the highest engine tok/s (ties: the smaller k, the cheaper verify). The main measurement
then runs at that k. Short by design: with few prompts, tok/s differences of a few per cent are
within noise (the printed note says so). DFlash + lookup (`dflash+lookup`, our vLLM plugin) has a k of
its own: when it is served, the sweep serves it at every candidate k too and picks its fastest k
separately (lookup's copies can make a longer k pay where the drafter's blocks do not); n-gram is
served at DFlash's k, as before."""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from rich.console import Console
from rich.table import Table

from dflash_train.engine.measure import export_block_size, label_of, serve_methods, summarise
from dflash_train.errors import UserError
from dflash_train.results import fmt

# 1-5 where most CPU / small-batch optima lie, then sparser steps up to the 16-token block of the
# public recipe; block_size - 1 (the length the drafter trained for) is always added
BASE_CANDIDATES = (1, 2, 3, 4, 5, 7, 11, 15)
SWEEP_PROMPTS = 4
SWEEP_TOKENS = 32
AUTO = "auto"


def parse_k(value: Any, flag: str) -> int | str | None:
    """A k as the user wrote it: None, a number of draft tokens >= 1, or "auto". The upper bound
    (the drafter's block) is `check_k`'s, once the drafter is read."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text == AUTO:
        return AUTO
    try:
        k = int(text)
    except ValueError:
        raise UserError(f"{flag} {value}: give a number of draft tokens per step (>= 1) or auto") from None
    if k < 1:
        raise UserError(f"{flag} {value}: draft tokens per step must be >= 1 (or auto)")
    return k


def check_k(k: int | None, block_size: int, name: str) -> None:
    """k draft tokens per step: 1 .. block_size - 1 (a DFlash block is the anchor and k masks)."""
    if k is not None and not 1 <= k <= block_size - 1:
        raise UserError(f"{name}={k}: a drafter of block_size {block_size} drafts 1 to {block_size - 1} tokens per step")


def candidates(block_size: int) -> list[int]:
    kmax = int(block_size) - 1
    return sorted({c for c in BASE_CANDIDATES if c <= kmax} | {kmax})


def pick_k(rows: Sequence[dict[str, Any]]) -> int:
    """The k of the fastest row by engine tok/s; ties -> the smaller k."""
    timed = [r for r in rows if isinstance(r.get("tokens_per_s"), float) and math.isfinite(r["tokens_per_s"])]
    if not timed:
        raise UserError("--k auto: the sweep measured no tok/s (no tokens generated)")
    return max(timed, key=lambda r: (r["tokens_per_s"], -r["k"]))["k"]


def sweep_k(export_dir: Path, target_dir: Path, prompt_ids: Sequence[Sequence[int]], stop_token_ids: Sequence[int],
            max_new_tokens: int, dtype: str | None = None, log: Callable[[str], None] | None = None,
            temperature: float = 0.0, top_p: float = 1.0, lookup: Sequence[str] = ()) -> dict[str, Any]:
    """Plain vLLM and the export at each candidate k on the first few prompts (and each `lookup`
    method, `dflash+lookup`, at each k too); the rows, DFlash's chosen k ("k") and every swept
    method's ("ks": {method: k}). Raises UserError (one line) when vLLM cannot serve the pair."""
    ks = candidates(export_block_size(export_dir))
    ids = [list(p) for p in prompt_ids[:SWEEP_PROMPTS]]
    tokens = min(int(max_new_tokens), SWEEP_TOKENS)
    swept = ["dflash", *lookup]
    if log:
        log(f"k sweep: {', '.join(swept)} at k {', '.join(map(str, ks))} beside plain vLLM, {len(ids)} prompts x "
            f"<= {tokens} tokens (short: picks k, the measurement follows at it)")
    t0 = time.perf_counter()
    methods = ["plain"] + [m for m in swept for _ in ks]
    res, job = serve_methods(export_dir, target_dir, ids, stop_token_ids, tokens, methods,
                             dtype=dtype, log=log, temperature=temperature, top_p=top_p, ks=[0] + ks * len(swept))
    rows = [r for r in summarise(res["methods"], len(ids), compare_outputs=temperature <= 0) if r["method"] != "plain"]
    keep = ("method", "label", "k", "tau", "tokens_per_draft", "tokens_per_s", "speedup", "lossless", "drafts",
            "draft_tokens", "accepted_tokens", "new_tokens", "seconds", "load_seconds")
    plain = next(m for m in res["methods"] if m["name"] == "plain")
    plain_tps = sum(len(o) for o in plain["outputs"]) / plain["seconds"] if plain["seconds"] > 0 else None
    picked = {m: pick_k([r for r in rows if r["method"] == m]) for m in swept}
    return {"candidates": ks, "k": picked["dflash"], "ks": picked, "num_prompts": len(ids),
            "max_new_tokens": tokens, "dtype": job["dtype"], "tokens_per_s_plain": plain_tps,
            "seconds": time.perf_counter() - t0, "rows": [{c: r[c] for c in keep} for r in rows]}


def sweep_note(sweep: dict[str, Any]) -> str:
    ks = sweep.get("ks") or {"dflash": sweep["k"]}
    fastest = ", ".join(f"{label_of(m)} {k}" for m, k in ks.items()) if len(ks) > 1 else str(sweep["k"])
    return (f"k sweep: {sweep['num_prompts']} prompts x <= {sweep['max_new_tokens']} tokens per k (short; tok/s "
            f"differences of a few % are noise), fastest k {fastest} (ties: the smaller k); the measurement "
            "below runs at it")


def print_sweep(sweep: dict[str, Any], console=None) -> None:
    """The sweep's rows (k, tau, tokens/draft, tok/s, vs plain, lossless), each method's chosen k
    marked (a method column when more than DFlash was swept)."""
    ks = sweep.get("ks") or {"dflash": sweep["k"]}
    t = Table(title=f"k sweep in vLLM (plain vLLM {fmt(sweep['tokens_per_s_plain'], '.2f')} tok/s)")
    for c in (["method"] if len(ks) > 1 else []) + ["k", "tau", "tokens/draft", "tok/s", "vs plain", "lossless"]:
        t.add_column(c, justify="left" if c == "method" else "right")
    for r in sweep["rows"]:
        lossless = "-" if r["lossless"] is None else ("yes" if r["lossless"] else "NO")
        method = r.get("method", "dflash")
        t.add_row(*([label_of(method)] if len(ks) > 1 else []),
                  f"{r['k']}{' *' if r['k'] == ks.get(method) else ''}", fmt(r["tau"], ".3f"),
                  fmt(r["tokens_per_draft"], ".3f"), fmt(r["tokens_per_s"], ".2f"),
                  fmt(r["speedup"], ".2f", suffix="x"),
                  lossless)
    con = console or Console()
    con.print(t)
    con.print(sweep_note(sweep), markup=False)
