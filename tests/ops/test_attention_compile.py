"""Every attention variant compiles ahead of time for sm_90 and sm_100, on a machine without a GPU.

The cases come from the registry (tilegym/ops/attention/variants.py, VARIANTS) and the config
tables, so a new variant is compiled and checked without touching this file:

- every variant, wherever it has a table: every config of its sm_90 and sm_100 tables at head
  dims 64 and 128 and the first config at the other head-dim tiles, causal and not, in bf16;
  fp16 at D=128 and the fp32/fp64 configs at D=64;
- on sm_90 in 16 bits, no variant spills registers to local memory (LDL/STL), and those with
  matrix products use warpgroup MMA (HGMMA) issued in groups, not each waited for alone (what
  ptxas does when it lacks registers to pipeline them); variants that sum dQ (fixed sum_dq) add
  their fp32 sums by TMA reductions: each is a slowdown that CPU CI can catch;
- every variant's plain code matches its stored fingerprint (sass.fingerprint_cases);
- each variant compiles with every score modifier it takes (Variant.modifiers), the int64-indexed
  twins compile.

Only the head-dim tile enters the code (sass.signature), so head dims 80 and 96 are not
compiled apart from 128; a variant without the `causal` switch is compiled once.
test_every_variant_is_covered (no compile) fails where a variant would escape all of this.
"""

import cuda.tile as ct
import pytest

from tests.ops import sass
from tilegym.ops.attention import configs, dispatch
from tilegym.ops.attention.variants import (
    ANY_SCORES,
    BACKWARD_DK,
    BACKWARD_DV,
    BACKWARD_PREPROCESS,
    PLAIN_SCORES,
    SCORE_SWITCHES,
    VARIANTS,
)

# Each compile takes seconds: python -m pytest -m "not slow" leaves them out.
slow = pytest.mark.slow

ARCHS = ("sm_90", "sm_100")
TUNED_HEAD_DIMS = (64, 128)
HEAD_DIM_TILES = sorted({configs.head_dim_tile(head_dim) for head_dim in configs.HEAD_DIMS})
# Variants without a matrix product (a row reduction): no warpgroup MMA to look for.
ROW_REDUCTIONS = (BACKWARD_PREPROCESS,)


def _causal_forms(name):
    return (False, True) if sass.takes(name, "causal") else (False,)


def _sums_by_tma(name) -> bool:
    return bool(VARIANTS[name].fixed.get("sum_dq"))


def _runs_at(name, head_dim, value_dim) -> bool:
    """Whether dispatch launches a variant for these head dims: dV and dK apart only for the
    pairs whose tables name them (configs.PAIR_TABLES, dispatch.split_dkdv)."""
    return name not in (BACKWARD_DV, BACKWARD_DK) or name in configs.PAIR_TABLES["sm_90"].get((head_dim, value_dim), {})


def _runs_wide(name) -> bool:
    """Whether a variant has an int64-indexed twin: the fixed-max forwards are never run wide
    (dispatch.fixed_max_forward)."""
    return not VARIANTS[name].fixed.get("fixed_max")


# Where spills are allowed, by (variant, score switch, head-dim tile): "around-loops", values
# kept in local memory around the loops, none inside (ALiBi's fused backward at D=128,
# configs._SM90_FUSED_SCORES); "measured", spills inside the loops of a kernel measured faster
# than the alternative all the same (softcap's fused backward at D=128,
# perf-notes#fused-backward-softcap; at D=64 a window's forward without a causal mask on four
# 64x64 CTAs per SM, perf-notes#d64-running-max-four-ctas, and ALiBi's fixed-max forward on
# plain attention's table, perf-notes#d64-fixed-max-four-ctas). Elsewhere none.
ALLOWED_SPILLS = {
    (configs.BACKWARD_FUSED, "alibi", 128): "around-loops",
    (configs.BACKWARD_FUSED, "capped", 128): "measured",
    (configs.FORWARD, "windowed", 64): "measured",
    (configs.FORWARD_LSE, "windowed", 64): "measured",
    (configs.FORWARD_FIXED_MAX, "alibi", 64): "measured",
    (configs.FORWARD_LSE_FIXED_MAX, "alibi", 64): "measured",
}


