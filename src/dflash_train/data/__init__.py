"""Training data: conversation sources, chat formats + assistant-only loss
masks, packing into fixed-length rows with document ids, the resumable data
order, the prepared-data cache (`prepare-data`) and `regenerate`.

Trainer entry points: `load_prepared(cfg, tokenizer, family) -> PreparedData`
and `DataOrder(num_rows, seed)`.
"""
from dflash_train.data.order import DataOrder, RankSlice
from dflash_train.data.packing import Document, cut_document, pack_documents
from dflash_train.data.prepare import PreparedData, build_prepared, load_prepared, read_prepared
from dflash_train.data.sources import Conversation, DataError, heldout_score, is_heldout, read_conversations
from dflash_train.data.template import ChatFormat, TemplateMismatch

__all__ = [
    "ChatFormat",
    "Conversation",
    "DataError",
    "DataOrder",
    "Document",
    "PreparedData",
    "RankSlice",
    "TemplateMismatch",
    "build_prepared",
    "cut_document",
    "heldout_score",
    "is_heldout",
    "load_prepared",
    "pack_documents",
    "read_conversations",
    "read_prepared",
]
