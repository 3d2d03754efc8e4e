"""Every attention kernel compiles ahead of time for sm_90 and sm_100, on a machine without a GPU.

For each kernel: every config of its sm_90 and sm_100 tables at head dims 64 and 128, and the
first config at the other head dims, causal and not, in bf16 (fp16 and the fp32/fp64 configs
at one head dim); the fused backward's sm_90 configs (plain and grouped), which must add
their fp32 sums by TMA reductions; and the sm_90 configs of the forwards with a fixed row max.
On sm_90 the matrix kernels must use warpgroup MMA (HGMMA), must not spill registers to
local memory (LDL/STL) and must issue their HGMMAs in groups, not each waited for alone (what
ptxas does when it lacks registers to pipeline them): each is a slowdown that CPU CI can catch.
"""

import cuda.tile as ct
import pytest

from tests.ops import aot, plain_sass
from tilegym.ops.attention import configs

# Each case runs the compiler (seconds): python -m pytest -m "not slow" leaves them out.
pytestmark = pytest.mark.slow

MATRIX_KERNELS = (configs.FORWARD, configs.FORWARD_LSE, configs.BACKWARD_DKDV, configs.BACKWARD_DQ)
FUSED_KERNELS = (configs.BACKWARD_FUSED, configs.BACKWARD_FUSED_GROUPED)
FIXED_MAX_KERNELS = (configs.FORWARD_FIXED_MAX, configs.FORWARD_LSE_FIXED_MAX)
TUNED_HEAD_DIMS = (64, 128)


def _bf16_params(arch, kernel, head_dim, chosen):
    for index, config in enumerate(chosen):
        for causal in (False, True):
            yield pytest.param(
                arch, kernel, ct.bfloat16, head_dim, config, causal,
                id=f"{arch}-{kernel}-d{head_dim}-cfg{index}-{'causal' if causal else 'full'}",
            )  # fmt: skip


def _compile_matrix():
    for arch in ("sm_90", "sm_100"):
        for kernel in configs.KERNELS:
            for head_dim in configs.HEAD_DIMS:
                table = configs.candidates(kernel, arch, head_dim, element_size=2)
                yield from _bf16_params(arch, kernel, head_dim, table if head_dim in TUNED_HEAD_DIMS else table[:1])
    for kernel in FUSED_KERNELS + FIXED_MAX_KERNELS:
        for head_dim in configs.TABLES["sm_90"][kernel]:
            yield from _bf16_params("sm_90", kernel, head_dim, configs.candidates(kernel, "sm_90", head_dim, 2))
    for kernel in configs.KERNELS:
        yield pytest.param("sm_90", kernel, ct.float16, 128, configs.candidates(kernel, "sm_90", 128, 2)[0], True,
                           id=f"sm_90-{kernel}-d128-fp16")  # fmt: skip
        for dtype, size in ((ct.float32, 4), (ct.float64, 8)):
            config = configs.candidates(kernel, "sm_90", 64, size)[0]
            yield pytest.param("sm_90", kernel, dtype, 64, config, True, id=f"sm_90-{kernel}-d64-{dtype}")


@pytest.mark.parametrize("arch, kernel, dtype, head_dim, config, causal", list(_compile_matrix()))
def test_op_attention_compiles(arch, kernel, dtype, head_dim, config, causal, tmp_path):
    cubin = aot.compile_cubin(kernel, dtype, head_dim, config, causal, arch, tmp_path / "kernel.cubin")
    assert cubin.stat().st_size > 0
    matrix_kernels = (*MATRIX_KERNELS, *FUSED_KERNELS, *FIXED_MAX_KERNELS)
    if arch != "sm_90" or kernel not in matrix_kernels or dtype not in (ct.float16, ct.bfloat16):
        return
    text = aot.sass(cubin)
    assert aot.count_instructions(text, "HGMMA") > 0, "matrix work did not become warpgroup MMA (HGMMA)"
    spills = aot.count_instructions(text, "LDL") + aot.count_instructions(text, "STL")
    assert spills == 0, f"{spills} local-memory instructions (LDL/STL): registers spilled"
    assert not aot.matmuls_serialized(text), "every HGMMA is waited for alone: too few registers to pipeline them"
    if kernel in FUSED_KERNELS:
        assert aot.count_instructions(text, "UTMAREDG") > 0, "fp32 sums are not added by TMA reductions"
        assert aot.count_instructions(text, "REDG") == 0, "fp32 sums are added one element at a time"