def _allowed_spills(kernel, switches, head_dim) -> str:
    """ALLOWED_SPILLS for one score switch alone (sinks and gradients aside)."""
    on = [name for name, value in switches.items() if value and name in SCORE_SWITCHES]
    key = (kernel, on[0] if len(on) == 1 else None, configs.head_dim_tile(head_dim))
    return ALLOWED_SPILLS.get(key, "none")


def _check_sass(name, text, spills="none"):
    """The sm_90 16-bit checks: no spills (or as ALLOWED_SPILLS says); HGMMA, pipelined; fp32
    sums by TMA reductions."""
    if spills == "around-loops":
        inside = sass.spills_in_matmul_loops(text)
        assert inside == 0, f"{inside} local-memory instructions (LDL/STL) inside the matmul loops"
    elif spills == "none":
        count = sass.count_instructions(text, "LDL") + sass.count_instructions(text, "STL")
        assert count == 0, f"{count} local-memory instructions (LDL/STL): registers spilled"
    if name not in ROW_REDUCTIONS:
        assert sass.count_instructions(text, "HGMMA") > 0, "matrix work did not become warpgroup MMA (HGMMA)"
        assert not sass.matmuls_serialized(text), "every HGMMA is waited for alone: too few registers to pipeline them"
    if _sums_by_tma(name):
        assert sass.count_instructions(text, "UTMAREDG") > 0, "fp32 sums are not added by TMA reductions"
        assert sass.count_instructions(text, "REDG") == 0, "fp32 sums are added one element at a time"


def _bf16_params(arch, name, head_dim, chosen):
    for index, config in enumerate(chosen):
        for causal in _causal_forms(name):
            yield pytest.param(
                arch, name, ct.bfloat16, head_dim, config, causal,
                id=f"{arch}-{name}-d{head_dim}-cfg{index}-{'causal' if causal else 'full'}",
            )  # fmt: skip


def _compile_matrix():
    for name in VARIANTS:
        for arch in ARCHS:
            for head_dim in HEAD_DIM_TILES:
                table = configs.candidates(name, arch, head_dim, element_size=2)
                yield from _bf16_params(arch, name, head_dim, table if head_dim in TUNED_HEAD_DIMS else table[:1])
        causal = _causal_forms(name)[-1]
        for config in configs.candidates(name, "sm_90", 128, 2)[:1]:
            yield pytest.param("sm_90", name, ct.float16, 128, config, causal, id=f"sm_90-{name}-d128-fp16")
        for dtype, size in ((ct.float32, 4), (ct.float64, 8)):
            for config in configs.candidates(name, "sm_90", 64, size)[:1]:
                yield pytest.param("sm_90", name, dtype, 64, config, causal, id=f"sm_90-{name}-d64-{dtype}")


COMPILE_MATRIX = list(_compile_matrix())


@slow
@pytest.mark.parametrize("arch, kernel, dtype, head_dim, config, causal", COMPILE_MATRIX)
def test_op_attention_compiles(arch, kernel, dtype, head_dim, config, causal, tmp_path):
    cubin = sass.compile_cubin(kernel, dtype, head_dim, config, causal, arch, tmp_path / "kernel.cubin")
    assert cubin.stat().st_size > 0
    if arch == "sm_90" and dtype in (ct.float16, ct.bfloat16):
        _check_sass(kernel, sass.disassemble(cubin))


@slow
@pytest.mark.parametrize("kernel, head_dim, causal", sass.fingerprint_cases(), ids=str)
def test_op_attention_plain_sass_unchanged_by_score_modifiers(kernel, head_dim, causal, tmp_path):
    """With every modifier switched off, the variants compile to the stored plain code."""
    name = sass.fingerprint_name(kernel, head_dim, causal)
    expected = sass.stored().get(name, "none stored: python -m tests.ops.sass fingerprints --update")
    assert sass.current_fingerprint(kernel, head_dim, causal, tmp_path) == expected, (
        f"{name}: the plain kernel's instructions changed"
    )


@slow
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_op_attention_d64_fused_dq_share_not_loaded_back(causal, packed, tmp_path):
    """The D=64 fused backward's unmasked steps compute dQ^T = K^T dS^T from dS^T in shared memory:
    no byte permutes that rebuild dS, transposed, in registers for dS K (64 per thread and step
    before, perf-notes#dq-transposed). Masked steps (causal) keep dS K."""
    config = configs.candidates(configs.BACKWARD_FUSED, "sm_90", 64, 2)[0]
    cubin = sass.compile_cubin(
        configs.BACKWARD_FUSED, ct.bfloat16, 64, config, causal, "sm_90", tmp_path / "k.cubin", {"varlen": packed}
    )
    loops = sass.matmul_loops(sass.disassemble(cubin))
    unmasked = [loop for loop in loops if "PRMT" not in loop.opcodes]
    # Full: two loops (the compiler splits the key loop); causal: two of four, the others masked.
    assert len(unmasked) == 2 and len(loops) == (4 if causal else 2), [len(loop.opcodes) for loop in loops]
    for loop in unmasked:
        assert "STSM" in loop.opcodes and len(loop.opcodes) < 850, len(loop.opcodes)


