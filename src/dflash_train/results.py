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


def fmt(v: Any, spec: str, missing: str = "n/a", suffix: str = "") -> str:
    """A number for a table cell; None / NaN -> `missing`."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return missing
    return format(v, spec) + suffix


def lossless_text(row: MethodRow) -> str:
    if not row.decoded or row.reference:
        return "-"
    if row.lossless is None:
        return "not checked"
    return "yes" if row.lossless else f"NO (prompts {list(row.mismatched)})"


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


def rows_to_dicts(rows: Sequence[MethodRow]) -> list[dict[str, Any]]:
    return [r.to_dict() for r in rows]


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
            unchecked if row.lossless is None else ("yes" if row.lossless else "NO")]
