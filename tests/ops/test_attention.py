"""Attention on the GPU against a float64 reference; every test skips without CUDA."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.ops.attention_cases import (
    CORNERS,
    GQA,
    HEAD_DIMS,
    IRREGULAR,
    REGULAR,
    SEQLEN_MISMATCH,
    Case,
    assert_close_to_reference,
    make_inputs,
    max_error,
    ran_with,
)
from tests.ops.conftest import requires_cuda
from tilegym import fmha_forward_with_lse, launching, tile_fmha, tile_fmha_functional, tile_fmha_with_backward
from tilegym.ops.attention import configs, dispatch, launch
from tilegym.ops.attention import problem as problem_mod
from tilegym.ops.attention.reference import attention_reference, causal_mask

pytestmark = requires_cuda

LOW_PRECISION = [torch.float16, torch.bfloat16]


def _sdpa_baseline(q, k, v, d_out, scale, causal):
    """PyTorch SDPA in the inputs' dtype: its output and gradients, the error yardstick.

    SDPA has no bottom-right causal flag, so the mask is explicit; rows that see no key are
    given every key (SDPA would return NaN) and then zeroed, as the convention says.
    A backend that returns non-finite values (seen with negative scales) is replaced by MATH.
    """
    out, grads = _sdpa_run(q, k, v, d_out, scale, causal)
    if not all(t.isfinite().all() for t in (out, *grads)):
        with sdpa_kernel(SDPBackend.MATH):
            out, grads = _sdpa_run(q, k, v, d_out, scale, causal)
    return out, grads


def _sdpa_run(q, k, v, d_out, scale, causal):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k_full, v_full = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    mask = causal_mask(seqlen_q, seqlen_k, q.device) if causal else None
    sees_any = torch.ones(seqlen_q, 1, dtype=torch.bool, device=q.device)
    if mask is not None:
        sees_any = mask.any(-1, keepdim=True)
        mask = mask | ~sees_any
    out = F.scaled_dot_product_attention(q, k_full, v_full, attn_mask=mask, scale=scale) * sees_any
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    return out.detach(), grads


def _poisoned_like(t, dtype=None):
    return torch.full(t.shape, math.nan, dtype=dtype or t.dtype, device=t.device)


def check_forward_and_backward(case: Case, dtype, causal, scaling=None, transform=None):
    """Training forward, LSE and all three gradients against the fp64 reference.

    Outputs are pre-filled with NaN, so an element the kernels skip fails the test.
    transform, if given, maps each fresh input to the (possibly strided) tensor to test.
    """
    q, k, v = make_inputs(case, dtype)
    if transform is not None:
        q, k, v = (transform(t) for t in (q, k, v))
    problem, _ = problem_mod.check_inputs(q, k, v, scaling, causal)
    scale = problem.softmax_scale

    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention_reference(*ref_inputs, scaling=scale, is_causal=causal)
    d_out = torch.randn_like(q)
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, d_out.double())
    base_out, base_grads = _sdpa_baseline(q, k, v, d_out, scale, causal)

    out, lse = _poisoned_like(q), torch.full(q.shape[:3], math.nan, device=q.device, dtype=ref_lse.dtype)
    if dtype != torch.float64:
        lse = lse.float()
    launch.forward(q, k, v, problem, with_lse=True, out=out, lse=lse)
    grads = tuple(_poisoned_like(t) for t in (q, k, v))
    launch.backward(d_out, q, k, v, out, lse, problem, grads=grads)

    assert_close_to_reference("out", out, base_out, ref_out, dtype)
    sees_none = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), sees_none), "lse must be -inf exactly where a row sees no key"
    lse_tolerance = 1e-5 if dtype != torch.float64 else 1e-12
    assert max_error(lse[~sees_none], ref_lse[~sees_none]) <= lse_tolerance * (1 + ref_lse.abs().max().item())
    for name, ours, base, ref in zip(("dq", "dk", "dv"), grads, base_grads, ref_grads, strict=True):
        assert_close_to_reference(name, ours, base, ref, dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("case", REGULAR + IRREGULAR + CORNERS + SEQLEN_MISMATCH + GQA, ids=str)
def test_op_attention_shapes(case, dtype, causal):
    check_forward_and_backward(case, dtype, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("case", HEAD_DIMS, ids=str)
def test_op_attention_head_dims(case, dtype, causal):
    check_forward_and_backward(case, dtype, causal)


# Every case whose head dim has a fused table (D=64, and D=80 to 128 on 128-wide tiles), with
# the fused backward forced.
FUSED_HEAD_DIM_TILES = tuple(configs.TABLES["sm_90"][configs.BACKWARD_FUSED])
FUSED_CASES = [
    c
    for c in REGULAR + IRREGULAR + CORNERS + SEQLEN_MISMATCH + GQA + HEAD_DIMS
    if configs.head_dim_tile(c.head_dim) in FUSED_HEAD_DIM_TILES
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("case", FUSED_CASES, ids=str)
def test_op_attention_fused_backward(case, dtype, causal, monkeypatch):
    monkeypatch.setenv("TILEGYM_BACKWARD", "fused")
    check_forward_and_backward(case, dtype, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", FUSED_HEAD_DIM_TILES)
def test_op_attention_fused_backward_chosen_for_long_sequences(head_dim, causal):
    """Just past the length from which "auto" picks the fused backward; odd, so the last tiles
    are partial."""
    seqlen = dispatch.FUSED_BACKWARD_MIN_SEQLEN_K + 3
    check_forward_and_backward(Case("fused-auto", 1, 2, 1, seqlen, seqlen, head_dim), torch.bfloat16, causal)


@pytest.mark.parametrize(("query_heads", "kv_heads"), [(61, 61), (62, 31)], ids=["mha", "gqa"])
@pytest.mark.parametrize("head_dim", FUSED_HEAD_DIM_TILES)
def test_op_attention_fused_causal_backward_spans_head_groups(head_dim, query_heads, kv_heads, monkeypatch):
    """The fused causal backward hands out its programs by key tile across groups of heads
    (kernels/scheduling.py, heaviest_first): 3 key tiles make groups of 86 heads, so 183 or 186 query heads
    (with GQA, a program per query head) fill two groups and part of a third."""
    monkeypatch.setenv("TILEGYM_BACKWARD", "fused")
    check_forward_and_backward(Case("head-groups", 3, query_heads, kv_heads, 333, 333, head_dim), torch.bfloat16, True)


@pytest.mark.parametrize("backward", ["two-kernel", "fused"])
def test_op_attention_runs_on_the_current_stream(backward, monkeypatch):
    """Kernels are queued on the caller's current stream: behind a long sleep on a side stream,
    the outputs are still unwritten when the default stream is done, and right once the side
    stream is."""
    monkeypatch.setenv("TILEGYM_BACKWARD", backward)
    q, k, v = make_inputs(Case("side-stream", 2, 4, 2, 200, 300, 64), torch.bfloat16)
    problem, _ = problem_mod.check_inputs(q, k, v, None, True)
    d_out = torch.randn_like(q)
    base_out, base_grads = _sdpa_baseline(q, k, v, d_out, problem.softmax_scale, True)
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = attention_reference(*ref_inputs, is_causal=True)
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, d_out.double())
    out, lse = _poisoned_like(q), torch.full(q.shape[:3], math.nan, device=q.device)
    grads = tuple(_poisoned_like(t) for t in (q, k, v))
    launch.backward(d_out, q, k, v, *launch.forward(q, k, v, problem, with_lse=True), problem)  # compiles
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # about 0.1 s
        launch.forward(q, k, v, problem, with_lse=True, out=out, lse=lse)
        launch.backward(d_out, q, k, v, out, lse, problem, grads=grads)
    seen_early = [t.clone() for t in (out, *grads)]  # on the default stream, which does not wait
    side.synchronize()
    assert all(t.isnan().all() for t in seen_early), "a kernel ran outside the current stream"
    for name, ours, base, ref in zip(
        ("out", "dq", "dk", "dv"), (out, *grads), (base_out, *base_grads), (ref_out, *ref_grads), strict=True
    ):
        assert_close_to_reference(name, ours, base, ref, torch.bfloat16)


FIXED_MAX_HEAD_DIMS = tuple(dispatch.FIXED_MAX_FORWARD_MIN_MEAN_KEYS)


def _fixed_max_seqlen_k(head_dim, seqlen_q, causal):
    """An odd key length a little past the one from which the forward keeps a fixed row max
    (so the last tiles are partial); seqlen_q=None for a square problem."""
    min_keys = dispatch.FIXED_MAX_FORWARD_MIN_MEAN_KEYS[head_dim]
    if not causal:
        return min_keys + 3
    return 2 * min_keys + 3 if seqlen_q is None else min_keys + seqlen_q // 2 + 3


def _assert_fixed_max_chosen(q, k, v, causal):
    problem, _ = problem_mod.check_inputs(q, k, v, None, causal)
    assert dispatch.fixed_max_forward(problem, launch._Launcher(problem, q.device).candidates)
    return problem


# Every candidate of the Hopper fixed-max forward: the tuner may pick any, tests otherwise run the first.
FIXED_MAX_CONFIGS = [
    pytest.param(head_dim, config, id=f"d{head_dim}-{config.block_m}x{config.block_n}")
    for head_dim in FIXED_MAX_HEAD_DIMS
    for config in configs.candidates(configs.FORWARD_LSE_FIXED_MAX, "sm_90", head_dim, 2)
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("square", [False, True], ids=["300-queries", "square"])
@pytest.mark.parametrize(("head_dim", "config"), FIXED_MAX_CONFIGS)
def test_op_attention_fixed_max_forward_for_long_sequences(head_dim, config, square, causal, force_config):
    """Just past the length from which the forward keeps a fixed row max, under each config."""
    force_config(configs.FORWARD_LSE_FIXED_MAX, config)
    seqlen_k = _fixed_max_seqlen_k(head_dim, None if square else 300, causal)
    case = Case("fixed-max", 1, 2, 1, seqlen_k if square else 300, seqlen_k, head_dim)
    _assert_fixed_max_chosen(*make_inputs(case, torch.bfloat16), causal)
    check_forward_and_backward(case, torch.bfloat16, causal)
    assert ran_with(configs.FORWARD_LSE_FIXED_MAX, config)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("head_dim", "config"), FIXED_MAX_CONFIGS)
def test_op_attention_fixed_max_forward_recomputes_after_overflow(head_dim, config, causal, force_config):
    """Keys past the first tile score far above it: probabilities against the first tile's max
    overflow fp32, so each query tile must be computed again with a running max."""
    force_config(configs.FORWARD_LSE_FIXED_MAX, config)
    seqlen_k = _fixed_max_seqlen_k(head_dim, 256, causal)
    q, k, v = make_inputs(Case("fixed-max-overflow", 1, 2, 1, 256, seqlen_k, head_dim), torch.bfloat16)
    k[:, :, :128] *= 0.01
    k[:, :, 128:] *= 30
    problem = _assert_fixed_max_chosen(q, k, v, causal)
    ref_out, ref_lse = attention_reference(q.double(), k.double(), v.double(), is_causal=causal)
    base_out, _ = _sdpa_baseline(q, k, v, torch.randn_like(q), problem.softmax_scale, causal)
    out, lse = _poisoned_like(q), _poisoned_like(ref_lse, torch.float32)
    launch.forward(q, k, v, problem, with_lse=True, out=out, lse=lse)
    assert ran_with(configs.FORWARD_LSE_FIXED_MAX, config)
    assert_close_to_reference("out", out, base_out, ref_out, torch.bfloat16)
    assert max_error(lse, ref_lse) <= 1e-5 * (1 + ref_lse.abs().max().item())


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_op_attention_wide_dtypes(dtype, causal):
    check_forward_and_backward(Case("gqa-odd", 1, 4, 2, 45, 37, 64), dtype, causal)


# A negative or zero scale takes the forward's sign-flipped or zeroed copy of q.
@pytest.mark.parametrize("scaling", [0.05, 1.0, -0.3, 0.0], ids=lambda s: f"scale{s}")
def test_op_attention_scaling(scaling):
    check_forward_and_backward(Case("scaled", 1, 2, 2, 100, 100, 64), torch.bfloat16, True, scaling=scaling)


def _bshd_view(t):
    """The same values laid out [B, S, H, D] and viewed as [B, H, S, D]: no copy is needed."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _strided_head_dim(t):
    """A head dim with stride 2: taken with one copy."""
    wide = torch.stack([t, torch.randn_like(t)], dim=-1)
    return wide.flatten(-2)[..., ::2]


