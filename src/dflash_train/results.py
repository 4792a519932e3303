"""The one result row of a decoding method: what `eval`, the demo's summary and report, and
measurements in a serving engine (vLLM, SGLang: `measured_by`) report, so their rows join one
table. Standard library only (report.py, eval/ and the engine measurement all use it)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence


@dataclass(frozen=True)
class MethodRow:
    method: str  # what decoded: "DFlash drafter (trained)", "prompt lookup (k=15)", "plain decoding", ...
    tau: float | None  # tokens per target forward (plain decoding: 1)
    tokens_per_s: float | None = None  # None: not decoded for time (tau by replay only)
    speedup: float | None = None  # tokens/s over plain decoding's in the same place
    lossless: bool | None = None  # output identical to plain greedy decoding; None: not checked
    mismatched: tuple[int, ...] = ()  # prompts whose output differed (lossless False)
    measured_by: str = "dflash-train"  # where: our decoding loop, or an engine ("vllm", "sglang")
    decoded: bool = True  # False: a tau by replay, no decoding (the time columns do not apply)
    reference: bool = False  # plain decoding itself: what "lossless" compares with
    # measured in an engine only (None elsewhere): its draft length, tokens per step that had a draft
    k: int | None = None
    tokens_per_draft: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mismatched"] = list(self.mismatched)
        return d


def jsonable(v: Any) -> Any:
    """NaN/inf -> None (strict JSON), recursively: what every `--json` prints."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    return v


