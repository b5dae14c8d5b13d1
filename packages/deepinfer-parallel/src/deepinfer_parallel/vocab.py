"""Vocabulary-parallel embedding and LM head (vocabulary-sized layers sharded by row over a group).

Both work with attention data parallelism: every rank passes its *own* tokens (counts may differ per rank).

- ``vocab_parallel_embedding``: the embedding table is row-sharded (``RowSharding(vocab, world)``); a lookup is
  ``gather_rows``: bitwise equal to ``weight[ids]``.
- ``vocab_parallel_logits``: the head is row-sharded the same way; hidden states are all-gathered, each rank
  computes the logits of every rank's tokens for its vocabulary slice, and an all-to-all returns each rank its
  tokens' slices, concatenated in vocabulary order. Traffic per step: sum(T) x d (gather) + T x V (logits, fp32).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from deepinfer_kernels.ops.linear import linear

from ._comm import all_gather_rows, all_to_all_rows
from .rows import RowSharding, gather_rows


def vocab_parallel_embedding(
    ids: torch.Tensor, weight_shard: torch.Tensor, vocab_size: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """[T] token ids -> [T, d] embeddings in the table dtype (collective).

    Args:
        weight_shard: this rank's rows of the [vocab_size, d] table (``shard_rows(weight, world, rank)``).
    """
    return gather_rows(weight_shard, ids, vocab_size, group)


def vocab_parallel_logits(
    hidden: torch.Tensor,
    head_shard: torch.Tensor,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
    *,
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = linear,
) -> torch.Tensor:
    """[T, d] final hidden states -> [T, vocab_size] fp32 logits (collective).

    Args:
        hidden: [T, d] this rank's tokens (T may differ per rank).
        head_shard: this rank's rows of the [vocab_size, d] head (``shard_rows(head, world, rank)``).
        matmul: (x [M, d] fp32, w [n, d] fp32) -> [M, n] fp32; default the kernels' ``linear`` op.
    """
    world = dist.get_world_size(group)
    sh = RowSharding(vocab_size, world)
    per_rank = all_gather_rows(hidden, group)
    counts = [h.shape[0] for h in per_rank]
    local = matmul(torch.cat(per_rank).float(), head_shard.float())  # [sum T, V_r]
    # all_to_all wants one row shape: pad the vocab slice to the block width, strip after
    width = sh.block
    padded = torch.zeros((local.shape[0], width), dtype=torch.float32, device=local.device)
    padded[:, : local.shape[1]] = local
    mine = all_to_all_rows(padded, counts, [hidden.shape[0]] * world, group)  # [world * T, width] rank-major
    t = hidden.shape[0]
    parts = [mine[r * t : (r + 1) * t, : sh.stop(r) - sh.start(r)] for r in range(world)]
    return torch.cat(parts, dim=1)
