"""Attention dropout on the GPU against the float64 reference with the kernels' own mask
(reference.dropout_kept); every test skips without CUDA.

Each call's seed is fixed by replacing dropout.new_seed, so that the reference builds the same
mask; the yardstick is the reference in the inputs' dtype with that mask.
"""

import pytest
import torch

from tests.ops import test_attention_varlen as varlen_tests
from tests.ops.attention_cases import (
    Case,
    assert_close_to_reference,
    capture_training_step,
    make_inputs,
    max_error,
    reference_run,
)
from tests.ops.conftest import requires_cuda
from tilegym import tile_fmha_functional, tile_fmha_with_backward
from tilegym.ops.attention import dropout
from tilegym.ops.attention.reference import dropout_kept

pytestmark = requires_cuda

SEED = (1234567, 89101112, 0, 0)  # two words of seed, the first row, a zero (dropout.new_seed)


@pytest.fixture
def fixed_seed(monkeypatch):
    """The seed every call draws: int32 [2] on the call's device."""
    seed = torch.tensor(SEED, dtype=torch.int32)
    monkeypatch.setattr(dropout, "new_seed", lambda device: seed.to(device))
    return seed


def _dense_kwargs(case: Case, rate: float, seed, extra: dict) -> dict:
    kept = dropout_kept(seed, rate, case.batch, case.q_heads, case.seqlen_q, case.seqlen_k).cuda()
    return {**extra, "dropout_kept": kept, "dropout_scale": dropout.kept_scale(rate)}


def check_dense(case: Case, dtype, causal: bool, rate: float, seed, extra=None):
    """out, LSE, dq, dk, dv (and dsinks) of tile_fmha_with_backward with dropout against the
    reference with the kernels' mask; outputs and gradients allocated from poisoned memory."""
    extra = dict(extra or {})
    q, k, v = make_inputs(case, dtype)
    d_out = torch.randn(*q.shape[:3], v.shape[-1], dtype=dtype, device=q.device)
    kwargs = _dense_kwargs(case, rate, seed, extra)
    ref_out, ref_lse, ref_grads = reference_run(q, k, v, d_out, causal, kwargs, torch.float64)
    base_out, _, base_grads = reference_run(q, k, v, d_out, causal, kwargs, dtype)

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    sinks = extra.get("sinks")
    inputs = leaves + ([sinks] if sinks is not None and sinks.requires_grad else [])
    varlen_tests.poison_cached_memory()
    out, lse = tile_fmha_with_backward(*leaves, is_causal=causal, dropout_p=rate, return_lse=True, **extra)
    varlen_tests.poison_cached_memory()
    grads = torch.autograd.grad(out, inputs, d_out)

    assert_close_to_reference("out", out, base_out, ref_out, dtype)
    seen = ~torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), ~seen), "lse is -inf exactly where a row sees no key"
    if seen.any():
        tolerance = 1e-5 * (1 + ref_lse[seen].abs().max().item())
        assert max_error(lse[seen], ref_lse[seen]) <= tolerance, "the LSE is that of the undropped probabilities"
    for name, ours, base, ref in zip(("dq", "dk", "dv", "dsinks"), grads, base_grads, ref_grads, strict=False):
        assert_close_to_reference(name, ours, base, ref, dtype)


DENSE_CASES = {
    "d64-causal": (Case("d64", 2, 4, 4, 256, 256, 64), torch.bfloat16, True, {}),
    "d128-full-sq-lt-sk": (Case("sq-lt-sk", 1, 4, 4, 130, 257, 128), torch.float16, False, {}),
    "d128-causal-gqa-odd": (Case("gqa", 1, 8, 2, 131, 257, 128), torch.bfloat16, True, {}),
    "d32-causal-sq-gt-sk": (Case("sq-gt-sk", 2, 2, 2, 300, 100, 32), torch.bfloat16, True, {}),
    "d96-full": (Case("d96", 1, 2, 2, 200, 150, 96), torch.bfloat16, False, {}),
    "d256-causal": (Case("d256", 1, 2, 2, 200, 200, 256), torch.bfloat16, True, {}),
    "d64-float32": (Case("fp32", 1, 2, 2, 77, 77, 64), torch.float32, True, {}),
    "d64-window-softcap": (Case("window", 1, 4, 2, 300, 300, 64), torch.bfloat16, True,
                           {"window_size": (64, 0), "softcap": 20.0}),
    "d128-alibi": (Case("alibi", 1, 4, 4, 200, 200, 128), torch.bfloat16, False, {"alibi_slopes": "slopes"}),
    "d64-sinks": (Case("sinks", 1, 4, 4, 150, 150, 64), torch.bfloat16, True, {"sinks": "learned"}),
    # Long enough for the fused backward and the fixed-max forward.
    "d128-causal-long": (Case("long", 1, 2, 2, 2100, 2100, 128), torch.bfloat16, True, {}),
    "d64-full-long": (Case("long", 1, 2, 2, 2048, 2048, 64), torch.bfloat16, False, {}),
}  # fmt: skip


