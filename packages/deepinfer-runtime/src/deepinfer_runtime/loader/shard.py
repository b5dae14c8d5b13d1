"""Per-rank checkpoint loading: which part of a checkpoint one rank of a multi-process engine reads.

A rank of the parallel engine (``deepinfer_runtime.distributed``) keeps only its expert slots of every backbone
MoE layer (expert parallel) and its row range of every Engram table (row sharding). ``load_model(...,
shard=LoadShard(...))`` reads exactly that from the safetensors shards (Engram rows through ``get_slice``) and
everything else (attention, shared expert, router, embedding, head, the DSpark stages) in full, as the
single-process loader does. The inventory is still validated in full first, so a missing shard or tensor
gives the same ``CheckpointError`` on every rank, owned or not.

The placement is ``deepinfer_parallel.default_placement`` (slot p holds logical expert p mod E) and the row split
``deepinfer_parallel.RowSharding``: the same functions ``install_expert_parallel`` / ``install_engram_sharding``
use, which then take the loaded shards as they are (and check that they match).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_ROUTED_EXPERT = re.compile(r"^(layers|mtp)\.(\d+)\.ffn\.experts\.(\d+)\.")


def expert_placement(num_experts: int, world: int, num_redundant: int = 0):
    """The initial ``ExpertPlacement`` of E + redundant physical slots over ``world`` EP ranks.

    Raises:
        ValueError: when E + num_redundant is not a multiple of ``world`` (slots must split evenly).
    """
    from deepinfer_parallel import default_placement

    if (num_experts + num_redundant) % world:
        raise ValueError(
            f"expert parallel: {num_experts} routed experts + {num_redundant} redundant slots do not split "
            f"over {world} ranks; choose num_redundant_experts so that the sum is a multiple of {world}"
        )
    return default_placement(num_experts, world, num_redundant)


@dataclass(frozen=True)
class LoadShard:
    """The part of the checkpoint one rank reads.

    Attributes:
        rank, world: this rank and the number of ranks.
        expert_parallel: read only this rank's routed-expert slots of the backbone MoE layers (``layers.*``;
            the DSpark stages ``mtp.*`` keep all their experts); False: every expert.
        num_redundant_experts: physical slots per layer beyond the E logical experts (EP only).
        shard_engram: read only rows [rank*B, (rank+1)*B) of each Engram table, B = ceil(rows / world).
    """

    rank: int
    world: int
    expert_parallel: bool = True
    num_redundant_experts: int = 0
    shard_engram: bool = True

    def local_experts(self, num_experts: int) -> list[int] | None:
        """Logical expert of each of this rank's slots (local slot order), or None when experts are not sharded."""
        if not self.expert_parallel:
            return None
        placement = expert_placement(num_experts, self.world, self.num_redundant_experts)
        return placement.local_logical(self.rank).tolist()

    def engram_rows(self, num_rows: int) -> tuple[int, int] | None:
        """This rank's row range [lo, hi) of a table of ``num_rows`` rows, or None when tables are not sharded."""
        if not self.shard_engram:
            return None
        from deepinfer_parallel import RowSharding

        sharding = RowSharding(num_rows, self.world)
        return sharding.start(self.rank), sharding.stop(self.rank)


@dataclass
class LoadStats:
    """What one ``load_model`` call read (returned by the ranks to the driver; tests and the load benchmark).

    Attributes:
        bytes_read: bytes of tensor data materialised from the shards (sliced reads count the slice only).
        checkpoint_bytes: size of the checkpoint's safetensors files (headers included).
        tensors: bytes read per tensor name (a sliced tensor appears with the bytes of its slice).
        seconds: wall time of the load (config, model build, decode, Engram tables).
        peak_rss_bytes: the process's peak resident set after the load (``ru_maxrss``; includes Python and torch).
    """

    bytes_read: int = 0
    checkpoint_bytes: int = 0
    tensors: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    peak_rss_bytes: int = 0

    def routed_experts(self) -> dict[tuple[str, int], set[int]]:
        """{("layers" | "mtp", index): logical experts} whose tensors (weights or scales) were read."""
        out: dict[tuple[str, int], set[int]] = {}
        for name in self.tensors:
            m = _ROUTED_EXPERT.match(name)
            if m:
                out.setdefault((m[1], int(m[2])), set()).add(int(m[3]))
        return out

    def bytes_of(self, prefix: str = "", contains: str = "") -> int:
        """Bytes read from tensors whose name starts with ``prefix`` and contains ``contains``."""
        return sum(b for n, b in self.tensors.items() if n.startswith(prefix) and contains in n)
