"""Attention at the edges of integer ranges, on the GPU: window sides of 2**31 - 1, tensors of more
than 2**31 elements, sizes and strides past int32, offsets past 2**31 without bulk copies."""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.ops.conftest import requires_cuda
from tilegym import fmha_forward_with_lse, tile_fmha_with_backward
from tilegym.ops.attention import problem as problem_mod

pytestmark = requires_cuda

HUGE = 2**31 - 1


def _run(q, k, v, d_out, **kwargs):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = tile_fmha_with_backward(q, k, v, **kwargs)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), d_out))


@pytest.mark.parametrize(
    "window, causal, same_as",
    [
        ((HUGE, 0), True, {"is_causal": True}),
        ((0, HUGE), False, {"is_causal": False, "window_size": (0, -1)}),
        ((HUGE, HUGE), False, {"is_causal": False}),
        ((HUGE - 7, 5), False, {"is_causal": False, "window_size": (-1, 5)}),
    ],
    ids=["left-causal", "right", "both", "left-and-5"],
)
def test_op_window_sides_of_int32_max(window, causal, same_as):
    """Sides of 2**31 - 1 once overflowed the kernels' int32 sums (relative error 1.0); they mean
    unbounded, so the call matches the one that says so, bit for bit."""
    shape = (2, 4, 300, 64)
    q, k, v = (torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    d_out = torch.randn_like(q)
    ours = _run(q, k, v, d_out, window_size=window, is_causal=causal)
    expected = _run(q, k, v, d_out, **same_as)
    for name, got, want in zip(("out", "dq", "dk", "dv"), ours, expected, strict=True):
        assert torch.equal(got, want), name


def _relative_rms(actual: torch.Tensor, expected: torch.Tensor, rows=1 << 14) -> float:
    """RMS of the difference over RMS of expected, in float64 a chunk of rows at a time (a whole
    float64 copy of these tensors would not fit beside them)."""
    error = norm = 0.0
    for start in range(0, actual.shape[2], rows):
        got, want = (t[:, :, start : start + rows].double() for t in (actual, expected))
        error += (got - want).square().sum().item()
        norm += want.square().sum().item()
    return math.sqrt(error / norm)


# bf16 inputs against an fp32 reference: about 3e-3 where every element is right; a wrong tile
# or an overflowed offset gives order 1.
_BF16_RELATIVE_RMS = 1.5e-2


def _chunked_reference(q, k, v, d_out, scale, chunk=1 << 16):
    """Non-causal out, LSE and gradients in fp32, a chunk of query rows at a time (keys few)."""
    k32, v32 = (t.float().requires_grad_() for t in (k, v))
    out, lse, dq = torch.empty_like(q), torch.empty(q.shape[:3], device=q.device), torch.empty_like(q)
    for start in range(0, q.shape[2], chunk):
        rows = slice(start, start + chunk)
        q32 = q[:, :, rows].float().requires_grad_()
        scores = q32 @ k32.transpose(-1, -2) * scale
        chunk_out = torch.softmax(scores, dim=-1) @ v32
        chunk_out.backward(d_out[:, :, rows].float())
        out[:, :, rows], lse[:, :, rows], dq[:, :, rows] = chunk_out.detach(), scores.logsumexp(-1).detach(), q32.grad
    return out, lse, dq, k32.grad, v32.grad


def test_op_strides_past_int32_use_wide_indexing():
    """q [1, 16, 1048653, 128] has a batch stride past int32 (cuTile's default indexing refuses
    it): the int64-indexed kernels run, forward, LSE and backward."""
    q = torch.randn((1, 16, 1048653, 128), dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn((1, 16, 200, 128), dtype=torch.bfloat16, device="cuda") for _ in range(2))
    problem, _ = problem_mod.check_inputs(q, k, v, None, False)
    assert problem.wide_index
    d_out = torch.randn_like(q)
    with torch.no_grad():
        out, lse = fmha_forward_with_lse(q, k, v, is_causal=False)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = _chunked_reference(q, k, v, d_out, problem.softmax_scale)
    assert _relative_rms(out, ref_out) < _BF16_RELATIVE_RMS
    assert (lse - ref_lse).abs().max().item() < 1e-2
    del out, lse
    _, dq, dk, dv = _run(q, k, v, d_out, is_causal=False)
    for name, got, want in (("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv)):
        assert _relative_rms(got, want) < _BF16_RELATIVE_RMS, name


def _sdpa_heads(q, k, v, d_out, heads, causal):
    """SDPA's output and gradients for a few (batch, head) pairs of a large call."""
    results = []
    for b, h in heads:
        inputs = [t[b : b + 1, h : h + 1].detach().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*inputs, is_causal=causal)
        results.append((out.detach(), *torch.autograd.grad(out, inputs, d_out[b : b + 1, h : h + 1])))
    return results


def test_op_more_than_2_31_elements_causal_training():
    """B=4, H=32, S=131072, D=128: 2**31 elements in each of q, k, v (refused before), strides
    within int32. The last heads live past element 2**31; they are checked against SDPA."""
    shape = (4, 32, 131072, 128)
    q, k, v = (torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    assert q.numel() > HUGE
    problem, _ = problem_mod.check_inputs(q, k, v, None, True)
    assert not problem.wide_index
    d_out = torch.randn_like(q)
    out, dq, dk, dv = _run(q, k, v, d_out, is_causal=True)
    heads = [(3, 31), (3, 0), (0, 0)]
    for (b, h), expected in zip(heads, _sdpa_heads(q, k, v, d_out, heads, True), strict=True):
        for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), expected, strict=True):
            assert _relative_rms(got[b : b + 1, h : h + 1], want) < _BF16_RELATIVE_RMS, (name, b, h)


def _forward_reference(q, k, v, rows=1 << 15):
    """Non-causal attention in fp32 with the default scale, a chunk of query rows at a time."""
    k32, v32 = k.float(), v.float()
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for start in range(0, q.shape[2], rows):
        scores = q[:, :, start : start + rows].float() @ k32.transpose(-1, -2) / math.sqrt(q.shape[-1])
        out[:, :, start : start + rows] = torch.softmax(scores, dim=-1) @ v32
    return out


@pytest.mark.parametrize("seqlen", [200, 131072], ids=["small", "past-2-31"])
def test_op_misaligned_tensors(seqlen):
    """A q whose address is one element off 16-byte alignment cannot use bulk tensor copies; its
    tiles are addressed element by element, also past 2**31 elements (the int64 kernels)."""
    shape = (4, 32, seqlen, 128)
    storage = torch.randn(math.prod(shape) + 1, dtype=torch.bfloat16, device="cuda")
    q = storage[1:].view(shape)
    assert q.data_ptr() % 16
    k, v = (torch.randn((4, 32, 512, 128), dtype=torch.bfloat16, device="cuda") for _ in range(2))
    problem, _ = problem_mod.check_inputs(q, k, v, None, False)
    assert problem.wide_index is (q.numel() > HUGE)
    with torch.no_grad():
        out, _ = fmha_forward_with_lse(q, k, v, is_causal=False)
        for b, h in [(3, 31), (3, 16), (1, 0), (0, 0)]:
            pick = (slice(b, b + 1), slice(h, h + 1))
            expected = _forward_reference(q[pick], k[pick], v[pick])
            assert _relative_rms(out[pick], expected) < _BF16_RELATIVE_RMS, (b, h)
