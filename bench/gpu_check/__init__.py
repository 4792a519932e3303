"""The checks of bench/gpu_check.py (the driver): one module per kind of check, each check a
function `(smoke: bool, work: Path) -> Result` that the driver runs in its own process."""