@pytest.mark.parametrize("transform", [_bshd_view, _strided_head_dim], ids=["bshd-view", "head-dim-stride-2"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_op_attention_strided_inputs(transform, causal):
    check_forward_and_backward(Case("strided", 2, 4, 2, 99, 130, 64), torch.bfloat16, causal, transform=transform)


def test_op_attention_bshd_view_is_not_copied():
    q, k, v = (_bshd_view(t) for t in make_inputs(Case("view", 1, 2, 2, 64, 64, 64), torch.float16))
    assert launching.addressable(q) is q


def test_op_attention_lse_public_api():
    case = Case("lse", 2, 4, 2, 150, 90, 128)
    q, k, v = make_inputs(case, torch.bfloat16)
    out, lse = fmha_forward_with_lse(q, k, v, is_causal=True)
    ref_out, ref_lse = attention_reference(q, k, v, is_causal=True)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 150)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = ~torch.isinf(ref_lse)
    assert max_error(lse[finite], ref_lse[finite]) < 1e-4
    assert torch.equal(out[:, :, :60], torch.zeros_like(out[:, :, :60])), "rows that see no key output zeros"
    assert max_error(out, ref_out) < 2e-2


def test_op_attention_inference_kernel():
    case = Case("inference", 2, 8, 2, 200, 333, 80)
    for causal in (False, True):
        q, k, v = make_inputs(case, torch.float16)
        out = tile_fmha(q, k, v, is_causal=causal)
        ref_out, _ = attention_reference(q, k, v, is_causal=causal)
        base_out, _ = _sdpa_baseline(q, k, v, torch.zeros_like(q), None, causal)
        assert_close_to_reference("out", out, base_out, ref_out, torch.float16)


def test_op_attention_functional_modes():
    q, k, v = make_inputs(Case("functional", 1, 2, 2, 64, 64, 64), torch.bfloat16, requires_grad=True)
    assert tile_fmha_functional(q, k, v, training=True).grad_fn is not None
    assert tile_fmha_functional(q, k, v, training=False).grad_fn is None
    assert tile_fmha_functional(q, k, v).grad_fn is not None, "training=None with grads wanted trains"
    with torch.no_grad():
        assert tile_fmha_functional(q, k, v).grad_fn is None, "training=None under no_grad is inference"
    plain = [t.detach() for t in (q, k, v)]
    assert tile_fmha_functional(*plain).grad_fn is None, "training=None without requires_grad is inference"
    with pytest.raises(TypeError, match="training"):
        tile_fmha_functional(q, k, v, training="yes")
    out = tile_fmha_functional(q, k, v, is_causal=False)
    out.sum().backward()
    ref_out, _ = attention_reference(q, k, v, is_causal=False)
    assert max_error(out, ref_out) < 2e-2
    assert all(t.grad is not None and not t.grad.isnan().any() for t in (q, k, v))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_op_attention_gradcheck_fp64(causal):
    q, k, v = make_inputs(Case("gradcheck", 1, 4, 2, 6, 9, 32), torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: tile_fmha_with_backward(*t, is_causal=causal), (q, k, v))


def test_op_attention_gradcheck_fp64_queries_without_keys():
    q, k, v = make_inputs(Case("gradcheck-sq-gt-sk", 1, 2, 2, 7, 3, 32), torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: tile_fmha_with_backward(*t, is_causal=True), (q, k, v))


def test_op_attention_backward_is_deterministic():
    q, k, v = make_inputs(Case("determinism", 2, 8, 2, 300, 300, 64), torch.bfloat16, requires_grad=True)
    d_out = torch.randn_like(q)
    first = torch.autograd.grad(tile_fmha_with_backward(q, k, v), (q, k, v), d_out)
    second = torch.autograd.grad(tile_fmha_with_backward(q, k, v), (q, k, v), d_out)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize(
    "case",
    [
        Case("batch0", 0, 2, 2, 16, 16, 64),
        Case("heads0", 2, 0, 0, 16, 16, 64),
        Case("sq0", 1, 2, 2, 0, 16, 64),
        Case("sk0", 1, 2, 2, 16, 0, 64),
    ],
    ids=str,
)
def test_op_attention_empty(case):
    q, k, v = make_inputs(case, torch.bfloat16, requires_grad=True)
    out, lse = fmha_forward_with_lse(q, k, v)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == -math.inf).all())
    out = tile_fmha_with_backward(q, k, v)
    out.sum().backward()
    assert all(torch.equal(t.grad, torch.zeros_like(t)) for t in (q, k, v))


