"""Ahead-of-time compilation of attention kernels to cubins and a look at their SASS, no GPU needed."""

import inspect
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import cuda.tile as ct
from cuda.tile.compilation import ArrayConstraint, CallingConvention, KernelSignature, ScalarConstraint, export_kernel

from tilegym import autotune, index_width
from tilegym.ops.attention import configs
from tilegym.ops.attention.variants import VARIANTS

_ROW_STATS = ("Lse", "Delta", "LseBase2")


def _array(dtype, ndim: int, index_dtype=ct.int32) -> ArrayConstraint:
    """An array as PyTorch hands over a contiguous, 16-byte aligned tensor."""
    return ArrayConstraint(
        dtype=dtype,
        ndim=ndim,
        index_dtype=index_dtype,
        stride_lower_bound_incl=0,
        alias_groups=(),
        may_alias_internally=False,
        stride_constant=(None,) * (ndim - 1) + (1,),
        stride_divisible_by=(8,) * (ndim - 1) + (1,),
        base_addr_divisible_by=16,
    )


# The score modifiers' switches, all off: plain attention.
PLAIN = {"windowed": False, "capped": False, "bias_mode": 0, "alibi": False, "bias_grad": 0}


def signature(
    kernel_name: str, dtype, head_dim: int, config: autotune.TileConfig, causal: bool, switches=None, wide=False
) -> KernelSignature:
    """The kernel's signature for one launch, built from its parameter names and annotations.

    switches overrides entries of PLAIN (the score modifiers' compile-time switches); wide
    gives every array int64 sizes and strides (index_width.wide's twin of the kernel).
    """
    index_dtype = ct.int64 if wide else ct.int32
    variant = VARIANTS[kernel_name]
    kernel = variant.kernel
    stat_dtype = ct.float64 if dtype == ct.float64 else ct.float32
    constants = {
        "block_m": config.block_m,
        "block_n": config.block_n,
        "block_d": configs.head_dim_tile(head_dim),
        "causal": causal,
        **PLAIN,
        **variant.fixed,
        **(switches or {}),
    }
    params = []
    for name, param in inspect.signature(kernel._pyfunc).parameters.items():
        if name in constants:
            params.append(constants[name])
        elif param.annotation is float:
            params.append(ScalarConstraint(ct.float32))
        elif param.annotation is int:
            params.append(ScalarConstraint(ct.int32))
        elif (
            name in _ROW_STATS
            or name == "DBias"
            or (name == "DQSum" and constants.get("sum_dq"))
            or (name in ("dK", "dV") and constants.get("sum_dkdv"))
        ):
            params.append(_array(stat_dtype, 3 if name in _ROW_STATS else 4, index_dtype))
        elif name == "Slopes":
            params.append(_array(ct.float32, 2, index_dtype))
        else:
            params.append(_array(dtype, 4, index_dtype))
    return KernelSignature(params, CallingConvention.cutile_python_v2()).with_mangled_symbol(kernel_name)


def compile_cubin(
    kernel_name: str, dtype, head_dim: int, config, causal: bool, arch: str, path: Path, switches=None, wide=False
) -> Path:
    kernel = VARIANTS[kernel_name].kernel
    kernel = autotune.with_hints(index_width.wide(kernel) if wide else kernel, config)
    export_kernel(
        kernel,
        [signature(kernel_name, dtype, head_dim, config, causal, switches, wide)],
        str(path),
        gpu_code=arch,
        output_format="cubin",
    )
    return path


def cuobjdump() -> str | None:
    """cuobjdump from PATH or from the nvidia-cuda-cuobjdump wheel."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    for root in {sysconfig.get_paths()["purelib"], *sys.path}:
        candidate = Path(root) / "nvidia" / "cu13" / "bin" / "cuobjdump"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def sass(cubin: Path) -> str:
    tool = cuobjdump()
    if tool is None:
        raise RuntimeError("cuobjdump not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    return subprocess.run([tool, "--dump-sass", str(cubin)], check=True, capture_output=True, text=True).stdout


def count_instructions(text: str, opcode: str) -> int:
    return len(re.findall(rf"\b{opcode}\b", text))


def matmuls_serialized(text: str) -> bool:
    """Whether every warpgroup MMA (HGMMA) of a listing closes a group of its own (`gsb0`), so
    each is waited for alone: what ptxas does to a whole kernel when it finds too few registers
    to pipeline them (its advisory C7511, which cuTile's compile does not show)."""
    matmuls = re.findall(r"\bHGMMA\.[^;]*;", text)
    return bool(matmuls) and all(matmul.rstrip(" ;").endswith("gsb0") for matmul in matmuls)
