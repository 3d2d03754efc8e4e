"""V's head dim different from Q's and K's (DeepSeek MLA: 192 and 128): forward and backward on
the GPU against the float64 reference, outputs poisoned first; every test skips without CUDA."""

import math

import pytest
import torch

from tests.ops.attention_cases import assert_close_to_reference, max_error, reference_run
from tests.ops.conftest import requires_cuda
from tilegym import fmha_forward_with_lse, tile_fmha, tile_fmha_functional, tile_fmha_with_backward
from tilegym.ops.attention import launch
from tilegym.ops.attention import problem as problem_mod
from tilegym.ops.attention.reference import attention_reference

pytestmark = requires_cuda

# (Dqk, Dv): MLA's, the issue's, every narrower/wider pairing of the tiles, and the pairs with
# tables of their own (configs.PAIR_TABLES).
PAIRS = [(192, 128), (128, 64), (96, 64), (64, 128), (32, 256), (256, 64), (80, 96), (192, 192), (256, 128)]


def _inputs(batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim, value_dim, dtype):
    q = torch.randn(batch, q_heads, seqlen_q, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(batch, kv_heads, seqlen_k, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(batch, kv_heads, seqlen_k, value_dim, device="cuda", dtype=dtype)
    return q, k, v


def check(shape, dtype, causal, kwargs=None):
    kwargs = kwargs or {}
    q, k, v = _inputs(*shape, dtype)
    out_shape = (*q.shape[:3], v.shape[3])
    d_out = torch.randn(out_shape, device="cuda", dtype=dtype)
    ref_out, ref_lse, ref_grads = reference_run(q, k, v, d_out, causal, kwargs, torch.float64)
    base_dtype = torch.float64 if dtype == torch.float64 else dtype
    base_out, _, base_grads = reference_run(q, k, v, d_out, causal, kwargs, base_dtype)

    problem, mod_tensors = problem_mod.check_inputs(q, k, v, None, causal, **kwargs)
    assert problem.value_dim == v.shape[3]
    out = torch.full(out_shape, math.nan, device="cuda", dtype=dtype)
    lse = torch.full(q.shape[:3], math.nan, device="cuda", dtype=launch.row_stat(problem, "cuda").dtype)
    launch.forward(q, k, v, problem, with_lse=True, out=out, lse=lse, mod_tensors=mod_tensors)
    grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
    launch.backward(d_out, q, k, v, out, lse, problem, grads=grads, mod_tensors=mod_tensors)

    assert_close_to_reference("out", out, base_out, ref_out, dtype)
    seen = ~torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), ~seen)
    assert max_error(lse[seen], ref_lse[seen]) <= 1e-5 * (1 + ref_lse[seen].abs().max().item())
    for name, ours, base, ref in zip(("dq", "dk", "dv"), grads, base_grads, ref_grads, strict=True):
        assert_close_to_reference(name, ours, base, ref, dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"qk{p[0]}-v{p[1]}")
def test_op_value_dim(pair, causal):
    check((2, 4, 2, 133, 157, *pair), torch.bfloat16, causal)


@pytest.mark.parametrize("pair", [(192, 128), (64, 128)], ids=lambda p: f"qk{p[0]}-v{p[1]}")
def test_op_value_dim_sq_gt_sk_and_modifiers(pair):
    """Rows that see no key, a window, softcap, ALiBi and sinks, with GQA."""
    kwargs = {
        "window_size": (50, 0), "softcap": 5.0, "alibi_slopes": torch.rand(8, device="cuda") * 0.1,
        "sinks": torch.randn(8, device="cuda"),
    }  # fmt: skip
    check((1, 8, 2, 300, 120, *pair), torch.bfloat16, True, kwargs)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("pair", [(128, 64), (64, 128), (96, 64), (80, 96)], ids=lambda p: f"qk{p[0]}-v{p[1]}")
