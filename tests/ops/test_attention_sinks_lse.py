"""Learnable sinks (with dSink) and the LSE's gradient, on the GPU against the float64
reference; every test skips without CUDA.

Outputs are poisoned with NaN before each run. The error yardstick is the reference run in
the inputs' dtype (assert_close_to_reference); the LSE is compared in absolute terms.
"""

import math

import pytest
import torch

from tests.ops.attention_cases import (
    Case,
    assert_close_to_reference,
    make_inputs,
    max_error,
    ran_with,
    reference_run,
)
from tests.ops.conftest import requires_cuda
from tilegym import autotune, fmha_forward_with_lse, tile_fmha, tile_fmha_functional, tile_fmha_with_backward
from tilegym.ops.attention import configs, launch
from tilegym.ops.attention import problem as problem_mod
from tilegym.ops.attention.reference import attention_reference

pytestmark = requires_cuda

ODD = Case("odd-lengths", 2, 3, 3, 77, 77, 64)
GQA = Case("gqa-4to1", 1, 8, 2, 130, 257, 128)
SQ_GT_SK = Case("sq-gt-sk", 2, 2, 2, 300, 100, 64)  # causal: the first 200 rows see no key
MQA = Case("mqa", 2, 6, 1, 97, 97, 128)
GPT_OSS = Case("gpt-oss-like", 1, 16, 2, 520, 520, 64)  # GQA 8:1, D=64, window 128


def _sinks(case: Case, dtype=torch.float32, requires_grad=True):
    # Around the scores' own range, so that the sink takes a real share of each row.
    return (torch.randn(case.q_heads, device="cuda", dtype=dtype) * 2).requires_grad_(requires_grad)


def check(case: Case, dtype, causal: bool, kwargs: dict, lse_grad: bool):
    q, k, v = make_inputs(case, dtype)
    d_out = torch.randn_like(q)
    d_lse = torch.randn(q.shape[:3], device="cuda", dtype=torch.float32) if lse_grad else None
    ref_out, ref_lse, ref_grads = reference_run(q, k, v, d_out, causal, kwargs, torch.float64, d_lse)
    base_dtype = torch.float64 if dtype == torch.float64 else dtype
    base_out, _, base_grads = reference_run(q, k, v, d_out, causal, kwargs, base_dtype, d_lse)

    problem, mod_tensors = problem_mod.check_inputs(q, k, v, None, causal, **kwargs)
    out = torch.full_like(q, math.nan)
    stat_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    lse = torch.full(q.shape[:3], math.nan, device="cuda", dtype=stat_dtype)
    launch.forward(q, k, v, problem, with_lse=True, out=out, lse=lse, mod_tensors=mod_tensors)
    grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
    sinks = kwargs.get("sinks")
    result = launch.backward(
        d_out, q, k, v, out, lse, problem, grads=grads, mod_tensors=mod_tensors, d_lse=d_lse,
        sinks_grad=sinks is not None,
    )  # fmt: skip

    assert_close_to_reference("out", out, base_out, ref_out, dtype)
    sees_none = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), sees_none), "lse is -inf exactly where the reference's is"
    tolerance = (1e-5 if dtype != torch.float64 else 1e-12) * (1 + ref_lse[~sees_none].abs().max().item())
    assert max_error(lse[~sees_none], ref_lse[~sees_none]) <= tolerance
    ours = (result.dq, result.dk, result.dv) + ((result.d_sinks,) if sinks is not None else ())
    names = ("dq", "dk", "dv", "dsinks")[: len(ours)]
    for name, mine, base, ref in zip(names, ours, base_grads, ref_grads, strict=True):
        assert_close_to_reference(name, mine, base, ref, dtype)
    assert (result.d_sinks is None) == (sinks is None)


