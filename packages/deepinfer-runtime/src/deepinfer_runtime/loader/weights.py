"""Decode checkpoint tensors (FP8 block-scaled, MXFP4, plain) into a model's parameters.

The reference path dequantises once at load into the model dtype; GPU backends that run FP8 /
FP4 GEMMs directly keep the raw tensors instead (their own issue). V4.1 Engram tables (183 GiB of FP8 in
the release) are read with ``load_engram_table``, which keeps them quantised.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from deepinfer_kernels import fp8_block_dequantize, mxfp4_dequantize
from tqdm import tqdm

from deepinfer_runtime.errors import CheckpointError
from deepinfer_runtime.loader.safetensors_dir import SafetensorsDir
from deepinfer_runtime.models.deepseek_v4_config import QuantConfig
from deepinfer_runtime.models.deepseek_v4_weights import EXPERT, LINEAR, TensorSpec
from deepinfer_runtime.models.deepseek_v41_weights import ENGRAM_TABLE

_FP8 = (torch.float8_e4m3fn,)
_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8, torch.float32)
# roles whose ``.weight`` may come with a ``.scale`` companion
_SCALED_ROLES = (LINEAR, EXPERT, ENGRAM_TABLE)
ENGRAM_SCALE_BLOCK = 32  # Engram table: one UE8M0 scale per row per 32 channels


def _scale_name(name: str) -> str:
    return name[: -len(".weight")] + ".scale"


def expected_names(inventory: Iterable[TensorSpec], ckpt: SafetensorsDir) -> set[str]:
    """Inventory names plus the ``.scale`` companion of each quantisable weight stored quantised."""
    have = ckpt.names()
    names = set()
    for spec in inventory:
        names.add(spec.name)
        if spec.role in _SCALED_ROLES and _scale_name(spec.name) in have:
            names.add(_scale_name(spec.name))
    return names


def check_inventory(inventory: list[TensorSpec], ckpt: SafetensorsDir, ignore_prefixes: tuple[str, ...]) -> None:
    """One CheckpointError listing every missing and every unexpected tensor."""
    want = expected_names(inventory, ckpt)
    have = {n for n in ckpt.names() if not n.startswith(ignore_prefixes)}
    missing, unexpected = sorted(want - have), sorted(have - want)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing tensor(s): {missing[:20]}{' ...' if len(missing) > 20 else ''}")
        if unexpected:
            parts.append(
                f"{len(unexpected)} unexpected tensor(s): {unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}"
            )
        raise CheckpointError(f"{ckpt.path}: checkpoint does not match the config: " + "; ".join(parts))


def load_engram_table(
    spec: TensorSpec, ckpt: SafetensorsDir, quant: QuantConfig | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Read an Engram table *without* dequantising it.

    Returns ``(rows, scale)``: for a quantised table ``rows`` [R, D] float8_e4m3fn and ``scale``
    [R, D / 32] float8_e8m0fnu (raw uint8 scale bytes are reinterpreted, not converted); for an unquantised
    table ``rows`` [R, D] bfloat16 and ``None``. Value = rows[r, c] * 2^(e[r, c // 32] - 127), i.e.
    ``fp8_block_dequantize(rows, scale, (1, 32))``. Shapes and dtypes are checked; a mismatch raises a
    CheckpointError naming the tensor.
    """
    if spec.role != ENGRAM_TABLE:
        raise ValueError(f"load_engram_table: {spec.name!r} has role {spec.role!r}, not {ENGRAM_TABLE!r}")
    where = f"{ckpt.path}: tensor {spec.name!r}"
    if len(spec.shape) != 2:
        raise CheckpointError(f"{where}: an Engram table is 2-D [rows, head_dim], inventory says {spec.shape}")
    n_rows, dim = spec.shape
    raw = ckpt.get(spec.name)
    if tuple(raw.shape) != spec.shape:
        raise CheckpointError(f"{where}: shape {tuple(raw.shape)} != expected {spec.shape}")
    scale_name = _scale_name(spec.name)
    if scale_name not in ckpt.names():
        if raw.dtype in _FP8 or not raw.is_floating_point():
            raise CheckpointError(f"{where}: dtype {raw.dtype} without {scale_name!r}; want bfloat16")
        return raw.to(torch.bfloat16), None
    if quant is None:
        raise CheckpointError(f"{where}: quantised Engram table but config.json has no quantization_config")
    if raw.dtype not in _FP8:
        raise CheckpointError(f"{where}: has a scale but dtype {raw.dtype} (want float8_e4m3fn)")
    if dim % ENGRAM_SCALE_BLOCK:
        raise CheckpointError(f"{where}: head_dim {dim} is not a multiple of {ENGRAM_SCALE_BLOCK}")
    scale = ckpt.get(scale_name)
    want = (n_rows, dim // ENGRAM_SCALE_BLOCK)
    if tuple(scale.shape) != want:
        raise CheckpointError(f"{ckpt.path}: tensor {scale_name!r}: shape {tuple(scale.shape)} != expected {want}")
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e8m0fnu)
    elif scale.dtype != torch.float8_e8m0fnu:
        raise CheckpointError(f"{ckpt.path}: tensor {scale_name!r}: dtype {scale.dtype}, want float8_e8m0fnu")
    return raw, scale


