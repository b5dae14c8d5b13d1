"""The batch mask: one int32 bitmask [B, ceil(V/32)] for a step's sampled rows, filled per constrained request
by llguidance (in parallel, one call), then applied to the whole batch by one vectorised kernel op."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from deepinfer_kernels import apply_token_bitmask

from deepinfer_runtime.structured.backend import ll_executor
from deepinfer_runtime.structured.matcher import RequestGrammar


def fill_bitmask(grammars: Sequence[RequestGrammar | None], vocab_size: int) -> tuple[torch.Tensor, list[int]]:
    """(bitmask int32 [B, ceil(V/32)] on the CPU, the constrained row indices). Unconstrained rows are all ones.

    Waits for the compilation of grammars not compiled yet (their first sample). Rows whose grammar failed
    stay all ones: the engine ends those requests with their error and discards the token.
    """
    bitmask = torch.full((len(grammars), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    rows = [i for i, g in enumerate(grammars) if g is not None and g.constrained]
    if rows:
        # One call fills every constrained row (llguidance's thread pool); each row's width is the
        # tokenizer's n_vocab, which backend.ll_tokenizer set to the model's vocabulary.
        matchers = [(grammars[i].matcher, i) for i in rows]
        ll_executor().unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
        for i in rows:
            if grammars[i].spec.bound_token_id is not None:
                grammars[i].adjust_bitmask(bitmask[i])
    return bitmask, rows


def apply_grammar_bitmask(logits: torch.Tensor, grammars: Sequence[RequestGrammar | None]) -> torch.Tensor:
    """Mask ``logits`` [B, V] (in place) with the grammars of the B sampled requests; unconstrained rows untouched."""
    bitmask, rows = fill_bitmask(grammars, logits.shape[1])
    if not rows:
        return logits
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    return apply_token_bitmask(logits, bitmask.to(logits.device, non_blocking=True), index)