SINK_CASES = {
    "odd": (ODD, False, lambda c: {}),
    "gqa-causal": (GQA, True, lambda c: {}),
    "rows-without-keys": (SQ_GT_SK, True, lambda c: {}),
    "mqa": (MQA, False, lambda c: {}),
    "gpt-oss-window": (GPT_OSS, True, lambda c: {"window_size": (128, 0)}),
    "window-softcap-alibi": (GQA, False, lambda c: {"window_size": (40, 9), "softcap": 4.0,
                                                    "alibi_slopes": torch.rand(c.q_heads, device="cuda") * 0.1}),
    # ALiBi alone: the forward keeps raw products, the sink joins in base-2 units.
    "alibi-causal": (SQ_GT_SK, True, lambda c: {"alibi_slopes": torch.rand(c.q_heads, device="cuda") * 0.3}),
}  # fmt: skip


@pytest.mark.parametrize("lse_grad", [False, True], ids=["out-grad", "out-and-lse-grad"])
@pytest.mark.parametrize("name", list(SINK_CASES))
def test_op_sinks(name, lse_grad):
    case, causal, build = SINK_CASES[name]
    check(case, torch.bfloat16, causal, {"sinks": _sinks(case), **build(case)}, lse_grad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=str)
def test_op_sinks_dtypes(dtype):
    case = Case("small", 2, 4, 2, 45, 61, 64)
    check(case, dtype, True, {"sinks": _sinks(case)}, lse_grad=True)


@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 192, 256])
def test_op_sinks_head_dims(head_dim):
    case = Case(f"d{head_dim}", 1, 4, 2, 150, 170, head_dim)
    check(case, torch.bfloat16, True, {"sinks": _sinks(case), "window_size": (64, 0)}, lse_grad=True)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_op_sinks_window_fused_backward(head_dim, monkeypatch):
    """Sinks and a window with the fused backward forced (it takes both): the sinks' gradient from
    its preprocess, dQ from its sums."""
    monkeypatch.setenv("TILEGYM_BACKWARD", "fused")
    case = Case(f"gqa-d{head_dim}", 2, 8, 2, 300, 300, head_dim)
    check(case, torch.bfloat16, True, {"sinks": _sinks(case), "window_size": (100, 0)}, lse_grad=True)


@pytest.mark.parametrize("backward", ["two-kernel", "fused"])
def test_op_sinks_far_above_the_scores(backward, monkeypatch):
    """A sink of 100 (natural units) on one head: its rows' probability goes to the sink. Rows past
    the sequence in the last query tile load LSE 0, where exp(100) overflows: they must add
    nothing to dSink (the dQ kernel's share, and the fused backward's preprocess)."""
    monkeypatch.setenv("TILEGYM_BACKWARD", backward)
    case = Case("odd-gqa-d128", 2, 8, 2, 300, 300, 128)
    sinks = _sinks(case, requires_grad=False)
    sinks[0] = 100.0
    autotune._chosen.clear()
    check(case, torch.bfloat16, True, {"sinks": sinks.requires_grad_(), "window_size": (100, 0)}, lse_grad=True)
    writes_row_stats = configs.BACKWARD_PREPROCESS if backward == "fused" else configs.BACKWARD_DQ
    assert ran_with(writes_row_stats)


LSE_CASES = {
    "plain-odd": (ODD, False, {}),
    "plain-causal-gqa": (GQA, True, {}),
    "rows-without-keys": (SQ_GT_SK, True, {}),
    "window": (MQA, True, {"window_size": (30, 0)}),
    "softcap": (ODD, True, {"softcap": 3.0}),
}


@pytest.mark.parametrize("name", list(LSE_CASES))
def test_op_lse_gradient(name):
    case, causal, kwargs = LSE_CASES[name]
    check(case, torch.bfloat16, causal, kwargs, lse_grad=True)


@pytest.mark.parametrize("case", [Case("fused", 1, 4, 4, 300, 2100, 64), Case("fused-gqa", 1, 8, 2, 300, 2100, 128)],
                         ids=str)  # fmt: skip