@slow
@pytest.mark.parametrize("switches", [{}, {"windowed": True}, {"alibi": True}], ids=["plain", "window", "alibi"])
def test_op_attention_grouped_d64_exp2_split_between_pipes(switches, tmp_path):
    """The grouped fused backward at D=64 (64x128 steps, 32 scores per thread) computes half of
    each unmasked step's P on the FMA pipe: 16 MUFU there, 32 in the masked steps; with ALiBi,
    which spilled so, every step keeps 32 (perf-notes#grouped-exp2-split)."""
    name = configs.BACKWARD_FUSED_GROUPED
    tables = configs.ScoreTables.ALIBI if "alibi" in switches else configs.ScoreTables.WINDOW if switches else None
    config = configs.candidates(name, "sm_90", 64, 2, tables or configs.ScoreTables.PLAIN)[0]
    cubin = sass.compile_cubin(name, ct.bfloat16, 64, config, True, "sm_90", tmp_path / "k.cubin", switches)
    text = sass.disassemble(cubin)
    exp2_counts = sorted(loop.opcodes.count("MUFU") for loop in sass.matmul_loops(text))
    split = "alibi" not in switches
    assert min(exp2_counts) == (16 if split else 32) and max(exp2_counts) >= 32, exp2_counts
    assert sass.count_instructions(text, r"\b(LDL|STL)\b") == 0, "values in local memory"


# One compile per switch (and a few combinations), in both orientations of the score tile.
_SWITCHES = {
    "bias-per-row": {"bias_mode": 2},
    "bias-one-row": {"bias_mode": 1},
    "window": {"windowed": True},
    "softcap": {"capped": True},
    "alibi": {"alibi": True},
    "all": {"bias_mode": 2, "windowed": True, "capped": True, "alibi": True},
}
# Only for variants whose kernel takes the switch (the dK/dV kernel writes dBias).
_BIAS_GRADS = {"dbias-per-row": {"bias_mode": 2, "bias_grad": 2}, "dbias-one-row": {"bias_mode": 1, "bias_grad": 1}}
# Sinks and the LSE's gradient reach plain attention's variants too (the fixed-max forward, the
# fused backward's preprocess): every variant whose kernel takes the switches.
_ROW_SWITCHES = {
    "sinks": {"with_sinks": True},
    "sinks-window": {"with_sinks": True, "windowed": True},
    "lse-grad": {"lse_grad": True},
    "sinks-grad": {"sinks_grad": True, "lse_grad": True},
    "sinks-grad-window": {"sinks_grad": True, "lse_grad": True, "windowed": True},
}
MODIFIABLE = tuple(name for name, variant in VARIANTS.items() if variant.modifiers == ANY_SCORES)
# Variants that take some score switches (the fused backward: a window alone).
TAKES_SCORE_SWITCHES = tuple(name for name, variant in VARIANTS.items() if variant.modifiers != PLAIN_SCORES)


def _takes(name: str, switches: dict) -> bool:
    """Whether a variant takes these switches: score switches only those it was built for
    (Variant.modifiers), the others where its kernel has the parameter."""
    score_switches = {switch for switch in switches if switch in SCORE_SWITCHES}
    if not VARIANTS[name].takes_switches(frozenset(score_switches)):
        return False
    return all(switch in SCORE_SWITCHES or sass.takes(name, switch) for switch in switches)


def _score_tables(switches: dict) -> configs.ScoreTables:
    """The config tables a call with these switches runs (configs.score_tables)."""
    return configs.score_tables(frozenset(name for name, on in switches.items() if on and name in SCORE_SWITCHES))


