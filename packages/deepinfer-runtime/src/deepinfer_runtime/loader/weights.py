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
    spec: TensorSpec, ckpt: SafetensorsDir, quant: QuantConfig | None, rows: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Read an Engram table (or its rows [lo, hi) with ``rows``: a rank's shard) *without* dequantising it.

    Returns ``(rows, scale)``: for a quantised table ``rows`` [R, D] float8_e4m3fn and ``scale``
    [R, D / 32] float8_e8m0fnu (raw uint8 scale bytes are reinterpreted, not converted); for an unquantised
    table ``rows`` [R, D] bfloat16 and ``None`` (R = hi - lo with ``rows``). Value = rows[r, c] *
    2^(e[r, c // 32] - 127), i.e. ``fp8_block_dequantize(rows, scale, (1, 32))``. Stored shapes are checked
    against the whole table from the header (a slice reads only its rows); dtypes on what is read. A mismatch
    raises a CheckpointError naming the tensor.
    """
    if spec.role != ENGRAM_TABLE:
        raise ValueError(f"load_engram_table: {spec.name!r} has role {spec.role!r}, not {ENGRAM_TABLE!r}")
    where = f"{ckpt.path}: tensor {spec.name!r}"
    if len(spec.shape) != 2:
        raise CheckpointError(f"{where}: an Engram table is 2-D [rows, head_dim], inventory says {spec.shape}")
    n_rows, dim = spec.shape
    stored = ckpt.shape(spec.name)
    if stored != spec.shape:
        raise CheckpointError(f"{where}: shape {stored} != expected {spec.shape}")
    raw = ckpt.get_rows(spec.name, rows)
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
    want = (n_rows, dim // ENGRAM_SCALE_BLOCK)
    stored = ckpt.shape(scale_name)
    if stored != want:
        raise CheckpointError(f"{ckpt.path}: tensor {scale_name!r}: shape {stored} != expected {want}")
    scale = ckpt.get_rows(scale_name, rows)
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


ParamFor = Callable[[str], tuple[str, int | None, int | None]]


def load_tensor(
    spec: TensorSpec,
    ckpt: SafetensorsDir,
    quant: QuantConfig | None,
    params: dict[str, torch.Tensor],
    param_for: ParamFor,
    local_experts: list[int] | None = None,
) -> None:
    """Decode ``spec`` into its model parameter (in place).

    ``param_for`` maps a checkpoint name to (parameter, expert index or None, half of a w13 stack or None).
    With ``local_experts`` (a rank's logical expert per local slot, ``LoadShard.local_experts``) a routed expert
    of a backbone layer (``layers.*``) goes to every local slot holding it, and one this rank does not hold is
    not read at all; the DSpark stages (``mtp.*``) keep every expert.
    """
    target_name, expert, half = param_for(spec.name)
    slots: list[int | None] = [expert]
    if expert is not None and local_experts is not None and spec.name.startswith("layers."):
        slots = [slot for slot, logical in enumerate(local_experts) if logical == expert]
        if not slots:
            return
    target = params[target_name]
    value = decode_tensor(spec, ckpt, quant, target.dtype)
    for slot in slots:
        dest = target if slot is None else target[slot]
        if half is not None:
            dest = dest[half * value.shape[0] : (half + 1) * value.shape[0]]
        dest.copy_(value)


def load_weights(
    model: torch.nn.Module,
    inventory: list[TensorSpec],
    ckpt: SafetensorsDir,
    quant: QuantConfig | None,
    param_for: ParamFor,
    ignore_prefixes: tuple[str, ...] = (),
    progress: bool = True,
    local_experts: list[int] | None = None,
) -> None:
    """Validate the inventory, then decode every tensor into its model parameter (in place); with
    ``local_experts`` only this rank's routed experts (see ``load_tensor``)."""
    check_inventory(inventory, ckpt, ignore_prefixes)
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    for spec in tqdm(inventory, desc="loading weights", unit="tensor", disable=not progress, leave=False):
        load_tensor(spec, ckpt, quant, params, param_for, local_experts)
