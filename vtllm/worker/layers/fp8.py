"""FP8 (e4m3) weights for the dense linears (qkv / o / gate_up / down) and the MoE experts.

Where the FP8 weights come from (``loader/quant_config.py``: ``resolve_quantization``):

* a checkpoint's ``quantization_config``: ``quant_method: fp8`` (``fmt: e4m3``) with
  ``weight_block_size: [bn, bk]`` stores ``weight_scale_inv [cdiv(N, bn), cdiv(K, bk)]``
  per linear (DeepSeek / Qwen3-FP8); without it, ``weight_scale`` per tensor (vLLM's fp8
  format). ``quant_method: compressed-tensors`` with 8-bit float weights stores
  ``weight_scale`` per tensor or per output channel. Static ``input_scale`` tensors are
  skipped: activations are scaled dynamically.
* ``--quantization fp8`` on a bf16/fp32 checkpoint (or random ``dummy`` weights): each
  weight row is quantised at load time with its own scale (per output channel).

Life of a quantised layer::

    build (bf16) ─ prepare_fp8_checkpoint: FP8 ``weight`` + fp32 scale parameters with
    loaders (checkpoint only) ─ load_safetensors ─ finish_fp8: quantise what is still
    bf16, FP8 → e4m3fnuz on MI300, set ``layer.linear_method`` / ``experts.expert_scales``

Inside, every scale is either per row (``weight_scale [N]``: a per-tensor scale repeated
over its shard's rows, so packed q/k/v or gate/up shards keep their own) or per block
(``weight_scale_inv``). The matmul: ``torch._scaled_mm`` with row-wise scales and dynamic
per-token FP8 activations on NVIDIA sm_89+ for per-row weights, bf16 activations and batches
of at least ``SCALED_MM_MIN_TOKENS`` tokens (prefill); else the Triton kernel ``fp8_matmul``
(weight-only: activations stay in the model dtype), or for per-row weights at up to
``MAX_GEMV_ROWS`` rows the small-batch GEMV (``kernels/gemv.py``) where start-up timing
found it faster (``layers/small_batch.py``); the dequantising reference on CPU. Experts run
through ``fused_moe`` with ``ExpertScales``.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from vtllm.worker.layers.linear import ColumnParallelLinear, LinearMethod, RowParallelLinear
from vtllm.worker.layers.moe import FusedMoE
from vtllm.worker.loader.quant_config import Fp8Config
from vtllm.worker.platform import Platform

# -- quantising ----------------------------------------------------------------------


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def quantize_rows(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_fp8, scale)``: one fp32 scale per row (``amax / fp8 max``) of ``w [..., K]``,
    ``scale [...]``; ``w ≈ w_fp8 * scale[..., None]``."""
    # times the reciprocal, as torch's CUDA division by a scalar computes it anyway: the
    # same scales on every device as kernels/fp8_quant.py's
    scale = w.abs().amax(dim=-1).float().clamp(min=1e-12) * (1.0 / fp8_max(dtype))  # [...]
    w_fp8 = (w.float() / scale[..., None]).clamp(-fp8_max(dtype), fp8_max(dtype)).to(dtype)
    return w_fp8, scale


def quantize_blocks(
    w: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_fp8, scale)``: one fp32 scale per ``block`` of ``w [..., N, K]``, ``scale
    [..., cdiv(N, bn), cdiv(K, bk)]`` (partial edge blocks included)."""
    *lead, n, k = w.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(*lead, nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = w
    tiles = padded.view(*lead, nb, bn, kb, bk)
    scale = tiles.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / fp8_max(dtype)  # [..., nb, kb]
    full = scale[..., :, None, :, None]
    limit = fp8_max(dtype)
    w_fp8 = (tiles / full).clamp(-limit, limit).view(*lead, nb * bn, kb * bk)[..., :n, :k]
    return w_fp8.to(dtype).contiguous(), scale


def quantize_activations(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token scales: ``(x_fp8 [M, K], scale [M, 1] fp32)``; on a GPU one Triton
    kernel (``kernels/fp8_quant.py``, the same codes as ``quantize_rows``)."""
    if x.is_cuda and x.dim() == 2:
        from vtllm.worker.kernels.fp8_quant import quantize_fp8

        return quantize_fp8(x, dtype)
    x_fp8, scale = quantize_rows(x, dtype)
    return x_fp8, scale[:, None]


