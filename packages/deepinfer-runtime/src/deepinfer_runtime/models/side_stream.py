"""A decode step's independent branches on a second CUDA stream.

At small decode batches a layer's kernels are latency-bound: each waits on a few dependent memory round trips and
leaves most SMs idle. Work that no kernel of the main path reads until later can then run beside the main path
instead of before or after it: the compressors (ring write, pooling, norm, entry store; V4 and V4.1) and the
window's latents (norm, RoPE, ring write, row table) beside the query path, the shared expert beside the router and
the routed experts (both), V4.1's mHC coefficients beside the sublayer they wrap (its lagged wiring collapses with the
previous site's weights, so only the expand waits for them). Some work takes lanes of its own: V4.1's Engram
values (hash, row gather, value projection: token ids only; lane "engram") beside the layers before their gate, V4's
index-key compressor (lane "index"), so that the index scores wait for their keys alone, not for the attention's
compressor and window, V4's window latents (lane "window", beside its compressor on "layer"), V4's post / comb
coefficients at decode sizes (lane "mhc", beside the sublayer whose input
the site makes from its pre alone), and the shared expert (lane "shared"):

    side = SideStream.of(x.device)
    with side.branch():   # the side stream waits for everything enqueued so far, then takes this block's work
        compressor.decode(...)
    ...                   # main-path work, enqueued on the current stream, runs concurrently
    side.join()           # the current stream waits for the branch before reading what it wrote

Inside a CUDA graph capture the fork and the join are captured as graph edges (the side stream joins the capture
through the fork's event), so a replay runs the branch concurrently too. Tensors the branch reads must outlive the
join (keep a reference until ``join``): the caching allocator would otherwise hand their memory to main-stream work
that the branch's kernels do not wait for. On a CPU device, or with ``DEEPINFER_SIDE_STREAMS=0``, ``branch`` and
``join`` do nothing (the work runs in order on the current stream; results are the same either way).

Streams have priorities (``LANE_PRIORITY``; ``DEEPINFER_STREAM_PRIORITIES=0`` leaves every stream at CUDA's default):
when kernels of several streams wait for SMs, the block scheduler starts the higher-priority grid's programs first,
and a graph replay keeps the priority each kernel was captured with (PyTorch instantiates graphs with node
priorities). A weight stream fills every SM with its programs; without priorities a short kernel of another branch
waits for a whole wave of them. So the lanes of short latency-bound chains that the main path will wait for
(compressors, window latents, index keys, mHC coefficients: lanes "layer", "window", "index", "mhc") come first, the
main path (``capture_stream``, where a decode step's graph is recorded) next, and work with slack last: the shared
expert (lane "shared", beside the router and the routed experts), V4.1's Engram values (lane "engram") and, with
``deepseek_v41.CANDIDATE_LANE``, V4.1's candidate blocks (lane "candidates", read a few layers later).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

SIDE_STREAMS_ENV = "DEEPINFER_SIDE_STREAMS"  # "0": run the branches in order on the current stream
PRIORITIES_ENV = "DEEPINFER_STREAM_PRIORITIES"  # "0": every stream at CUDA's default priority
# lower runs first; CUDA's default, 0, is its lowest priority, and out-of-range values clamp to the nearest
FIRST, MAIN, LAST = -2, -1, 0
LANE_PRIORITY = {
    "layer": FIRST, "window": FIRST, "index": FIRST, "mhc": FIRST, "shared": LAST, "engram": LAST, "candidates": LAST,
}  # fmt: skip


def _priority(level: int) -> int:
    return level if os.environ.get(PRIORITIES_ENV, "1") != "0" else 0


_capture_streams: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream a decode step's CUDA graph is captured on (the main path's priority, ``MAIN``)."""
    stream = _capture_streams.get(device)
    if stream is None:
        stream = _capture_streams[device] = torch.cuda.Stream(device, priority=_priority(MAIN))
    return stream


class SideStream:
    """Side streams per CUDA device, one per ``lane`` (``of``); a no-op stand-in elsewhere."""

    _streams: dict[tuple[torch.device, str], SideStream] = {}

    def __init__(self, stream: torch.cuda.Stream | None):
        self.stream = stream
        self.pending = False  # work branched since the last join

    @classmethod
    def of(cls, device: torch.device, lane: str = "layer") -> SideStream:
        """The side stream of ``lane`` on ``device``. Branches of one lane run in order; a long branch that must not
        hold up the layers' short ones (V4.1's Engram values, made at the start of a step) takes its own lane, and
        the lane sets the stream's priority (``LANE_PRIORITY``; lanes not named there come first)."""
        if device.type != "cuda" or os.environ.get(SIDE_STREAMS_ENV, "1") == "0":
            return _INLINE
        side = cls._streams.get((device, lane))
        if side is None:
            priority = _priority(LANE_PRIORITY.get(lane, FIRST))
            side = cls._streams[(device, lane)] = cls(torch.cuda.Stream(device, priority=priority))
        return side

    @classmethod
    def inline(cls) -> SideStream:
        """The no-op stand-in: ``branch`` and ``join`` do nothing, the work runs in order on the current stream (a
        caller that decides per call to keep a branch on the main path)."""
        return _INLINE

    @contextlib.contextmanager
    def branch(self) -> Iterator[None]:
        """Work enqueued inside runs on the side stream, after everything enqueued on the current stream so far."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        self.pending = True
        with torch.cuda.stream(self.stream):
            yield

    def depend(self) -> None:
        """The current stream (another lane's branch that reads this lane's results) waits for the work branched so
        far; unlike ``join`` that work stays pending, so the main path still joins the lane before reading it."""
        if self.pending:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def join(self) -> None:
        """The current stream waits for the work branched since the last join; nothing when there is none (a
        stream outside a graph capture must not be joined into it)."""
        if self.pending:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self.pending = False


_INLINE = SideStream(None)
