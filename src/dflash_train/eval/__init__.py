"""Real speculative decoding with a DFlash drafter (greedy exact, lossless sampling)
and the acceptance length tau. See `specdec` (the decoding loop, reference
semantics of PyPI dflash 0.1.0), `prompts` (which prompts, in the chat format), `ngram`
(the prompt-lookup baseline), `replay`, `tau` (`evaluate_tau`) and `command` (`dflash-train eval`)."""
from dflash_train.eval.specdec import plain_generate, rejection_sample, speculative_generate
from dflash_train.eval.tau import evaluate_tau

__all__ = ["speculative_generate", "plain_generate", "rejection_sample", "evaluate_tau"]
