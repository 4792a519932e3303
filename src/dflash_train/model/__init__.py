"""The DFlash drafter, its attention masks and its training loss (see docs/architecture.md)."""
from dflash_train.model.drafter import DFlashDrafter, DrafterCache, DrafterConfig, default_target_layer_ids
from dflash_train.model.loss import (
    LossOutput,
    default_gamma,
    dflash_loss,
    expected_acceptance_length,
    make_blocks,
    sample_anchors,
)
from dflash_train.model.masks import (
    build_masks,
    dense_mask,
    dflash_mask_mod,
    document_ids_from_lengths,
    flex_block_mask,
)

__all__ = [
    "DFlashDrafter", "DrafterCache", "DrafterConfig", "default_target_layer_ids",
    "LossOutput", "default_gamma", "dflash_loss", "expected_acceptance_length", "make_blocks", "sample_anchors",
    "build_masks", "dense_mask", "dflash_mask_mod", "document_ids_from_lengths", "flex_block_mask",
]
