"""A real serving engine as the judge: an export served by vLLM (its own environment,
`.venv-vllm`), measured by the engine's own counters beside plain vLLM and vLLM's n-gram.
`serve_bench.measure_in_vllm` / `serve_bench_command`; the engine side is `vllm_worker.py`."""
