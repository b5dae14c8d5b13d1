"""engram_gather_rows: the Triton gather vs the reference (bitwise: exact gather and power-of-two scales) under
Triton's interpreter on CPU and on CUDA at V4.1 shapes (FP8 rows of 256 with per-32 UE8M0 scales, 24 rows per
token), with the table on the device and in pinned host memory read in place (no host sync: captured in a CUDA
graph and replayed with new ids); ``engram_rows_in_place`` says which tables a step can capture."""

import pytest
import torch
from deepinfer_kernels import engram_gather_rows, engram_rows_in_place
from deepinfer_kernels.ops.engram.reference import engram_gather_rows_ref

pytest.importorskip("triton")

from deepinfer_kernels.testing.compare import assert_bitwise  # noqa: E402
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test  # noqa: E402


def _table(r: int, dh: int, fp8: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    vals = torch.randn(r, dh, generator=g) * 4
    if not fp8:
        return vals.to(torch.bfloat16), None
    scale = torch.randint(115, 135, (r, dh // 32), generator=g, dtype=torch.uint8)
    scale[1, 0] = 255  # NaN decodes like the reference (byte 0, 2^-127, makes fp32 subnormals: not bitwise)
    return vals.to(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu)


def _interp_matches_reference(fp8: bool, dh: int):
    from deepinfer_kernels.ops.engram.triton import engram_gather_rows_triton

    rows, scale = _table(50, dh, fp8, dh)
    ids = torch.randint(0, 50, (7, 3), generator=torch.Generator().manual_seed(1))
    ids[0, 0], ids[0, 1] = 0, 1
    for dt in (torch.float32, torch.bfloat16):
        got = engram_gather_rows_triton(rows, scale, ids, dt)
        assert_bitwise(got, engram_gather_rows_ref(rows, scale, ids, dt), f"fp8={fp8} dh={dh} {dt}")


INTERP_CASES = {
    "fp8-256": ("_interp_matches_reference", (True, 256)),
    "fp8-64": ("_interp_matches_reference", (True, 64)),
    "bf16-96": ("_interp_matches_reference", (False, 96)),
}

test_interpreter = interpreted_cases_test(__file__, INTERP_CASES)


def test_contract_errors_and_cpu_in_place():
    rows, scale = _table(10, 64, True, 0)
    with pytest.raises(ValueError, match="int64 ids"):
        engram_gather_rows(rows, scale, torch.zeros(3, dtype=torch.int64), torch.float32)
    with pytest.raises(ValueError, match="scale"):
        engram_gather_rows(rows, scale[:, :1], torch.zeros(1, 2, dtype=torch.int64), torch.float32)
    assert engram_rows_in_place(rows, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["cuda", "pinned"])
def test_gpu_bitwise_and_graph_capture(where):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rows, scale = _table(200_000, 256, True, 3)
    if where == "cuda":
        rows, scale = rows.cuda(), scale.cuda()
    else:
        rows, scale = rows.pin_memory(), scale.pin_memory()
    assert engram_rows_in_place(rows, "cuda")
    assert not engram_rows_in_place(rows.clone() if where == "pinned" else rows.cpu(), "cuda")  # pageable: no
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, 200_000, (64, 24), generator=g, device="cuda")
    want = engram_gather_rows_ref(rows, scale, ids, torch.bfloat16)
    assert_bitwise(engram_gather_rows(rows, scale, ids, torch.bfloat16), want, where)
    static = ids.clone()
    out = engram_gather_rows(rows, scale, static, torch.bfloat16)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = engram_gather_rows(rows, scale, static, torch.bfloat16)
    new = torch.randint(0, 200_000, (64, 24), generator=g, device="cuda")
    static.copy_(new)
    graph.replay()
    assert_bitwise(out, engram_gather_rows_ref(rows, scale, new, torch.bfloat16), f"{where}, replayed")
