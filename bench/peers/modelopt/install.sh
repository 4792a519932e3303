#!/usr/bin/env bash
# Creates /work/main/.venv-peers/modelopt: torch 2.13.0 (CPU) first, then nvidia-modelopt 0.47.0 with
# --no-deps, then every dependency pinned with == (resolved once on 2026 registries, then frozen), so
# nothing replaces the CPU torch. Idempotent: a finished venv is marked with .installed.
# transformers 5.12.1: the example's requirements.txt asks transformers>=5.0,<5.13 (the [hf] extra <5.15).
# peft 0.18.1 and accelerate>=1.12 are what examples/speculative_decoding/requirements.txt asks.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
V=${MODELOPT_VENV:-$ROOT/.venv-peers/modelopt}
if [ -f "$V/.installed" ]; then echo "$V already installed"; exit 0; fi
[ -x "$V/bin/python" ] || python3 -m venv "$V"
"$V/bin/pip" install -q torch==2.13.0
"$V/bin/pip" install -q --no-deps nvidia-modelopt==0.47.0
"$V/bin/pip" install -q --no-deps accelerate==1.16.0 annotated-doc==0.0.7 annotated-types==0.8.0 anyio==4.16.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3 click==8.5.1 datasets==5.2.0 dill==0.4.1 filelock==4.3.2 fsspec==2026.9.0 h11==0.16.0 hf-xet==1.8.0 httpcore==1.0.9 httpx==0.29.0 huggingface_hub==1.33.0 idna==3.21 Jinja2==3.1.6 markdown-it-py==4.3.0 MarkupSafe==3.0.4 mdurl==0.1.2 mpmath==1.3.0 multiprocess==0.70.19 networkx==3.6.1 ninja==1.13.2 numpy==2.4.6 nvidia-ml-py==13.615.71 omegaconf==2.4.0 packaging==26.4 pandas==3.1.1 peft==0.18.1 psutil==7.2.2 PuLP==3.3.2 pyarrow==26.0.1 pydantic==2.14.4 pydantic_core==2.50.5 Pygments==2.21.0 python-dateutil==4.0.0 PyYAML==6.0.4 regex==2026.12.2 requests==2.34.2 rich==15.0.0 safetensors==0.8.0 scipy==1.17.1 shellingham==1.5.4 sympy==1.14.0 tokenizers==0.22.2 tqdm==4.70.1 transformers==5.12.1 typer==0.29.2 typing-inspection==0.4.5 typing_extensions==4.16.0 tzdata==2026.6 urllib3==2.8.0 xxhash==4.1.0 
"$V/bin/python" - <<'PY'
import torch, transformers, importlib.metadata as md
assert torch.__version__.startswith("2.13.0") and "+cpu" in torch.__version__, torch.__version__
import modelopt.torch.speculative  # noqa: F401
print("torch", torch.__version__, "transformers", transformers.__version__, "modelopt", md.version("nvidia-modelopt"))
PY
touch "$V/.installed"
