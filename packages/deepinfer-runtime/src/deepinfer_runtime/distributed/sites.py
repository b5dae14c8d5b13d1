"""The collective sites of one model forward on a rank, in call order, and the per-step call count.

A *site* is a layer whose forward is a collective over all ranks: an expert-parallel MoE layer (``EPExperts``)
or a row-sharded Engram lookup (``ShardedEngramGather``). Ranks run different batches in lockstep, so every rank
must make the same sequence of collective calls each step: a rank with no model work calls every site with zero
tokens (``dummy_pass``), and ``finish_step`` checks the count so that a mismatch raises instead of deadlocking.
"""

from __future__ import annotations

from typing import Protocol


class Site(Protocol):
    def empty_call(self) -> None:
        """Join this site's collectives with no rows."""


class CollectiveSites:
    """Attributes:
    sites: the model's collective sites in forward order.
    calls: site calls since the last ``reset``."""

    def __init__(self) -> None:
        self.sites: list[Site] = []
        self.calls = 0

    def __len__(self) -> int:
        return len(self.sites)

    def reset(self) -> None:
        self.calls = 0

    def dummy_pass(self) -> None:
        """One empty call per site, in forward order: what a model forward would have done."""
        for site in self.sites:
            site.empty_call()

    def finish_step(self) -> None:
        """Complete this rank's collective calls of the step: a dummy pass when it ran no forward. Any count
        other than 0 or one forward's means the ranks would disagree on their collectives: raise instead."""
        if self.calls == 0:
            self.dummy_pass()
        elif self.calls != len(self.sites):
            raise RuntimeError(
                f"parallel engine: {self.calls} collective layer calls in one step, expected {len(self.sites)} "
                "(one forward); the ranks would disagree on their collectives"
            )
        self.reset()
