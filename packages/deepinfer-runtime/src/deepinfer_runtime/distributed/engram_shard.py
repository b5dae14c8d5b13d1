"""Engram tables row-sharded across the ranks (the placement chosen in deepinfer-parallel's ``placement.md``).

Each rank keeps rows [r*B, (r+1)*B) of each Engram table (B = ceil(rows / world)) in its stored format (FP8
rows + UE8M0 scales, or bf16), where the model keeps tables (host memory next to a GPU). A lookup is
``deepinfer_parallel.gather_rows``: every rank sends the row ids its tokens hash to, owners answer with the raw
rows, and only the gathered rows are dequantised, exactly as ``Engram.gather`` does with the whole table, so the
values are bitwise the same. Each Engram layer becomes a collective site (``sites.py``).

A model loaded with ``load_model(..., shard=LoadShard(...))`` read only this rank's rows (``Engram.row_range``):
they are taken as they are, after checking the range is this rank's.

The embedding and the LM head stay replicated on every rank (the default of ``placement.md``: 2 x 1.23 GiB per
rank and no collective on the critical path).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepinfer_kernels import fp8_block_dequantize
from deepinfer_parallel import RowSharding, gather_rows

from deepinfer_runtime.distributed.sites import CollectiveSites


class ShardedEngramGather:
    """Replaces one ``Engram`` module's ``gather``: same call, rows fetched from their owner ranks (collective).

    Attributes:
        rows: [B_r, head_dim] this rank's rows (stored dtype); scale: [B_r, head_dim / 32] or None.
        num_rows: rows of the whole table.
    """

    def __init__(self, engram, rank: int, world: int, sites: CollectiveSites, comm_device: torch.device):
        loaded = engram.row_range
        self.num_rows = engram.rows.shape[0] if loaded is None else loaded[2]
        sharding = RowSharding(self.num_rows, world)
        lo, hi = sharding.start(rank), sharding.stop(rank)
        if loaded is None:
            self.rows = engram.rows[lo:hi].clone()
            self.scale = None if engram.scale is None else engram.scale[lo:hi].clone()
        elif loaded[:2] != (lo, hi):
            raise ValueError(f"Engram sharding: rank {rank} loaded rows {loaded[:2]}, its shard is {(lo, hi)}")
        else:  # loaded per rank: the module holds this rank's rows already
            self.rows, self.scale = engram.rows, engram.scale
        self.width = engram.rows.shape[1]
        self.sites, self.comm_device = sites, comm_device
        # the module keeps only the shard (a full table is freed)
        engram.set_table(self.rows, self.scale, (lo, hi, self.num_rows))
        engram.gather = self  # instance attribute: Engram.forward calls self.gather(...)

    def __call__(self, ids: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """ids [T, C] global row ids -> dequantised rows [T, C * head_dim] (collective)."""
        self.sites.calls += 1
        flat = ids.reshape(-1)
        rows = gather_rows(self.rows, flat, self.num_rows, device=self.comm_device)
        scale = None if self.scale is None else gather_rows(self.scale, flat, self.num_rows, device=self.comm_device)
        if not flat.numel():  # an empty call (a rank without tokens): the collectives above were all it owed
            return torch.zeros(ids.shape[0], ids.shape[1] * self.width, dtype=dtype, device=device)
        if scale is not None:
            rows = fp8_block_dequantize(rows, scale, (1, 32), out_dtype=torch.float32)
        return rows.to(device=device, dtype=dtype).view(ids.shape[0], -1)

    def empty_call(self) -> None:
        self(torch.zeros(0, 1, dtype=torch.long), torch.float32, self.comm_device)


def install_engram_sharding(model, rank: int, world: int, sites: CollectiveSites) -> dict[int, ShardedEngramGather]:
    """Shard every Engram table of ``model`` (V4.1 backbone layers); returns {layer index: its gather site}."""
    backend = dist.get_backend()
    comm_device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    out = {}
    for index, block in enumerate(model.layers):
        engram = getattr(block, "engram", None)
        if engram is not None and engram.rows is not None:
            out[index] = ShardedEngramGather(engram, rank, world, sites, comm_device)
    return out
