"""The Gluon GEMM kernels launched with programmatic dependent launch: compiled for sm_90 with PDL on, each waits
(``griddepcontrol.wait``) before its first global load and lets the next kernel launch, as the Triton kernels'
``_pdl.pdl_prologue`` does (a program may start while the kernel before it still runs: a load ahead of the wait
could read stale data). CPU only: compiles, runs nothing."""

import pytest

pytest.importorskip("triton.experimental.gluon")

from deepinfer_kernels.testing.triton_interpreter import triton_importable  # noqa: E402

FP8_SIG = {
    "a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "b_ptr": "*fp8e4nv", "bs_ptr": "*u8", "c_ptr": "*bf16", "ws_ptr": "*fp32",
    "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "STEPS_PER_SPLIT": "i32",
}  # fmt: skip
MXFP4_SIG = {
    "x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "out_ptr": "*bf16", "rs_ptr": "*fp32", "tile_e_ptr": "*i32",
    "r0_ptr": "*i32", "r1_ptr": "*i32", "N_OUT": "i32", "K": "i32", "limit": "fp32",
}  # fmt: skip


def _kernels():
    from deepinfer_kernels.ops.fp8_gemm import gluon as fp8_rows
    from deepinfer_kernels.ops.mxfp4_grouped_gemm import gluon as mx_rows
    from deepinfer_kernels.ops.mxfp4_grouped_gemm import gluon_wgmma as mx_wgmma

    rows_sig = dict(MXFP4_SIG, expert_ptr="*i32", index_ptr="*i32", RPI="i32")
    del rows_sig["tile_e_ptr"]
    mcfg = mx_rows.SORTED_CFG
    epi = dict(FUSE=True, HAS_LIMIT=True, HAS_RS=False)
    tiles = dict(BLOCK_N=mcfg["BLOCK_N"], BKH=mcfg["BKH"], NUM_WARPS=4)
    return {
        "fp8_rows": (fp8_rows._fp8_rows_kernel, FP8_SIG, dict(A_E8M0=False, B_E8M0=True, BLOCK_N=64, NUM_WARPS=4,
                                                                           SPLIT=4, SUM_IN_KERNEL=True, BK=128)),
        "mxfp4_rows": (mx_rows._expert_rows_kernel, rows_sig,
                       dict(SORTED=True, HAS_INDEX=False, **tiles, **epi)),
        "mxfp4_wgmma": (mx_wgmma._expert_rows_wgmma_kernel, MXFP4_SIG,
                        dict(mx_wgmma.wgmma_meta(mx_wgmma.WGMMA_CFG), **epi)),
    }  # fmt: skip


@pytest.mark.skipif(not triton_importable(), reason="triton is not importable")
@pytest.mark.parametrize("name", ["fp8_rows", "mxfp4_rows", "mxfp4_wgmma"])
def test_pdl_wait_before_loads(name):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn, sig, meta = _kernels()[name]
    meta = dict(meta, PDL=True)
    sig = dict(sig, **dict.fromkeys(meta, "constexpr"))
    src = GluonASTSource(fn=fn, signature=sig, constexprs=meta, attrs={})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    assert 0 <= wait < ptx.find("ld.global"), "griddepcontrol.wait must precede every global load"
    assert "griddepcontrol.launch_dependents" in ptx
