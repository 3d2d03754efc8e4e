"""Score modifiers (attn_bias with dBias, window_size, softcap, alibi_slopes) on the GPU against
the float64 reference; every test skips without CUDA.

The error yardstick is the same reference run in the inputs' dtype (PyTorch SDPA has no
softcap): ours must be within ERROR_RATIO (RMS) and MAX_ERROR_RATIO (max) of its error.
"""

import dataclasses
import math

import pytest
import torch

from tests.ops.attention_cases import (
    GQA_4TO1,
    MQA,
    ODD_LENGTHS,
    SQ_GT_SK,
    Case,
    assert_close_to_reference,
    make_inputs,
    max_error,
    ran_with,
    reference_run,
)
from tests.ops.conftest import requires_cuda
from tilegym import fmha_forward_with_lse, tile_fmha, tile_fmha_functional, tile_fmha_with_backward
from tilegym.ops.attention import configs, dispatch, launch
from tilegym.ops.attention import problem as problem_mod
from tilegym.ops.attention.reference import attention_reference

pytestmark = requires_cuda

# Key lengths whose bias rows are 16-byte aligned, as in training: the bias is then read by
# TMA, which the odd lengths above never reach (a broadcast row once faulted only here).
ALIGNED = Case("aligned", 2, 4, 4, 256, 256, 128)
ALIGNED_D64 = Case("aligned-d64", 2, 4, 2, 384, 512, 64)


def _bias(shape_name: str, case: Case, dtype, grad: bool, neg_inf: bool = False):
    b, h, sq, sk = case.batch, case.q_heads, case.seqlen_q, case.seqlen_k
    shapes = {
        "full": (b, h, sq, sk),
        "one-row": (1, h, 1, sk),
        "2d": (sq, sk),
        "batch-rows": (b, 1, 1, sk),
        "key-broadcast": (b, 1, sq, 1),
    }
    if shape_name == "expanded":
        bias = torch.randn((1, 1, sq, sk), dtype=dtype, device="cuda").expand(b, h, sq, sk)
    else:
        bias = torch.randn(shapes[shape_name], dtype=dtype, device="cuda")
    if neg_inf:  # a padding-mask style bias: some keys hidden, and one row hidden entirely
        bias = bias.masked_fill(torch.rand(bias.shape, device="cuda") < 0.3, -math.inf)
        bias[..., 0, :] = -math.inf
    return bias.requires_grad_(grad) if bias.is_leaf else bias.detach().requires_grad_(grad)


def _alibi(case: Case, per_batch: bool):
    shape = (case.batch, case.q_heads) if per_batch else (case.q_heads,)
    return torch.rand(shape, device="cuda", dtype=torch.float32) * 0.2 + 0.01


