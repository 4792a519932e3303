"""gpu_check --smoke only (put on PYTHONPATH for its compiled training run): torch.compile's
default backend becomes "eager", so dynamo still traces, guards and recompiles exactly as it
would, but inductor generates no code (minutes of C++ compilation on a 2-core CPU)."""
import torch

_compile = torch.compile


def _eager_by_default(model=None, **kwargs):
    kwargs.setdefault("backend", "eager")
    return _compile(model, **kwargs)


torch.compile = _eager_by_default
