"""SideStream: the decode step's branch / join. On the CPU (or with DEEPINFER_SIDE_STREAMS=0) both do nothing; on CUDA
a branch's writes are seen after the join, eagerly and from a captured graph, on either lane, and a join without a
branch (a layer that branched nothing) is a no-op, also inside a capture. The lanes' and the capture stream's
priorities are ordered as ``LANE_PRIORITY`` says, and DEEPINFER_STREAM_PRIORITIES=0 puts them all at the default."""

import pytest
import torch
from deepinfer_runtime.models import side_stream
from deepinfer_runtime.models.side_stream import PRIORITIES_ENV, SIDE_STREAMS_ENV, SideStream, capture_stream


def test_cpu_and_switched_off_are_inline(monkeypatch):
    side = SideStream.of(torch.device("cpu"))
    assert side.stream is None
    x = torch.zeros(3)
    with side.branch():
        x += 1
    side.join()
    assert x.tolist() == [1, 1, 1]
    monkeypatch.setenv(SIDE_STREAMS_ENV, "0")
    assert SideStream.of(torch.device("cuda", 0)).stream is None


@pytest.mark.gpu
def test_gpu_lanes():
    dev = torch.device("cuda")
    layer, engram = SideStream.of(dev), SideStream.of(dev, "engram")
    assert layer is SideStream.of(dev, "layer") and engram is SideStream.of(dev, "engram")
    assert layer.stream is not None and engram.stream is not None and layer.stream != engram.stream


@pytest.mark.gpu
@pytest.mark.parametrize("enabled", [True, False])
def test_gpu_priorities(monkeypatch, enabled):
    monkeypatch.setattr(SideStream, "_streams", {})  # fresh streams, made under this test's setting
    monkeypatch.setattr(side_stream, "_capture_streams", {})
    monkeypatch.setenv(PRIORITIES_ENV, "1" if enabled else "0")
    dev = torch.device("cuda")
    least, greatest = torch.cuda.Stream.priority_range()  # (0, -3) on an H100 / H200: lower runs first
    layer, index = SideStream.of(dev).stream.priority, SideStream.of(dev, "index").stream.priority
    assert SideStream.of(dev, "mhc").stream.priority == layer
    shared, engram = SideStream.of(dev, "shared").stream.priority, SideStream.of(dev, "engram").stream.priority
    main = capture_stream(dev).priority
    assert capture_stream(dev) is capture_stream(dev)
    if not enabled:
        assert {layer, index, shared, engram, main} == {0}
    elif greatest <= -2:
        assert layer == index < main < shared == engram == least
    else:  # a GPU with two levels: the short chains and the main path share the high one
        assert layer == index <= main < shared == engram == least


def _step(side: SideStream, a: torch.Tensor, out: torch.Tensor, branch: bool) -> torch.Tensor:
    """main: b = a * 3 (several kernels); branch: out = a + 1 (written in place, read after the join)."""
    if branch:
        with side.branch():
            for _ in range(50):  # long enough to still run when the main path reaches the join
                out.copy_(a + 1)
    b = a * 3
    for _ in range(20):
        b = b * 1
    side.join()
    side.join()  # a second join has nothing to wait for
    return b + out


@pytest.mark.gpu
@pytest.mark.parametrize("branch", [True, False])
@pytest.mark.parametrize("lane", ["layer", "engram"])
def test_gpu_branch_join_eager_and_captured(branch, lane):
    side = SideStream.of(torch.device("cuda"), lane)
    assert side.stream is not None
    a = torch.randn(1 << 20, device="cuda")
    out = torch.zeros_like(a)
    want = a * 3 + ((a + 1) if branch else 0)
    torch.testing.assert_close(_step(side, a, out, branch), want, rtol=0, atol=0)
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = _step(side, a, out, branch)
    a.copy_(torch.randn_like(a))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(res, a * 3 + ((a + 1) if branch else 0), rtol=0, atol=0)


def _two_lanes(first: SideStream, second: SideStream, a: torch.Tensor, mid: torch.Tensor, out: torch.Tensor):
    """lane 1: mid = a + 1 (slowly); lane 2, after ``depend`` on lane 1: out = mid * 2; main joins both."""
    with first.branch():
        for _ in range(50):
            mid.copy_(a + 1)
    with second.branch():
        first.depend()
        out.copy_(mid * 2)
    assert first.pending, "depend leaves the lane to be joined by the main path"
    first.join()
    second.join()
    return out + mid


@pytest.mark.gpu
def test_gpu_depend_orders_lanes_eager_and_captured():
    dev = torch.device("cuda")
    first, second = SideStream.of(dev, "layer"), SideStream.of(dev, "index")
    a = torch.randn(1 << 20, device="cuda")
    mid, out = torch.zeros_like(a), torch.zeros_like(a)
    torch.testing.assert_close(_two_lanes(first, second, a, mid, out), (a + 1) * 3, rtol=0, atol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = _two_lanes(first, second, a, mid, out)
    a.copy_(torch.randn_like(a))
    mid.zero_()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(res, (a + 1) * 3, rtol=0, atol=0)


def test_depend_inline_on_cpu():
    first, second = SideStream.of(torch.device("cpu")), SideStream.of(torch.device("cpu"), "index")
    x = torch.zeros(2)
    with first.branch():
        x += 1
    with second.branch():
        first.depend()
        x *= 3
    first.join()
    second.join()
    assert x.tolist() == [3, 3]


def test_shared_expert_inline_policy(monkeypatch):
    """``routed_plus_shared`` asks for the "shared" lane except at SHARED_INLINE_TOKENS with MXFP4 experts, where the
    shared expert runs first on the main path; the sum is the same either way."""
    from deepinfer_runtime.models import layers

    torch.manual_seed(0)
    hidden, inter = 64, 32
    experts = layers.Experts(4, inter, hidden, torch.float32)
    for p in experts.parameters():
        p.data.normal_(0, 0.05)
    shared = layers.SharedExpert(inter, hidden, torch.float32)
    for p in shared.parameters():
        p.data.normal_(0, 0.05)
    asked = []

    def of(device, lane="layer"):
        asked.append(lane)
        return SideStream.inline()

    monkeypatch.setattr(layers.SideStream, "of", staticmethod(of))
    monkeypatch.setattr(layers, "SHARED_INLINE_TOKENS", ((1, 1), (5, 6)))

    def run(t, exp):
        x = torch.randn(t, hidden)

        def route():
            return torch.full((t, 2), 0.5), torch.stack([torch.arange(t) % 4, (torch.arange(t) + 1) % 4], 1)

        asked.clear()
        out = layers.routed_plus_shared(x, route, exp, shared, 10.0)
        w, ids = route()
        want = exp(x, ids, w, swiglu_limit=10.0) + layers.swiglu_mlp(
            x, shared.w1.weight, shared.w3.weight, shared.w2.weight, swiglu_limit=10.0
        )
        torch.testing.assert_close(out, want)
        return list(asked)

    assert [run(t, experts) for t in (1, 2, 5, 7)] == [["shared"]] * 4  # bf16 / fp32 experts: always the lane
    experts.quantize_mxfp4_()
    assert [run(t, experts) for t in (1, 2, 5, 6, 7)] == [[], ["shared"], [], [], ["shared"]]
    assert layers.shared_expert_inline(1, torch.nn.Linear(2, 2)) is False  # e.g. expert-parallel experts