def fmt(v: Any, spec: str = "", missing: str = "n/a", suffix: str = "") -> str:
    """THE number formatter of every table, report.md and the model card. One NaN rule: None, NaN
    and +-inf -> `missing` (what `--json` writes as null, `jsonable`); a value `spec` cannot
    format (a string): as it is."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return missing
    try:
        return format(v, spec) + suffix
    except (TypeError, ValueError):
        return str(v)


def lossless_cell(ok: bool | None, unchecked: str = "not checked", detail: str = "") -> str:
    """THE lossless cell: "yes", "NO" (+ " (detail)": which prompts or methods differed), or
    `unchecked` when not compared with plain decoding ("-", "n/a", "n/a (sampling)", ...)."""
    if ok is None:
        return unchecked
    return "yes" if ok else "NO" + (f" ({detail})" if detail else "")


def lossless_of(verdicts: Sequence[tuple[str, bool | None]], unchecked: str = "-") -> str:
    """The lossless cell of several methods' verdicts (("DFlash", True), ("n-gram", None), ...):
    those checked pooled, the methods that differed named; none checked: `unchecked`."""
    checked = [(name, ok) for name, ok in verdicts if ok is not None]
    if not checked:
        return unchecked
    bad = [name for name, ok in checked if not ok]
    return lossless_cell(not bad, detail=", ".join(bad))


def lossless_text(row: MethodRow) -> str:
    if not row.decoded or row.reference:
        return "-"
    detail = f"prompts {list(row.mismatched)}" if row.mismatched or row.lossless is False else ""
    return lossless_cell(row.lossless, "not checked", detail)


def cells(row: MethodRow, lossless: bool = True) -> list[str]:
    """[method, tau, tokens/s, speedup(, same as plain)] as text."""
    if not row.decoded:
        out = [row.method, fmt(row.tau, ".3f"), "-", "-"]
    else:
        out = [row.method, fmt(row.tau, ".3f"), fmt(row.tokens_per_s, ".2f"), fmt(row.speedup, ".2f")]
    return out + [lossless_text(row)] if lossless else out


def eval_rows(res: dict[str, Any], drafter_label: str = "DFlash drafter") -> list[MethodRow]:
    """The rows of one `evaluate_tau` result: the drafter, prompt lookup (when measured), the
    drafter from masks only (a seeded drafter; replay), plain decoding (when measured)."""
    rows = [MethodRow(drafter_label, res["tau"], res["tokens_per_s_spec"], res["speedup"], res["outputs_match"],
                      tuple(res.get("mismatched_prompts") or ()))]
    if res.get("tau_ngram") is not None:
        rows.append(MethodRow(f"prompt lookup (k={res['ngram_k']})", res["tau_ngram"], res["tokens_per_s_ngram"],
                              res["speedup_ngram"], res["outputs_match_ngram"],
                              tuple(res.get("mismatched_prompts_ngram") or ())))
    if res.get("tau_unseeded") is not None:
        rows.append(MethodRow("  same drafter, masks only (no lookup seeds: as SGLang / vLLM run it)",
                              res["tau_unseeded"], decoded=False))
    if res.get("tokens_per_s_plain") is not None:
        rows.append(plain_row(res["tokens_per_s_plain"]))
    return rows


def plain_row(tokens_per_s: float | None, method: str = "plain decoding") -> MethodRow:
    return MethodRow(method, 1.0, tokens_per_s, 1.0, None, reference=True)



# ----------------------------------------------------------------- a group's figures (eval/serve-bench --suite)


@dataclass(frozen=True)
class Figures:
    """One method's figures pooled over a group of prompts (a suite, an MT-Bench category): what
    `eval --suite` pools from per-prompt `evaluate_tau` results (eval/suite_bench.pool_eval) and
    `serve-bench --suite` from engine rows (engine/suite_serving.engine_figures)."""

    tau: float | None = None
    tokens_per_draft: float | None = None  # engine counters only
    tokens_per_s: float | None = None
    speedup: float | None = None
    lossless: bool | None = None
    mismatched: tuple[int, ...] | None = None  # the prompts that differed; None: not tracked (engine)

    @classmethod
    def of_engine(cls, r: Mapping[str, Any]) -> "Figures":
        """From one `engine.measure.summarise` row (empty: the method was not served)."""
        return cls(r.get("tau"), r.get("tokens_per_draft"), r.get("tokens_per_s"), r.get("speedup"), r.get("lossless"))


def group_figures(dflash: Figures, ngram: Figures, plain_tokens_per_s: float | None) -> dict[str, Any]:
    """A group's flat figures (summary.json, `--json`, the suite tables): DFlash's under their own
    names, n-gram's with the ``_ngram`` suffix, plain decoding's tok/s. The one place that names them."""
    out: dict[str, Any] = {}
    for f, sfx in ((dflash, ""), (ngram, "_ngram")):
        out.update({f"tau{sfx}": f.tau, f"tokens_per_draft{sfx}": f.tokens_per_draft,
                    f"tokens_per_s{sfx}": f.tokens_per_s, f"speedup{sfx}": f.speedup, f"lossless{sfx}": f.lossless})
        if f.mismatched is not None:
            out[f"mismatched_prompts{sfx}"] = list(f.mismatched)
    out["tokens_per_s_plain"] = plain_tokens_per_s
    return out


# ----------------------------------------------------------------- rows measured in a serving engine

ENGINE_COLUMNS = ("method", "k", "tau", "tokens/draft", "tok/s", "vs plain", "lossless")


def engine_row(r: Mapping[str, Any], measured_by: str = "vllm") -> MethodRow:
    """One row of an engine measurement (`engine.measure.summarise`'s dicts: what
    `serve-bench --json` prints and the demo's summary.json keeps) as a MethodRow, with the
    engine-only columns k and tokens per draft; lossless is against the engine's own plain run."""
    return MethodRow(r.get("label", r["method"]), r.get("tau"), r.get("tokens_per_s"), r.get("speedup"),
                     r.get("lossless"), measured_by=measured_by, reference=r["method"] == "plain",
                     k=r.get("k"), tokens_per_draft=r.get("tokens_per_draft"))


def engine_rows(measurement: Mapping[str, Any], measured_by: str = "vllm") -> list[MethodRow]:
    """The rows of one engine measurement (`engine.measure.measure_in_vllm`'s result, also the
    demo's summary["engine"]) as MethodRows."""
    return [engine_row(r, measured_by) for r in measurement.get("rows", [])]


def engine_cells(row: MethodRow, missing: str = "-", speedup_suffix: str = "", unchecked: str = "-") -> list[str]:
    """An engine row as text, in ENGINE_COLUMNS order (no k for plain decoding; lossless `unchecked`
    when not compared with a plain run: "-", or "n/a (sampling)" where outputs differ by chance)."""
    return [row.method, str(row.k or "-"), fmt(row.tau, ".3f", missing), fmt(row.tokens_per_draft, ".3f", missing),
            fmt(row.tokens_per_s, ".2f", missing), fmt(row.speedup, ".2f", missing, speedup_suffix),
            lossless_cell(row.lossless, unchecked)]
