"""Attention inside torch.compile and CUDA graphs, on the GPU; every test skips without CUDA.

Each result is checked against the eager call on the same inputs and against the float64
reference: its error may exceed the eager call's by at most a tenth, plus EPS.
"""

import math

import pytest
import torch

from tests.ops.attention_cases import EPS, Case, capture_training_step, make_inputs, max_error
from tests.ops.conftest import requires_cuda
from tilegym import fmha_forward_with_lse, tile_fmha, tile_fmha_with_backward
from tilegym.ops.attention import custom_ops
from tilegym.ops.attention.reference import attention_reference

pytestmark = requires_cuda

ODD = Case("odd-lengths", 2, 3, 3, 77, 93, 64)
GQA_D128 = Case("gqa-d128", 1, 8, 2, 130, 257, 128)


def _assert_like_eager(name, got, eager, reference, dtype):
    assert not got.isnan().any(), f"{name} has NaN"
    torch.testing.assert_close(got, eager, msg=lambda m: f"{name} differs from the eager call: {m}")
    bound = 1.1 * max_error(eager, reference) + EPS[dtype]
    assert max_error(got, reference) <= bound, f"{name}: error against float64 above the eager call's"


def _training_step(fn, q, k, v, d_out, **kwargs):
    """out and (dq, dk, dv[, d_bias]) of fn, with d_out as the output's gradient."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    bias = kwargs.get("attn_bias")
    if bias is not None:
        kwargs["attn_bias"] = bias = bias.detach().requires_grad_()
    out = fn(*leaves, **kwargs)
    grads = torch.autograd.grad(out, leaves + ([bias] if bias is not None else []), d_out)
    return out.detach(), grads


def _reference_step(q, k, v, d_out, causal, **kwargs):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    bias = kwargs.get("attn_bias")
    if bias is not None:
        kwargs["attn_bias"] = bias = bias.detach().double().requires_grad_()
    out, _ = attention_reference(*leaves, is_causal=causal, **kwargs)
    grads = torch.autograd.grad(out, leaves + ([bias] if bias is not None else []), d_out.double())
    return out, grads


def _modifiers(name, case: Case, dtype):
    b, h, sq, sk = case.batch, case.q_heads, case.seqlen_q, case.seqlen_k
    if name == "plain":
        return {}
    if name == "bias-expanded":  # a stride-0 bias: its gradient is summed over the expanded dims
        return {"attn_bias": torch.randn((1, h, sq, sk), dtype=dtype, device="cuda").expand(b, h, sq, sk)}
    if name == "window-softcap-alibi":
        slopes = torch.rand(h, device="cuda") * 0.1 + 0.01
        return {"window_size": (19, 7), "softcap": 30.0, "alibi_slopes": slopes}
    raise ValueError(name)


# Score modifiers always take the two-kernel backward.
COMPILED_STEPS = [
    ("plain", "two-kernel"),
    ("plain", "fused"),
    ("bias-expanded", "auto"),
    ("window-softcap-alibi", "auto"),
]


@pytest.mark.parametrize(("mods", "backward"), COMPILED_STEPS, ids=["-".join(s) for s in COMPILED_STEPS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_op_attention_compiled_training_step(causal, mods, backward, monkeypatch):
    """torch.compile(fullgraph=True) of the training forward and its backward: the graph does
    not break at our call, and the results are the eager call's."""
    monkeypatch.setenv("TILEGYM_BACKWARD", backward)
    torch._dynamo.reset()
    dtype = torch.bfloat16
    case = GQA_D128 if mods == "plain" else ODD
    q, k, v = make_inputs(case, dtype)
    d_out = torch.randn_like(q)
    kwargs = _modifiers(mods, case, dtype)
    if "window_size" in kwargs and causal:
        kwargs["window_size"] = (19, 0)
    compiled = torch.compile(tile_fmha_with_backward, fullgraph=True)
    got_out, got_grads = _training_step(compiled, q, k, v, d_out, is_causal=causal, **kwargs)
    eager_out, eager_grads = _training_step(tile_fmha_with_backward, q, k, v, d_out, is_causal=causal, **kwargs)
    ref_out, ref_grads = _reference_step(q, k, v, d_out, causal, **kwargs)
    names = ("out", "dq", "dk", "dv", "d_bias")[: 1 + len(got_grads)]
    results = zip(names, (got_out, *got_grads), (eager_out, *eager_grads), (ref_out, *ref_grads), strict=True)
    for name, got, eager, ref in results:
        _assert_like_eager(name, got, eager, ref, dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_op_attention_compiled_inference(causal):
    """tile_fmha and fmha_forward_with_lse compiled: the eager results, and no gradient path."""
    torch._dynamo.reset()
    q, k, v = make_inputs(ODD, torch.float16, requires_grad=True)
    out = torch.compile(tile_fmha, fullgraph=True)(q, k, v, is_causal=causal)
    assert not out.requires_grad, "the inference call must not build a gradient path"
    out_lse, lse = torch.compile(fmha_forward_with_lse, fullgraph=True)(q, k, v, is_causal=causal)
    eager_out, eager_lse = fmha_forward_with_lse(q, k, v, is_causal=causal)
    ref_out, _ = attention_reference(q.detach(), k.detach(), v.detach(), is_causal=causal)
    _assert_like_eager("out", out, eager_out, ref_out, torch.float16)
    _assert_like_eager("out (with lse)", out_lse, eager_out, ref_out, torch.float16)
    assert lse.dtype == torch.float32
    torch.testing.assert_close(lse, eager_lse)


@pytest.mark.parametrize(
    ("kv_heads", "window_size", "match"),
    [(3, None, r"q's head count \(2\) must be a multiple of k's and v's \(3\)"), (2, (3, -2), "window_size sides")],
    ids=["heads", "window"],
)
def test_op_attention_compiled_bad_input_names_the_argument(kv_heads, window_size, match):
    """The operator's fake implementation checks its arguments while the graph is traced:
    dynamo reports the eager call's ValueError inside its own error's message."""
    torch._dynamo.reset()
    q = torch.randn(1, 2, 16, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, kv_heads, 16, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(Exception, match="ValueError.*" + match):
        torch.compile(tile_fmha_with_backward, fullgraph=True)(q, k, k, window_size=window_size)


def test_op_attention_custom_ops_pass_opcheck():
    """torch.library's checks of both operators: schema, fake implementation against the real
    one, autograd registration, and tracing through AOTAutograd."""
    q, k, v = make_inputs(Case("opcheck", 1, 4, 2, 70, 90, 64), torch.bfloat16, requires_grad=True)
    bias = torch.randn(1, 4, 70, 90, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    sinks = torch.randn(4, device="cuda", requires_grad=True)
    forward_args = (q, k, v, bias, None, sinks, 0.3, True, [40, 0], 25.0, True, "", [], [])
    torch.library.opcheck(custom_ops.attention, forward_args)
    out, lse = custom_ops.attention(*[t.detach() if isinstance(t, torch.Tensor) else t for t in forward_args])
    d_out, d_lse = torch.randn_like(out), torch.randn_like(lse)
    tensors = (q.detach(), k.detach(), v.detach(), out, lse, bias.detach(), None, sinks.detach())
    backward_args = (d_out, d_lse, *tensors, 0.3, True, [40, 0], 25.0, True, True, "", [], [])
    torch.library.opcheck(custom_ops.attention_backward, backward_args)


def _poison_(*tensors):
    for t in tensors:
        t.fill_(math.nan)


@pytest.mark.parametrize("backward", ["two-kernel", "fused"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_op_attention_training_step_in_a_cuda_graph(causal, backward, monkeypatch):
    """A training step captured in a CUDA graph: replayed on fresh inputs, with its output and
    gradients poisoned before the replay, it gives the eager call's results."""
    monkeypatch.setenv("TILEGYM_BACKWARD", backward)
    dtype = torch.bfloat16
    q, k, v = (t.requires_grad_() for t in make_inputs(GQA_D128, dtype))
    d_out = torch.randn_like(q)

    def step():
        out = tile_fmha_with_backward(q, k, v, is_causal=causal)
        out.backward(d_out)
        return out

    graph, out = capture_training_step(step, (q, k, v))

    with torch.no_grad():
        for t in (q, k, v, d_out):
            t.copy_(torch.randn_like(t))
        _poison_(out, q.grad, k.grad, v.grad)
    graph.replay()
    torch.cuda.synchronize()

    eager_out, eager_grads = _training_step(tile_fmha_with_backward, q, k, v, d_out, is_causal=causal)
    ref_out, ref_grads = _reference_step(q, k, v, d_out, causal)
    got = (out, q.grad, k.grad, v.grad)
    results = zip(("out", "dq", "dk", "dv"), got, (eager_out, *eager_grads), (ref_out, *ref_grads), strict=True)
    for name, ours, eager, ref in results:
        _assert_like_eager(name, ours, eager, ref, dtype)