def test_op_value_dim_softcap_bounded_max(pair, causal):
    """Softcap alone in bf16 takes its cap as the forward's fixed max (dispatch.bounded_softcap)."""
    from tilegym.ops.attention import dispatch

    shape = (1, 4, 2, 150, 333, *pair)
    problem, _ = problem_mod.check_inputs(*_inputs(*shape, torch.bfloat16), None, causal, softcap=20.0)
    assert dispatch.fixed_max_forward(problem, launch._Launcher(problem, torch.device("cuda")).candidates)
    check(shape, torch.bfloat16, causal, {"softcap": 20.0})


@pytest.mark.parametrize("pair", [(192, 128), (256, 128), (192, 192)], ids=lambda p: f"qk{p[0]}-v{p[1]}")
def test_op_value_dim_pair_tables_with_sinks(pair):
    """Sinks alone keep plain scores, so the pairs' own tables (configs.PAIR_TABLES) run, GQA."""
    check((1, 8, 2, 300, 260, *pair), torch.bfloat16, True, {"sinks": torch.randn(8, device="cuda")})


@pytest.mark.parametrize("q_heads", [4, 8], ids=["fused", "fused-grouped"])
@pytest.mark.parametrize("pair", [(128, 64), (64, 128)], ids=lambda p: f"qk{p[0]}-v{p[1]}")
def test_op_value_dim_fused_backward(pair, q_heads, monkeypatch):
    """V narrower than Q takes the fused backward; a wider V, the two-kernel one (dispatch)."""
    from tilegym.ops.attention import dispatch

    monkeypatch.setenv("TILEGYM_BACKWARD", "fused")
    shape = (1, q_heads, 4 if q_heads == 4 else 2, 200, 2100, *pair)
    problem, _ = problem_mod.check_inputs(*_inputs(*shape, torch.bfloat16), None, True)
    fused = dispatch.fused_backward(problem, launch._Launcher(problem, torch.device("cuda")).candidates, False)
    assert (fused is not None) == (pair[1] <= pair[0])
    check(shape, torch.bfloat16, True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=str)
def test_op_value_dim_dtypes(dtype):
    check((1, 4, 2, 45, 61, 128, 64), dtype, True)


def test_op_value_dim_long_plain_kernels():
    """A long plain call: the fixed-max forward and the fused backward with Dv != D."""
    check((1, 4, 4, 64, 4200, 128, 64), torch.bfloat16, False)


def test_op_value_dim_public_api():
    q, k, v = (t.requires_grad_() for t in _inputs(2, 4, 2, 70, 90, 192, 128, torch.bfloat16))
    ref_out, ref_lse = attention_reference(q, k, v)
    outs = [tile_fmha(q, k, v), fmha_forward_with_lse(q, k, v)[0], tile_fmha_with_backward(q, k, v)]
    outs.append(tile_fmha_functional(q, k, v))
    for out in outs:
        assert out.shape == (2, 4, 70, 128) and max_error(out, ref_out) < 3e-2
    outs[2].float().sum().backward()
    assert q.grad.shape == q.shape and v.grad.shape == v.shape
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_op_value_dim_gradcheck_fp64():
    q, k, v = (t.requires_grad_() for t in _inputs(1, 2, 1, 7, 11, 32, 64, torch.float64))
    assert torch.autograd.gradcheck(lambda *t: tile_fmha_with_backward(*t, window_size=(5, 0)), (q, k, v))


def test_op_value_dim_under_torch_compile():
    q, k, v = (t.requires_grad_() for t in _inputs(1, 4, 2, 64, 64, 128, 64, torch.bfloat16))

    @torch.compile(fullgraph=True)
    def step(q, k, v):
        return tile_fmha_with_backward(q, k, v).float().square().sum()

    step(q, k, v).backward()
    compiled = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    tile_fmha_with_backward(q, k, v).float().square().sum().backward()
    for ours, eager in zip(compiled, (q.grad, k.grad, v.grad), strict=True):
        assert max_error(ours, eager) <= 1e-2 * (1 + eager.abs().max().item())
