"""Which quantisation a model runs with, from ``--quantization`` and the checkpoint's
``config.json`` ``quantization_config``. Plain Python (no torch): the launcher refuses an
unsupported checkpoint with one line before any worker starts, and the workers build
``layers/fp8.py`` from the same ``Fp8Config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QUANTIZATION_METHODS = ("fp8",)  # --quantization choices


@dataclass(frozen=True)
class Fp8Config:
    """``checkpoint_fp8``: the checkpoint holds FP8 weights (else they are quantised per
    row at load). ``weight_block_size``: ``(bn, bk)`` block scales, None = per-row scales.
    ``ignored``: checkpoint module names (or ``re:`` patterns) kept unquantised."""

    checkpoint_fp8: bool
    weight_block_size: tuple[int, int] | None = None
    ignored: tuple[str, ...] = ()

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.weight_block_size else "weight_scale"

    def describe(self) -> str:
        """For the start-up log: ``fp8 e4m3 (checkpoint, 128x128 block scales)``."""
        where = "checkpoint" if self.checkpoint_fp8 else "quantised at load"
        if self.weight_block_size:
            scales = f"{self.weight_block_size[0]}x{self.weight_block_size[1]} block scales"
        else:
            scales = "per-tensor/per-channel scales" if self.checkpoint_fp8 else "per-channel"
        return f"fp8 e4m3 ({where}, {scales})"


def resolve_quantization(hf_config: dict[str, Any], requested: str | None) -> Fp8Config | None:
    """The quantisation to run with: the checkpoint's ``quantization_config`` if any, else
    ``requested`` (``--quantization``; None = none). Raises ValueError with one line for an
    unknown ``--quantization`` or a checkpoint format vtllm cannot run."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(
            f"--quantization {requested!r} is not supported; supported: "
            + ", ".join(QUANTIZATION_METHODS)
        )
    config = hf_config.get("quantization_config")
    if not config:
        return None if requested is None else Fp8Config(checkpoint_fp8=False)
    method = config.get("quant_method")
    if method == "fp8":
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8 checkpoint format {fmt!r} is not supported (only e4m3)")
        block = config.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) < 1):
            raise ValueError(f"quantization_config.weight_block_size {block} is not [n, k]")
        ignored = config.get("ignored_layers") or config.get("modules_to_not_convert") or ()
        return Fp8Config(True, tuple(block) if block else None, tuple(ignored))
    if method == "compressed-tensors":
        for name, group in (config.get("config_groups") or {}).items():
            weights = group.get("weights") or {}
            kind = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
            if kind[:2] != ("float", 8) or kind[2] not in ("tensor", "channel"):
                raise ValueError(
                    f"compressed-tensors group {name!r} has {kind[1]}-bit {kind[0]} weights "
                    f"with strategy {kind[2]!r}; vtllm runs only 8-bit float weights with "
                    "tensor or channel scales"
                )
        return Fp8Config(True, None, tuple(config.get("ignore") or ()))
    raise ValueError(
        f"checkpoint quantization {method!r} is not supported; vtllm loads fp8 (e4m3) and "
        "compressed-tensors fp8 checkpoints, or quantises bf16 ones with --quantization fp8"
    )
