"""A test double of DeepEP's V1 normal-mode ``deep_ep.Buffer`` (intranode), over torch.distributed (gloo works).

It has the signatures and return tuples of DeepEP's ``Buffer.get_dispatch_config`` / ``get_dispatch_layout`` /
``dispatch`` / ``combine`` (DeepEP README and ``deep_ep/buffer.py`` of the 1.0.0 source) and their documented
semantics, and checks the argument dtypes DeepEP requires, so ``deep_ep_adapter`` can be exercised without DeepEP:

- ``get_dispatch_layout(topk_idx [T, k] int64, num_experts)``: experts are split evenly over ranks; returns
  ``num_tokens_per_rank [W] int32``, ``None`` (no RDMA ranks), ``num_tokens_per_expert [E] int32``,
  ``is_token_in_rank [T, W] bool``, an event;
- ``dispatch(x [T, d] bf16, ...)``: each token once per destination rank; received tokens grouped by source rank
  (ascending token within a source); ``recv_topk_idx`` holds local expert ids, -1 for experts of other ranks;
- ``combine(x [R, d] bf16, handle)``: every received row back to its source token, summed over ranks (fp32
  accumulation, cast to x's dtype), no weights applied.

FP8 inputs, cached-handle dispatch, internode and low-latency modes are not modelled (NotImplementedError).
Not a communication library: no buffers, events or streams.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._comm import all_to_all_rows, exchange_counts


class EventOverlap:
    """DeepEP's event wrapper; nothing is asynchronous here."""

    def current_stream_wait(self) -> None:
        pass


@dataclass
class Config:
    num_sms: int = 20

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return max(1, hidden_bytes) * num_ranks * 4096


@dataclass
class _Handle:
    send_tok: torch.Tensor  # [sum(send_counts)] source token of each sent row, rank-major
    send_counts: list[int]
    recv_counts: list[int]
    num_tokens: int


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise TypeError(f"fake deep_ep: {what}")


class Buffer:
    num_sms: int = 20

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 1,
    ) -> None:
        if low_latency_mode or num_rdma_bytes:
            raise NotImplementedError("fake deep_ep: only the intranode normal mode")
        _need(num_nvl_bytes > 0, "normal-mode intranode dispatch needs num_nvl_bytes > 0")
        self.group, self.rank, self.group_size = group, group.rank(), group.size()
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        self._count("get_dispatch_layout")
        _need(topk_idx.dim() == 2 and topk_idx.dtype == torch.int64, "topk_idx must be [num_tokens, k] int64")
        _need(num_experts % self.group_size == 0, "num_experts must split evenly over the ranks")
        per_rank_experts = num_experts // self.group_size
        valid = topk_idx >= 0
        dst = torch.where(valid, topk_idx // per_rank_experts, -1)
        ranks = torch.arange(self.group_size, device=topk_idx.device)
        in_rank = (dst[:, :, None] == ranks).any(1)  # [T, W]
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts)
        return in_rank.sum(0).int(), None, per_expert.int(), in_rank, EventOverlap()

    def dispatch(
        self,
        x,
        handle=None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        self._count("dispatch")
        if isinstance(x, tuple) or handle is not None:
            raise NotImplementedError("fake deep_ep: FP8 (x, scales) input and cached-handle dispatch")
        _need(x.dim() == 2 and x.dtype == torch.bfloat16, "x must be [num_tokens, hidden] bfloat16")
        _need(num_tokens_per_rdma_rank is None, "intranode: num_tokens_per_rdma_rank must be None")
        _need(
            num_tokens_per_rank is not None and num_tokens_per_rank.dtype == torch.int32,
            "num_tokens_per_rank must be int32",
        )
        _need(num_tokens_per_expert is not None and num_tokens_per_expert.dtype == torch.int32, "per-expert int32")
        _need(
            is_token_in_rank is not None
            and is_token_in_rank.dtype == torch.bool
            and is_token_in_rank.shape == (x.shape[0], self.group_size),
            "is_token_in_rank must be [num_tokens, num_ranks] bool",
        )
        _need(topk_idx is not None and topk_idx.dtype == torch.int64, "topk_idx must be int64")
        _need(topk_weights is not None and topk_weights.dtype == torch.float32, "topk_weights must be float32")
        per_rank_experts = num_tokens_per_expert.shape[0] // self.group_size
        send_tok = is_token_in_rank.t().nonzero()[:, 1]  # rank-major, ascending token
        send_rank = is_token_in_rank.t().nonzero()[:, 0]
        local = topk_idx[send_tok] - (send_rank * per_rank_experts)[:, None]
        local = torch.where((local >= 0) & (local < per_rank_experts) & (topk_idx[send_tok] >= 0), local, -1)
        send_counts = num_tokens_per_rank.tolist()
        recv_counts = exchange_counts(send_counts, self.group, device=x.device)
        recv_x = all_to_all_rows(x[send_tok], send_counts, recv_counts, self.group)
        recv_idx = all_to_all_rows(local, send_counts, recv_counts, self.group)
        recv_w = all_to_all_rows(topk_weights[send_tok], send_counts, recv_counts, self.group)
        counts = torch.bincount(recv_idx[recv_idx >= 0], minlength=per_rank_experts)
        aligned = (-(-counts // expert_alignment) * expert_alignment).tolist()
        handle = _Handle(send_tok, send_counts, recv_counts, x.shape[0])
        return recv_x, recv_idx, recv_w, aligned, handle, EventOverlap()

    def combine(
        self,
        x: torch.Tensor,
        handle: _Handle,
        topk_weights: torch.Tensor | None = None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        self._count("combine")
        _need(x.dim() == 2 and x.dtype == torch.bfloat16, "x must be [num_recv_tokens, hidden] bfloat16")
        _need(x.shape[0] == sum(handle.recv_counts), "x must have one row per received token")
        back = all_to_all_rows(x, handle.recv_counts, handle.send_counts, self.group)
        out = torch.zeros((handle.num_tokens, x.shape[1]), dtype=torch.float32, device=x.device)
        out.index_add_(0, handle.send_tok, back.float())
        return out.to(x.dtype), None, EventOverlap()
