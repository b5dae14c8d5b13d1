"""``ParallelConfig``: the engine arguments of multi-process serving, validated in one place.

Process model (``deepinfer_parallel.launcher``): the process holding ``LLM`` is the *driver*; it spawns
``world_size`` ranks and is not one of them. Every rank is an attention-DP replica (its own scheduler, runner and
KV pools); the MoE layers of all ranks form one expert-parallel group; consecutive blocks of
``context_parallel_size`` ranks form the context-parallel groups that share long prefills.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from deepinfer_parallel import EplbConfig
from deepinfer_parallel.deep_ep_adapter import EP_BACKENDS


@dataclass(frozen=True)
class ParallelConfig:
    """Validated parallel settings.

    Attributes:
        data_parallel_size: attention-DP ranks = processes (the world size).
        expert_parallel_size: 1 (every rank holds all routed experts) or the world size (experts sharded).
        context_parallel_size: ranks that share one long prefill (1 = off); divides the world size.
        backend: "gloo" (CPU) or "nccl" (one GPU per rank).
        eplb: live EPLB settings (window, interval), or None when EPLB is off.
        num_redundant_experts: physical expert slots per MoE layer beyond the E logical experts (EP only).
        cp_min_tokens: prompts of at least this many tokens are prefilled with CP (when CP is on).
        step_timeout_s: a rank that does not finish one engine step in this time is reported as hung.
        ep_backend: "all_to_all" (default: exact combine, bitwise the single process) or "deep_ep" (DeepEP's
            kernels when usable on the ranks, else all_to_all with a log line); ``DEEPINFER_EP_BACKEND``.
    """

    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    context_parallel_size: int = 1
    backend: str = "gloo"
    eplb: EplbConfig | None = None
    num_redundant_experts: int = 0
    cp_min_tokens: int = 2048
    step_timeout_s: float = 300.0
    ep_backend: str = "all_to_all"

    @property
    def world_size(self) -> int:
        return self.data_parallel_size

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def cp_group_of(self, rank: int) -> int:
        return rank // self.context_parallel_size

    def cp_ranks(self, group: int) -> list[int]:
        m = self.context_parallel_size
        return list(range(group * m, (group + 1) * m))

    @property
    def num_cp_groups(self) -> int:
        return self.world_size // self.context_parallel_size

    @classmethod
    def create(
        cls,
        data_parallel_size: int = 1,
        expert_parallel_size: int | None = None,
        context_parallel_size: int = 1,
        *,
        device_type: str = "cpu",
        enable_eplb: bool = False,
        eplb_window_size: int | None = None,
        eplb_step_interval: int | None = None,
        num_redundant_experts: int | None = None,
        cp_min_tokens: int | None = None,
        step_timeout_s: float = 300.0,
    ) -> ParallelConfig:
        """Check the combination and fill defaults (EP follows DP; EPLB knobs: argument > DEEPINFER_EPLB_* >
        default). Raises ValueError with the reason for a combination this engine does not run."""
        sizes = (("data_parallel_size", data_parallel_size), ("context_parallel_size", context_parallel_size))
        for name, value in sizes:
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if expert_parallel_size is None:
            expert_parallel_size = data_parallel_size
        if expert_parallel_size not in (1, data_parallel_size):
            raise ValueError(
                f"expert_parallel_size must be 1 or equal to data_parallel_size ({data_parallel_size}): the MoE "
                f"layers of all attention-DP ranks form one EP group; got {expert_parallel_size!r}"
            )
        if data_parallel_size % context_parallel_size:
            raise ValueError(
                f"context_parallel_size ({context_parallel_size}) must divide data_parallel_size "
                f"({data_parallel_size}): CP groups are made of DP ranks (use data_parallel_size >= "
                f"context_parallel_size)"
            )
        if enable_eplb and expert_parallel_size == 1:
            raise ValueError("enable_eplb needs expert parallelism (expert_parallel_size > 1)")
        if not enable_eplb and any(v is not None for v in (eplb_window_size, eplb_step_interval)):
            raise ValueError("eplb_window_size / eplb_step_interval are set but enable_eplb is False")
        if num_redundant_experts and expert_parallel_size == 1:
            raise ValueError("num_redundant_experts needs expert parallelism (expert_parallel_size > 1)")
        eplb = EplbConfig.from_env(eplb_window_size, eplb_step_interval, num_redundant_experts)
        if cp_min_tokens is not None and (not isinstance(cp_min_tokens, int) or cp_min_tokens < 2):
            raise ValueError(f"context_parallel_min_tokens must be an int >= 2, got {cp_min_tokens!r}")
        ep_backend = os.environ.get("DEEPINFER_EP_BACKEND") or "all_to_all"
        if ep_backend not in EP_BACKENDS:
            raise ValueError(f"DEEPINFER_EP_BACKEND must be one of {EP_BACKENDS}, got {ep_backend!r}")
        return cls(
            data_parallel_size=data_parallel_size,
            expert_parallel_size=expert_parallel_size,
            context_parallel_size=context_parallel_size,
            backend="nccl" if device_type == "cuda" else "gloo",
            eplb=eplb if enable_eplb else None,
            num_redundant_experts=eplb.num_redundant_experts if expert_parallel_size > 1 else 0,
            cp_min_tokens=cp_min_tokens if cp_min_tokens is not None else cls.cp_min_tokens,
            step_timeout_s=step_timeout_s,
            ep_backend=ep_backend,
        )
