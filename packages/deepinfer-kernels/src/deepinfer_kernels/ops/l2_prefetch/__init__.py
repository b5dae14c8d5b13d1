"""Warm the L2 cache with the start of a tensor that a later kernel will stream (a hint: no result)."""

import torch

from deepinfer_kernels.registry import dispatch

from . import reference as _reference  # noqa: F401  (registers the reference)


def l2_prefetch(t: torch.Tensor, max_bytes: int, period: int = 0) -> None:
    """Ask the memory system to bring up to ``max_bytes`` of ``t`` into L2, asynchronously; returns at once.

    A decode step at small batch alternates weight streams (HBM-bound) with chains of small latency-bound kernels
    (norms, the attention core, routing) during which HBM idles. Launched on a side stream as such a chain starts,
    this fills that idle time with part of the next weight, which the weight's kernel then reads from L2. Measured
    on an H200 (session 25, ``benchmarks/bench_l2_prefetch.py``): after an idle gap of 8-14 us, 16-40 MB taken
    save a 67 MB stream 2-6 us alone; in whole decode steps of the model slices the same prefetches cost 14-33 us
    (the chains they run beside are memory-latency-bound too), so the models do not use it.

    Args:
        t: any tensor with contiguous storage (a weight, typically [N, K] row-major); values are never changed.
        max_bytes: how much to bring in (clamped to the tensor's size). Keep the sum in flight well under the
            L2 size (``torch.cuda.get_device_properties(d).L2_cache_size``), or the lines evict one another.
        period: 0 takes the first ``max_bytes`` of ``t``; otherwise the tensor is read as consecutive spans of
            ``period`` bytes and the same leading part of every span is taken (the share ``max_bytes / nbytes``),
            so that every program of a one-wave kernel, whatever part of ``t`` it streams, finds that share in L2:
            with ``period`` = one row of a [N, K] weight, every row's first columns.

    The reference (and any device without bulk prefetch: CPUs, GPUs before sm_90) does nothing: the op never
    changes a value, only when bytes arrive.
    """
    if max_bytes < 0 or period < 0:
        raise ValueError(f"l2_prefetch: max_bytes ({max_bytes}) and period ({period}) must be >= 0")
    if not t.is_contiguous():
        raise ValueError("l2_prefetch: t must be contiguous")
    if max_bytes == 0 or t.numel() == 0:
        return
    dispatch("l2_prefetch", t.device, t, max_bytes, period)


try:  # the Triton backend registers itself on import; triton is optional (CPU-only installs have none)
    from . import triton as _triton  # noqa: F401
except ImportError:
    pass
