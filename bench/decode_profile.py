"""Where the time of DFlash speculative decoding goes: a per-step breakdown and tokens/s.

Runs plain greedy decoding (`plain_generate`) and DFlash speculative decoding
(`speculative_generate`) on held-out-like chat prompts against the real target
(default: the embedded Gemma 3 270M of configs/cpu-demo.yaml) with a drafter
(default: an UNTRAINED drafter of the cpu-demo shape, tau ~1; or --drafter
RUN_DIR / checkpoint / export dir; or --oracle: the drafter still runs, but
its logits are overwritten so it drafts the plain greedy continuation, i.e.
tau ~ block size).

tokens/s come from un-instrumented runs, plain and speculative interleaved
prompt by prompt, repeated (`--repeats`); the table shows the median and the
best repeat. The breakdown comes from one more, instrumented, pass: timers
wrap the target's decoder forward and lm_head, the drafter's draft_block /
extend_context, the drafter's lm_head (the target's head applied to the
drafter's hidden states), the target KV-cache crop and every host sync
(Tensor.item / tolist / __bool__ / __int__ / __float__); each row is
EXCLUSIVE time (a timed call inside another is subtracted from its parent).
Everything else in the loop (argmax, acceptance, slicing, bookkeeping) is
"rest of the loop". Timings on a shared CPU are noisy: compare runs made back
to back, and prefer the medians.

    .venv/bin/python bench/decode_profile.py                          # ~2-4 min on 2 cores
    .venv/bin/python bench/decode_profile.py --num-prompts 3 --max-new-tokens 64 --repeats 3
    .venv/bin/python bench/decode_profile.py --drafter runs/demo      # a trained drafter
    .venv/bin/python bench/decode_profile.py --oracle                 # the high-acceptance regime
    .venv/bin/python bench/decode_profile.py --json out.json          # also write the numbers
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

PROMPTS = [
    "Hello friend. My task for today is to engage in a debate with you. Will you humor me in this regard?",
    "Can you explain how a refrigerator keeps food cold, in simple terms?",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are some good strategies for learning a new language as an adult?",
    "I have chicken, rice, and broccoli. What can I cook for dinner tonight?",
    "Summarize the main causes of the First World War in a few paragraphs.",
    "Give me three tips for writing clean Python code.",
    "Why is the sky blue? Please answer as if I were ten years old.",
]

# rows of the speculative breakdown, in print order
SPEC_ROWS = [
    ("verify_body", "target verify forward (decoder over the block)"),
    ("verify_head", "target lm_head over the block"),
    ("draft_body", "drafter forward (draft_block)"),
    ("draft_head", "drafter lm_head (full vocab)"),
    ("draft_ctx", "drafter context cache (extend_context)"),
    ("crop", "target KV-cache crop"),
    ("seed", "prompt-lookup seeds (block_seeds drafters)"),
    ("embed", "block embedding"),
    ("sync", "host syncs (item/tolist/bool/int)"),
    ("rest", "rest of the loop (argmax, accept, slicing)"),
]
PLAIN_ROWS = [
    ("verify_body", "target decoder forward (1 token)"),
    ("verify_head", "target lm_head (1 token)"),
    ("sync", "host syncs (item/tolist/bool/int)"),
    ("rest", "rest of the loop"),
]


class Profiler:
    """Exclusive wall time per category over wrapped callables (CPU ops are synchronous;
    on CUDA the host syncs absorb the queued GPU work, so read it as a CPU-side view)."""

    def __init__(self) -> None:
        self.excl: dict[str, float] = defaultdict(float)
        self.incl: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.stack: list[float] = []
        self.phase = "target"  # which model the next lm_head call belongs to
        self.prefill = False  # before the first drafter context extension of a generation
        self.oracle = None  # (sequence list, anchor) when drafting perfectly
        self.anchor = 0
        self.mode = "spec"
        self.tcalls = 0  # outermost target forwards in this generation
        self.tdepth = 0
        self._undo: list = []

    def _timed(self, cat_fn, orig, before=None, after=None):
        prof = self

        def wrapper(*args, **kwargs):
            if before is not None:
                before(*args, **kwargs)
            cat = cat_fn() if callable(cat_fn) else cat_fn
            t0 = time.perf_counter()
            prof.stack.append(0.0)
            try:
                out = orig(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                child = prof.stack.pop()
                prof.excl[cat] += dt - child
                prof.incl[cat] += dt
                prof.calls[cat] += 1
                if prof.stack:
                    prof.stack[-1] += dt
            if after is not None:
                out = after(out, *args, **kwargs)
            return out

        return wrapper

    def patch(self, obj, name, cat_fn, before=None, after=None) -> None:
        if obj is None or not hasattr(obj, name):
            return
        had_own = name in getattr(obj, "__dict__", {})
        orig = getattr(obj, name)
        setattr(obj, name, self._timed(cat_fn, orig, before, after))
        self._undo.append((obj, name, orig if had_own else None))

    def unpatch(self) -> None:
        for obj, name, orig in reversed(self._undo):
            if orig is None:
                delattr(obj, name)
            else:
                setattr(obj, name, orig)
        self._undo.clear()

    def cat(self, kind: str):
        """Category for target/drafter work; everything before the first context extension is prefill."""
        return lambda: "prefill" if self.prefill else kind

    def reset(self) -> None:
        self.excl.clear()
        self.incl.clear()
        self.calls.clear()


def instrument(prof: Profiler, target, drafter, specdec, full: bool = True) -> None:
    """Wrap the timed callables; full=False wraps only what --oracle needs to rewrite the drafts."""
    model = target.model
    decoder = getattr(target, "decoder", None) or model.get_decoder()
    head = model.get_output_embeddings()

    def target_before(*a, **k):
        prof.phase = "target"
        if prof.tdepth == 0:
            prof.tcalls += 1
            if prof.mode == "plain" and prof.tcalls >= 2:
                prof.prefill = False  # plain: the prefill is the first target call (+ its head and sync)
        prof.tdepth += 1

    def target_after(out, *a, **k):
        prof.tdepth -= 1
        return out

    def head_cat():
        if prof.prefill:
            return "prefill"
        return "draft_head" if prof.phase == "drafter" else "verify_head"

    def oracle_logits(out, *args, **kwargs):
        """--oracle: the drafter's real logits, with the plain greedy token made the argmax."""
        if prof.oracle is None or prof.phase != "drafter" or prof.prefill:
            return out
        seq = prof.oracle
        a = prof.anchor
        out = out.clone()
        for k in range(out.shape[1]):
            p = a + 1 + k
            if p < len(seq):
                out[0, k, seq[p]] = out[0, k].max() + 1.0
        return out

    def on_draft(cache, block_embeds, anchor_position):
        prof.phase = "drafter"
        prof.anchor = int(anchor_position)

    def end_prefill(out, *args, **kwargs):
        prof.prefill = False  # speculative: the prefill ends with the first context extension
        return out

    def start(mode):
        def f(*a, **k):
            prof.mode, prof.prefill, prof.phase, prof.tcalls, prof.tdepth = mode, True, "target", 0, 0
        return f

    # the target: full CausalLM forward (its exclusive part = the head wrapper), decoder, lm_head
    prof.patch(model, "forward", head_cat, before=target_before, after=target_after)
    prof.patch(decoder, "forward", prof.cat("verify_body"), before=target_before, after=target_after)
    for name in ("logits", "inference_logits"):  # the drafter's lm_head is the target's head
        prof.patch(target, name, head_cat, after=oracle_logits)
    prof.patch(drafter, "draft_block", prof.cat("draft_body"), before=on_draft)
    prof.patch(drafter, "extend_context", prof.cat("draft_ctx"), after=end_prefill)
    prof.patch(specdec, "speculative_generate", "total_spec", before=start("spec"))
    prof.patch(specdec, "plain_generate", "total_plain", before=start("plain"))
    if not full:
        return
    prof.patch(head, "forward", head_cat)
    prof.patch(target, "embed", prof.cat("embed"))
    prof.patch(drafter, "new_cache", prof.cat("draft_ctx"))
    prof.patch(specdec, "_crop_to", prof.cat("crop"))
    prof.patch(specdec, "seed_blocks", prof.cat("seed"))
    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):  # host syncs
        prof.patch(torch.Tensor, name, prof.cat("sync"))


