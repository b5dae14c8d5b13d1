"""Expert parallelism inside the model: each MoE layer's routed experts are replaced by this rank's slots.

``install_expert_parallel(model, rank, world)`` swaps every backbone ``Experts`` module for an ``EPExperts`` that
holds only this rank's physical slots (``ExpertPlacement.local_logical(rank)``) and runs the layer through
``deepinfer_parallel.ep_moe`` (all-to-all dispatch, local SwiGLU experts, exact combine). The router, the shared
expert and everything else stay replicated, so the MoE call site does not change (``Experts.forward`` has the same
signature). Exact combine + row-invariant experts make the result bitwise equal to the single-process layer.

Every EP call is a collective over all ranks, so each layer is a collective site (``sites.CollectiveSites``:
counted, and called with zero tokens by a rank that had nothing to run). The DSpark draft stages keep their
(small) expert stacks replicated.

With a ``DeepEPDispatcher`` (``ParallelConfig.ep_backend == "deep_ep"`` and DeepEP usable, see
``deepinfer_parallel.deep_ep_adapter``) the layer goes through ``deep_ep_moe`` instead: DeepEP's kernels, reduced
combine (close to, not bitwise, the single-process layer).

A model loaded with ``load_model(..., shard=LoadShard(...))`` already holds only this rank's slots
(``Experts.slot_experts``): its stacks are taken as they are, after checking they are the placement's slots.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepinfer_parallel import ExpertPlacement, LoadRecorder, ep_moe, swiglu_expert_fn
from deepinfer_parallel.deep_ep_adapter import DeepEPDispatcher, deep_ep_moe
from torch import nn

from deepinfer_runtime.distributed.sites import CollectiveSites
from deepinfer_runtime.loader.shard import expert_placement
from deepinfer_runtime.models.layers import Experts


class EPExperts(nn.Module):
    """One MoE layer's routed experts on this EP rank (a drop-in for ``Experts``).

    Attributes:
        w13: [S, 2I, d], w2: [S, d, I] (model dtype): the weights of this rank's S physical slots, local order.
        placement: the layer's ``ExpertPlacement`` (replaced by EPLB rearrangements).
        index: position of the layer among the EP layers (the load recorder's layer id).
    """

    def __init__(
        self,
        full: Experts,
        placement: ExpertPlacement,
        rank: int,
        index: int,
        owner: ExpertParallel,
        swiglu_limit: float | None,
    ):
        super().__init__()
        # an empty call still runs this rank's experts on the tokens other ranks send it: it needs the layer's clamp
        self.swiglu_limit = swiglu_limit
        local = placement.local_logical(rank)
        if full.slot_experts is not None:  # loaded per rank: the stacks are this rank's slots already
            if list(full.slot_experts) != local.tolist():
                raise ValueError(
                    f"EPExperts: the loaded slots hold experts {list(full.slot_experts)}, rank {rank}'s placement "
                    f"wants {local.tolist()}"
                )
            w13, w2 = full.w13.data, full.w2.data
        else:
            index = local.to(full.w13.device)
            w13, w2 = full.w13.data[index].clone(), full.w2.data[index].clone()
        self.register_buffer("w13", w13, persistent=False)
        self.register_buffer("w2", w2, persistent=False)
        self.placement, self.rank, self.index = placement, rank, index
        self._owner = (owner,)  # a tuple: not a submodule, no reference cycle through nn.Module registration

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, *, swiglu_limit: float | None
    ) -> torch.Tensor:
        """x [T, d], experts [T, k] int64 logical ids, weights [T, k] fp32 -> [T, d] in x.dtype (collective)."""
        if swiglu_limit != self.swiglu_limit:
            raise ValueError(f"EPExperts: called with swiglu_limit={swiglu_limit}, the layer has {self.swiglu_limit}")
        owner = self._owner[0]
        owner.sites.calls += 1
        if owner.recorder is not None:
            owner.recorder.record(self.index, experts)
        fn = swiglu_expert_fn(self.w13, self.w2, swiglu_limit=swiglu_limit)
        if owner.dispatcher is not None:
            return deep_ep_moe(x, experts, weights, self.placement, fn, owner.dispatcher)
        return ep_moe(x, experts, weights, self.placement, fn, owner.group)

    def empty_call(self) -> None:
        """Join this layer's collectives with no tokens (a rank without work this step)."""
        d = self.w13.shape[-1]
        x = torch.zeros(0, d, dtype=self.w13.dtype, device=self.w13.device)
        ids = torch.zeros(0, 1, dtype=torch.long, device=self.w13.device)
        self.forward(x, ids, torch.zeros(0, 1, device=self.w13.device), swiglu_limit=self.swiglu_limit)

    def swap(self, w13: torch.Tensor, w2: torch.Tensor, placement: ExpertPlacement) -> None:
        """Install weights and placement of a rearrangement (between two steps)."""
        self.w13, self.w2, self.placement = w13, w2, placement


class ExpertParallel:
    """The EP layers of one model on one rank.

    Attributes:
        layers: the ``EPExperts`` of the backbone MoE layers, layer order.
        sites: the rank's collective-site tracker (counts EP calls).
        group: the EP process group (None = the default group, all ranks).
        recorder: the EPLB ``LoadRecorder`` (None when EPLB is off).
        dispatcher: DeepEP dispatch/combine for every layer, or None (the all-to-all path, exact combine).
    """

    def __init__(
        self,
        sites: CollectiveSites,
        group: dist.ProcessGroup | None = None,
        dispatcher: DeepEPDispatcher | None = None,
    ):
        self.layers: list[EPExperts] = []
        self.sites, self.group, self.dispatcher = sites, group, dispatcher
        self.recorder: LoadRecorder | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def placements(self) -> list[ExpertPlacement]:
        return [layer.placement for layer in self.layers]


def install_expert_parallel(
    model: nn.Module,
    rank: int,
    world: int,
    sites: CollectiveSites,
    num_redundant: int = 0,
    group: dist.ProcessGroup | None = None,
    dispatcher: DeepEPDispatcher | None = None,
) -> ExpertParallel:
    """Replace the routed experts of every backbone MoE layer of ``model`` (``model.layers[i].ffn.experts``) by
    this rank's share under ``default_placement(E, world, num_redundant)``; frees the other experts (a model
    loaded per rank holds none).

    Raises:
        ValueError: when E + num_redundant is not a multiple of ``world`` (slots must split evenly).
    """
    ep = ExpertParallel(sites, group, dispatcher)
    for index, block in enumerate(model.layers):
        full = block.ffn.experts
        num_experts = block.ffn.gate.weight.shape[0]  # the router's width: the stacks may hold slots only
        placement = expert_placement(num_experts, world, num_redundant)
        layer = EPExperts(full, placement, rank, index, ep, block.ffn.limit)
        block.ffn.experts = layer
        ep.layers.append(layer)
    return ep
