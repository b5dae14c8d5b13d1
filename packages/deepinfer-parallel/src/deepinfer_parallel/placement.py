"""Expert placement: which logical expert each physical expert slot holds, and on which rank.

Vocabulary (as in DeepSeek's EPLB and vLLM):

- *logical* expert: one of the model's E routed experts (``experts`` ids from the router).
- *physical* slot: one of P >= E expert weight sets actually held on the devices; slot ``p`` lives on rank
  ``p // slots_per_rank`` (ranks hold equal, contiguous slot ranges). P - E slots are *redundant*: extra replicas
  of heavy experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    """One MoE layer's replication and placement.

    Attributes:
        phy2log: [P] int64, the logical expert held by each physical slot.
        num_logical: E.
        num_ranks: EP ranks; P must be a multiple of it.
        log2phy: [E, max_replicas] int64, the physical slots of each logical expert in ascending slot order,
            padded with -1 (derived).
        logcnt: [E] int64, replicas per logical expert, every entry >= 1 (derived).
    """

    phy2log: torch.Tensor
    num_logical: int
    num_ranks: int
    log2phy: torch.Tensor = field(init=False, repr=False)
    logcnt: torch.Tensor = field(init=False, repr=False)
    _on_device: dict = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        phy2log = torch.as_tensor(self.phy2log, dtype=torch.int64).cpu().contiguous()
        if phy2log.dim() != 1:
            raise ValueError(f"ExpertPlacement: phy2log must be [P], got {tuple(phy2log.shape)}")
        num_phy = phy2log.numel()
        if self.num_ranks < 1 or num_phy % self.num_ranks:
            raise ValueError(f"ExpertPlacement: {num_phy} physical slots do not split over {self.num_ranks} ranks")
        if num_phy and (int(phy2log.min()) < 0 or int(phy2log.max()) >= self.num_logical):
            raise ValueError(f"ExpertPlacement: phy2log entries must be in [0, {self.num_logical})")
        logcnt = torch.bincount(phy2log, minlength=self.num_logical)
        missing = (logcnt == 0).nonzero().flatten().tolist()
        if missing:
            raise ValueError(f"ExpertPlacement: logical experts {missing[:8]} have no replica")
        order = torch.argsort(phy2log, stable=True)  # slots grouped by expert, ascending slot within
        starts = torch.cumsum(logcnt, 0) - logcnt
        replica = torch.arange(num_phy) - starts[phy2log[order]]
        log2phy = torch.full((self.num_logical, int(logcnt.max())), -1, dtype=torch.int64)
        log2phy[phy2log[order], replica] = order
        object.__setattr__(self, "phy2log", phy2log)
        object.__setattr__(self, "log2phy", log2phy)
        object.__setattr__(self, "logcnt", logcnt)

    def tables_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log2phy, logcnt)`` on ``device``, copied once per device (a per-call host-to-device copy of a
        pageable tensor would make every dispatch wait for the GPU)."""
        key = str(device)
        if key not in self._on_device:
            self._on_device[key] = (self.log2phy.to(device), self.logcnt.to(device))
        return self._on_device[key]

    @property
    def num_physical(self) -> int:
        return self.phy2log.numel()

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    def rank_of_slot(self, slot: torch.Tensor | int) -> torch.Tensor | int:
        """Rank holding physical slot(s) ``slot``."""
        return slot // self.slots_per_rank

    def local_slots(self, rank: int) -> range:
        """The physical slots rank ``rank`` holds, in local order."""
        s = self.slots_per_rank
        return range(rank * s, (rank + 1) * s)

    def local_logical(self, rank: int) -> torch.Tensor:
        """[slots_per_rank] int64: the logical expert in each local slot of ``rank`` (to load weights)."""
        s = self.slots_per_rank
        return self.phy2log[rank * s : (rank + 1) * s].clone()

    def rank_loads(self, load: torch.Tensor) -> torch.Tensor:
        """[num_ranks] float64: each rank's load when expert e's load ``load[e]`` is split evenly over its replicas
        (what round-robin replica choice gives on average)."""
        load = torch.as_tensor(load, dtype=torch.float64).cpu()
        if tuple(load.shape) != (self.num_logical,):
            raise ValueError(f"rank_loads: load must be [{self.num_logical}], got {tuple(load.shape)}")
        per_slot = load[self.phy2log] / self.logcnt[self.phy2log].double()
        return per_slot.view(self.num_ranks, self.slots_per_rank).sum(-1)

    def imbalance(self, load: torch.Tensor) -> float:
        """max / mean of ``rank_loads(load)`` (1.0 is perfect balance; the step time follows the max)."""
        per_rank = self.rank_loads(load)
        mean = float(per_rank.mean())
        return float(per_rank.max()) / mean if mean > 0 else 1.0


def default_placement(num_logical: int, num_ranks: int, num_redundant: int = 0) -> ExpertPlacement:
    """The placement before any load is known: slot p holds expert p % E (contiguous experts per rank; the
    ``num_redundant`` extra slots replicate experts 0, 1, ... in order)."""
    num_phy = num_logical + num_redundant
    return ExpertPlacement(torch.arange(num_phy) % num_logical, num_logical, num_ranks)