def _runs_with(name, switches, head_dim) -> bool:
    """Whether dispatch runs a variant with these switches at this head dim: softcap takes the
    fused backward only at dispatch.FUSED_SCORES_HEAD_DIM_TILES, forced or not."""
    softcap_fused = switches.get("capped") and VARIANTS[name].fixed.get("sum_dq")
    return not softcap_fused or configs.head_dim_tile(head_dim) in dispatch.FUSED_SCORES_HEAD_DIM_TILES


def _compile_modified():
    for label, switches in {**_SWITCHES, **_BIAS_GRADS, **_ROW_SWITCHES}.items():
        for name in (name for name in VARIANTS if _takes(name, switches)):
            for head_dim in TUNED_HEAD_DIMS:
                if _runs_with(name, switches, head_dim):
                    yield pytest.param(name, ct.bfloat16, head_dim, switches, id=f"{name}-d{head_dim}-{label}")
        for name in MODIFIABLE:
            if sass.takes(name, "bias_grad") and _takes(name, switches) and label not in _ROW_SWITCHES:
                with_grad = {**switches, "bias_grad": switches.get("bias_mode", 0)}
                yield pytest.param(name, ct.float64, 64, with_grad, id=f"{name}-d64-fp64-{label}")
    for switch in ("with_sinks", "sinks_grad"):
        for name in (name for name in VARIANTS if _takes(name, {switch: True, "windowed": True})):
            yield pytest.param(name, ct.float64, 64, {switch: True, "windowed": True}, id=f"{name}-d64-fp64-{switch}")


ROW_SWITCH_VARIANTS = {name for name in VARIANTS for switches in _ROW_SWITCHES.values() if _takes(name, switches)}
MODIFIED_MATRIX = list(_compile_modified())


@slow
@pytest.mark.parametrize("kernel, dtype, head_dim, switches", MODIFIED_MATRIX)
def test_op_attention_score_modifiers_compile(kernel, dtype, head_dim, switches, tmp_path):
    """Each modifier compiles for sm_90 with every candidate config of the tables it picks,
    keeping the warpgroup MMA and spilling nothing; ALiBi and softcap alone, whose tables are
    their own, causal and not (their register use differs)."""
    size = 8 if dtype == ct.float64 else 2
    tables = _score_tables(switches)
    chosen = configs.candidates(kernel, "sm_90", head_dim, size, tables)
    assert chosen, f"{kernel} takes score modifiers but has no sm_90 config for them at D={head_dim}"
    causal_forms = (False, True) if tables in (configs.ScoreTables.ALIBI, configs.ScoreTables.SOFTCAP) else (False,)
    for config in chosen:
        for causal in causal_forms:
            path = tmp_path / "k.cubin"
            cubin = sass.compile_cubin(kernel, dtype, head_dim, config, causal, "sm_90", path, switches)
            assert cubin.stat().st_size > 0
            if dtype != ct.float64:
                _check_sass(kernel, sass.disassemble(cubin), _allowed_spills(kernel, switches, head_dim))


# V's head dim narrower and wider than Q's (tables by the wider: configs.candidates); 192 runs
# as 128 + 64 and 96 as 64 + 32 (configs.SPLIT_HEAD_DIMS).
VALUE_DIMS = [(128, 64), (64, 128), (256, 128), (192, 128), (192, 192), (96, 96), (128, 96)]


VALUE_DIM_MATRIX = [
    pytest.param(name, head_dim, value_dim, id=f"{name}-qk{head_dim}-v{value_dim}")
    for name in VARIANTS
    if sass.takes(name, "block_dv")
    for head_dim, value_dim in VALUE_DIMS
    if configs.candidates(name, "sm_90", head_dim, 2, value_dim=value_dim)  # variants run only where they have a table
    # The fused backward runs only where V is no wider than Q (dispatch.fused_backward).
    and not (VARIANTS[name].fixed.get("sum_dq") and value_dim > head_dim)
    and _runs_at(name, head_dim, value_dim)
]


@slow
@pytest.mark.parametrize("kernel, head_dim, value_dim", VALUE_DIM_MATRIX)
def test_op_attention_value_dim_compiles(kernel, head_dim, value_dim, tmp_path):
    """A V head dim other than Q's compiles for sm_90 with the first config of its table (the
    pair's, else the wider head dim's), keeping the SASS checks (a pair's tables hold configs
    measured faster in spite of spills: PAIR_MATRIX checks them)."""
    chosen = configs.candidates(kernel, "sm_90", head_dim, 2, value_dim=value_dim)
    path = tmp_path / "k.cubin"
    cubin = sass.compile_cubin(kernel, ct.bfloat16, head_dim, chosen[0], True, "sm_90", path, value_dim=value_dim)
    paired = kernel in configs.PAIR_TABLES["sm_90"].get((head_dim, value_dim), {})
    _check_sass(kernel, sass.disassemble(cubin), "measured" if paired else "none")


