"""Drawn combinations of the arguments on the GPU against the float64 reference; every test skips
without CUDA.

The other files test each argument on shapes chosen for it. Here a fixed-seed draw combines them
as callers do: dense or packed batches; head dims and value head dims; GQA and MQA; lengths
around tile edges, 0 and 1, Sq != Sk; causal or not; windows, softcap, ALiBi per head or per
batch row, learnable sinks, a bias (learnable or not), a gradient through the LSE, a scaling
of either sign; [B, S, H, D] strides and packed QKV views; training, inference and inference
with the LSE; deterministic algorithms; and the ready-made score and mask functions. Inputs are
16-bit (float32 and float64 have tests of their own). Each case is checked as the files that
own its arguments check theirs, by their helpers: outputs and gradients allocated from poisoned
memory, within the tolerance rule of the reference run in the inputs' dtype.
"""

import contextlib
import random
from dataclasses import asdict, dataclass

import pytest
import torch

from tests.ops import test_attention_programmable as programmable_tests
from tests.ops import test_attention_variants as variants_tests
from tests.ops import test_attention_varlen as varlen_tests
from tests.ops.attention_cases import Case, assert_close_to_reference, reference_run
from tests.ops.conftest import requires_cuda
from tilegym import fmha_forward_with_lse, tile_fmha, tile_fmha_with_backward

SEED, DRAWS = 2026, 36
HEAD_DIMS = (32, 64, 80, 96, 128, 192, 256)
TILE_EDGES = (63, 64, 65, 127, 128, 129, 191, 255, 256, 257, 383, 384, 385)
# Ready-made functions by the builders of the files that test them (dense: (case, dtype); packed:
# the number of query heads); those that read document ids or prefixes want Sq = Sk.
DENSE_FUNCTIONS = ("softcap", "alibi", "relative", "documents", "prefix_lm", "window_globals", "key_padding",
                   "relative_in_documents", "additive_bias", "head_and_key_bias", "sliding_window")  # fmt: skip
SQUARE_FUNCTIONS = ("documents", "prefix_lm", "relative_in_documents")
PACKED_FUNCTIONS = ("softcap", "relative-table", "softcap-sinks-window", "learned-relative", "learned-per-sequence")


@dataclass(frozen=True)
class Draw:
    packed: bool
    dtype: str
    head_dim: int
    value_dim: int
    kv_heads: int
    group: int
    causal: bool
    lengths_q: tuple  # one per sequence (packed) or (Sq,) repeated per batch row
    lengths_k: tuple
    spare: tuple = (0, 0)  # packed: rows after the last sequence, q and k
    window: tuple | None = None
    softcap: float | None = None
    alibi: str | None = None  # "heads" [Hq] or "rows" [B or N, Hq]
    sinks: str | None = None  # "learned" or "fixed"
    bias: str | None = None  # dense: a shape of test_attention_variants._bias; "+grad": learnable
    lse_grad: bool = False
    scaling: float | None = None
    deterministic: bool = False
    strided: bool = False  # dense: [B, S, H, D] transposed; packed: q, k, v views of one [total, 3, H, D]
    mode: str = "train"  # dense: "train", "infer" or "infer_lse"
    function: str | None = None  # a ready-made function instead of the keyword modifiers

    def __str__(self):
        given = {key: value for key, value in asdict(self).items() if value not in (None, False, (0, 0))}
        return "-".join(f"{key}={value}" for key, value in given.items()).replace(" ", "")


def _length(rng: random.Random, longest: int) -> int:
    kind = rng.random()
    if kind < 0.1:
        return rng.choice((0, 1, 2))
    if kind < 0.35:
        return rng.choice(TILE_EDGES)
    return rng.randint(3, 300) if kind < 0.75 else rng.randint(300, longest)


