"""Row invariance of the reference ops and of what batch-invariant mode dispatches to, on CUDA (skipped
without a GPU) and on the CPU with several intra-op thread counts.

CUDA picks the reduction strategy of .sum()/.mean()/softmax from the tensor's shape, so references that
reduced that way changed a row's bits with the batch (rms_norm, mhc_coefficients, sparse attention, the
Engram gate, as measured on an H200). They now reduce with ``ops/_reduce.row_sum``; this test keeps it so.
The default dispatch is not row-invariant by design (decode shapes take other tiles: ``linear``'s skinny GEMV,
mHC's adaptive tiles), so the references are forced (``DEEPINFER_FORCE_REFERENCE``); batch-invariant mode
(``set_batch_invariant``) must give the same guarantee with its own backends.
"""

import deepinfer_kernels as dk
import pytest
import torch
from deepinfer_kernels import MhcConfig, MhcParams, registry

T = 37


def _invariant(fn, *rowed):
    full = fn(*rowed)
    for chunk in (1, 5, 16, 17):
        parts = [fn(*(r[s : s + chunk] for r in rowed)) for s in range(0, T, chunk)]
        if not torch.equal(torch.cat(parts), full):
            return False
    return True


def _cases(dev: str = "cuda"):
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, device=dev, generator=g)

    w, inv = r(704, 1280), dk.rope_inv_freq(64, 160000.0).to(dev)
    prm, cfg = MhcParams(r(24, 1024) * 0.03, r(24), r(3).abs()), MhcConfig(1e-6, 1e-6, 20)
    e, i = 8, 128
    w13, w2 = r(e, 2 * i, 256) * 0.05, r(e, 256, i) * 0.05
    experts = torch.stack([torch.randperm(e, device=dev, generator=g)[:3] for _ in range(T)])
    keys, kv = r(300, 64), r(400, 512)
    idx = torch.randint(-1, 400, (T, 150), device=dev, generator=g)
    sinks, ew = r(8), r(4, 256)
    return {
        "linear": (lambda x: dk.linear(x, w), r(T, 1280)),
        "rope_interleaved": (
            lambda x, p: dk.rope_interleaved(x, p, inv),
            r(T, 8, 512),
            torch.randint(0, 9999, (T,), device=dev, generator=g),
        ),
        "mhc_collapse": (dk.mhc_collapse, r(T, 4, 256), r(T, 4).abs()),
        "mhc_expand": (dk.mhc_expand, r(T, 4, 256), r(T, 256), r(T, 4).abs(), r(T, 4, 4).abs()),
        "moe_experts": (
            lambda x, ex, wt: dk.moe_experts(x, ex, wt, w13, w2, swiglu_limit=10.0),
            r(T, 256),
            experts,
            r(T, 3).abs(),
        ),
        "grouped_linear": (lambda x: dk.grouped_linear(x, w[:1024, :512].contiguous()), r(T, 8, 512)),
        "indexer_scores": (
            lambda q, wt: dk.indexer_scores(q[None], keys[None], wt[None], 0.125)[0],
            r(T, 16, 64),
            r(T, 16).abs(),
        ),
        "kv_compress_pool": (dk.kv_compress_pool, r(T, 2, 512), r(T, 2, 512)),
        "fake_quant_e2m1": (lambda x: dk.fake_quant_e2m1(x, 16, "e4m3"), r(T, 512)),
        "rms_norm": (lambda x: dk.rms_norm(x, None, 1e-6), r(T, 512)),
        "mhc_coefficients": (
            lambda x: torch.cat([t.reshape(x.shape[0], -1) for t in dk.mhc_coefficients(x, prm, cfg)], 1),
            r(T, 4, 256),
        ),
        "sparse_mqa_attention": (lambda q, i_: dk.sparse_mqa_attention(q, kv, i_, sinks, 512**-0.5), r(T, 8, 512), idx),
        "engram_gate_inject": (
            lambda x, k, v: dk.engram_gate_inject(x, k, v, ew, None),
            r(T, 4, 256),
            r(T, 4, 256),
            r(T, 256),
        ),
    }


OPS = [
    "linear",
    "rope_interleaved",
    "mhc_collapse",
    "mhc_expand",
    "moe_experts",
    "grouped_linear",
    "indexer_scores",
    "kv_compress_pool",
    "fake_quant_e2m1",
    "engram_gate_inject",
    "mhc_coefficients",
    "rms_norm",
    "sparse_mqa_attention",
]


@pytest.fixture(params=["reference", "batch_invariant"])
def mode(request, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if request.param == "reference":
        monkeypatch.setenv("DEEPINFER_FORCE_REFERENCE", "1")
        yield request.param
    else:
        monkeypatch.delenv("DEEPINFER_FORCE_REFERENCE", raising=False)
        registry.set_batch_invariant(True)
        yield request.param
        registry.set_batch_invariant(None)


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_op_is_row_invariant_on_cuda(op, mode):
    fn, *rowed = _cases()[op]
    assert _invariant(fn, *rowed), f"{op} is not row-invariant on CUDA ({mode})"


@pytest.mark.parametrize("threads", [2, 4, 8, 16])
@pytest.mark.parametrize("op", OPS)
def test_op_is_row_invariant_on_cpu_with_any_thread_count(op, threads):
    """The CPU's batch-invariant dispatch too: intra-op threading splits work by shape (seen: a 16-core host)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    registry.set_batch_invariant(True)
    try:
        fn, *rowed = _cases("cpu")[op]
        assert _invariant(fn, *rowed), f"{op} is not row-invariant on the CPU with {threads} threads"
    finally:
        registry.set_batch_invariant(None)
        torch.set_num_threads(before)