@pytest.mark.parametrize("kernel, head_dim, causal", plain_sass.VARIANTS, ids=lambda v: str(v))
def test_op_attention_plain_sass_unchanged_by_score_modifiers(kernel, head_dim, causal, tmp_path):
    """With every modifier switched off, the kernels compile to the stored plain code."""
    name = plain_sass.variant_name(kernel, head_dim, causal)
    assert plain_sass.current_fingerprint(kernel, head_dim, causal, tmp_path) == plain_sass.stored()[name], (
        f"{name}: the plain kernel's instructions changed"
    )


# One compile per switch (and a few combinations), in both orientations of the score tile.
_SWITCHES = {
    "bias-per-row": {"bias_mode": 2},
    "bias-one-row": {"bias_mode": 1},
    "window": {"windowed": True},
    "softcap": {"capped": True},
    "alibi": {"alibi": True},
    "all": {"bias_mode": 2, "windowed": True, "capped": True, "alibi": True},
}
_BIAS_GRADS = {"dbias-per-row": {"bias_mode": 2, "bias_grad": 2}, "dbias-one-row": {"bias_mode": 1, "bias_grad": 1}}


def _compile_variants():
    for name, switches in {**_SWITCHES, **_BIAS_GRADS}.items():
        for kernel in MATRIX_KERNELS:
            if "bias_grad" in switches and kernel != configs.BACKWARD_DKDV:
                continue
            for head_dim in TUNED_HEAD_DIMS:
                yield pytest.param(kernel, ct.bfloat16, head_dim, switches, id=f"{kernel}-d{head_dim}-{name}")
        with_grad = {**switches, "bias_grad": switches.get("bias_mode", 0)}
        yield pytest.param(
            configs.BACKWARD_DKDV, ct.float64, 64, with_grad, id=f"{configs.BACKWARD_DKDV}-d64-fp64-{name}"
        )


@pytest.mark.parametrize("kernel, dtype, head_dim, switches", list(_compile_variants()))
def test_op_attention_score_modifiers_compile(kernel, dtype, head_dim, switches, tmp_path):
    """Each modifier compiles for sm_90 with every candidate config, keeping the warpgroup MMA
    and spilling nothing."""
    size = 8 if dtype == ct.float64 else 2
    for config in configs.candidates(kernel, "sm_90", head_dim, size, modified=True):
        _check_modified_compile(kernel, dtype, head_dim, config, switches, tmp_path)


def _check_modified_compile(kernel, dtype, head_dim, config, switches, tmp_path):
    cubin = aot.compile_cubin(kernel, dtype, head_dim, config, False, "sm_90", tmp_path / "k.cubin", switches)
    if dtype == ct.float64:
        assert cubin.stat().st_size > 0
        return
    text = aot.sass(cubin)
    assert aot.count_instructions(text, "HGMMA") > 0, "matrix work did not become warpgroup MMA (HGMMA)"
    spills = aot.count_instructions(text, "LDL") + aot.count_instructions(text, "STL")
    assert spills == 0, f"{spills} local-memory instructions (LDL/STL): registers spilled"
    assert not aot.matmuls_serialized(text), "every HGMMA is waited for alone: too few registers to pipeline them"


@pytest.mark.parametrize("kernel", configs.KERNELS + (configs.BACKWARD_FUSED,), ids=str)
def test_op_attention_int64_indexed_twins_compile(kernel, tmp_path):
    """Each kernel's int64-indexed twin (index_width.wide), which runs where a size or stride
    passes int32, compiles for sm_90 with every array indexed by int64, its positions in int32.
    (The fixed-max forwards are never run wide: dispatch.fixed_max_forward.)"""
    config = configs.candidates(kernel, "sm_90", 64, element_size=2)[0]
    cubin = aot.compile_cubin(kernel, ct.bfloat16, 64, config, True, "sm_90", tmp_path / "k.cubin", wide=True)
    text = aot.sass(cubin)
    assert aot.count_instructions(text, "HGMMA") > 0 or kernel == configs.BACKWARD_PREPROCESS
