"""deepinfer-parallel: expert parallel (dispatch/combine, EPLB), attention data parallel, balanced context parallel
and row-sharded tables over torch.distributed. Engine-independent pieces; see README.md and placement.md."""

from .cp import CPAssignment, cp_gather, cp_scatter, zigzag_assignment
from .dp import DPBalancer, assign_requests
from .ep import ep_combine, ep_dispatch, ep_moe, swiglu_expert_fn
from .eplb import rebalance_experts, rebalance_layers
from .launcher import ParallelError, RankContext, WorkerGroup
from .load_recorder import EplbConfig, LoadRecorder
from .placement import ExpertPlacement, default_placement
from .rearrange import ExpertMove, apply_moves, exchange_expert_weights, plan_moves
from .rows import RowSharding, gather_rows, shard_rows
from .vocab import vocab_parallel_embedding, vocab_parallel_logits

__version__ = "0.1.0"

__all__ = [
    "CPAssignment",
    "DPBalancer",
    "EplbConfig",
    "ExpertMove",
    "ExpertPlacement",
    "LoadRecorder",
    "ParallelError",
    "RankContext",
    "RowSharding",
    "WorkerGroup",
    "apply_moves",
    "assign_requests",
    "cp_gather",
    "cp_scatter",
    "default_placement",
    "ep_combine",
    "ep_dispatch",
    "ep_moe",
    "exchange_expert_weights",
    "gather_rows",
    "plan_moves",
    "rebalance_experts",
    "rebalance_layers",
    "shard_rows",
    "swiglu_expert_fn",
    "vocab_parallel_embedding",
    "vocab_parallel_logits",
    "zigzag_assignment",
]
