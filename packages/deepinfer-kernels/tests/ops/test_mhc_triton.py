"""Triton mHC backends vs the references: the kernels under Triton's interpreter on CPU at small shapes (in one
child process, so it runs whatever else imported triton first), and on CUDA at V4-Flash / V4.1-Flash shapes
(d = 4096 / 5120, n = 4, fresh random inputs, bf16 and fp32 streams), plus bitwise batch invariance (a token
alone, inside 7, 64 and 4096 tokens) and the registry's choice (triton on CUDA, the reference when forced).

The interpreter rounds fp32 -> bf16 stores toward zero (the GPU rounds to nearest even), so interpreted bf16
outputs are held to 1 bf16 ulp of the reference; on the GPU most of them are bitwise equal."""

import pytest
import torch

pytest.importorskip("triton")

from deepinfer_kernels.ops.mhc import MhcConfig, MhcParams, mhc_same_site_sublayer  # noqa: E402
from deepinfer_kernels.ops.mhc.reference import (  # noqa: E402
    mhc_coefficients_ref,
    mhc_collapse_ref,
    mhc_expand_ref,
    mhc_head_weights_ref,
)
from deepinfer_kernels.ops.mhc.triton import (  # noqa: E402
    mhc_coefficients_triton,
    mhc_coefficients_triton_adaptive,
    mhc_collapse_rms_norm_triton,
    mhc_collapse_triton,
    mhc_expand_collapse_triton,
    mhc_expand_triton,
    mhc_head_weights_triton,
    mhc_head_weights_triton_adaptive,
    mhc_pre_collapse_rms_norm_triton,
    mhc_pre_collapse_rms_norm_triton_adaptive,
)
from deepinfer_kernels.ops.rms_norm.reference import rms_norm_ref  # noqa: E402
from deepinfer_kernels.ops.rms_norm.triton import rms_norm_triton  # noqa: E402
from deepinfer_kernels.registry import list_ops, resolve, set_batch_invariant  # noqa: E402
from deepinfer_kernels.testing.compare import assert_bitwise, assert_rel_close  # noqa: E402
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test  # noqa: E402

COEF_TOL = 1e-5  # fp32 coefficients, bf16 or fp32 streams
OPS = (
    "mhc_coefficients", "mhc_head_weights", "mhc_collapse", "mhc_collapse_rms_norm", "mhc_pre_collapse_rms_norm",
    "mhc_expand", "mhc_expand_collapse",
)  # fmt: skip


def _inputs(t: int, n: int, d: int, dtype: torch.dtype, device: str, seed: int):
    """x [T, n, d], site params (fn, base, scale), head params, y [T, d]: mixes of O(1) so that softmax and
    Sinkhorn see non-trivial logits."""
    g = torch.Generator(device=device).manual_seed(seed)
    rows, k = (2 + n) * n, n * d

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=g, device=device) * std

    x = randn(t, n, d).to(dtype)
    fn = randn(rows, k, std=2 / k**0.5)
    base = randn(rows, std=0.5)
    scale = 0.5 + torch.rand(3, generator=g, device=device)
    head = (randn(n, k, std=2 / k**0.5), randn(n, std=0.5), 0.5 + torch.rand(1, generator=g, device=device))
    y = randn(t, d).to(dtype)
    return x, (fn, base, scale), head, y


