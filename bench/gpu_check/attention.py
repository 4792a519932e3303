"""Checks 1 and 2: the attention the drafter trains with, at a real shape.

1. compiled FlexAttention (the drafter's own `_flex_attention` with the BlockMask `build_masks`
   gives it) against SDPA with the dense mask of the same `dflash_mask_mod`, forward and the
   gradients of q, k, v under a random upstream gradient. Both are compared element by element
   with an fp32 SDPA reference, relative to the largest reference value; SDPA in the low dtype
   is reported beside flex as the yardstick of what that dtype allows.
2. `create_block_mask` compiled against eager: the same block sparsity, and both build times.
"""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from dflash_train.model import masks as M
from dflash_train.model.loss import sample_anchors

from .common import Result, device, rel_error, sync, timed

# Qwen3-8B's attention (32 q heads, 8 kv heads, head_dim 128); the shipped 8B recipe's
# 512 anchors x 16 over a 3072-token context; a window that cuts inside the context
REAL = dict(heads=32, kv_heads=8, head_dim=128, seq=3072, anchors=512, block=16, window=1024)
SMOKE = dict(heads=4, kv_heads=2, head_dim=16, seq=96, anchors=8, block=4, window=12)
# relative to max |reference|: bf16 keeps 8 significant bits (2**-8 = 3.9e-3), so a few ulps
# of the largest value; fp32 (smoke) is near exact
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def mask_inputs(shape: dict, dev: torch.device, seed: int = 0):
    """anchors [1, A], valid [1, A], docs [1, T]: three documents and a padded tail; a loss mask
    sparse enough that ~5 % of the anchors are padding blocks (they see only themselves)."""
    T, A = shape["seq"], shape["anchors"]
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([T * 45 // 100, T * 35 // 100, T * 15 // 100])
    docs = M.document_ids_from_lengths(lengths, T)[None]
    p = min(1.0, (0.95 * A / T) ** 0.5)  # a valid anchor needs two supervised tokens in a row
    loss_mask = torch.rand(1, T, generator=g) < p
    anchors, valid = sample_anchors(loss_mask, docs, A, shape["block"], g)
    return anchors.to(dev), valid.to(dev), docs.to(dev)


def mask_mod(shape: dict, layer_type: str, anchors, valid, docs):
    return M.dflash_mask_mod(anchors, valid, docs, shape["block"], layer_type, shape["window"], shape["seq"])


def _sdpa_grouped(q, k, v, dense, scale):
    """SDPA one kv head at a time (its q heads broadcast over it): the score matrix of one group
    stays small whichever SDPA kernel serves a boolean mask, fp32 included."""
    g = q.shape[1] // k.shape[1]
    outs = []
    for h in range(k.shape[1]):
        kh = k[:, h:h + 1].expand(-1, g, -1, -1)
        vh = v[:, h:h + 1].expand(-1, g, -1, -1)
        outs.append(F.scaled_dot_product_attention(q[:, h * g:(h + 1) * g], kh, vh, attn_mask=dense, scale=scale))
    return torch.cat(outs, dim=1)


def _out_and_grads(fn, q, k, v, grad_out, grads: bool = True):
    if not grads:  # FlexAttention has no backward on CPU (smoke): the forward only
        with torch.no_grad():
            return {"out": fn(q, k, v)}
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype))
    return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}


def compare_attention(shape: dict, layer_type: str, dev: torch.device, dtype: torch.dtype,
                      tol: float | None = None, flex_layer_type: str | None = None) -> Result:
    """Flex (compiled on CUDA) vs SDPA + dense mask vs an fp32 reference. `flex_layer_type`: give
    flex ANOTHER layer type's mask (a wrong mask: the check must fail)."""
    from dflash_train.model.drafter import _flex_attention

    tol = TOLERANCE[dtype] if tol is None else tol
    anchors, valid, docs = mask_inputs(shape, dev)
    B, T, A, bs = 1, shape["seq"], shape["anchors"], shape["block"]
    Q, KV = A * bs, T + A * bs
    ref_mod = mask_mod(shape, layer_type, anchors, valid, docs)
    flex_mod = mask_mod(shape, flex_layer_type or layer_type, anchors, valid, docs)
    dense = M.dense_mask(ref_mod, B, Q, KV, device=dev)
    block_mask = M.flex_block_mask(flex_mod, B, Q, KV, device=dev)  # what build_masks hands the drafter

    g = torch.Generator(device="cpu").manual_seed(1)
    H, Hkv, D = shape["heads"], shape["kv_heads"], shape["head_dim"]
    q = torch.randn(B, H, Q, D, generator=g).to(dev)
    k = torch.randn(B, Hkv, KV, D, generator=g).to(dev)
    v = torch.randn(B, Hkv, KV, D, generator=g).to(dev)
    grad_out = torch.randn(B, H, Q, D, generator=g).to(dev)
    scale = D ** -0.5
    low = [t.to(dtype) for t in (q, k, v)]

    ref = _out_and_grads(lambda a, b, c: _sdpa_grouped(a, b, c, dense, scale), q, k, v, grad_out)
    sdpa = _out_and_grads(lambda a, b, c: _sdpa_grouped(a, b, c, dense, scale), *low, grad_out)
    flex, seconds = timed(lambda: _out_and_grads(
        lambda a, b, c: _flex_attention(a, b, c, block_mask, scale, H != Hkv), *low, grad_out,
        grads=dev.type == "cuda"), dev)
    flex_err = {n: rel_error(flex[n], ref[n]) for n in flex}
    sdpa_err = {n: rel_error(sdpa[n], ref[n]) for n in ref}
    ok = all(e <= tol for e in flex_err.values())
    worst = max(flex_err, key=flex_err.get)
    errs = " ".join(f"{n.replace('out', 'fwd')} {flex_err[n]:.1e}" if n in flex_err else f"{n} -" for n in ref)
    figure = (f"{layer_type.split('_')[0]}: flex rel err {errs} (sdpa {dtype_name(dtype)} worst "
              f"{max(sdpa_err.values()):.1e}; tol {tol:.0e})")
    return Result(ok, figure, {"layer_type": layer_type, "flex_layer_type": flex_layer_type or layer_type,
                               "shape": shape, "dtype": dtype_name(dtype), "tolerance": tol,
                               "flex_rel_err": flex_err, "sdpa_rel_err": sdpa_err, "worst": worst,
                               "padding_anchors": int((~valid).sum()), "first_flex_seconds": seconds})


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_flex_vs_sdpa(smoke: bool, work) -> Result:
    dev = device(smoke)
    shape, dtype = (SMOKE, torch.float32) if smoke else (REAL, torch.bfloat16)
    parts = [compare_attention(shape, lt, dev, dtype) for lt in (M.FULL, M.SLIDING)]
    return Result(all(p.ok for p in parts), "; ".join(p.figure for p in parts),
                  {p.details["layer_type"]: p.details for p in parts})


