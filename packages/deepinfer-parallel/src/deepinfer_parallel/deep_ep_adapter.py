"""Optional DeepEP path for the EP dispatch/combine (DeepEP V1 normal-mode ``deep_ep.Buffer`` API).

``select_ep_backend`` picks it at run time: asked for (``"deep_ep"``), importable, CUDA with NCCL; otherwise
the all-to-all path of ``ep.py`` with one log line saying why. ``DeepEPDispatcher`` calls
``Buffer.get_dispatch_layout`` / ``dispatch`` / ``combine`` with the physical expert slots as DeepEP's experts
(``num_experts = placement.num_physical``, rank r holding slots [r*S, (r+1)*S), as in ``ExpertPlacement``);
``deep_ep_moe`` runs the local experts on what arrives and sums a received token's local pairs before the
combine (DeepEP returns one row per (token, rank)), i.e. ``ep.ep_combine(combine="reduced")`` semantics: close
to, not bitwise, the single-process layer.

Tested only against ``fake_deep_ep`` (a test double of the same ``Buffer`` signatures over torch.distributed);
**untested on real deep_ep**: not installable on the CI machine, and it did not build on the GPU machine (see
deepinfer_runtime/distributed/README.md).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist

from .ep import ExpertFn, choose_replicas
from .placement import ExpertPlacement

EP_BACKENDS = ("all_to_all", "deep_ep")


def _import_deep_ep() -> ModuleType | None:
    try:
        return importlib.import_module("deep_ep")
    except Exception:  # a broken build raises more than ImportError (missing CUDA symbols, ...)
        return None


def deep_ep_available() -> bool:
    """True when ``import deep_ep`` works (then ``DeepEPDispatcher`` may be used on CUDA with NCCL)."""
    return _import_deep_ep() is not None


def select_ep_backend(
    requested: str, device_type: str, dist_backend: str, log: Callable[[str], None] | None = None
) -> str:
    """The EP backend to use: ``requested`` ("all_to_all" or "deep_ep") when it can run here, else "all_to_all"
    after logging why (``log``, default stderr).

    Raises:
        ValueError: ``requested`` is not one of ``EP_BACKENDS``.
    """
    if requested not in EP_BACKENDS:
        raise ValueError(f"EP backend must be one of {EP_BACKENDS}, got {requested!r}")
    if requested == "all_to_all":
        return requested
    module = None if device_type != "cuda" or dist_backend != "nccl" else _import_deep_ep()
    if device_type != "cuda" or dist_backend != "nccl":
        why = f"it needs CUDA ranks with NCCL (here: {device_type}, {dist_backend})"
    elif module is None:
        why = "`import deep_ep` fails (DeepEP is not installed or did not build)"
    elif not hasattr(module, "Buffer"):  # DeepEP >= 2 replaced Buffer by EPBuffer, another API
        why = f"deep_ep {getattr(module, '__version__', '?')} has no V1 `Buffer` (this adapter speaks the V1 API)"
    else:
        return requested
    message = f"[deepinfer] EP backend deep_ep unavailable: {why}; using all_to_all"
    if log is None:
        print(message, file=sys.stderr)
    else:
        log(message)
    return "all_to_all"


@dataclass
class DeepEPDispatch:
    """What ``DeepEPDispatcher.dispatch`` returns.

    Attributes:
        recv_x: [R, d] tokens received (DeepEP groups them by source rank), x's dtype.
        recv_slot: [R, k] int64 local slot of each of a received token's k choices, -1 where not on this rank.
        recv_weight: [R, k] fp32 routing weights.
        handle: DeepEP's communication handle (for ``combine``).
    """

    recv_x: torch.Tensor
    recv_slot: torch.Tensor
    recv_weight: torch.Tensor
    handle: object


class DeepEPDispatcher:
    """DeepEP normal-mode dispatch/combine for one EP group (one ``deep_ep.Buffer``, reused by every layer).

    Args:
        group: the EP process group (NCCL).
        hidden_bytes: bytes of one token row (d * element size), for the NVLink buffer size hint.
        deep_ep: the module to use (tests pass ``fake_deep_ep``); None imports ``deep_ep``.
    """

    def __init__(self, group: dist.ProcessGroup | None, hidden_bytes: int, deep_ep: ModuleType | None = None):
        group = group if group is not None else dist.group.WORLD
        deep_ep = deep_ep if deep_ep is not None else importlib.import_module("deep_ep")
        world = dist.get_world_size(group)
        config = deep_ep.Buffer.get_dispatch_config(world)
        self.buffer = deep_ep.Buffer(group, config.get_nvl_buffer_size_hint(hidden_bytes, world), 0)
        self.group, self.rank = group, dist.get_rank(group)

    def dispatch(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, placement: ExpertPlacement
    ) -> DeepEPDispatch:
        """x [T, d], experts [T, k] logical ids, weights [T, k] -> the received tokens (collective)."""
        phys = choose_replicas(experts, placement, self.rank).to(device=x.device, dtype=torch.int64)
        per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(phys, placement.num_physical)
        recv_x, recv_idx, recv_w, _, handle, _ = self.buffer.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=phys,
            topk_weights=weights.float(),
        )
        return DeepEPDispatch(recv_x, recv_idx, recv_w, handle)

    def combine(self, y: torch.Tensor, dispatched: DeepEPDispatch) -> torch.Tensor:
        """y [R, d] (one row per received token, its local pairs summed) -> [T, d] summed over ranks (collective)."""
        combined, _, _ = self.buffer.combine(y, dispatched.handle)
        return combined


def deep_ep_moe(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    placement: ExpertPlacement,
    expert_fn: ExpertFn,
    dispatcher: DeepEPDispatcher,
) -> torch.Tensor:
    """Routed experts through DeepEP: [T, d] in x.dtype, the sum over each token's k experts of their weighted
    outputs (``ep.ep_moe(..., combine="reduced")`` semantics; ``expert_fn`` as there)."""
    got = dispatcher.dispatch(x, experts, weights, placement)
    rows, cols = (got.recv_slot >= 0).nonzero(as_tuple=True)
    y = expert_fn(got.recv_x[rows], got.recv_slot[rows, cols], got.recv_weight[rows, cols])
    per_token = torch.zeros((got.recv_x.shape[0], x.shape[1]), dtype=torch.float32, device=x.device)
    per_token.index_add_(0, rows, y.float())
    return dispatcher.combine(per_token.to(x.dtype), got).to(x.dtype)