def to_e4m3fnuz(w: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP e4m3fn bits read as MI300's e4m3fnuz are half the value (exponent bias 8, not
    7): the same bits with twice the scale. The bit pattern 0x80 (-0 in fn, NaN in fnuz)
    becomes +0."""
    bits = w.view(torch.int8).clone()
    bits[bits == -128] = 0
    return bits.view(torch.float8_e4m3fnuz), scale * 2.0


# -- the linear method -----------------------------------------------------------------


# Fewer tokens than this take the Triton kernel even where _scaled_mm runs: quantising the
# activations per token was ~7 small kernels per linear when this was measured, which at
# decode batch sizes cost more than the halved weight bytes save (H200, Qwen3-30B-A3B shape,
# batch 1: 5.98 ms a step with _scaled_mm everywhere vs 5.12 ms in bf16). It is one kernel
# now (kernels/fp8_quant.py); the threshold has not been re-measured since.
SCALED_MM_MIN_TOKENS = 64


class Fp8LinearMethod(LinearMethod):
    """``x @ dequant(weight)^T`` for a layer holding FP8 ``weight [N, K]`` and
    ``weight_scale [N]`` (``block`` None) or ``weight_scale_inv`` (``block`` ``(bn, bk)``).
    ``backend``: ``scaled_mm`` (per-row only; batches under ``SCALED_MM_MIN_TOKENS`` tokens
    take the Triton kernel), ``triton`` or ``reference``."""

    def __init__(self, block: tuple[int, int] | None, backend: str) -> None:
        self.block = block
        self.backend = backend
        # set by layers/small_batch.py where the GEMV beats the kernel below at one row
        # (per-row scales on a GPU only): batches of up to MAX_GEMV_ROWS rows take it
        self.gemv_tiles = None

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        from vtllm.worker.kernels.fp8_matmul import fp8_matmul, fp8_matmul_ref
        from vtllm.worker.kernels.gemv import MAX_GEMV_ROWS, gemv

        weight = layer.weight  # [N, K] fp8
        if self.gemv_tiles is not None and x.shape[0] <= MAX_GEMV_ROWS:
            return gemv(x, weight, self.gemv_tiles, row_scale=layer.weight_scale)
        if self.backend == "scaled_mm" and x.shape[0] >= SCALED_MM_MIN_TOKENS:
            x_fp8, x_scale = quantize_activations(x, weight.dtype)
            return torch._scaled_mm(
                x_fp8,
                weight.t(),  # [K, N] column-major, as cuBLASLt wants it
                scale_a=x_scale,  # [M, 1]
                scale_b=layer.weight_scale.view(1, -1),  # [1, N]
                out_dtype=x.dtype,
            )
        if self.block is None:
            scale, block = layer.weight_scale[:, None], (1, weight.shape[1])  # [N, 1]
        else:
            scale, block = layer.weight_scale_inv, self.block
        matmul = fp8_matmul_ref if self.backend == "reference" else fp8_matmul
        return matmul(x, weight, scale, block)  # [M, N]


def linear_backend(platform: Platform, block: tuple[int, int] | None, layer: nn.Module) -> str:
    """``scaled_mm`` for per-row scales on NVIDIA sm_89+ in bf16 (dims multiples of 16,
    cuBLASLt's rule), ``triton`` on other GPUs, ``reference`` on CPU."""
    if not platform.is_gpu:
        return "reference"
    n, k = layer.weight.shape
    if block is None and platform.has_fp8_scaled_mm and n % 16 == 0 and k % 16 == 0:
        return "scaled_mm"
    return "triton"


# -- preparing a model for an FP8 checkpoint ---------------------------------------------


def _fp8_param(shape: torch.Size | tuple[int, ...], like: torch.Tensor) -> nn.Parameter:
    # checkpoints are OCP e4m3fn; MI300's e4m3fnuz conversion happens in finish_fp8
    data = torch.empty(shape, dtype=torch.float8_e4m3fn, device=like.device)
    return nn.Parameter(data, requires_grad=False)


def _scale_param(*shape: int, like: torch.Tensor) -> nn.Parameter:
    data = torch.ones(shape, dtype=torch.float32, device=like.device)
    return nn.Parameter(data, requires_grad=False)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_multiple(size: int, step: int, what: str) -> None:
    if size % step:
        raise ValueError(f"{what} ({size}) is not a multiple of the FP8 scale block ({step})")


def _copy_rows(target: torch.Tensor, loaded: torch.Tensor, full: int, start: int) -> None:
    """Per-row scales from a checkpoint scale tensor: one value (per tensor) fills the
    target; ``full`` values (per channel) give the target's ``start`` slice."""
    values = loaded.float().reshape(-1)
    if values.numel() == 1:
        target.fill_(values[0].item())
    elif values.numel() == full:
        target.copy_(values.narrow(0, start, target.numel()))
    else:
        raise ValueError(f"scale has {values.numel()} values, expected 1 or {full}")


def _check_block_shape(loaded: torch.Tensor, expected: tuple[int, int], what: str) -> None:
    if tuple(loaded.shape) != expected:
        raise ValueError(f"{what} block scales {tuple(loaded.shape)}, expected {expected}")


def _prepare_column(layer: ColumnParallelLinear, block: tuple[int, int] | None) -> None:
    tp = layer.tp
    n_local, k = layer.weight.shape
    if block is not None and (len(layer.local_sizes) > 1 or tp.size > 1):
        for size in layer.local_sizes:
            _check_multiple(size, block[0], "a packed or split output size")
    layer.weight = _fp8_param(layer.weight.shape, layer.weight)
    layer.weight.weight_loader = layer.weight_loader

    def load_scale(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        index = 0 if shard_id is None else layer.shard_ids.index(shard_id)
        offset, size = sum(layer.local_sizes[:index]), layer.local_sizes[index]
        if block is None:
            _copy_rows(param.data.narrow(0, offset, size), loaded, size * tp.size, tp.rank * size)
            return
        rows = _cdiv(size, block[0])
        expected = (_cdiv(size * tp.size, block[0]), _cdiv(k, block[1]))
        _check_block_shape(loaded, expected, f"shard {shard_id!r}")
        part = loaded.narrow(0, tp.rank * rows, rows)
        param.data.narrow(0, offset // block[0], rows).copy_(part)

    if block is None:
        layer.weight_scale = _scale_param(n_local, like=layer.weight)
        layer.weight_scale.weight_loader = load_scale
    else:
        shape = (_cdiv(n_local, block[0]), _cdiv(k, block[1]))
        layer.weight_scale_inv = _scale_param(*shape, like=layer.weight)
        layer.weight_scale_inv.weight_loader = load_scale


def _prepare_row(layer: RowParallelLinear, block: tuple[int, int] | None) -> None:
    tp = layer.tp
    n, k_local = layer.weight.shape
    if block is not None and tp.size > 1:
        _check_multiple(k_local, block[1], "a split input size")
    layer.weight = _fp8_param(layer.weight.shape, layer.weight)
    layer.weight.weight_loader = layer.weight_loader

    def load_scale(param: nn.Parameter, loaded: torch.Tensor) -> None:
        if block is None:
            _copy_rows(param.data, loaded, n, 0)
            return
        cols = param.shape[1]
        expected = (_cdiv(n, block[0]), _cdiv(k_local * tp.size, block[1]))
        _check_block_shape(loaded, expected, "row-parallel")
        param.data.copy_(loaded.narrow(1, tp.rank * cols, cols))

    if block is None:
        layer.weight_scale = _scale_param(n, like=layer.weight)
        layer.weight_scale.weight_loader = load_scale
    else:
        layer.weight_scale_inv = _scale_param(
            _cdiv(n, block[0]), _cdiv(k_local, block[1]), like=layer.weight
        )
        layer.weight_scale_inv.weight_loader = load_scale


def _prepare_experts(experts: FusedMoE, block: tuple[int, int] | None) -> None:
    """FP8 ``w13_weight`` / ``w2_weight`` and their scales, filled per (expert, kind)."""
    tp, size = experts.tp, experts.local_size
    num_experts, hidden = experts.num_experts, experts.w2_weight.shape[1]
    if block is not None:
        _check_multiple(size, block[0], "the experts' per-rank intermediate size")
        if tp.size > 1:
            _check_multiple(size, block[1], "the experts' per-rank intermediate size")
    for name in ("w13_weight", "w2_weight"):
        old = getattr(experts, name)
        new = _fp8_param(old.shape, old)
        new.shard_ids, new.weight_loader = old.shard_ids, old.weight_loader
        setattr(experts, name, new)

    def load_scale(param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        expert, kind = shard_id
        if not 0 <= expert < num_experts:
            raise ValueError(f"expert {expert} out of range: the model has {num_experts}")
        target = param.data[expert]
        if block is None:
            if kind == "down":
                _copy_rows(target, loaded, hidden, 0)
            else:
                offset = 0 if kind == "gate" else size
                _copy_rows(target.narrow(0, offset, size), loaded, size * tp.size, tp.rank * size)
            return
        bn, bk = block
        if kind == "down":
            cols = target.shape[1]
            expected = (_cdiv(hidden, bn), _cdiv(size * tp.size, bk))
            _check_block_shape(loaded, expected, f"expert {expert} {kind}")
            target.copy_(loaded.narrow(1, tp.rank * cols, cols))
        else:
            rows = size // bn
            expected = (size * tp.size // bn, _cdiv(hidden, bk))
            _check_block_shape(loaded, expected, f"expert {expert} {kind}")
            offset = 0 if kind == "gate" else rows
            target.narrow(0, offset, rows).copy_(loaded.narrow(0, tp.rank * rows, rows))

    if block is None:
        shapes = {"w13": (num_experts, 2 * size), "w2": (num_experts, hidden)}
    else:
        bn, bk = block
        shapes = {
            "w13": (num_experts, 2 * size // bn, _cdiv(hidden, bk)),
            "w2": (num_experts, _cdiv(hidden, bn), _cdiv(size, bk)),
        }
    suffix = "weight_scale_inv" if block else "weight_scale"
    for prefix, shape in shapes.items():
        param = _scale_param(*shape, like=experts.w2_weight)
        param.shard_ids = getattr(experts, f"{prefix}_weight").shard_ids
        param.weight_loader = load_scale
        setattr(experts, f"{prefix}_{suffix}", param)


def _checkpoint_names(model: nn.Module, module_name: str) -> list[str]:
    """The checkpoint module names a module is loaded from (q/k/v for ``qkv_proj``)."""
    packed = getattr(model, "packed_modules_mapping", {})
    head, _, last = module_name.rpartition(".")
    sources = [ckpt for ckpt, (param, _) in packed.items() if param == last]
    return [f"{head}.{source}" for source in sources] or [module_name]


def _is_ignored(names: list[str], ignored: tuple[str, ...]) -> bool:
    def match(name: str) -> bool:
        for rule in ignored:
            if rule.startswith("re:") and re.fullmatch(rule[3:], name):
                return True
            if name == rule or name.endswith("." + rule):
                return True
        return False

    hits = [match(name) for name in names]
    if any(hits) and not all(hits):
        raise ValueError(f"checkpoint quantises only some of {names}; vtllm needs all or none")
    return bool(hits) and all(hits)


def quantized_modules(model: nn.Module, config: Fp8Config) -> list[tuple[str, nn.Module]]:
    """(name, module) of every linear and expert set that runs in FP8: the Column/Row
    parallel linears and FusedMoE experts not in ``config.ignored`` (embeddings, the LM
    head and MoE routers always stay in the model dtype)."""
    kinds = (ColumnParallelLinear, RowParallelLinear, FusedMoE)
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, kinds)
        and not _is_ignored(_checkpoint_names(model, name), config.ignored)
    ]


def prepare_fp8_checkpoint(model: nn.Module, config: Fp8Config) -> None:
    """Give every quantised module FP8 weights and fp32 scale parameters whose
    ``weight_loader`` takes the checkpoint's ``weight_scale`` / ``weight_scale_inv`` (the
    bf16 weights built before are freed one by one). Raises ValueError when a packed or
    split size does not fall on the scale blocks."""
    block = config.weight_block_size
    for _, module in quantized_modules(model, config):
        if isinstance(module, ColumnParallelLinear):
            _prepare_column(module, block)
        elif isinstance(module, RowParallelLinear):
            _prepare_row(module, block)
        else:
            _prepare_experts(module, block)
    # static activation scales are not used: activations are scaled per token
    ignored = getattr(model, "ignored_checkpoint_suffixes", ())
    model.ignored_checkpoint_suffixes = (*ignored, ".input_scale")


# -- after loading -----------------------------------------------------------------------


def _set(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    setattr(module, name, nn.Parameter(tensor, requires_grad=False))


def _finish_weight(
    module: nn.Module, prefix: str, config: Fp8Config, fp8_dtype: torch.dtype
) -> None:
    """Quantise ``{prefix}weight`` if it is still unquantised, convert to ``fp8_dtype``."""
    weight = getattr(module, f"{prefix}weight")
    block = config.weight_block_size
    scale_name = f"{prefix}{config.scale_name}"
    if weight.dtype == torch.float8_e4m3fn and hasattr(module, scale_name):
        w_fp8, scale = weight.data, getattr(module, scale_name).data
        if fp8_dtype == torch.float8_e4m3fnuz:
            w_fp8, scale = to_e4m3fnuz(w_fp8, scale)
    elif block is None:
        w_fp8, scale = quantize_rows(weight.data, fp8_dtype)
    else:
        w_fp8, scale = quantize_blocks(weight.data, block, fp8_dtype)
    _set(module, f"{prefix}weight", w_fp8)  # frees the bf16 weight
    _set(module, scale_name, scale.contiguous())


def finish_fp8(model: nn.Module, config: Fp8Config, platform: Platform) -> None:
    """After loading: quantise every module that is still in the model dtype (online
        ``--quantization fp8``, dummy weights), convert FP8 to the platform's format, and
        route the layers' matmuls through FP8 (the kernel modules, and triton, are imported here,
    not when this module is)."""
    from vtllm.worker.kernels.fused_moe import ExpertScales

    fp8_dtype = platform.fp8_dtype
    block = config.weight_block_size
    for _, module in quantized_modules(model, config):
        if isinstance(module, FusedMoE):
            for prefix in ("w13_", "w2_"):
                _finish_weight(module, prefix, config, fp8_dtype)
            module.expert_scales = tuple(
                ExpertScales(getattr(module, f"{p}_{config.scale_name}"), block)
                for p in ("w13", "w2")
            )
        else:
            _finish_weight(module, "", config, fp8_dtype)
            module.linear_method = Fp8LinearMethod(block, linear_backend(platform, block, module))