def _built(case: Case, extra: dict) -> dict:
    built = dict(extra)
    if built.get("alibi_slopes") == "slopes":
        built["alibi_slopes"] = torch.rand(case.q_heads, device="cuda") * 0.1
    if built.get("sinks") == "learned":
        built["sinks"] = torch.randn(case.q_heads, device="cuda").requires_grad_()
    return built


@pytest.mark.parametrize("rate", [0.1, 0.45])
@pytest.mark.parametrize("name", list(DENSE_CASES))
def test_op_dropout_dense(name, rate, fixed_seed):
    case, dtype, causal, extra = DENSE_CASES[name]
    check_dense(case, dtype, causal, rate, fixed_seed, _built(case, extra))


@pytest.mark.parametrize("backward", ["fused", "two-kernel"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_op_dropout_each_backward(backward, head_dim, fixed_seed, monkeypatch):
    monkeypatch.setenv("TILEGYM_BACKWARD", backward)
    case = Case(f"d{head_dim}", 1, 4, 2, 600, 700, head_dim)
    check_dense(case, torch.bfloat16, True, 0.2, fixed_seed)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("backward", ["auto", "fused"])
@pytest.mark.parametrize("causal", [True, False])
def test_op_dropout_packed(causal, backward, head_dim, fixed_seed, monkeypatch):
    """tile_fmha_varlen: each sequence's mask counts its own rows and columns, b the sequence;
    also with the fused backward forced (its programs read the whole batch's row statistics)."""
    monkeypatch.setenv("TILEGYM_BACKWARD", backward)
    rate = 0.3
    batch = varlen_tests.pack([0, 1, 77, 300, 129, 64], [5, 1, 90, 300, 129, 0], q_heads=4, kv_heads=2,
                              head_dim=head_dim, spare_q=3, spare_k=2)  # fmt: skip

    def per_sequence(s, length_q, length_k):
        kept = dropout_kept(fixed_seed, rate, 1, 4, length_q, length_k, first_sequence=s).cuda()
        return {"dropout_kept": kept, "dropout_scale": dropout.kept_scale(rate)}

    varlen_tests.check(batch, causal, {"dropout_p": rate}, per_sequence=per_sequence)


def test_op_dropout_at_a_first_row(monkeypatch):
    """A call whose seed names a first row (context parallelism's chunks: dropout.with_first_row)
    draws those rows of the sequence's mask: 77 queries from row 100 against 300 keys."""
    seed = torch.tensor((*SEED[:2], 100, 0), dtype=torch.int32)
    monkeypatch.setattr(dropout, "new_seed", lambda device: seed.to(device))
    check_dense(Case("first-row", 1, 4, 2, 77, 300, 64), torch.bfloat16, False, 0.3, seed)


def test_op_dropout_masks_per_call_and_seed():
    """Two calls draw different masks; torch.cuda.manual_seed repeats one bit for bit; rate 0 is
    the plain call."""
    q, k, v = make_inputs(Case("c", 1, 2, 2, 256, 256, 64), torch.bfloat16)
    torch.cuda.manual_seed(7)
    first = tile_fmha_with_backward(q, k, v, dropout_p=0.2)
    second = tile_fmha_with_backward(q, k, v, dropout_p=0.2)
    torch.cuda.manual_seed(7)
    again = tile_fmha_with_backward(q, k, v, dropout_p=0.2)
    assert torch.equal(first, again)
    assert not torch.equal(first, second)
    assert torch.equal(tile_fmha_with_backward(q, k, v, dropout_p=0.0), tile_fmha_with_backward(q, k, v))


def test_op_dropout_keeps_the_expected_share():
    """With v = 1 every output element is the kept probabilities' scaled row sum: its mean over
    many rows is 1 (the dropout is unbiased)."""
    case = Case("c", 4, 8, 8, 512, 512, 64)
    q, k, _ = make_inputs(case, torch.float32)
    v = torch.ones_like(k)
    out = tile_fmha_with_backward(q, k, v, is_causal=False, dropout_p=0.3)
    assert abs(out.mean().item() - 1.0) < 0.01


def test_op_dropout_functional_and_gradcheck_fp64():
    """tile_fmha_functional takes dropout_p (training path without a gradient too); gradcheck
    in float64 with the seed repeated before each call."""
    case = Case("gradcheck", 1, 4, 2, 7, 11, 32)
    q, k, v = make_inputs(case, torch.float64, requires_grad=True)

    def attention(*tensors):
        torch.cuda.manual_seed(3)
        return tile_fmha_functional(*tensors, is_causal=False, dropout_p=0.3)

    assert torch.autograd.gradcheck(attention, (q, k, v))
    with torch.no_grad():
        torch.cuda.manual_seed(3)
        assert torch.equal(tile_fmha_functional(q, k, v, is_causal=False, dropout_p=0.3), attention(q, k, v))


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_op_dropout_under_torch_compile(packed, fixed_seed):
    """torch.compile(fullgraph=True) runs the same kernels with the same mask as the eager call."""
    torch._dynamo.reset()
    if packed:
        batch = varlen_tests.pack([37, 300, 129], q_heads=4, kv_heads=2, head_dim=64)
        q, k, v = batch.q, batch.k, batch.v
        extra = dict(zip(("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"), batch.lengths, strict=True))
    else:
        q, k, v = make_inputs(Case("c", 2, 4, 2, 300, 300, 64), torch.bfloat16)
        extra = {}
    d_out = torch.randn(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)

    def attention(q, k, v):
        return tile_fmha_functional(q, k, v, None, True, dropout_p=0.3, **extra)

    def step(call):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = call(*leaves)
        return (out, *torch.autograd.grad(out, leaves, d_out))

    eager = step(attention)
    compiled = step(torch.compile(attention, fullgraph=True))
    for name, ours, expected in zip(("out", "dq", "dk", "dv"), compiled, eager, strict=True):
        assert torch.equal(ours, expected), name


def test_op_dropout_in_a_cuda_graph(monkeypatch):
    """A captured training step reads the seed's tensor at each replay: filled with another seed,
    a replay applies that seed's mask (checked against the reference each time)."""
    case = Case("c", 1, 4, 2, 200, 260, 64)
    rate = 0.3
    seed = torch.tensor(SEED, dtype=torch.int32, device="cuda")
    monkeypatch.setattr(dropout, "new_seed", lambda device: seed)
    q, k, v = (t.requires_grad_() for t in make_inputs(case, torch.bfloat16))
    d_out = torch.randn_like(q)

    def step():
        out = tile_fmha_with_backward(q, k, v, is_causal=True, dropout_p=rate)
        return (out, *torch.autograd.grad(out, (q, k, v), d_out))

    graph, results = capture_training_step(step, [])
    for words in ((11, 22, 0, 0), (33, 44, 0, 0)):
        seed.copy_(torch.tensor(words, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        kwargs = _dense_kwargs(case, rate, seed.cpu(), {})
        ref_out, _, ref_grads = reference_run(q, k, v, d_out, True, kwargs, torch.float64)
        base_out, _, base_grads = reference_run(q, k, v, d_out, True, kwargs, torch.bfloat16)
        assert_close_to_reference("out", results[0], base_out, ref_out, torch.bfloat16)
        for name, ours, base, ref in zip(("dq", "dk", "dv"), results[1:], base_grads, ref_grads, strict=True):
            assert_close_to_reference(name, ours, base, ref, torch.bfloat16)


@pytest.mark.parametrize("rate, error", [(1.0, ValueError), (-0.1, ValueError), ("0.1", TypeError), (True, TypeError)])
def test_op_dropout_rejects_bad_rates(rate, error):
    q, k, v = make_inputs(Case("c", 1, 2, 2, 16, 16, 64), torch.bfloat16)
    with pytest.raises(error, match="dropout_p"):
        tile_fmha_with_backward(q, k, v, dropout_p=rate)
    with pytest.raises(ValueError, match="training=False"):
        tile_fmha_functional(q, k, v, training=False, dropout_p=0.1)