PAIR_MATRIX = [
    pytest.param(name, pair, choices, id=f"{name}-qk{pair[0]}-v{pair[1]}")
    for pair, kernels in configs.PAIR_TABLES["sm_90"].items()
    for name, choices in kernels.items()
]


@slow
@pytest.mark.parametrize("kernel, pair, choices", PAIR_MATRIX)
def test_op_attention_pair_tables_compile(kernel, pair, choices, tmp_path):
    """Every config of a (head dim, V head dim) pair's table compiles for sm_90 to HGMMA, and for
    causal masks and for none, one of them at least keeps its matmuls pipelined (the tuner picks
    per shape: at (192, 128) 64-row query steps pipeline only with a causal mask)."""
    head_dim, value_dim = pair
    for causal in _causal_forms(kernel):
        pipelined = []
        for config in choices:
            path = tmp_path / "k.cubin"
            cubin = sass.compile_cubin(
                kernel, ct.bfloat16, head_dim, config, causal, "sm_90", path, value_dim=value_dim
            )
            text = sass.disassemble(cubin)
            assert sass.count_instructions(text, "HGMMA") > 0, (config, causal)
            pipelined.append(not sass.matmuls_serialized(text))
        assert any(pipelined), f"no config of {kernel} at {pair} pipelines its matmuls (causal={causal})"


WIDE = tuple(name for name in VARIANTS if _runs_wide(name))


@slow
@pytest.mark.parametrize("kernel", WIDE, ids=str)
def test_op_attention_int64_indexed_twins_compile(kernel, tmp_path):
    """Each variant's int64-indexed twin (index_width.wide), which runs where a size or stride
    passes int32, compiles for sm_90 with every array indexed by int64, its positions in int32; at
    D=64, or at the smallest head-dim tile of its tables."""
    head_dim = next(d for d in HEAD_DIM_TILES if configs.candidates(kernel, "sm_90", d, element_size=2))
    config = configs.candidates(kernel, "sm_90", head_dim, element_size=2)[0]
    path = tmp_path / "k.cubin"
    cubin = sass.compile_cubin(kernel, ct.bfloat16, head_dim, config, True, "sm_90", path, wide=True)
    text = sass.disassemble(cubin)
    assert sass.count_instructions(text, "HGMMA") > 0 or kernel in ROW_REDUCTIONS


# Packed batches (kernels/packed.py) run every variant that takes `varlen`. Plain, at every
# head-dim tile, they keep the SASS checks, and up to D=128 the query-tile kernels build
# bulk-copy descriptors only for the two arrays their loops read (packed.bulk_once): each one is
# a global round trip. With score modifiers they compile with warpgroup MMA; the backward
# kernels then spill at D=128 with ALiBi (perf-notes#packed-batches).
PACKED = tuple(name for name in VARIANTS if sass.takes(name, "varlen"))
_PACKED_MODIFIERS = {"windowed": True, "capped": True, "alibi": True, "with_sinks": True, "sinks_grad": True}
PACKED_MATRIX = [
    pytest.param(name, head_dim, causal, switches, id=f"{name}-d{head_dim}-{'causal' if causal else 'full'}-{label}")
    for name in PACKED
    for causal in _causal_forms(name)
    for head_dim, label, switches in [(d, "plain", {}) for d in (64, 128, 192, 256)]
    + [(d, "modifiers", _PACKED_MODIFIERS) for d in TUNED_HEAD_DIMS if _takes(name, _PACKED_MODIFIERS)]
    + [(d, "alibi", {"alibi": True}) for d in TUNED_HEAD_DIMS if _takes(name, {"alibi": True})]
    if configs.candidates(name, "sm_90", head_dim, 2)
    and _runs_at(name, head_dim, head_dim)
    # "auto" runs the fused backward packed at D=64 and D=128 only.
    and not (_sums_by_tma(name) and head_dim not in dispatch.FUSED_PACKED_HEAD_DIM_TILES)
]