def decode_tensor(
    spec: TensorSpec, ckpt: SafetensorsDir, quant: QuantConfig | None, dtype: torch.dtype
) -> torch.Tensor:
    """Read ``spec.name`` and return it dequantised, [spec.shape] in ``dtype``.

    An Engram table is dequantised too (fine for tiny checkpoints); real-size engines keep it quantised with
    ``load_engram_table``.
    """
    if spec.role == ENGRAM_TABLE:
        rows, scale = load_engram_table(spec, ckpt, quant)
        if scale is None:
            return rows.to(dtype)
        return fp8_block_dequantize(rows, scale, (1, ENGRAM_SCALE_BLOCK), out_dtype=torch.float32).to(dtype)
    raw = ckpt.get(spec.name)
    scale_name = _scale_name(spec.name) if spec.name.endswith(".weight") else None
    where = f"{ckpt.path}: tensor {spec.name!r}"
    if scale_name and scale_name in ckpt.names() and spec.role in (LINEAR, EXPERT):
        scale = ckpt.get(scale_name)
        if scale.dtype not in _SCALE_DTYPES:
            raise CheckpointError(f"{where}: scale dtype {scale.dtype} is not e8m0/uint8/float32")
        if raw.dtype in (torch.int8, torch.uint8):  # MXFP4: two E2M1 codes per byte
            if spec.role != EXPERT:
                raise CheckpointError(f"{where}: packed FP4 is only valid for routed experts")
            want = (spec.shape[0], spec.shape[1] // 2)
            if tuple(raw.shape) != want or tuple(scale.shape) != (spec.shape[0], spec.shape[1] // 32):
                raise CheckpointError(
                    f"{where}: FP4 shapes {tuple(raw.shape)}/{tuple(scale.shape)} != "
                    f"{want}/{(spec.shape[0], spec.shape[1] // 32)}"
                )
            return mxfp4_dequantize(raw, scale, out_dtype=torch.float32).to(dtype)
        if raw.dtype in _FP8:
            if quant is None:
                raise CheckpointError(f"{where}: FP8 weight but config.json has no quantization_config")
            b0, b1 = quant.weight_block_size
            want = (-(-spec.shape[0] // b0), -(-spec.shape[1] // b1))
            if tuple(raw.shape) != spec.shape or tuple(scale.shape) != want:
                raise CheckpointError(
                    f"{where}: FP8 shapes {tuple(raw.shape)}/{tuple(scale.shape)} != "
                    f"{spec.shape}/{want} for block {quant.weight_block_size}"
                )
            return fp8_block_dequantize(raw, scale, (b0, b1), out_dtype=torch.float32).to(dtype)
        raise CheckpointError(f"{where}: has a scale but dtype {raw.dtype} (want float8_e4m3fn or int8)")
    if tuple(raw.shape) != spec.shape:
        raise CheckpointError(f"{where}: shape {tuple(raw.shape)} != expected {spec.shape}")
    if spec.role == "int64":
        if raw.dtype not in (torch.int64, torch.int32):
            raise CheckpointError(f"{where}: dtype {raw.dtype}, want int64")
        return raw.long()
    if not raw.is_floating_point() or raw.dtype in _FP8:
        raise CheckpointError(f"{where}: dtype {raw.dtype} without a scale; want a float dtype")
    return raw.to(dtype)


def load_weights(
    model: torch.nn.Module,
    inventory: list[TensorSpec],
    ckpt: SafetensorsDir,
    quant: QuantConfig | None,
    param_for: Callable[[str], tuple[str, int | None, int | None]],
    ignore_prefixes: tuple[str, ...] = (),
    progress: bool = True,
) -> None:
    """Validate the inventory, then decode every tensor into its model parameter (in place)."""
    check_inventory(inventory, ckpt, ignore_prefixes)
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    for spec in tqdm(inventory, desc="loading weights", unit="tensor", disable=not progress, leave=False):
        target_name, expert, half = param_for(spec.name)
        target = params[target_name]
        value = decode_tensor(spec, ckpt, quant, target.dtype)
        if expert is not None:
            target = target[expert]
            if half is not None:
                rows = value.shape[0]
                target = target[half * rows : (half + 1) * rows]
        target.copy_(value)
