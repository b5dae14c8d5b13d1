"""Per-expert load recording for EPLB over a sliding window of engine steps, and the EPLB knobs.

Knob names follow vLLM's ``EPLBConfig`` (``window_size`` 1000, ``step_interval`` 3000, ``num_redundant_experts``
0), the closest peer: engine arguments ``eplb_window_size`` / ``eplb_step_interval`` / ``num_redundant_experts``
and environment variables ``DEEPINFER_EPLB_WINDOW_SIZE`` / ``DEEPINFER_EPLB_STEP_INTERVAL`` /
``DEEPINFER_EPLB_NUM_REDUNDANT_EXPERTS``. An explicit engine argument wins over the environment, which wins over
the default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

ENV_WINDOW = "DEEPINFER_EPLB_WINDOW_SIZE"
ENV_INTERVAL = "DEEPINFER_EPLB_STEP_INTERVAL"
ENV_REDUNDANT = "DEEPINFER_EPLB_NUM_REDUNDANT_EXPERTS"


def _env_int(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


@dataclass(frozen=True)
class EplbConfig:
    """EPLB settings.

    Attributes:
        window_size: engine steps whose expert counts form the load (>= 1).
        step_interval: steps between two rearrangements (>= 1); the load is the last ``window_size`` steps.
        num_redundant_experts: physical slots beyond the E logical experts, per MoE layer (>= 0).
    """

    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int = 0

    @classmethod
    def from_env(
        cls,
        window_size: int | None = None,
        step_interval: int | None = None,
        num_redundant_experts: int | None = None,
    ) -> EplbConfig:
        """Engine arguments (when not None) over ``DEEPINFER_EPLB_*`` over the defaults."""
        return cls(
            window_size=window_size if window_size is not None else _env_int(ENV_WINDOW, cls.window_size, 1),
            step_interval=step_interval if step_interval is not None else _env_int(ENV_INTERVAL, cls.step_interval, 1),
            num_redundant_experts=(
                num_redundant_experts
                if num_redundant_experts is not None
                else _env_int(ENV_REDUNDANT, cls.num_redundant_experts, 0)
            ),
        )


class LoadRecorder:
    """Token counts per (MoE layer, logical expert) over the last ``window_size`` steps (a ring buffer).

    Usage per engine step: ``record(layer, experts)`` for every MoE layer (experts = the router's [T, k] ids on
    this rank), then ``step()``; when it returns True a rearrangement is due: all-reduce ``load()`` over the EP
    group (``global_load``) and plan with ``rebalance_layers``. Counts are int64 on the CPU (a [window, L, E]
    buffer: 1000 x 43 x 256 x 8 B = 88 MB for V4-Flash; use a smaller window if that matters).
    """

    def __init__(self, num_layers: int, num_experts: int, window_size: int = 1000, step_interval: int = 3000):
        if num_layers < 1 or num_experts < 1 or window_size < 1 or step_interval < 1:
            raise ValueError("LoadRecorder: num_layers, num_experts, window_size and step_interval must be >= 1")
        self.num_layers, self.num_experts = num_layers, num_experts
        self.window_size, self.step_interval = window_size, step_interval
        self._counts = torch.zeros(window_size, num_layers, num_experts, dtype=torch.int64)
        self._slot = 0  # ring position of the current step
        self.steps = 0  # completed steps

    @classmethod
    def from_config(cls, num_layers: int, num_experts: int, config: EplbConfig) -> LoadRecorder:
        return cls(num_layers, num_experts, config.window_size, config.step_interval)

    def record(self, layer: int, experts: torch.Tensor) -> None:
        """Add one count per entry of ``experts`` (any shape, integer logical ids in [0, E); -1 entries, e.g.
        padding, are ignored) to layer ``layer`` of the current step."""
        flat = experts.reshape(-1).long().cpu()
        flat = flat[flat >= 0]
        if flat.numel() and int(flat.max()) >= self.num_experts:
            raise ValueError(f"LoadRecorder.record: expert id {int(flat.max())} >= {self.num_experts}")
        self._counts[self._slot, layer] += torch.bincount(flat, minlength=self.num_experts)

    def step(self) -> bool:
        """Close the current step; True when ``step_interval`` steps have passed since the last rearrangement."""
        self.steps += 1
        self._slot = (self._slot + 1) % self.window_size
        self._counts[self._slot].zero_()
        return self.steps % self.step_interval == 0

    def load(self) -> torch.Tensor:
        """[L, E] int64: counts of the last ``window_size`` completed steps (plus the open one) on this rank."""
        return self._counts.sum(0)

    def global_load(self, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """``load()`` summed over the ranks of ``group`` (a collective: every rank calls it). [L, E] int64 CPU."""
        total = self.load()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            backend = dist.get_backend(group)
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
            buf = total.to(device)
            dist.all_reduce(buf, group=group)
            total = buf.cpu()
        return total