def _assert_stream_close(actual: torch.Tensor, expected: torch.Tensor, what: str, min_equal: float) -> None:
    """fp32: relative error ~ fp32 rounding. bf16: every element within one bf16 ulp of ``expected`` (or within
    2^-20 of its largest magnitude, where the sum cancels and the fp32 orders differ by more than a tiny ulp),
    and at least ``min_equal`` of the elements bitwise equal."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if expected.dtype == torch.float32:
        assert_rel_close(actual, expected, 2e-6, what)
        return
    a, e = actual.double(), expected.double()
    ulp = torch.finfo(expected.dtype).eps * torch.ldexp(torch.ones_like(e), torch.frexp(e).exponent - 1)
    far = (a - e).abs() > torch.clamp(ulp, min=2**-20 * e.abs().max().item())
    assert not far.any(), f"{what}: {int(far.sum())} of {e.numel()} elements more than 1 ulp off"
    equal = (a == e).double().mean().item()
    assert equal >= min_equal, f"{what}: only {equal:.4f} of the elements bitwise equal"


def _check_all(x, site, head, y, eps=(1e-6, 1e-6, 20), min_equal=0.99) -> None:
    norm_eps, hc_eps, iters = eps
    n = x.shape[1]
    what = f"{x.dtype} T={x.shape[0]} n={n} d={x.shape[2]} eps={eps}"
    ref = mhc_coefficients_ref(x, *site, norm_eps, hc_eps, iters)
    h_ref = mhc_head_weights_ref(x, *head, norm_eps, hc_eps)
    # the adaptive backend: its tier's tiling up to ADAPTIVE_MAX_TOKENS tokens, the invariant one above
    for coef, head_w in (
        (mhc_coefficients_triton, mhc_head_weights_triton),
        (mhc_coefficients_triton_adaptive, mhc_head_weights_triton_adaptive),
    ):
        got = coef(x, *site, norm_eps, hc_eps, iters)
        for name, a, e in zip(("pre", "post", "comb"), got, ref, strict=True):
            assert a.dtype == torch.float32
            assert_rel_close(a, e, COEF_TOL, f"{name} {what} {coef.__name__}")
        assert_rel_close(head_w(x, *head, norm_eps, hc_eps), h_ref, COEF_TOL, f"head {what} {head_w.__name__}")
    pre, post, comb = ref  # the same weights for both sides: only the contraction is under test
    u = mhc_collapse_triton(x, pre)
    _assert_stream_close(u, mhc_collapse_ref(x, pre), f"collapse {what}", min_equal)
    g = 0.5 + torch.rand(x.shape[2], device=x.device)
    fused = mhc_collapse_rms_norm_triton(x, pre, g, norm_eps)
    # against the reference norm of the collapse just checked (under the interpreter each cast truncates once)
    _assert_stream_close(fused, rms_norm_ref(u, g, norm_eps), f"collapse+norm {what}", min_equal)
    if x.dtype == torch.bfloat16:  # the models' streams: the two kernels' bits (fp32 streams: fp32 rounding)
        assert_bitwise(fused, rms_norm_triton(u, g, norm_eps), f"collapse+norm vs the two kernels {what}")
    # a V4 site's input from its pre rows alone: against the head weights' kernels then the collapse + norm (the
    # same pre up to its split sum's order) and against the reference composition
    rows = (site[0][:n], site[1][:n], site[2][:1])
    for fused_fn, head_w in (
        (mhc_pre_collapse_rms_norm_triton, mhc_head_weights_triton),
        (mhc_pre_collapse_rms_norm_triton_adaptive, mhc_head_weights_triton_adaptive),
    ):
        got = fused_fn(x, *rows, g, norm_eps, hc_eps, 1e-6)
        two = mhc_collapse_rms_norm_triton(x, head_w(x, *rows, norm_eps, hc_eps), g, 1e-6)
        # pre's split sum runs on another warp layout (fp32 rounding apart), then two bf16 roundings (the collapse,
        # the norm): a few elements in 10^4 move by 2 ulp; nearly all are bitwise the kernels' on the GPU
        assert_rel_close(got, two, 2e-6 if x.dtype == torch.float32 else 2e-3, f"pre+collapse+norm vs kernels {what}")
        if x.dtype == torch.bfloat16:
            equal = (got == two).double().mean().item()
            assert equal >= 0.98 * min_equal, f"pre+collapse+norm vs kernels {what}: {equal:.4f} bitwise equal"
        want = rms_norm_ref(mhc_collapse_ref(x, pre), g, 1e-6)  # bf16: two roundings (interpreted: truncations)
        assert_rel_close(got, want, 2e-6 if x.dtype == torch.float32 else 8e-3, f"pre+collapse+norm {what}")
    out = mhc_expand_triton(x, y, post, comb)
    _assert_stream_close(out, mhc_expand_ref(x, y, post, comb), f"expand {what}", min_equal)
    # a sublayer output given as two addends (a MoE's routed and shared experts): the kernel's sum in y's dtype is
    # torch's, so on the GPU the result is the expand of y + y_add bitwise (the interpreter truncates its bf16 cast)
    if x.is_cuda or y.dtype == torch.float32:
        y_add = torch.randn_like(y)
        got = mhc_expand_triton(x, y, post, comb, y_add)
        _assert_stream_close(got, mhc_expand_ref(x, y, post, comb, y_add), f"expand y + y_add {what}", min_equal)
        assert_bitwise(got, mhc_expand_triton(x, y + y_add, post, comb), f"expand y_add vs y + y_add {what}")
    # the expand with the collapse of what it writes (V4.1's next-site input): the expand kernel's streams and the
    # collapse kernel's bits over them, by construction (the same roundings, the same order of the fp32 sums)
    for y_add in (None, torch.randn_like(y)):
        got, u2 = mhc_expand_collapse_triton(x, y, post, comb, pre, y_add)
        assert_bitwise(got, mhc_expand_triton(x, y, post, comb, y_add), f"expand+collapse streams {what}")
        assert_bitwise(u2, mhc_collapse_triton(got, pre), f"expand+collapse vs the two kernels {what}")
        _assert_stream_close(u2, mhc_collapse_ref(got, pre), f"expand+collapse vs reference {what}", min_equal)


def _check_invariant(x, site, head, y, rows, sizes, eps=(1e-6, 1e-6, 20), streams=True) -> None:
    """Token r computed alone and inside x[r - i : r - i + size] equals token r of the whole batch, bitwise
    (``streams``: collapse and expand too, not only the coefficients)."""
    full = mhc_coefficients_triton(x, *site, *eps)
    h_full = mhc_head_weights_triton(x, *head, *eps[:2])
    if streams:
        u_full = mhc_collapse_triton(x, full[0])
        g = 0.5 + torch.rand(x.shape[2], device=x.device)
        n_full = mhc_collapse_rms_norm_triton(x, full[0], g, eps[0])
        rows_ = (site[0][: x.shape[1]], site[1][: x.shape[1]], site[2][:1])
        p_full = mhc_pre_collapse_rms_norm_triton(x, *rows_, g, *eps[:2], 1e-6)
        o_full = mhc_expand_triton(x, y, full[1], full[2])
        c_full = mhc_expand_collapse_triton(x, y, full[1], full[2], full[0])[1]
    t = x.shape[0]
    for r in rows:
        for size in sizes:
            lo = max(0, min(r - size // 2, t - size))
            i = r - lo
            sl = slice(lo, lo + size)
            part = mhc_coefficients_triton(x[sl].clone(), *site, *eps)
            for name, a, b in zip(("pre", "post", "comb"), part, full, strict=True):
                assert_bitwise(a[i], b[r], f"{name} of token {r} in {size} vs in {t}")
            assert_bitwise(mhc_head_weights_triton(x[sl].clone(), *head, *eps[:2])[i], h_full[r], f"head {r}/{size}")
            if streams:
                assert_bitwise(mhc_collapse_triton(x[sl].clone(), full[0][sl])[i], u_full[r], f"collapse {r}/{size}")
                normed = mhc_collapse_rms_norm_triton(x[sl].clone(), full[0][sl], g, eps[0])
                assert_bitwise(normed[i], n_full[r], f"collapse+norm {r}/{size}")
                pcn = mhc_pre_collapse_rms_norm_triton(x[sl].clone(), *rows_, g, *eps[:2], 1e-6)
                assert_bitwise(pcn[i], p_full[r], f"pre+collapse+norm {r}/{size}")
                o = mhc_expand_triton(x[sl].clone(), y[sl].clone(), full[1][sl], full[2][sl])
                assert_bitwise(o[i], o_full[r], f"expand {r}/{size}")
                c = mhc_expand_collapse_triton(x[sl].clone(), y[sl].clone(), full[1][sl], full[2][sl], full[0][sl])
                assert_bitwise(c[1][i], c_full[r], f"expand+collapse {r}/{size}")


# ---- CPU, Triton interpreter (one child process) ----


def _interp_matches_reference(dtype: str, t: int, n: int, d: int, eps: tuple) -> None:
    x, site, head, y = _inputs(t, n, d, getattr(torch, dtype), "cpu", seed=t * d + n)
    if t > 1:
        x[1] = 0  # an all-zero token: with V4.1's norm_eps = 1e-20 its mixes stay 0
    # interpreted bf16 stores truncate: 1 ulp always allowed, no bitwise share asked for
    _check_all(x, site, head, y, eps, min_equal=0.99 if dtype == "float32" else 0.0)


def _interp_batch_invariant() -> None:
    # 130 tokens: two BLOCK_T tiles; d = 300: K = 1200 is three K splits, the last ragged. One Sinkhorn pass
    # and no collapse / expand (one program per token, nothing shared: the GPU test covers them) keep it fast.
    x, site, head, y = _inputs(130, 4, 300, torch.bfloat16, "cpu", seed=7)
    _check_invariant(x, site, head, y, rows=(0, 129), sizes=(1, 3), eps=(1e-6, 1e-6, 1), streams=False)


INTERP_CASES = {
    f"{dt}-T{t}-n{n}-d{d}-eps{i}": ("_interp_matches_reference", (dt, t, n, d, eps))
    for dt in ("float32", "bfloat16")
    for i, (t, n, d, eps) in enumerate(
        (
            (5, 4, 64, (1e-6, 1e-6, 20)),
            (3, 4, 300, (0.5, 0.05, 3)),  # exaggerated eps: a misplaced epsilon moves results far
            (4, 4, 96, (1e-20, 1e-6, 1)),  # one Sinkhorn pass, V4.1's norm eps
            (2, 3, 40, (1e-6, 1e-6, 20)),  # n not a power of two: padded comb / rows
            (20, 4, 64, (1e-6, 1e-6, 20)),  # the adaptive backend's 32-token tier: two token tiles
            (40, 4, 64, (1e-6, 1e-6, 20)),  # and its 64-token tier
        )
    )
}
INTERP_CASES["batch-invariant"] = ("_interp_batch_invariant", ())


def _interp_collapse_rms_norm_chunks() -> None:
    """Rows longer than rms_norm's widest chunk: the fused kernels' two-pass paths, against the two kernels."""
    import deepinfer_kernels.ops.rms_norm.triton as norm_triton

    norm_triton.MAX_BLOCK = 64  # read at call time: d = 300 becomes five chunks, the last ragged
    x, _, _, _ = _inputs(3, 4, 300, torch.bfloat16, "cpu", seed=11)
    w, g = torch.rand(3, 4) + 0.1, torch.rand(300) + 0.5
    fused = mhc_collapse_rms_norm_triton(x, w, g, 1e-6)
    assert_bitwise(fused, rms_norm_triton(mhc_collapse_triton(x, w), g, 1e-6), "collapse+norm, five chunks")
    _assert_stream_close(fused, rms_norm_ref(mhc_collapse_triton(x, w), g, 1e-6), "collapse+norm vs reference", 0.0)
    _, site, _, _ = _inputs(3, 4, 300, torch.bfloat16, "cpu", seed=12)
    rows = (site[0][:4], site[1][:4], site[2][:1])
    pre = mhc_head_weights_triton(x, *rows, 1e-6, 1e-6)
    got = mhc_pre_collapse_rms_norm_triton(x, *rows, g, 1e-6, 1e-6, 1e-6)
    _assert_stream_close(got, mhc_collapse_rms_norm_triton(x, pre, g, 1e-6), "pre+collapse+norm, five chunks", 0.0)


INTERP_CASES["collapse-rms-norm-chunks"] = ("_interp_collapse_rms_norm_chunks", ())


test_interpreter = interpreted_cases_test(__file__, INTERP_CASES)  # every case in one TRITON_INTERPRET=1 child process


def test_backends_registered():
    for op in OPS:
        assert "triton" in list_ops()[op], op
    if not torch.cuda.is_available():
        assert resolve("mhc_coefficients", "cpu") is mhc_coefficients_ref  # registered for "cuda" only


# ---- CUDA, real shapes ----


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [4096, 5120])  # V4-Flash, V4.1-Flash
@pytest.mark.parametrize("t", [1, 7, 16, 32, 64, 256, 4096])  # every ADAPTIVE_MIX tier and past them
def test_gpu_matches_reference(t, d, dtype):
    x, site, head, y = _inputs(t, 4, d, dtype, "cuda", seed=t + d)
    _check_all(x, site, head, y)
    if t == 64:
        _check_all(x, site, head, y, eps=(1e-20, 1e-6, 20))  # V4.1's norm eps


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [4096, 5120])
def test_gpu_batch_invariant(d, dtype):
    x, site, head, y = _inputs(4096, 4, d, dtype, "cuda", seed=d)
    _check_invariant(x, site, head, y, rows=(0, 127, 128, 2500, 4095), sizes=(1, 7, 64))


@pytest.mark.gpu
def test_gpu_registry_and_sublayer(monkeypatch):
    x, site, _, _ = _inputs(16, 4, 4096, torch.bfloat16, "cuda", seed=1)
    params, cfg = MhcParams(*site), MhcConfig(norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
    assert resolve("mhc_coefficients", "cuda") is mhc_coefficients_triton_adaptive
    assert resolve("mhc_head_weights", "cuda") is mhc_head_weights_triton_adaptive
    assert resolve("mhc_collapse", "cuda") is mhc_collapse_triton
    assert resolve("mhc_collapse_rms_norm", "cuda") is mhc_collapse_rms_norm_triton
    assert resolve("mhc_pre_collapse_rms_norm", "cuda") is mhc_pre_collapse_rms_norm_triton_adaptive
    assert resolve("mhc_expand", "cuda") is mhc_expand_triton
    assert resolve("mhc_expand_collapse", "cuda") is mhc_expand_collapse_triton
    set_batch_invariant(True)
    try:
        assert resolve("mhc_coefficients", "cuda") is mhc_coefficients_triton
        assert resolve("mhc_head_weights", "cuda") is mhc_head_weights_triton
        assert resolve("mhc_pre_collapse_rms_norm", "cuda") is mhc_pre_collapse_rms_norm_triton
        assert resolve("mhc_expand", "cuda") is mhc_expand_triton
        assert resolve("mhc_expand_collapse", "cuda") is mhc_expand_collapse_triton
    finally:
        set_batch_invariant(None)
    out = mhc_same_site_sublayer(x, torch.tanh, params, cfg)
    monkeypatch.setenv("DEEPINFER_FORCE_REFERENCE", "1")
    assert resolve("mhc_coefficients", "cuda") is mhc_coefficients_ref
    assert resolve("mhc_expand", "cuda") is mhc_expand_ref
    ref = mhc_same_site_sublayer(x, torch.tanh, params, cfg)
    assert_rel_close(out, ref, 1e-2, "same-site sublayer, triton vs forced reference")
