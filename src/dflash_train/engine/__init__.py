"""A real serving engine as the judge: an export served by vLLM (its own environment,
`.venv-vllm`), measured by the engine's own counters beside plain vLLM and vLLM's n-gram.
`vllm_process` runs every vLLM process (the worker, `vllm_worker.py`, and local servers); `measure`
serves the methods and makes the rows; `k_sweep`, `suite_serving` and `serve_bench` (the command)
build on it."""
