"""Host-built index tensors onto the device without stalling the host.

``torch.tensor(values, device="cuda")`` copies from pageable memory, which waits for every kernel already queued
on the stream: one such copy per request per step serialises the host with the device (and undoes asynchronous
scheduling). Building the values on the host and sending them in one pinned, non-blocking copy does not.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def host_tensor(values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` (a sequence, or a CPU tensor) as a ``dtype`` tensor on ``device``; on CUDA one pinned
    non-blocking copy (no wait for the device)."""
    t = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def long_tensor(values: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """int64 [len(values)] on ``device`` (``host_tensor``)."""
    return host_tensor(values, torch.long, device)