def load_drafter(path: str | None, target, cfg):
    from dflash_train.model.drafter import DFlashDrafter, DrafterConfig

    if path is None:
        return DFlashDrafter(DrafterConfig.from_target(cfg.model, target), seed=0).eval(), "untrained (cpu-demo shape)"
    from dflash_train.export import resolve_drafter_source

    src = resolve_drafter_source(path)
    d = DFlashDrafter(src.config, seed=0)
    missing, unexpected = d.load_state_dict(src.state_dict, strict=False)
    if missing or unexpected:
        sys.exit(f"{path}: weights do not fit the drafter config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    if src.config.hidden_size != target.hidden_size or src.config.vocab_size not in (0, target.vocab_size):
        sys.exit(f"{path}: drafter does not fit the target {target}")
    return d.to(target.device).eval(), f"{src.kind} {src.path}"


def fmt_table(rows, header) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/cpu-demo.yaml", help="run config for the target and the default drafter shape")
    ap.add_argument("--drafter", default=None, help="RUN_DIR, checkpoint dir or export dir (default: untrained)")
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed plain+spec passes over the prompts")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--oracle", action="store_true", help="overwrite the drafter's logits so it drafts the plain greedy tokens")
    ap.add_argument("--no-plain-breakdown", action="store_true")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if not 1 <= args.num_prompts <= len(PROMPTS):
        ap.error(f"--num-prompts must be 1..{len(PROMPTS)}")

    torch.set_num_threads(args.threads)
    from dflash_train.config import load_config
    from dflash_train.eval import specdec
    from dflash_train.eval.prompts import encode_prompts
    from dflash_train.targets import load_target

    cfg = load_config(args.config)
    t0 = time.perf_counter()
    target = load_target(cfg.target)
    drafter, dlabel = load_drafter(args.drafter, target, cfg)
    print(f"target {target.source} ({target.dtype}, {target.device}) + drafter {dlabel}: loaded in "
          f"{time.perf_counter() - t0:.1f}s; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"block size {drafter.cfg.block_size}", flush=True)
    ids, stops = encode_prompts(target, PROMPTS[:args.num_prompts])
    xs = [torch.tensor([p], dtype=torch.long, device=target.device) for p in ids]
    N = args.max_new_tokens

    prof = Profiler()
    # warm-up (one-time costs: weight packing, allocator, hooks) and the plain reference outputs
    t0 = time.perf_counter()
    refs = [specdec.plain_generate(target, x, N, stops) for x in xs]
    if args.oracle:
        instrument(prof, target, drafter, specdec, full=False)
    for x, ref in zip(xs, refs):
        prof.oracle = ref[0].tolist() if args.oracle else None
        specdec.speculative_generate(drafter, target, x, min(N, 8), stops)
    print(f"warm-up {time.perf_counter() - t0:.1f}s", flush=True)

    # timed, un-instrumented (--oracle keeps the few wrappers that make the drafts right)
    tps = {"plain": [], "spec": []}
    all_match = True
    taus = []
    for r in range(args.repeats):
        t_p = t_s = 0.0
        n_p = n_s = 0
        acc_all = []
        for x, ref in zip(xs, refs):
            t = time.perf_counter()
            out = specdec.plain_generate(target, x, N, stops)
            t_p += time.perf_counter() - t
            n_p += out.shape[1] - x.shape[1]
            prof.oracle = ref[0].tolist() if args.oracle else None
            t = time.perf_counter()
            sout, acc = specdec.speculative_generate(drafter, target, x, N, stops)
            t_s += time.perf_counter() - t
            n_s += sout.shape[1] - x.shape[1]
            acc_all += acc
            all_match &= bool(torch.equal(sout, ref)) and bool(torch.equal(out, ref))
        tps["plain"].append(n_p / t_p)
        tps["spec"].append(n_s / t_s)
        taus.append(sum(acc_all) / max(len(acc_all), 1))
        print(f"repeat {r + 1}/{args.repeats}: plain {n_p / t_p:.2f} tok/s, speculative {n_s / t_s:.2f} tok/s "
              f"(tau {taus[-1]:.3f}, {len(acc_all)} steps)", flush=True)

    # instrumented pass: the breakdown
    prof.unpatch()
    instrument(prof, target, drafter, specdec)
    try:
        prof.reset()
        steps = 0
        spec_tokens = 0
        for x, ref in zip(xs, refs):
            prof.oracle = ref[0].tolist() if args.oracle else None
            sout, acc = specdec.speculative_generate(drafter, target, x, N, stops)
            steps += len(acc)
            spec_tokens += sout.shape[1] - x.shape[1]
        spec = dict(prof.excl)
        spec["total"] = prof.incl["total_spec"]
        sync_calls = prof.calls.get("sync", 0)
        plain = None
        if not args.no_plain_breakdown:
            prof.reset()
            plain_tokens = 0
            for x in xs:
                out = specdec.plain_generate(target, x, N, stops)
                plain_tokens += out.shape[1] - x.shape[1]
            plain = dict(prof.excl)
            plain["total"] = prof.incl["total_plain"]
    finally:
        prof.unpatch()

    # the generate function's own (exclusive) time is the rest of the loop
    spec["rest"] = spec.get("total_spec", 0.0)
    plain_ms = None
    if plain is not None:
        plain["rest"] = plain.get("total_plain", 0.0)
        # one plain token = one decoder step; the first token comes from the prefill
        plain_steps = max(plain_tokens - len(xs), 1)
        plain_ms = 1e3 * (plain["total"] - plain.get("prefill", 0.0)) / plain_steps

    step_ms = 1e3 * (spec["total"] - spec.get("prefill", 0.0)) / max(steps, 1)
    rows = []
    for key, label in SPEC_ROWS:
        ms = 1e3 * spec.get(key, 0.0) / max(steps, 1)
        rows.append([label, f"{ms:.1f}", f"{100 * ms / step_ms:.0f}%"] + ([f"{ms / plain_ms:.2f}"] if plain_ms else []))
    rows.append(["= one verify step", f"{step_ms:.1f}", "100%"] + ([f"{step_ms / plain_ms:.2f}"] if plain_ms else []))
    tau = spec_tokens and (spec_tokens - len(xs)) / max(steps, 1)
    print()
    print(f"speculative decoding, per verify step ({steps} steps, tau {tau:.3f}, "
          f"{sync_calls / max(steps, 1):.1f} host syncs/step; prefill {1e3 * spec.get('prefill', 0.0) / len(xs):.0f} ms/prompt):")
    print(fmt_table(rows, ["component", "ms/step", "share"] + (["plain tokens"] if plain_ms else [])))
    if plain is not None:
        prow = []
        for key, label in PLAIN_ROWS:
            ms = 1e3 * plain.get(key, 0.0) / plain_steps
            prow.append([label, f"{ms:.1f}", f"{100 * ms / plain_ms:.0f}%"])
        prow.append(["= one plain token", f"{plain_ms:.1f}", "100%"])
        print()
        print(f"plain decoding, per token ({plain_steps} decode steps):")
        print(fmt_table(prow, ["component", "ms/token", "share"]))

    med = {k: statistics.median(v) for k, v in tps.items()}
    best = {k: max(v) for k, v in tps.items()}
    print()
    print(fmt_table(
        [["plain greedy", f"{med['plain']:.2f}", f"{best['plain']:.2f}", "1.000"],
         ["DFlash speculative", f"{med['spec']:.2f}", f"{best['spec']:.2f}", f"{statistics.median(taus):.3f}"]],
        ["decoding", "tok/s (median)", "tok/s (best)", "tau"]))
    print(f"speedup (medians) {med['spec'] / med['plain']:.2f}x; greedy outputs identical to plain: "
          f"{'yes' if all_match else 'NO'}")
    print(f"{args.num_prompts} prompts x {N} new tokens, {args.repeats} repeats; "
          f"command: {shlex.join([Path(sys.executable).name] + sys.argv)}")

    if args.json:
        res = {
            "args": vars(args), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "drafter": dlabel, "steps": steps, "tau": tau, "host_syncs_per_step": sync_calls / max(steps, 1),
            "spec_ms_per_step": {k: 1e3 * spec.get(k, 0.0) / max(steps, 1) for k, _ in SPEC_ROWS},
            "spec_step_ms": step_ms, "plain_ms_per_token": plain_ms,
            "plain_ms_per_token_parts": None if plain is None else
            {k: 1e3 * plain.get(k, 0.0) / plain_steps for k, _ in PLAIN_ROWS},
            "tokens_per_s": tps, "outputs_match": all_match,
        }
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0 if all_match else 1


if __name__ == "__main__":
    raise SystemExit(main())