# name -> (case, causal, builder of the keyword arguments)
VARIANTS = {
    "bias-full": (ODD_LENGTHS, False, lambda c, dt: {"attn_bias": _bias("full", c, dt, True)}),
    "bias-full-causal": (SQ_GT_SK, True, lambda c, dt: {"attn_bias": _bias("full", c, dt, True)}),
    "bias-one-row": (GQA_4TO1, True, lambda c, dt: {"attn_bias": _bias("one-row", c, dt, True)}),
    "bias-one-row-aligned": (ALIGNED, False, lambda c, dt: {"attn_bias": _bias("one-row", c, dt, True)}),
    "bias-batch-rows-aligned": (ALIGNED_D64, True, lambda c, dt: {"attn_bias": _bias("batch-rows", c, dt, True)}),
    "bias-2d-gqa": (GQA_4TO1, False, lambda c, dt: {"attn_bias": _bias("2d", c, dt, True)}),
    "bias-batch-rows": (ODD_LENGTHS, True, lambda c, dt: {"attn_bias": _bias("batch-rows", c, dt, True)}),
    "bias-key-broadcast": (MQA, False, lambda c, dt: {"attn_bias": _bias("key-broadcast", c, dt, True)}),
    "bias-expanded": (ODD_LENGTHS, False, lambda c, dt: {"attn_bias": _bias("expanded", c, dt, True)}),
    "bias-fp32": (MQA, True, lambda c, dt: {"attn_bias": _bias("full", c, torch.float32, True)}),
    "bias-neg-inf": (ODD_LENGTHS, False, lambda c, dt: {"attn_bias": _bias("full", c, dt, True, neg_inf=True)}),
    "window": (ODD_LENGTHS, False, lambda c, dt: {"window_size": (19, 7)}),
    "window-left": (GQA_4TO1, False, lambda c, dt: {"window_size": (40, -1)}),
    "window-right": (SQ_GT_SK, False, lambda c, dt: {"window_size": (-1, 30)}),
    "window-causal": (GQA_4TO1, True, lambda c, dt: {"window_size": (64, 0)}),
    "window-sq-gt-sk": (SQ_GT_SK, True, lambda c, dt: {"window_size": (5, -1)}),
    "softcap": (ODD_LENGTHS, False, lambda c, dt: {"softcap": 2.0}),
    "softcap-causal": (GQA_4TO1, True, lambda c, dt: {"softcap": 5.0}),
    "alibi": (MQA, True, lambda c, dt: {"alibi_slopes": _alibi(c, False)}),
    "alibi-per-batch": (SQ_GT_SK, False, lambda c, dt: {"alibi_slopes": _alibi(c, True)}),
    "alibi-causal": (SQ_GT_SK, True, lambda c, dt: {"alibi_slopes": _alibi(c, True)}),
    "all": (
        GQA_4TO1,
        True,
        lambda c, dt: {
            "attn_bias": _bias("one-row", c, dt, True),
            "window_size": (50, 0),
            "softcap": 3.0,
            "alibi_slopes": _alibi(c, False),
        },
    ),  # fmt: skip
    "all-full": (
        SQ_GT_SK,
        False,
        lambda c, dt: {
            "attn_bias": _bias("full", c, dt, True),
            "window_size": (60, 20),
            "softcap": 4.0,
            "alibi_slopes": _alibi(c, True),
        },
    ),  # fmt: skip
}


def check_variant(case: Case, dtype, causal: bool, kwargs: dict):
    """Training forward (outputs poisoned with NaN first), LSE, dq, dk, dv and dBias."""
    q, k, v = make_inputs(case, dtype)
    d_out = torch.randn_like(q)
    ref_out, ref_lse, ref_grads = reference_run(q, k, v, d_out, causal, kwargs, torch.float64)
    base_dtype = torch.float64 if dtype == torch.float64 else dtype
    base_out, _, base_grads = reference_run(q, k, v, d_out, causal, kwargs, base_dtype)

    mod_kwargs = {name: value for name, value in kwargs.items() if name != "scaling"}
    problem, mod_tensors = problem_mod.check_inputs(q, k, v, kwargs.get("scaling"), causal, **mod_kwargs)
    out = torch.full_like(q, math.nan)
    lse = torch.full(
        q.shape[:3], math.nan, device=q.device, dtype=ref_lse.dtype if dtype == torch.float64 else torch.float32
    )
    launch.forward(q, k, v, problem, with_lse=True, out=out, lse=lse, mod_tensors=mod_tensors)
    grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
    bias = kwargs.get("attn_bias")
    bias_grad = bias is not None and bias.requires_grad
    d_bias = launch.backward(
        d_out, q, k, v, out, lse, problem, grads=grads, mod_tensors=mod_tensors, bias_grad=bias_grad
    ).d_bias

    assert_close_to_reference("out", out, base_out, ref_out, dtype)
    sees_none = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), sees_none), "lse must be -inf exactly where a row sees no key"
    lse_tolerance = 1e-5 if dtype != torch.float64 else 1e-12
    scale = 1 + ref_lse[~sees_none].abs().max().item() if (~sees_none).any() else 1
    assert max_error(lse[~sees_none], ref_lse[~sees_none]) <= lse_tolerance * scale
    names = ("dq", "dk", "dv", "dbias")
    for name, ours, base, ref in zip(names, (*grads, d_bias), base_grads, ref_grads, strict=False):
        if name == "dbias":
            assert ours.shape == bias.shape and ours.dtype == bias.dtype, "dBias takes the bias's shape and dtype"
        assert_close_to_reference(name, ours, base, ref, dtype)
    assert (d_bias is None) == (not bias_grad)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_op_attention_variant(name):
    case, causal, build = VARIANTS[name]
    check_variant(case, torch.bfloat16, causal, build(case, torch.bfloat16))


