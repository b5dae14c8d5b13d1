"""Multi-process serving: attention data parallel + MoE expert parallel (with live EPLB) + context-parallel long
prefills, over ``deepinfer_parallel``. ``LLM(..., data_parallel_size=N)`` uses it; see ``driver.py`` (driver
side), ``rank.py`` (inside each rank), ``ep_experts.py``, ``eplb_live.py``, ``cp_prefill.py``."""

from deepinfer_runtime.distributed.config import ParallelConfig

__all__ = ["ParallelConfig"]