@pytest.mark.parametrize("with_sinks", [False, True], ids=["lse", "lse-and-sinks"])
def test_op_lse_gradient_fused_backward(case, with_sinks, monkeypatch):
    """The fused backward's preprocess folds the LSE's gradient in and writes the sinks' shares."""
    monkeypatch.setenv("TILEGYM_BACKWARD", "fused")
    check(case, torch.bfloat16, True, {"sinks": _sinks(case)} if with_sinks else {}, lse_grad=True)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_op_sinks_take_the_plain_kernels(head_dim):
    """Sinks leave scores and masks as they are: long plain calls keep the fixed-max forward and
    the fused backward, and agree with the reference."""
    from tilegym.ops.attention import dispatch

    case = Case("long", 1, 4, 4, 96, 4200, head_dim)
    q, k, v = make_inputs(case, torch.bfloat16)
    problem, _ = problem_mod.check_inputs(q, k, v, None, False, sinks=_sinks(case))
    launcher = launch._Launcher(problem, q.device)
    assert dispatch.fixed_max_forward(problem, launcher.candidates)
    assert dispatch.fused_backward(problem, launcher.candidates, False) is not None
    check(case, torch.bfloat16, False, {"sinks": _sinks(case)}, lse_grad=False)


def test_op_sinks_public_api():
    """Every public function takes sinks; autograd returns dSink in the sinks' own dtype and
    shape, and gradients flow from a returned LSE."""
    case = Case("api", 2, 4, 2, 70, 90, 64)
    q, k, v = make_inputs(case, torch.bfloat16, requires_grad=True)
    sinks = _sinks(case, torch.bfloat16)
    ref_out, ref_lse = attention_reference(q, k, v, is_causal=True, sinks=sinks)
    out_inference = tile_fmha(q, k, v, sinks=sinks)
    out_lse, lse = fmha_forward_with_lse(q, k, v, sinks=sinks)
    out_train, lse_train = tile_fmha_with_backward(q, k, v, sinks=sinks, return_lse=True)
    out_functional, lse_functional = tile_fmha_functional(q, k, v, sinks=sinks, return_lse=True)
    for out in (out_inference, out_lse, out_train, out_functional):
        assert max_error(out, ref_out) < 3e-2
    for value in (lse, lse_train, lse_functional):
        assert value.dtype == torch.float32 and max_error(value, ref_lse) < 1e-4
    assert lse_train.grad_fn is not None and lse_functional.grad_fn is not None
    (out_train.float().sum() + lse_train.sum()).backward()
    assert sinks.grad is not None and sinks.grad.shape == sinks.shape and sinks.grad.dtype == torch.bfloat16
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v, sinks))
    with torch.no_grad():
        out_nograd, lse_nograd = tile_fmha_functional(q, k, v, sinks=sinks, return_lse=True)
    assert out_nograd.grad_fn is None and lse_nograd.grad_fn is None


def test_op_lse_alone_carries_the_gradient():
    """A loss of the LSE alone: dOut is None for autograd, the LSE's gradient still reaches q and k
    (and v's gradient is zero: the LSE does not depend on v)."""
    case = Case("lse-only", 1, 2, 2, 40, 50, 64)
    q, k, v = make_inputs(case, torch.float64, requires_grad=True)
    _, lse = tile_fmha_with_backward(q, k, v, return_lse=True)
    lse.sum().backward()
    ref = [t.detach().requires_grad_() for t in (q, k, v)]
    attention_reference(*ref)[1].sum().backward()
    assert ref[2].grad is None and torch.equal(v.grad, torch.zeros_like(v))
    for ours, theirs in zip((q, k), ref[:2], strict=True):
        assert max_error(ours.grad, theirs.grad) < 1e-10


def test_op_sinks_gradient_is_deterministic():
    case = GPT_OSS
    q, k, v = make_inputs(case, torch.bfloat16)
    sinks = _sinks(case)
    d_out = torch.randn_like(q)
    first, second = (
        torch.autograd.grad(tile_fmha_with_backward(q, k, v, sinks=sinks, window_size=(128, 0)), sinks, d_out)[0]
        for _ in range(2)
    )
    assert torch.equal(first, second)