# The fused backward takes a sliding window or ALiBi alone (variants.WINDOW_OR_ALIBI): each such
# case with it forced, at head dims of both fused tables (96 runs as 64 + 32 on the 128 table);
# the causal cases with query groups take its grouped form.
FUSED_CASES = [name for name in VARIANTS if name.startswith("window") or name.startswith("alibi")]


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("name", FUSED_CASES)
def test_op_attention_fused_backward(name, head_dim, monkeypatch):
    monkeypatch.setenv("TILEGYM_BACKWARD", "fused")
    case, causal, build = VARIANTS[name]
    case = dataclasses.replace(case, why=f"{case.why}-d{head_dim}", head_dim=head_dim)
    check_variant(case, torch.bfloat16, causal, build(case, torch.bfloat16))


# Softcap alone takes the fused backward dense and ungrouped on its D=64 and D=128 tables (96 runs
# on the 128 table as 64 + 32; dispatch.FUSED_SCORES_HEAD_DIM_TILES): forced, causal and not,
# Sq != Sk, caps that bend most scores (2) and few (30).
SOFTCAP_FUSED_CASES = {
    "full-odd": (Case("odd-d128", 2, 3, 3, 77, 77, 128), False, 2.0),
    "causal-sq-gt-sk-d96": (Case("sq-gt-sk-d96", 2, 4, 4, 300, 170, 96), True, 5.0),
    "causal-sq-lt-sk": (Case("sq-lt-sk-d128", 1, 2, 2, 333, 640, 128), True, 30.0),
    "full-odd-gqa-d64": (Case("odd-gqa-d64", 2, 4, 2, 77, 150, 64), False, 2.0),
    "causal-sq-gt-sk-d64": (Case("sq-gt-sk-d64", 2, 4, 4, 300, 170, 64), True, 30.0),
    "causal-sq-lt-sk-d64": (Case("sq-lt-sk-d64", 1, 2, 2, 333, 640, 64), True, 5.0),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(SOFTCAP_FUSED_CASES))
def test_op_attention_fused_backward_softcap(name, dtype, monkeypatch, force_config):
    monkeypatch.setenv("TILEGYM_BACKWARD", "fused")
    case, causal, cap = SOFTCAP_FUSED_CASES[name]
    config = configs.candidates(configs.BACKWARD_FUSED, "sm_90", case.head_dim, 2, configs.ScoreTables.SOFTCAP)[0]
    force_config(configs.BACKWARD_FUSED, config)
    check_variant(case, dtype, causal, {"softcap": cap})
    assert ran_with(configs.BACKWARD_FUSED, config)


@pytest.mark.parametrize("name", ["bias-full", "softcap-causal", "window", "alibi", "all"])
def test_op_attention_variant_fp16(name):
    case, causal, build = VARIANTS[name]
    check_variant(case, torch.float16, causal, build(case, torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", ["all", "all-full"])
def test_op_attention_variant_wide_dtypes(name, dtype):
    case = Case("small", 1, 4, 2, 45, 37, 64)
    _, causal, build = VARIANTS[name]
    check_variant(case, dtype, causal, build(case, dtype))


# "alibi": ALiBi alone, whose forward keeps raw products (ALiBi in their units) as plain
# attention's does; "all": every modifier, in scaled units.
@pytest.mark.parametrize("name", ["all", "alibi"])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 192, 256])
def test_op_attention_variant_head_dims(head_dim, name):
    case = Case(f"d{head_dim}", 1, 4, 2, 150, 170, head_dim)
    _, causal, build = VARIANTS[name]
    check_variant(case, torch.bfloat16, causal, build(case, torch.bfloat16))


# The forward with ALiBi alone scales inside exp2, which needs a positive scale: a negative or
# zero one takes the sign-flipped or zeroed copy of q, as plain attention does.
@pytest.mark.parametrize("scaling", [0.7, -0.3, 0.0], ids=lambda s: f"scale{s}")
def test_op_attention_alibi_scaling(scaling):
    case, causal, build = VARIANTS["alibi-per-batch"]
    check_variant(case, torch.bfloat16, causal, {**build(case, torch.bfloat16), "scaling": scaling})