def test_op_attention_rejects_mixed_devices():
    q, k, v = make_inputs(Case("devices", 1, 2, 2, 16, 16, 64), torch.bfloat16)
    with pytest.raises(ValueError, match="k must be a CUDA tensor"):
        tile_fmha(q, k.cpu(), v)
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match="one device"):
            tile_fmha(q, k.to("cuda:1"), v)
    # The GPU is still usable after a rejected call.
    assert torch.isfinite(tile_fmha(q, k, v)).all()


_SERVED_AHEAD = """
import json, torch
from tilegym import kernel_cache, tile_fmha_with_backward

served = []
compile_for_launch = kernel_cache.CachedKernel._compile

def recording(self, signature, context, compute_capability=None):
    key = kernel_cache._ahead_key(self, signature, compute_capability)
    served.append((self._pyfunc.__name__, key in kernel_cache._ahead_compiles))
    return compile_for_launch(self, signature, context, compute_capability)

kernel_cache.CachedKernel._compile = recording
q, k, v = (torch.randn(2, 3, 300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
tile_fmha_with_backward(q, k, v, is_causal=True).sum().backward()
torch.cuda.synchronize()
print(json.dumps(served))
"""


def test_op_backward_compiles_during_the_forward(tmp_path):
    """The training forward starts the backward's compiles (a new process, empty caches): each
    backward kernel's launch finds its compile started, none compiles from scratch."""
    import json
    import os
    import subprocess
    import sys

    environment = dict(os.environ, TILEGYM_CACHE_DIR=str(tmp_path / "t"), CUDA_TILE_CACHE_DIR=str(tmp_path / "c"))
    run = subprocess.run([sys.executable, "-c", _SERVED_AHEAD], env=environment, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    served = json.loads(run.stdout.splitlines()[-1])
    backward = [started for name, started in served if "backward" in name]
    assert len(backward) >= 2 and all(backward), served  # dQ and dK/dV (two kernels at this length)
