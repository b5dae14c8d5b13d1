"""CUDA graphs of decode steps: whole planned steps (``StepGraphs``), and the static sublayers of other short steps
("piecewise" graphs, ``SublayerGraphs``).

A decode step is host-bound: every op is a Python call and a kernel launch. A decode step planned as one batch
(``decode_batch``) reads only its plan's index tensor and has static shapes (batch bucket, table width), so the
whole step is captured once per shape and replayed with one launch. Other short steps (a few prefill or
verification tokens, requests outside the engine's pools) run their attention request by request, whose shapes
change every step; their FFN sublayer (mHC coefficients and collapse, norm, router, routed and shared experts, mHC
expand) has no data-dependent shapes and no host reads, so for a given token count T it is captured once.

``SublayerGraphs.run(key, fn, *inputs)`` captures ``fn`` for the inputs' shapes on first use (after one warm-up
call on a side stream) and replays it afterwards: the inputs are copied into the graph's static input buffers and
the graph's static output is returned. That output is overwritten by the next replay of the same graph, so a
caller must consume it (any stream-ordered use will do) before running the same ``key`` at the same T again.
A replay runs the captured kernels on the same shapes, so its results are bitwise those of the eager call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer_runtime.models.side_stream import capture_stream


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]
    output: torch.Tensor

    @classmethod
    def capture(cls, fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], pool, warm_up: bool) -> _Graph:
        """``fn`` recorded over static copies of ``inputs`` in memory pool ``pool``; with ``warm_up`` it runs once
        first on a side stream (lazy initialisation and compilation stay out of the graph)."""
        static = tuple(t.clone() for t in inputs)
        if warm_up:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn(*static)
            torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # on the main path's priority stream: kernel nodes keep the priority of the stream they were captured on
        stream = capture_stream(torch.device("cuda", torch.cuda.current_device()))
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            out = fn(*static)
        return cls(graph, static, out)

    def replay(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Copy ``inputs`` into the static ones, replay, return the (static) output."""
        for dst, src in zip(self.inputs, inputs):
            dst.copy_(src)
        self.graph.replay()
        return self.output


class SublayerGraphs:
    """Graphs per (sublayer key, input shapes), for steps of at most ``max_tokens`` tokens (larger steps, prefill
    chunks, run eagerly: they are launch-bound no more, and each new T would cost a capture)."""

    def __init__(self, max_tokens: int = 64):
        if max_tokens < 1:
            raise ValueError(f"SublayerGraphs: max_tokens must be positive, got {max_tokens}")
        self.max_tokens = max_tokens
        self.pool = None  # one memory pool for every graph, made at the first capture
        self.graphs: dict[tuple, _Graph] = {}

    def applies(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.shape[0] <= self.max_tokens and not torch.cuda.is_current_stream_capturing()

    def run(self, key: object, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        """``fn(*inputs)`` through the graph for these shapes (captured on first use)."""
        shapes = tuple((t.shape, t.dtype) for t in inputs)
        entry = self.graphs.get((key, shapes))
        if entry is None:
            self.pool = self.pool or torch.cuda.graph_pool_handle()
            entry = self.graphs[(key, shapes)] = _Graph.capture(fn, inputs, self.pool, warm_up=True)
        return entry.replay(inputs)

    def __len__(self) -> int:
        return len(self.graphs)


def attach_sublayer_graphs(model: torch.nn.Module, block_type: type, max_tokens: int) -> SublayerGraphs:
    """One ``SublayerGraphs`` set as ``graphs`` on every ``block_type`` module of ``model`` (their FFN sites then
    replay graphs for steps of at most ``max_tokens`` tokens)."""
    graphs = SublayerGraphs(max_tokens)
    for m in model.modules():
        if isinstance(m, block_type):
            m.graphs = graphs
    return graphs


class StepGraphs:
    """CUDA graphs of whole decode steps (``decode_batch``): one per plan shape (batch bucket, table width), for
    batches of at most ``max_rows`` rows.

    A step writes the caches as it runs, and reads rows that its own write may overwrite (a ring's oldest), so it
    must run exactly once per plan: the usual warm-up-then-capture would run it twice. The first step of a shape
    runs eagerly (that compiles kernels and initialises libraries), a later one is captured without running and
    then replayed; replays copy the inputs into the graph's static ones first. The output is overwritten by the
    next replay of the same graph, so a caller consumes it before the next step. At most ``max_graphs`` are kept
    (the least recently replayed goes first; a shape seen again is captured again).
    """

    def __init__(self, max_rows: int = 64, max_graphs: int = 32):
        if max_rows < 1 or max_graphs < 1:
            raise ValueError(f"StepGraphs: max_rows and max_graphs must be positive, got {max_rows}, {max_graphs}")
        self.max_rows, self.max_graphs = max_rows, max_graphs
        self.pool = None
        self.graphs: OrderedDict[object, _Graph] = OrderedDict()  # least recently replayed first
        self._seen: set = set()

    def applies(self, rows: int, device: torch.device) -> bool:
        return device.type == "cuda" and rows <= self.max_rows and not torch.cuda.is_current_stream_capturing()

    def run(self, key: object, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        entry = self.graphs.get(key)
        if entry is None:
            if key not in self._seen:
                self._seen.add(key)
                return fn(*inputs)
            self.pool = self.pool or torch.cuda.graph_pool_handle()
            # no warm-up: the eager first step was it, and a second run would write the caches twice
            entry = self.graphs[key] = _Graph.capture(fn, inputs, self.pool, warm_up=False)
            while len(self.graphs) > self.max_graphs:  # each holds its inputs and output in the pool
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        return entry.replay(inputs)

    def __len__(self) -> int:
        return len(self.graphs)