# ---------------------------------------------------------------------------------- check 2

_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
           "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def block_mask_differences(a, b) -> list[str]:
    """The BlockMask fields in which a and b differ. Counts must be equal; of the index tensors
    only each row's first `count` entries are read by flex (the rest is sort order of unused
    blocks), so those prefixes are compared; the dense expansion must be equal too."""
    bad = []
    for name in _FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if (x is None) != (y is None):
            bad.append(name)
            continue
        if x is None:
            continue
        if x.shape != y.shape:
            bad.append(f"{name} shape")
        elif name.endswith("num_blocks"):
            if not torch.equal(x, y):
                bad.append(name)
        else:
            counts = getattr(a, name.replace("indices", "num_blocks"))
            live = torch.arange(x.shape[-1], device=x.device) < counts[..., None]
            if not torch.equal(torch.where(live, x, -1), torch.where(live, y, -1)):
                bad.append(name)
    if not bad and not torch.equal(a.to_dense(), b.to_dense()):
        bad.append("to_dense")
    return bad


def _build_times(mod, B, Q, KV, dev, compile: bool, repeats: int = 3):
    """(mask, first build seconds, median of `repeats` later builds)."""
    build = lambda: M.flex_block_mask(mod, B, Q, KV, device=dev, compile=compile)  # noqa: E731
    mask, first = timed(build, dev)
    later = [timed(build, dev)[1] for _ in range(repeats)]
    return mask, first, statistics.median(later)


def compare_block_masks(shape: dict, layer_type: str, dev: torch.device,
                        eager_layer_type: str | None = None, compiled: bool = True) -> Result:
    """create_block_mask(_compile=True) vs (_compile=False) for one layer type's mask.
    `eager_layer_type`: build the eager one from another layer type (must fail).
    compiled=False (smoke, CPU): the other side is eager create_block_mask over a lookup into the
    dense mask instead: inductor on CPU takes ~20 s per mask and, with torch 2.13, fails on
    dflash_mask_mod ("vr must not be None for symbol q1"), so CPU checks the comparison only."""
    anchors, valid, docs = mask_inputs(shape, dev)
    Q, KV = shape["anchors"] * shape["block"], shape["seq"] + shape["anchors"] * shape["block"]
    mod = mask_mod(shape, layer_type, anchors, valid, docs)
    if not compiled:
        dense = M.dense_mask(mod, 1, Q, KV, device=dev)
        mod = lambda b, h, q, kv: dense[b, 0, q, kv]  # noqa: E731
    compiled, c_first, c_time = _build_times(mod, 1, Q, KV, dev, compiled)
    eager, e_first, e_time = _build_times(mask_mod(shape, eager_layer_type or layer_type, anchors, valid, docs),
                                          1, Q, KV, dev, False)
    sync(dev)
    bad = block_mask_differences(compiled, eager)
    identical = all(torch.equal(getattr(compiled, n), getattr(eager, n)) for n in _FIELDS
                    if getattr(compiled, n) is not None and getattr(eager, n) is not None
                    and getattr(compiled, n).shape == getattr(eager, n).shape)
    figure = (f"{layer_type.split('_')[0]}: {'equal' if not bad else 'DIFFER in ' + ','.join(bad)}, "
              f"eager {e_time * 1e3:.1f} ms, compiled {c_time * 1e3:.1f} ms (first {c_first:.1f} s)")
    return Result(not bad, figure, {"layer_type": layer_type, "differences": bad,
                                    "all_index_entries_identical": identical,
                                    "eager_seconds": e_time, "eager_first_seconds": e_first,
                                    "compiled_seconds": c_time, "compiled_first_seconds": c_first,
                                    "sparsity": float(compiled.sparsity())})


def check_block_masks(smoke: bool, work) -> Result:
    dev = device(smoke)
    shape = SMOKE if smoke else REAL
    parts = [compare_block_masks(shape, lt, dev, compiled=not smoke) for lt in (M.FULL, M.SLIDING)]
    figure = "; ".join(p.figure for p in parts) + (" [smoke: dense lookup stands in for compiled]" if smoke else "")
    return Result(all(p.ok for p in parts), figure, {p.details["layer_type"]: p.details for p in parts})
