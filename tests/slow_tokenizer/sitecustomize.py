"""Test only: tests/test_resume_and_signals.py puts this directory on PYTHONPATH of
a `dflash-train` subprocess (nothing in the package knows about it).

When DFLASH_TEST_SLOW_TOKENIZE is set (a path prefix), the first tokenizer call of
the trainer (ChatFormat._tokenize) first runs ONE long C call that does not return
to the interpreter for DFLASH_TEST_SLOW_TOKENIZE_SECONDS (default 6), as a fast
(Rust) tokenizer's batch encode of a huge conversation does: pbkdf2_hmac releases
the GIL and ignores signals, so CPython can run a Python signal handler only after
it returns. `<prefix>.start` / `<prefix>.end` get time.time() before / after it
(`.end` also when a handler raised as the call returned).
"""
import os

_PREFIX = os.environ.get("DFLASH_TEST_SLOW_TOKENIZE")

if _PREFIX:
    import hashlib
    import time

    from dflash_train.data import template as _template

    _original = _template.ChatFormat._tokenize
    _done = []

    def _one_long_c_call(seconds: float) -> None:
        n = 20000
        t0 = time.perf_counter()
        hashlib.pbkdf2_hmac("sha256", b"p", b"salt", n)
        per_iter = max(time.perf_counter() - t0, 1e-6) / n
        hashlib.pbkdf2_hmac("sha256", b"p", b"salt", max(1, int(seconds / per_iter)))

    def _slow_tokenize(self, texts):
        if not _done:
            _done.append(True)
            with open(_PREFIX + ".start", "w") as f:
                f.write(repr(time.time()))
            try:
                _one_long_c_call(float(os.environ.get("DFLASH_TEST_SLOW_TOKENIZE_SECONDS", "6")))
            finally:  # a signal handler may raise right after the call returns
                with open(_PREFIX + ".end", "w") as f:
                    f.write(repr(time.time()))
        return _original(self, texts)

    _template.ChatFormat._tokenize = _slow_tokenize