def _draw(rng: random.Random) -> Draw:
    packed = rng.random() < 0.45
    head_dim = rng.choice(HEAD_DIMS)
    value_dim = head_dim if rng.random() < 0.75 else rng.choice(HEAD_DIMS)
    kv_heads, group = rng.choice((1, 2, 3)), rng.choice((1, 1, 2, 4, 8))
    group = max(group, 2 // kv_heads)  # two query heads at least: a sink's gradient sums many rows
    causal = rng.random() < 0.6
    longest = 600 if head_dim >= 192 else 1100
    if packed:
        sequences = rng.randint(1, 6)
        lengths_q = tuple(_length(rng, longest) for _ in range(sequences))
        lengths_k = lengths_q if rng.random() < 0.6 else tuple(_length(rng, longest) for _ in range(sequences))
    else:
        batch, seqlen_q = rng.randint(1, 3), _length(rng, longest)
        seqlen_k = seqlen_q if rng.random() < 0.5 else _length(rng, longest)
        lengths_q, lengths_k = (seqlen_q,) * batch, (seqlen_k,) * batch
    fields = {
        "packed": packed, "dtype": rng.choice(("bfloat16", "float16")), "head_dim": head_dim,
        "value_dim": value_dim, "kv_heads": kv_heads, "group": group, "causal": causal,
        "lengths_q": lengths_q, "lengths_k": lengths_k,
    }  # fmt: skip
    if rng.random() < 0.3:
        programmable = rng.choice(PACKED_FUNCTIONS if packed else DENSE_FUNCTIONS)
        return _function_draw(Draw(**fields, function=programmable))
    if rng.random() < 0.3:
        right = rng.choice((-1, 0)) if causal else rng.choice((-1, 0, 5, 129))
        fields["window"] = (rng.choice((-1, 0, 1, 17, 128, 300)), right)
    fields["softcap"] = rng.choice((None, None, None, 5.0, 30.0))
    fields["alibi"] = rng.choice((None, None, None, "heads", "rows"))
    fields["sinks"] = rng.choice((None, None, None, "learned", "fixed"))
    fields["lse_grad"] = rng.random() < 0.3
    fields["scaling"] = rng.choice((None, None, None, None, 0.05, 0.3, -0.1))
    fields["deterministic"] = rng.random() < 0.2
    if packed:
        fields["spare"] = (rng.choice((0, 0, 3)), rng.choice((0, 0, 5)))
        views_fit = group == 1 and lengths_q == lengths_k and head_dim == value_dim
        fields["strided"] = views_fit and rng.random() < 0.3
    else:
        fields["bias"] = rng.choice(
            (None, None, None, None, "full", "2d", "batch-rows", "full+grad", "batch-rows+grad")
        )
        fields["strided"] = rng.random() < 0.3
        fields["mode"] = rng.choice(("train", "train", "infer", "infer_lse"))
    return Draw(**fields)


def _function_draw(draw: Draw) -> Draw:
    """draw, with lengths the function's builder takes."""
    if draw.packed:
        return draw
    # The dense builders make q, k and v of one head dim.
    draw = Draw(**{**asdict(draw), "value_dim": draw.head_dim})
    batch, seqlen_q, seqlen_k = len(draw.lengths_q), draw.lengths_q[0], draw.lengths_k[0]
    if draw.function in SQUARE_FUNCTIONS:
        seqlen_q = seqlen_k = max(seqlen_q, 8)
    if draw.function in ("prefix_lm", "key_padding"):
        batch = min(batch, 2)  # their builders give two rows
    if draw.function == "key_padding":
        seqlen_k = max(seqlen_k, 14)
    return Draw(**{**asdict(draw), "lengths_q": (seqlen_q,) * batch, "lengths_k": (seqlen_k,) * batch})


DRAWN = [_draw(random.Random(SEED * 1000 + index)) for index in range(DRAWS)]


@contextlib.contextmanager
def _honest_half_precision_matmuls():
    """float16 matmuls of the yardstick with float32 sums throughout: with reduced-precision
    reductions cuBLAS may sum in float16 and overflow to NaN, a yardstick that bounds nothing."""
    before = torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = before


def _modifiers(draw: Draw, q_heads: int, rows: int) -> dict:
    """tile_fmha's keyword arguments for draw's modifiers; rows: batch rows or sequences."""
    kwargs = {}
    if draw.window is not None:
        kwargs["window_size"] = draw.window
    if draw.softcap:
        kwargs["softcap"] = draw.softcap
    if draw.alibi is not None:
        shape = (q_heads,) if draw.alibi == "heads" else (rows, q_heads)
        kwargs["alibi_slopes"] = varlen_tests._slopes(*shape)
    if draw.sinks is not None:
        kwargs["sinks"] = varlen_tests._sinks(q_heads).requires_grad_(draw.sinks == "learned")
    if draw.scaling is not None:
        kwargs["scaling"] = draw.scaling
    return kwargs


def _dense_inputs(draw: Draw, dtype) -> tuple:
    batch, seqlen_q, seqlen_k = len(draw.lengths_q), draw.lengths_q[0], draw.lengths_k[0]
    q_heads = draw.kv_heads * draw.group

    def make(length, heads, dim):
        if draw.strided:
            return torch.randn(batch, length, heads, dim, dtype=dtype, device="cuda").transpose(1, 2)
        return torch.randn(batch, heads, length, dim, dtype=dtype, device="cuda")

    return (make(seqlen_q, q_heads, draw.head_dim), make(seqlen_k, draw.kv_heads, draw.head_dim),
            make(seqlen_k, draw.kv_heads, draw.value_dim))  # fmt: skip


def _bias(draw: Draw, q_heads: int, dtype):
    """attn_bias of draw's shape, by test_attention_variants' builder."""
    form, _, grad = draw.bias.partition("+")
    case = Case("drawn", len(draw.lengths_q), q_heads, draw.kv_heads, draw.lengths_q[0], draw.lengths_k[0],
                draw.head_dim)  # fmt: skip
    return variants_tests._bias(form, case, dtype, bool(grad) and draw.mode == "train")


def _check_dense(draw: Draw, dtype):
    q, k, v = _dense_inputs(draw, dtype)
    kwargs = _modifiers(draw, q.shape[1], q.shape[0])
    if draw.bias is not None:
        kwargs["attn_bias"] = _bias(draw, q.shape[1], dtype)
    training = draw.mode == "train"
    d_out = torch.randn(*q.shape[:3], v.shape[-1], dtype=dtype, device="cuda")
    d_lse = torch.randn(q.shape[:3], device="cuda") if training and draw.lse_grad else None
    ref_out, ref_lse, ref_grads = reference_run(q, k, v, d_out, draw.causal, kwargs, torch.float64, d_lse)
    with _honest_half_precision_matmuls():
        base_out, _, base_grads = reference_run(q, k, v, d_out, draw.causal, kwargs, dtype, d_lse)
    learned = [name for name in ("attn_bias", "sinks") if name in kwargs and kwargs[name].requires_grad]
    learnable = [kwargs[name] for name in learned]
    varlen_tests.poison_cached_memory()
    if training:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = tile_fmha_with_backward(*leaves, is_causal=draw.causal, return_lse=True, **kwargs)
        varlen_tests.poison_cached_memory()
        outputs, upstream = ((out, lse), (d_out, d_lse)) if d_lse is not None else ((out,), (d_out,))
        grads = torch.autograd.grad(outputs, leaves + learnable, upstream)
        inputs = (q, k, v, *learnable)
        for name, ours, base, ref, given in zip(["dq", "dk", "dv"] + learned, grads, base_grads, ref_grads, inputs,
                                                strict=True):  # fmt: skip
            assert ours.shape == given.shape and ours.dtype == given.dtype, name
            assert_close_to_reference(name, ours, base.to(ours.dtype), ref, dtype)
    else:
        with torch.no_grad():
            if draw.mode == "infer":
                out, lse = tile_fmha(q, k, v, is_causal=draw.causal, **kwargs), None
            else:
                out, lse = fmha_forward_with_lse(q, k, v, is_causal=draw.causal, **kwargs)
    assert out.shape == ref_out.shape and out.dtype == dtype
    assert_close_to_reference("out", out, base_out, ref_out, dtype)
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
        varlen_tests.assert_lse_close(lse, ref_lse, dtype)


def _packed_batch(draw: Draw, dtype) -> varlen_tests.Packed:
    q_heads = draw.kv_heads * draw.group
    spare_q, spare_k = draw.spare
    if draw.strided:
        spare_k = spare_q  # one [total, 3, H, D] tensor
    batch = varlen_tests.pack(list(draw.lengths_q), list(draw.lengths_k), q_heads, draw.kv_heads, draw.head_dim,
                              dtype, value_dim=draw.value_dim, spare_q=spare_q, spare_k=spare_k)  # fmt: skip
    if draw.strided:
        qkv = torch.randn(batch.q.shape[0], 3, q_heads, draw.head_dim, dtype=dtype, device="cuda")
        batch = varlen_tests.dataclasses.replace(batch, q=qkv[:, 0], k=qkv[:, 1], v=qkv[:, 2])
    return batch


def _check_packed(draw: Draw, dtype):
    batch = _packed_batch(draw, dtype)
    kwargs = _modifiers(draw, batch.q.shape[1], batch.sequences)
    with _honest_half_precision_matmuls():
        varlen_tests.check(batch, draw.causal, kwargs, lse_grad=draw.lse_grad)


def _check_function(draw: Draw, dtype):
    q_heads = draw.kv_heads * draw.group
    if not draw.packed:
        case = Case("drawn", len(draw.lengths_q), q_heads, draw.kv_heads, draw.lengths_q[0], draw.lengths_k[0],
                    draw.head_dim)  # fmt: skip
        with _honest_half_precision_matmuls():
            programmable_tests.check_case(case, dtype, draw.causal, getattr(programmable_tests, f"_{draw.function}"))
        return
    batch = _packed_batch(draw, dtype)
    if draw.function in ("learned-relative", "learned-per-sequence"):
        if draw.function == "learned-relative":
            learnable, functions, meaning = varlen_tests._learned_relative(q_heads)
        else:
            learnable, functions, meaning = varlen_tests._learned_per_sequence(q_heads, batch.sequences)
        with _honest_half_precision_matmuls():
            varlen_tests.check(batch, draw.causal, lse_grad=True, functions=functions, per_sequence=meaning,
                               learnable=[learnable])  # fmt: skip
        return
    functions, builtins, per_sequence = varlen_tests.FUNCTIONS[draw.function](q_heads)
    with _honest_half_precision_matmuls():
        varlen_tests.check(batch, draw.causal, builtins, lse_grad=True, functions=functions, per_sequence=per_sequence)


@requires_cuda
@pytest.mark.parametrize("draw", DRAWN, ids=str)
def test_op_attention_drawn(draw: Draw):
    dtype = getattr(torch, draw.dtype)
    check = _check_function if draw.function else _check_packed if draw.packed else _check_dense
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    # warn_only: the references' cuBLAS matmuls would refuse to run without a workspace setting.
    torch.use_deterministic_algorithms(draw.deterministic, warn_only=True)
    try:
        check(draw, dtype)
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def test_op_attention_drawn_cover_the_arguments():
    """The draw reaches each argument and form at least once (a draw that lost one, by a change
    of seed or count, tests less than the docstring says)."""
    seen = {
        "packed": any(d.packed for d in DRAWN), "dense": any(not d.packed for d in DRAWN),
        "gqa": any(d.group > 1 for d in DRAWN), "value_dim": any(d.value_dim != d.head_dim for d in DRAWN),
        "empty": any(0 in d.lengths_q + d.lengths_k for d in DRAWN), "window": any(d.window for d in DRAWN),
        "softcap": any(d.softcap for d in DRAWN), "alibi": any(d.alibi for d in DRAWN),
        "learned sinks": any(d.sinks == "learned" for d in DRAWN), "bias": any(d.bias for d in DRAWN),
        "lse_grad": any(d.lse_grad for d in DRAWN), "strided": any(d.strided for d in DRAWN),
        "inference": any(d.mode != "train" for d in DRAWN), "function": any(d.function for d in DRAWN),
        "deterministic": any(d.deterministic for d in DRAWN),
    }  # fmt: skip
    assert all(seen.values()), [name for name, reached in seen.items() if not reached]