def test_op_minus_inf_sinks_change_nothing():
    case = ODD
    q, k, v = make_inputs(case, torch.bfloat16)
    sinks = torch.full((case.q_heads,), -math.inf, device="cuda")
    plain_out, plain_lse = fmha_forward_with_lse(q, k, v)
    out, lse = fmha_forward_with_lse(q, k, v, sinks=sinks)
    assert max_error(out, plain_out) < 1e-2 and max_error(lse, plain_lse) < 1e-5


@pytest.mark.parametrize("with_sinks", [False, True], ids=["lse", "lse-and-sinks"])
def test_op_sinks_and_lse_gradcheck_fp64(with_sinks):
    case = Case("gradcheck", 1, 4, 2, 7, 11, 32)
    q, k, v = make_inputs(case, torch.float64, requires_grad=True)
    inputs = (q, k, v, _sinks(case, torch.float64)) if with_sinks else (q, k, v)

    def attention(*tensors):
        sinks = tensors[3] if with_sinks else None
        return tile_fmha_with_backward(*tensors[:3], is_causal=True, window_size=(4, 0), sinks=sinks, return_lse=True)

    assert torch.autograd.gradcheck(attention, inputs)


def test_op_sinks_under_torch_compile():
    case = Case("compiled", 1, 4, 2, 64, 64, 64)
    q, k, v = make_inputs(case, torch.bfloat16, requires_grad=True)
    sinks = _sinks(case)

    @torch.compile(fullgraph=True)
    def step(q, k, v, sinks):
        out, lse = tile_fmha_with_backward(q, k, v, sinks=sinks, return_lse=True)
        return out.float().square().sum() + lse.sum()

    step(q, k, v, sinks).backward()
    compiled = [t.grad.clone() for t in (q, k, v, sinks)]
    for t in (q, k, v, sinks):
        t.grad = None
    out, lse = tile_fmha_with_backward(q, k, v, sinks=sinks, return_lse=True)
    (out.float().square().sum() + lse.sum()).backward()
    for name, ours, eager in zip(
        ("dq", "dk", "dv", "dsinks"), compiled, (q.grad, k.grad, v.grad, sinks.grad), strict=True
    ):
        assert max_error(ours, eager) <= 1e-2 * (1 + eager.abs().max().item()), name


@pytest.mark.parametrize(
    "sinks, error, message",
    [
        ("cpu", ValueError, "sinks must be on"),
        ("wrong-shape", ValueError, r"sinks must have shape \[q heads\]"),
        ("int", TypeError, "sinks must be a floating-point tensor"),
    ],
    ids=["device", "shape", "dtype"],
)
def test_op_sinks_rejected_before_launch(sinks, error, message):
    case = Case("bad", 1, 2, 2, 16, 16, 64)
    q, k, v = make_inputs(case, torch.bfloat16)
    bad = {
        "cpu": torch.zeros(2),
        "wrong-shape": torch.zeros(3, device="cuda"),
        "int": torch.zeros(2, device="cuda", dtype=torch.int32),
    }[sinks]
    with pytest.raises(error, match=message):
        tile_fmha_with_backward(q, k, v, sinks=bad)
    assert torch.isfinite(tile_fmha(q, k, v)).all(), "the GPU is still usable after a rejected call"


@pytest.mark.parametrize("choice", ["two-kernel", "fused"])
def test_op_sinks_gradient_with_tuning_on(choice, monkeypatch, tmp_path):
    """With tuning on, the first call times every candidate; configs with smaller query tiles
    write more sink shares than the chosen one, which must not reach dSink."""
    monkeypatch.setenv("DISABLE_AUTOTUNE", "0")
    monkeypatch.setenv("TILEGYM_CACHE_DIR", str(tmp_path))  # a fresh tune cache: this call tunes
    monkeypatch.setenv("TILEGYM_BACKWARD", choice)
    case = Case("tuned", 1, 4, 4, 333, 2100, 128)
    check(case, torch.bfloat16, False, {"sinks": _sinks(case)}, lse_grad=True)