@slow
@pytest.mark.parametrize("kernel, head_dim, causal, switches", PACKED_MATRIX)
def test_op_attention_packed_batches_compile(kernel, head_dim, causal, switches, tmp_path):
    """Each variant a packed batch runs compiles with varlen for sm_90 at its first config."""
    config = configs.candidates(kernel, "sm_90", head_dim, 2, _score_tables(switches))[0]
    path = tmp_path / "k.cubin"
    text = sass.disassemble(
        sass.compile_cubin(kernel, ct.bfloat16, head_dim, config, causal, "sm_90", path, {"varlen": True, **switches})
    )
    if switches:
        assert sass.count_instructions(text, "HGMMA") > 0, "matrix work did not become warpgroup MMA (HGMMA)"
        return
    _check_sass(kernel, text)
    if configs.head_dim_tile(head_dim) <= 128 and VARIANTS[kernel].tiles == "query":  # packed.bulk_once
        assert sass.count_instructions(text, r"UTMACCTL\.IV") <= 2, "a descriptor built for a tile loaded once"
    if kernel == configs.BACKWARD_FUSED and head_dim == 64:
        # Statistics read at a tile index, dK and dV stored plainly: descriptors built per program
        # for K, V, Q, dOut and the dQ sum only (perf-notes#packed-fused-plain-stores); causal, one
        # more since masked steps add dS K and the others dQ^T (perf-notes#dq-transposed).
        most = 6 if causal else 5
        assert sass.count_instructions(text, r"UTMACCTL\.IV") <= most, "a descriptor built for the statistics or dK, dV"
    # The backward's row statistics start each sequence at a multiple of every query tile
    # (packed.stat_rows), so the dK/dV loop loads them by bulk copy, not element by element from
    # the math warps.
    assert sass.count_instructions(text, "LDGSTS") == 0, "a row statistic copied without a bulk copy"


@slow
@pytest.mark.parametrize("head_dim", [64, 256])
def test_op_attention_packed_preprocess_as_one_compiles(head_dim, tmp_path):
    """The fused backward's preprocess of a packed batch, run over all its rows as one batch
    entry, places each row's statistics by its sequence (packed.stat_rows_of_rows): it compiles
    for sm_90 at every config of its table, without local memory."""
    for config in configs.candidates(configs.BACKWARD_PREPROCESS, "sm_90", head_dim, 2):
        path = tmp_path / "k.cubin"
        text = sass.disassemble(
            sass.compile_cubin(
                configs.BACKWARD_PREPROCESS, ct.bfloat16, head_dim, config, False, "sm_90", path,
                {"stats_by_sequence": True},
            )
        )  # fmt: skip
        assert sass.count_instructions(text, "LDL") == 0 and sass.count_instructions(text, "STL") == 0, config


def test_every_variant_is_covered():
    """No compile: every variant in the registry reaches the compile tests above."""
    assert set(ROW_REDUCTIONS) <= set(VARIANTS), "ROW_REDUCTIONS names a variant the registry lacks"
    checked = {
        kernel
        for arch, kernel, dtype, *_ in (p.values for p in COMPILE_MATRIX)
        if (arch, dtype) == ("sm_90", ct.bfloat16)
    }
    assert checked == set(VARIANTS), f"without an sm_90 bf16 compile and SASS check: {set(VARIANTS) - checked}"
    for name in (name for name, variant in VARIANTS.items() if variant.default):
        for arch in ARCHS:
            assert all(configs.candidates(name, arch, d, 2) for d in HEAD_DIM_TILES), f"{name}: no full {arch} table"
    assert {param.values[0] for param in MODIFIED_MATRIX} == set(TAKES_SCORE_SWITCHES) | ROW_SWITCH_VARIANTS
    cases = sass.fingerprint_cases()
    # Variants of wide heads alone (an sm_90 table at D=256 only) have no D=64 or 128 code to keep.
    wide_only = {
        name
        for name in VARIANTS
        if configs.candidates(name, "sm_90", 256, 2)
        and not any(configs.candidates(name, "sm_90", d, 2) for d in sass.FINGERPRINT_HEAD_DIMS)
    }
    assert {name for name, _, _ in cases} | wide_only == set(VARIANTS), "a variant without an sm_90 table"
    stored = set(sass.stored())
    expected = {sass.fingerprint_name(*case) for case in cases}
    assert stored == expected, (
        f"stored fingerprints differ from the variants: missing {sorted(expected - stored)}, "
        f"stale {sorted(stored - expected)}; python -m tests.ops.sass fingerprints --update"
    )
