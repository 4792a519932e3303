"""Cutting tokenised conversations to `data.max_tokens` and packing them into rows.

Long rule (`data.long_rule`), for a conversation longer than max_tokens:

* ``truncate``: keep its first max_tokens tokens;
* ``split``: cut it into consecutive pieces of max_tokens tokens (the last one
  shorter); each piece becomes its own document (positions restart, no
  attention to earlier pieces).

Drop rule: a document (piece) with fewer than ``min_supervised`` supervised
(loss-mask) tokens is dropped and counted (``dropped_documents``); the
default ``min_supervised`` is ``model.block_size + 1``: enough labels for one
full block. Every row therefore holds at least one block's worth of labels.

Packing: greedy first-fit in source order into rows of exactly max_tokens;
only the most recent 256 rows that still have room are scanned (keeps it
linear), rows with less room than ``min_supervised`` are closed. In a row
the documents get ids 0, 1, 2... and padding -1 (pad token id, loss mask
False).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SCAN_ROWS = 256


@dataclass
class Document:
    input_ids: list[int]
    loss_mask: list[bool]

    @property
    def supervised(self) -> int:
        return sum(self.loss_mask)


def cut_document(ids: list[int], mask: list[bool], max_tokens: int, long_rule: str) -> tuple[list[Document], bool]:
    """(pieces, was_long)."""
    if len(ids) <= max_tokens:
        return [Document(ids, mask)], False
    if long_rule == "truncate":
        return [Document(ids[:max_tokens], mask[:max_tokens])], True
    if long_rule != "split":
        raise ValueError(f"unknown long_rule {long_rule!r}")
    return [Document(ids[i:i + max_tokens], mask[i:i + max_tokens]) for i in range(0, len(ids), max_tokens)], True


def pack_documents(docs: list[Document], max_tokens: int, pad_id: int, min_room: int = 1):
    """First-fit packing -> (input_ids [N,T] int64, loss_mask [N,T] bool, document_ids [N,T] int32)."""
    rows: list[list[Document]] = []
    room: list[int] = []
    open_rows: list[int] = []
    for d in docs:
        n = len(d.input_ids)
        if n > max_tokens:
            raise ValueError(f"document of {n} tokens exceeds max_tokens={max_tokens}")
        placed = -1
        for r in open_rows[-SCAN_ROWS:]:
            if room[r] >= n:
                placed = r
                break
        if placed < 0:
            rows.append([])
            room.append(max_tokens)
            open_rows.append(len(rows) - 1)
            placed = len(rows) - 1
        rows[placed].append(d)
        room[placed] -= n
        if room[placed] < max(min_room, 1):
            open_rows.remove(placed)
    N = len(rows)
    input_ids = torch.full((N, max_tokens), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros((N, max_tokens), dtype=torch.bool)
    document_ids = torch.full((N, max_tokens), -1, dtype=torch.int32)
    for r, row in enumerate(rows):
        p = 0
        for k, d in enumerate(row):
            n = len(d.input_ids)
            input_ids[r, p:p + n] = torch.tensor(d.input_ids, dtype=torch.int64)
            loss_mask[r, p:p + n] = torch.tensor(d.loss_mask, dtype=torch.bool)
            document_ids[r, p:p + n] = k
            p += n
    return input_ids, loss_mask, document_ids
