"""What the split layout's wire costs per token at the 8B shape (pipeline/remote.py's protocol).

Two processes on a gloo group: rank 0 (the target rank) sends what serve_target_rank sends per
batch - header int64[4], input_ids int64[B,T], loss_mask uint8[B,T], document_ids int32[B,T],
features [B,T,K*H] bf16, a JSON tail - and rank 1 (the trainer) receives it, N times. Prints the
wire's GB/s and microseconds per token. With CUDA it also times what the split layout adds on
each side: the features' device-to-host copy into pinned memory and host-to-device back.

    python bench/wire_cost.py                 # 8B shape: [1, 3072, 5*4096] bf16, 20 repetitions
    python bench/wire_cost.py --reps 50 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_train.engine.local_servers import free_port

META = json.dumps({"positions": list(range(1)), "order_state": {"epoch": 0, "position": 1, "seed": 0}}).encode()


def _messages(B: int, T: int, F: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.tensor([B, T, F, len(META)], dtype=torch.int64),
            torch.randint(0, 151936, (B, T), generator=g),
            torch.ones(B, T, dtype=torch.uint8),
            torch.zeros(B, T, dtype=torch.int32),
            torch.randn(B, T, F, generator=g).to(torch.bfloat16),
            torch.frombuffer(bytearray(META), dtype=torch.uint8)]


def _worker(rank: int, port: int, B: int, T: int, F: int, reps: int, warmup: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    msgs = _messages(B, T, F)
    bufs = [torch.empty_like(m) for m in msgs]
    times = []
    for i in range(warmup + reps):
        dist.barrier()  # both sides start each batch together: the time is the transfer's
        t0 = time.perf_counter()
        for m, b in zip(msgs, bufs):
            if rank == 0:
                dist.send(m, 1)
            else:
                dist.recv(b, 0)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    if rank == 1:
        assert torch.equal(bufs[4], msgs[4]), "features arrived corrupted"
        q.put(times)
    dist.barrier()
    dist.destroy_process_group()


def wire(B: int, T: int, F: int, reps: int, warmup: int = 2) -> list[float]:
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(free_port(), B, T, F, reps, warmup, q), nprocs=2, start_method="spawn")
    return q.get()


def device_copies(B: int, T: int, F: int, reps: int) -> dict:
    """The features' D2H into a pinned buffer and H2D back, timed with CUDA events."""
    dev = torch.device("cuda")
    feats = torch.randn(B, T, F, device=dev, dtype=torch.bfloat16)
    pinned = torch.empty(feats.shape, dtype=feats.dtype, pin_memory=True)
    back = torch.empty_like(feats)
    out = {}
    for name, fn in (("d2h_pinned", lambda: pinned.copy_(feats, non_blocking=True)),
                     ("h2d_pinned", lambda: back.copy_(pinned, non_blocking=True))):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        out[name] = start.elapsed_time(end) / 1e3 / reps
    assert torch.equal(back, feats)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=3072)
    p.add_argument("--features", type=int, default=5 * 4096, help="K target layers x hidden (5 x 4096 at 8B)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", help="write the figures here too")
    a = p.parse_args()
    B, T, F = a.batch, a.seq, a.features
    tokens = B * T
    nbytes = sum(m.numel() * m.element_size() for m in _messages(B, T, F))
    times = sorted(wire(B, T, F, a.reps))
    med = times[len(times) // 2]
    res = {"shape": [B, T, F], "bytes_per_batch": nbytes, "bytes_per_token": nbytes / tokens, "reps": a.reps,
           "wire_seconds_median": med, "wire_seconds_min": times[0], "wire_gb_s": nbytes / med / 1e9,
           "wire_us_per_token": med / tokens * 1e6, "host": os.cpu_count(), "torch": torch.__version__}
    print(f"wire (gloo, 2 processes, {os.cpu_count()} CPUs): {nbytes / 1e6:.1f} MB per batch "
          f"({nbytes / tokens / 1e3:.1f} kB/token), median {med * 1e3:.1f} ms (min {times[0] * 1e3:.1f}): "
          f"{res['wire_gb_s']:.2f} GB/s, {res['wire_us_per_token']:.2f} us/token")
    if torch.cuda.is_available():
        c = device_copies(B, T, F, a.reps)
        fb = B * T * F * 2
        for name, s in c.items():
            res[f"{name}_seconds"] = s
            res[f"{name}_gb_s"] = fb / s / 1e9
            res[f"{name}_us_per_token"] = s / tokens * 1e6
            print(f"{name}: {s * 1e3:.2f} ms, {fb / s / 1e9:.1f} GB/s, {s / tokens * 1e6:.3f} us/token")
        total = med + sum(c.values())
        res["split_us_per_token"] = total / tokens * 1e6
        print(f"split layout per batch: D2H + wire + H2D = {total * 1e3:.1f} ms, {res['split_us_per_token']:.2f} us/token")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
