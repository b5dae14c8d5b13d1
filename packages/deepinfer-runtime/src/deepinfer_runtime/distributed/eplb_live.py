"""Live EPLB: record per-expert load during the run, and every ``step_interval`` steps re-plan the placement and
move expert weights between ranks, between two engine steps (requests stay in flight; no drain, no restart).

Every rank ends each engine step with ``LiveEplb.end_step()`` (the ranks step in lockstep, so they agree on
when a rearrangement is due). A rearrangement: all-reduce the recorded loads, plan with DeepSeek's EPLB
(``rebalance_layers``: the global policy, V4 / V4.1 have no expert groups), then per layer exchange the weights
point to point (``exchange_expert_weights``) and swap in the new slots and placement.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_parallel import EplbConfig, LoadRecorder, plan_moves, rebalance_layers
from deepinfer_parallel.rearrange import exchange_expert_weights

from deepinfer_runtime.distributed.ep_experts import ExpertParallel


@dataclass
class EplbStats:
    """Rearrangements so far and expert copies they made (local + remote, all layers, all ranks)."""

    rearrangements: int = 0
    moved_slots: int = 0


class LiveEplb:
    def __init__(self, ep: ExpertParallel, config: EplbConfig, world: int):
        if not ep.layers:
            raise ValueError("LiveEplb: the model has no expert-parallel layers")
        num_experts = ep.layers[0].placement.num_logical
        self.ep, self.config, self.world = ep, config, world
        self.recorder = LoadRecorder.from_config(ep.num_layers, num_experts, config)
        ep.recorder = self.recorder
        self.stats = EplbStats()

    def end_step(self) -> bool:
        """Close the recorder's step; rearrange when due (a collective on every rank). True if it rearranged."""
        if not self.recorder.step():
            return False
        self.rearrange()
        return True

    def rearrange(self) -> None:
        load = self.recorder.global_load(self.ep.group)  # [L, E] summed over ranks
        old = self.ep.placements()
        new = rebalance_layers(load, old[0].num_physical, self.world)
        for layer, before, after in zip(self.ep.layers, old, new):
            moves = plan_moves(before, after)
            if not moves:
                continue
            w13, w2 = exchange_expert_weights([layer.w13, layer.w2], moves, before.slots_per_rank, self.ep.group)
            layer.swap(w13, w2, after)
            self.stats.moved_slots += len(moves)
        # no barrier needed: every send and receive has completed when exchange_expert_weights returns, and the
        # next step's first all-to-all orders the ranks again
        self.stats.rearrangements += 1
