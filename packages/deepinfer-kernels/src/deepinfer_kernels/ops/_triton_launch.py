"""Shared plumbing of the Triton backends: the availability probes (CUDA, the compute capability a kernel needs),
the SM count and the interpreter check.

Backends register for "cuda" only, but their launchers accept CPU tensors too, which Triton runs in
its interpreter when ``TRITON_INTERPRET=1`` was set before triton was first imported. The interpreter
decides at decoration time, for triton's own library functions as well as ours, so it cannot be
switched on later in a process: the tests run their interpreter cases in a child process
(``deepinfer_kernels.testing.triton_interpreter``).
"""

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

PDL_ENV = "DEEPINFER_PDL"  # "0" turns programmatic dependent launch off (``pdl_options``)
COUNTERS = 1 << 14  # arrival counters a launch may use (``counter_block``)
SCRATCH_WORDS = 1 << 18  # zeroed int32 words a launch may accumulate into (``zeroed_scratch``)


@functools.cache
def triton_cuda_available() -> bool:
    """True when triton imports and a CUDA device is present (probed once per process)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _index(device: torch.device | int | None) -> int:
    if isinstance(device, int):
        return device
    if device is None or device.index is None:
        return torch.cuda.current_device()
    return device.index


def sm90_or_newer(device: torch.device | int | None = None) -> bool:
    """A CUDA device (default: the current one) of compute capability 9.0 or newer: FP8 tensor cores, programmatic
    dependent launch, bulk L2 prefetch; Hopper (sm_90) and later."""
    if isinstance(device, torch.device) and device.type != "cuda":
        return False
    return torch.cuda.is_available() and _capability(_index(device)) >= (9, 0)


def hopper(device: torch.device | int | None = None) -> bool:
    """A CUDA device of compute capability 9.x: the Hopper-only instructions (``wgmma``) exist; Blackwell (10.x)
    has none of them, so the kernels built on them must not be chosen there."""
    if isinstance(device, torch.device) and device.type != "cuda":
        return False
    return torch.cuda.is_available() and _capability(_index(device))[0] == 9


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (1 for a CPU tensor's device, the interpreter's): what the
    launchers compare their grid sizes with. Probed once per device."""
    if device.type != "cuda":
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def interpreting() -> bool:
    """True when this process's triton kernels run in the interpreter (so CPU tensors are accepted)."""
    try:
        import triton.language as tl
    except ImportError:
        return False
    return type(tl.zeros).__name__ == "InterpretedFunction"


def require_same_device(*tensors: torch.Tensor) -> None:
    """CPU tensors are only valid under the interpreter; mixed devices never are."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"triton backend: tensors on several devices {sorted(map(str, devices))}")
    if next(iter(devices)).type == "cpu" and not interpreting():
        raise ValueError("triton backend: CPU tensors need TRITON_INTERPRET=1 set before triton is imported")


def pdl_options(device: torch.device) -> dict:
    """Launch options of a kernel that begins with ``_pdl.pdl_prologue(PDL)``: programmatic dependent launch on
    Hopper and later (``{"PDL": True, "launch_pdl": True}``), nothing elsewhere (older GPUs, the interpreter, or
    ``DEEPINFER_PDL=0``).

    With it the GPU may start the kernel's programs while the kernel before it in the stream is still finishing;
    the prologue's ``griddepcontrol.wait`` holds them until that kernel has completed and its writes are visible,
    before they touch memory. The overlap is the launch latency: about 0.3 us per kernel boundary in a CUDA graph of
    small kernels on an H200 (1.31 -> 1.02 us per launch in a chain of 200 one-program kernels), where a decode step
    crosses 250-500 boundaries. Numerics are unchanged."""
    if device.type != "cuda" or os.environ.get(PDL_ENV, "1") == "0" or interpreting():
        return {}
    options = _pdl_options(device.index if device.index is not None else torch.cuda.current_device())
    if _EARLY_LAUNCH_OFF[0] and options:
        return {"PDL": True}  # the same binary, launched without the attribute: its wait is a no-op
    return options


_EARLY_LAUNCH_OFF = [0]


@contextlib.contextmanager
def without_early_launch(active: bool = True) -> Iterator[None]:
    """Kernels launched inside start only once the kernel before them in the stream has completed (no programmatic
    dependent launch attribute; the same compiled kernels, the same bits). ``active`` False: a no-op (for callers
    that decide per call).

    What this is for: a PDL launch makes the kernel's programs resident while its predecessor still runs, and a
    weight stream's programs then hold every SM. A short kernel on another lane that becomes ready at the same
    moment (a decode step's index scores, forked from the same predecessor as the query's up-projection) finds no
    SM free and waits for the whole stream: launched without the attribute, the stream becomes ready with it, and
    the block scheduler serves the other lane's higher stream priority first."""
    _EARLY_LAUNCH_OFF[0] += int(active)
    try:
        yield
    finally:
        _EARLY_LAUNCH_OFF[0] -= int(active)


@functools.cache
def _pdl_options(index: int) -> dict:
    if not sm90_or_newer(index):
        return {}
    return {"PDL": True, "launch_pdl": True}


_zeroed: dict[tuple[str, torch.device, int], torch.Tensor] = {}


def _per_stream_zeros(name: str, words: int, device: torch.device) -> torch.Tensor:
    """``words`` zeroed int32 words for ``name``, one buffer per (device, current stream), made once."""
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    key = (name, device, stream)
    buf = _zeroed.get(key)
    if buf is None:
        buf = _zeroed[key] = torch.zeros(words, dtype=torch.int32, device=device)
    return buf


def counter_block(device: torch.device) -> torch.Tensor:
    """COUNTERS zeroed int32 arrival counters, one set per (device, stream), for kernels whose last program of a
    group finishes the group's work (split-K sums, a row's final selection): each launch leaves its counters at
    zero again, so graph replays need no memset. Kernels of one stream share the set (with programmatic dependent
    launch a kernel touches memory only after the one before it completed); kernels on two streams may run at once,
    hence one set per stream."""
    return _per_stream_zeros("counters", COUNTERS, device)


def zeroed_scratch(device: torch.device) -> torch.Tensor:
    """SCRATCH_WORDS zeroed int32 words, one buffer per (device, stream), on ``counter_block``'s terms: a kernel that
    accumulates into it (a row's histogram summed across programs) leaves it zeroed again before it completes, and
    kernels of one stream share it. Fixed size: a captured graph keeps pointing at it."""
    return _per_stream_zeros("scratch", SCRATCH_WORDS, device)