# Causal ALiBi on 16-bit inputs splits its term into a per-key part in the scores and a per-query
# part in the row statistics: steep slopes (1 and BLOOM's largest, 0.5, beside gentle ones), rows
# many tiles long, queries before the keys (rows that see nothing) and after them, GQA; with
# each backward (the fused one's grouped form with GQA).
@pytest.mark.parametrize("backward", ["two-kernel", "fused"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "case",
    [Case("sq-lt-sk", 1, 8, 2, 650, 1100, 128), Case("sq-gt-sk", 2, 4, 4, 900, 500, 64)],
    ids=lambda c: c.why,
)
def test_op_attention_alibi_causal_steep_slopes(case, dtype, backward, monkeypatch):
    monkeypatch.setenv("TILEGYM_BACKWARD", backward)
    slopes = torch.tensor([1.0, 0.5, 2**-4, 2**-8] * (case.q_heads // 4), device="cuda")
    check_variant(case, dtype, True, {"alibi_slopes": slopes})


# ALiBi alone keeps a fixed row max from as many keys per query as plain attention: causal, the
# diagonal's (masked) tiles set it; without a mask, the key tiles under each query tile's
# diagonal. Key lengths just past that, with the first row's last key inside a masked tile
# ("aligned"), or at the end of an unmasked one ("diagonal-at-tile-end": causal, that row's max is
# still -inf after the masked tiles, so its query tile takes the running max).
ALIBI_FIXED_MAX_CONFIGS = [
    pytest.param(head_dim, config, id=f"d{head_dim}-{config.block_m}x{config.block_n}")
    for head_dim in dispatch.FIXED_MAX_FORWARD_MIN_MEAN_KEYS
    for config in configs.candidates(configs.FORWARD_LSE_FIXED_MAX, "sm_90", head_dim, 2, configs.ScoreTables.ALIBI)
]
_ALIBI_SLOPES = (0.5, 2**-3, 2**-6, 2**-8)
_MASKS = pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])


def _alibi_fixed_max_case(head_dim: int, block_n: int, diagonal_at_tile_end: bool) -> Case:
    seqlen_q = 300
    seqlen_k = dispatch.FIXED_MAX_FORWARD_MIN_MEAN_KEYS[head_dim] + seqlen_q // 2 + 3
    if diagonal_at_tile_end:  # query 0 sees keys 0 .. Sk - Sq, a whole number of key tiles
        seqlen_k = seqlen_q - 1 + block_n * math.ceil((seqlen_k - seqlen_q + 1) / block_n)
    return Case("alibi-fixed-max", 1, 4, 2, seqlen_q, seqlen_k, head_dim)


def _assert_alibi_fixed_max_chosen(case: Case, slopes, causal: bool) -> None:
    q, k, v = make_inputs(case, torch.bfloat16)
    problem, _ = problem_mod.check_inputs(q, k, v, None, causal, alibi_slopes=slopes)
    assert dispatch.fixed_max_forward(problem, launch._Launcher(problem, q.device).candidates)


@_MASKS
@pytest.mark.parametrize("diagonal_at_tile_end", [False, True], ids=["aligned", "diagonal-at-tile-end"])
@pytest.mark.parametrize(("head_dim", "config"), ALIBI_FIXED_MAX_CONFIGS)
def test_op_attention_alibi_fixed_max_forward(head_dim, config, diagonal_at_tile_end, causal, force_config):
    force_config(configs.FORWARD_LSE_FIXED_MAX, config)
    case = _alibi_fixed_max_case(head_dim, config.block_n, diagonal_at_tile_end)
    slopes = torch.tensor(_ALIBI_SLOPES, device="cuda")
    _assert_alibi_fixed_max_chosen(case, slopes, causal)
    check_variant(case, torch.bfloat16, causal, {"alibi_slopes": slopes})
    assert ran_with(configs.FORWARD_LSE_FIXED_MAX, config)


@pytest.mark.parametrize(("head_dim", "config"), ALIBI_FIXED_MAX_CONFIGS)
def test_op_attention_alibi_fixed_max_without_a_mask_steep_slopes(head_dim, config, force_config):
    """Without a mask, Sq > Sk (the first rows' diagonal lies before key 0: they start at key
    tile 0) and slopes of up to 1 per key: a query tile's rows peak in different key tiles under
    its diagonal, all of which set its max."""
    force_config(configs.FORWARD_LSE_FIXED_MAX, config)
    seqlen_k = dispatch.FIXED_MAX_FORWARD_MIN_MEAN_KEYS[head_dim] + 37
    case = Case("alibi-fixed-max-steep", 1, 2, 1, seqlen_k + 2 * config.block_m + 9, seqlen_k, head_dim)
    slopes = torch.tensor((1.0, 2**-4), device="cuda")
    _assert_alibi_fixed_max_chosen(case, slopes, False)
    check_variant(case, torch.bfloat16, False, {"alibi_slopes": slopes})
    assert ran_with(configs.FORWARD_LSE_FIXED_MAX, config)


@_MASKS
@pytest.mark.parametrize(("head_dim", "config"), ALIBI_FIXED_MAX_CONFIGS)
def test_op_attention_alibi_fixed_max_recomputes_after_overflow(head_dim, config, causal, force_config):
    """Keys near the diagonal score far below the rest and the slopes are gentle: probabilities
    against the diagonal tiles' max overflow fp32, so each query tile must be computed again."""
    force_config(configs.FORWARD_LSE_FIXED_MAX, config)
    case = _alibi_fixed_max_case(head_dim, config.block_n, False)
    slopes = torch.full((case.q_heads,), 2**-10, device="cuda")
    _assert_alibi_fixed_max_chosen(case, slopes, causal)
    q, k, v = make_inputs(case, torch.bfloat16)
    near = case.seqlen_q + 2 * config.block_n  # the keys of every query tile's diagonal tiles
    k[:, :, -near:] *= 0.01
    k[:, :, :-near] *= 30
    problem, mod_tensors = problem_mod.check_inputs(q, k, v, None, causal, alibi_slopes=slopes)
    ref_out, ref_lse = attention_reference(q.double(), k.double(), v.double(), is_causal=causal, alibi_slopes=slopes)
    base_out, _ = attention_reference(q, k, v, is_causal=causal, alibi_slopes=slopes, compute_dtype=torch.bfloat16)
    out = torch.full_like(q, math.nan)
    lse = torch.full(q.shape[:3], math.nan, device=q.device, dtype=torch.float32)
    launch.forward(q, k, v, problem, with_lse=True, out=out, lse=lse, mod_tensors=mod_tensors)
    assert ran_with(configs.FORWARD_LSE_FIXED_MAX, config)
    assert_close_to_reference("out", out, base_out, ref_out, torch.bfloat16)
    assert max_error(lse, ref_lse) <= 1e-5 * (1 + ref_lse.abs().max().item())


# With score modifiers the D=64 running-max forward runs on four 64x64 CTAs per SM or one
# 128x128 CTA, as the tuner picks: each candidate of the call's table forced, with the backward
# after it; query groups, Sq != Sk (rows that see no key), odd lengths, sinks, fp16 with a cap
# past the bound, a window without a causal mask (which spills on four CTAs), everything at once.
RUNNING_MAX_D64_CASES = {
    "alibi-causal-sq-gt-sk-gqa": (
        Case("alibi-d64", 2, 4, 2, 333, 200, 64),
        torch.bfloat16,
        True,
        {"alibi_slopes": "steep"},
    ),
    "alibi-full-sinks": (
        Case("alibi-sinks-d64", 1, 4, 4, 130, 517, 64),
        torch.bfloat16,
        False,
        {"alibi_slopes": "steep", "sinks": "random"},
    ),
    "softcap-causal-sq-lt-sk": (Case("softcap-d64", 1, 3, 3, 190, 1000, 64), torch.bfloat16, True, {"softcap": 50.0}),
    "softcap-full-fp16": (Case("softcap-fp16-d64", 2, 4, 2, 257, 257, 64), torch.float16, False, {"softcap": 30.0}),
    "bias-causal-gqa": (Case("bias-d64", 2, 4, 2, 200, 333, 64), torch.bfloat16, True, {"attn_bias": "per-row"}),
    "one-row-bias-full": (Case("row-bias-d64", 2, 4, 4, 257, 130, 64), torch.bfloat16, False, {"attn_bias": "one-row"}),
    "window-full": (Case("window-d64", 1, 4, 2, 300, 517, 64), torch.bfloat16, False, {"window_size": (70, 33)}),
    "everything-causal": (
        Case("everything-d64", 1, 4, 4, 300, 300, 64),
        torch.bfloat16,
        True,
        {"window_size": (90, 0), "softcap": 20.0, "alibi_slopes": "steep", "attn_bias": "per-row"},
    ),
}


def _running_max_d64_kwargs(case: Case, kwargs: dict) -> dict:
    kwargs = dict(kwargs)
    if kwargs.get("alibi_slopes") == "steep":
        kwargs["alibi_slopes"] = torch.tensor([1.0, 0.5, 2**-4, 2**-8] * (case.q_heads // 4), device="cuda")
    if kwargs.get("sinks") == "random":
        kwargs["sinks"] = torch.randn(case.q_heads, device="cuda", dtype=torch.float32)
    bias_rows = {"per-row": case.seqlen_q, "one-row": 1}.get(kwargs.get("attn_bias"))
    if bias_rows is not None:
        shape = (case.batch, case.q_heads, bias_rows, case.seqlen_k)
        kwargs["attn_bias"] = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    return kwargs


# The score switch each keyword argument sets (score_mods.ScoreMods.switches); sinks set none.
_SWITCH_OF = {"alibi_slopes": "alibi", "softcap": "capped", "attn_bias": "bias_mode", "window_size": "windowed"}


def _running_max_d64_params():
    for name, (case, dtype, causal, kwargs) in RUNNING_MAX_D64_CASES.items():
        tables = configs.score_tables(frozenset(_SWITCH_OF[key] for key in kwargs if key in _SWITCH_OF))
        for config in configs.candidates(configs.FORWARD_LSE, "sm_90", 64, 2, tables):
            tiles = f"{config.block_m}x{config.block_n}-occ{config.occupancy or 1}"
            yield pytest.param(case, dtype, causal, kwargs, config, id=f"{name}-{tiles}")


@pytest.mark.parametrize(("case", "dtype", "causal", "kwargs", "config"), list(_running_max_d64_params()))
def test_op_attention_running_max_forward_d64_configs(case, dtype, causal, kwargs, config, force_config):
    force_config(configs.FORWARD_LSE, config)
    kwargs = _running_max_d64_kwargs(case, kwargs)
    q, k, v = make_inputs(case, dtype)
    problem, _ = problem_mod.check_inputs(q, k, v, None, causal, **kwargs)
    assert not dispatch.fixed_max_forward(problem, launch._Launcher(problem, q.device).candidates)
    check_variant(case, dtype, causal, kwargs)
    assert ran_with(configs.FORWARD_LSE, config)


# Softcap alone with bf16 inputs takes its cap as every row's fixed max (dispatch.bounded_softcap)
# at any length, causal or not: odd lengths, query groups, Sq > Sk (rows that see no key), the
# largest cap it takes, sinks.
SOFTCAP_BOUNDED_CASES = {
    "full-odd-d64": (Case("odd-d64", 2, 3, 3, 77, 150, 64), False, {"softcap": 30.0}),
    "causal-sq-gt-sk-gqa": (Case("sq-gt-sk-d128", 2, 4, 2, 300, 170, 128), True, {"softcap": 5.0}),
    "causal-sq-lt-sk-d96": (
        Case("sq-lt-sk-d96", 1, 2, 2, 333, 640, 96),
        True,
        {"softcap": dispatch.BOUNDED_SOFTCAP_MAX},
    ),
    "causal-sinks-d80": (Case("sinks-d80", 1, 3, 1, 129, 129, 80), True, {"softcap": 2.0, "sinks": "random"}),
}
SOFTCAP_BOUNDED_CONFIGS = [
    pytest.param(head_dim, config, id=f"d{head_dim}-{config.block_m}x{config.block_n}")
    for head_dim in dispatch.FIXED_MAX_FORWARD_MIN_MEAN_KEYS
    for config in configs.candidates(configs.FORWARD_LSE_FIXED_MAX, "sm_90", head_dim, 2, configs.ScoreTables.SOFTCAP)
]


def _softcap_bounded_kwargs(case: Case, kwargs: dict) -> dict:
    if kwargs.get("sinks") == "random":
        return {**kwargs, "sinks": torch.randn(case.q_heads, device="cuda", dtype=torch.float32)}
    return kwargs


@pytest.mark.parametrize("name", list(SOFTCAP_BOUNDED_CASES))
def test_op_attention_softcap_bounded_max_forward(name, force_config):
    case, causal, kwargs = SOFTCAP_BOUNDED_CASES[name]
    kwargs = _softcap_bounded_kwargs(case, kwargs)
    config = configs.candidates(configs.FORWARD_LSE_FIXED_MAX, "sm_90", case.head_dim, 2, configs.ScoreTables.SOFTCAP)[
        0
    ]
    force_config(configs.FORWARD_LSE_FIXED_MAX, config)
    q, k, v = make_inputs(case, torch.bfloat16)
    problem, _ = problem_mod.check_inputs(q, k, v, None, causal, **kwargs)
    assert dispatch.fixed_max_forward(problem, launch._Launcher(problem, q.device).candidates)
    check_variant(case, torch.bfloat16, causal, kwargs)
    assert ran_with(configs.FORWARD_LSE_FIXED_MAX, config)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("head_dim", "config"), SOFTCAP_BOUNDED_CONFIGS)
def test_op_attention_softcap_bounded_max_far_below_the_cap(head_dim, config, causal, force_config):
    """Every score near -cap at the largest cap the bound takes: probabilities near 2^-100
    against the fixed max, which the output and the LSE must not lose."""
    force_config(configs.FORWARD_LSE_FIXED_MAX, config)
    case = Case("far-below-cap", 1, 2, 2, 2 * config.block_m + 5, 3 * config.block_n + 7, head_dim)
    cap = dispatch.BOUNDED_SOFTCAP_MAX
    q, k, v = make_inputs(case, torch.bfloat16)
    q = (q + 3).to(torch.bfloat16)
    k = (-3 - k).to(torch.bfloat16)  # q.k near -9 D: scores near -cap, spread by the inputs
    problem, mod_tensors = problem_mod.check_inputs(q, k, v, None, causal, softcap=cap)
    assert dispatch.fixed_max_forward(problem, launch._Launcher(problem, q.device).candidates)
    ref_out, ref_lse = attention_reference(q.double(), k.double(), v.double(), is_causal=causal, softcap=cap)
    base_out, _ = attention_reference(q, k, v, is_causal=causal, softcap=cap, compute_dtype=torch.bfloat16)
    assert ref_lse.max().item() < -cap / 2, "the scores must sit near -cap"
    out = torch.full_like(q, math.nan)
    lse = torch.full(q.shape[:3], math.nan, device=q.device, dtype=torch.float32)
    launch.forward(q, k, v, problem, with_lse=True, out=out, lse=lse, mod_tensors=mod_tensors)
    assert ran_with(configs.FORWARD_LSE_FIXED_MAX, config)
    assert_close_to_reference("out", out, base_out, ref_out, torch.bfloat16)
    # Causal with fewer keys than queries (block_n < block_m), the first rows see no key: LSE -inf.
    sees_none = torch.isinf(ref_lse)
    assert torch.equal(lse[sees_none], ref_lse[sees_none].float())
    seen = ref_lse[~sees_none]
    assert max_error(lse[~sees_none], seen) <= 1e-5 * (1 + seen.abs().max().item())


def test_op_attention_variant_public_api():
    """Every public function takes the modifiers, and autograd hands dBias to the bias."""
    case = Case("api", 2, 4, 2, 70, 90, 64)
    q, k, v = make_inputs(case, torch.bfloat16, requires_grad=True)
    bias = _bias("one-row", case, torch.bfloat16, True)
    kwargs = {"attn_bias": bias, "window_size": (30, 10), "softcap": 6.0, "alibi_slopes": _alibi(case, False)}
    ref_out, ref_lse = attention_reference(q, k, v, is_causal=False, **kwargs)
    out_inference = tile_fmha(q, k, v, is_causal=False, **kwargs)
    out_lse, lse = fmha_forward_with_lse(q, k, v, is_causal=False, **kwargs)
    out_train = tile_fmha_with_backward(q, k, v, is_causal=False, **kwargs)
    out_functional = tile_fmha_functional(q, k, v, is_causal=False, **kwargs)
    for out in (out_inference, out_lse, out_train, out_functional):
        assert max_error(out, ref_out) < 3e-2
    assert max_error(lse, ref_lse) < 1e-4
    assert out_functional.grad_fn is not None
    out_train.backward(torch.ones_like(out_train))
    assert bias.grad is not None and bias.grad.shape == bias.shape and torch.isfinite(bias.grad).all()
    with torch.no_grad():
        assert tile_fmha_functional(q, k, v, is_causal=False, **kwargs).grad_fn is None
    only_bias_wants_grad = [t.detach() for t in (q, k, v)]
    assert tile_fmha_functional(*only_bias_wants_grad, is_causal=False, **kwargs).grad_fn is not None


def test_op_attention_variant_bias_grad_is_deterministic():
    case, causal, build = VARIANTS["bias-2d-gqa"]
    q, k, v = make_inputs(case, torch.bfloat16)
    bias = _bias("2d", case, torch.bfloat16, True)
    d_out = torch.randn_like(q)
    first = torch.autograd.grad(tile_fmha_with_backward(q, k, v, is_causal=causal, attn_bias=bias), bias, d_out)
    second = torch.autograd.grad(tile_fmha_with_backward(q, k, v, is_causal=causal, attn_bias=bias), bias, d_out)
    assert torch.equal(first[0], second[0])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"attn_bias": "full"},
        {"attn_bias": "one-row"},
        {"softcap": 0.7},
        {"window_size": (3, 2), "alibi_slopes": "alibi"},
        {"attn_bias": "one-row", "softcap": 1.5, "window_size": (4, -1)},
    ],
    ids=["bias", "bias-one-row", "softcap", "window-alibi", "bias-softcap-window"],
)
def test_op_attention_variant_gradcheck_fp64(kwargs):
    case = Case("gradcheck", 1, 4, 2, 7, 11, 32)
    q, k, v = make_inputs(case, torch.float64, requires_grad=True)
    built = dict(kwargs)
    if isinstance(built.get("attn_bias"), str):
        built["attn_bias"] = _bias(built["attn_bias"], case, torch.float64, True)
    if built.get("alibi_slopes") == "alibi":
        built["alibi_slopes"] = _alibi(case, True)
    bias = built.pop("attn_bias", None)
    inputs = (q, k, v) if bias is None else (q, k, v, bias)

    def attention(*tensors):
        extra = {} if bias is None else {"attn_bias": tensors[3]}
        return tile_fmha_with_backward(*tensors[:3], is_causal=False, **built, **extra)

    assert torch.autograd.gradcheck(attention, inputs)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"window_size": (4, 2)}, ValueError, "window_size"),
        ({"attn_bias": "wrong-shape"}, ValueError, "attn_bias of shape"),
        ({"attn_bias": "cpu"}, ValueError, "attn_bias must be on"),
        ({"alibi_slopes": "cpu"}, ValueError, "alibi_slopes must be on"),
        ({"softcap": -1.0}, ValueError, "softcap"),
    ],
    ids=["causal-window-right", "bias-shape", "bias-device", "slopes-device", "negative-softcap"],
)
def test_op_attention_variant_rejects_bad_options(kwargs, error, message):
    case = Case("bad", 1, 2, 2, 16, 16, 64)
    q, k, v = make_inputs(case, torch.bfloat16)
    built = dict(kwargs)
    if built.get("attn_bias") == "wrong-shape":
        built["attn_bias"] = torch.randn(1, 3, 16, 16, device="cuda", dtype=torch.bfloat16)
    if built.get("attn_bias") == "cpu":
        built["attn_bias"] = torch.randn(16, 16, dtype=torch.bfloat16)
    if built.get("alibi_slopes") == "cpu":
        built["alibi_slopes"] = torch.rand(2)
    with pytest.raises(error, match=message):
        tile_fmha_with_backward(q, k, v, is_causal=True, **built)
    assert torch.isfinite(tile_fmha(q, k, v)).all(), "the GPU is still usable after a rejected call"


@pytest.mark.parametrize("case", [Case("sq0", 2, 2, 2, 0, 16, 64), Case("sk0", 2, 2, 2, 16, 0, 64)], ids=str)
def test_op_attention_variant_empty(case):
    q, k, v = make_inputs(case, torch.bfloat16, requires_grad=True)
    bias = torch.randn(case.batch, 1, case.seqlen_q, case.seqlen_k, device="cuda", dtype=torch.bfloat16)
    bias.requires_grad_()
    out = tile_fmha_with_backward(q, k, v, is_causal=False, attn_bias=bias, softcap=5.0)
    out.sum().backward()
    assert torch.equal(out, torch.zeros_like(out))
    assert all(torch.equal(t.grad, torch.zeros_like(t)) for t in (q, k, v, bias))
