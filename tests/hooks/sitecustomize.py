"""Imported by Python at start-up when tests put tests/hooks on PYTHONPATH: installs the
test-only knobs of dflash_test_hooks (nothing without their environment variables)."""
import dflash_test_hooks

dflash_test_hooks.install()
