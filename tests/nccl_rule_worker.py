"""One torchrun rank of `dflash-train train` with NCCL's device rule applied to every point-to-point
message (tests/test_train_layouts.py). On a GPU the world group is NCCL, which carries CUDA tensors
only ("No backend type associated with device type cpu"); CPU CI runs the world on gloo, which
carries anything. So this spy treats the world group, and every group made without
backend="gloo", as NCCL: a host tensor sent or received there fails the rank, as NCCL would."""
from __future__ import annotations

import os
import sys

import torch.distributed as dist

from dflash_train.cli import main

_gloo_groups: list = []
_real_new_group, _real_send, _real_recv = dist.new_group, dist.send, dist.recv


def _new_group(*args, **kwargs):
    group = _real_new_group(*args, **kwargs)
    if kwargs.get("backend") == "gloo":
        _gloo_groups.append(group)
    return group


def _check(tensor, group, what: str) -> None:
    if not tensor.is_cuda and not any(group is g for g in _gloo_groups):
        raise RuntimeError(f"{what} of a {tensor.device.type} tensor on a group that is NCCL on a GPU: "
                           "No backend type associated with device type cpu")
    with open(os.environ["NCCL_RULE_LOG"], "a") as f:
        f.write(f"{what} ok\n")


def _send(tensor, dst=None, group=None, *args, **kwargs):
    _check(tensor, group, "send")
    return _real_send(tensor, dst, group, *args, **kwargs)


def _recv(tensor, src=None, group=None, *args, **kwargs):
    _check(tensor, group, "recv")
    return _real_recv(tensor, src, group, *args, **kwargs)


if __name__ == "__main__":
    dist.new_group, dist.send, dist.recv = _new_group, _send, _recv
    sys.argv = ["dflash-train", *sys.argv[1:]]
    main()
