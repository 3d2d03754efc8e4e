"""Packed variable-length attention (tile_fmha_varlen) on the GPU against the float64 reference
applied to one sequence at a time; every test skips without CUDA.

Each sequence of a packed batch must give exactly what the dense function gives on that
sequence alone, so varlen_reference runs attention_reference on each sequence's slice and packs
the results; rows outside every sequence are 0 (LSE -inf, gradients 0). The error yardstick
(attention_cases.assert_close_to_reference, over the whole packed tensors) is, as in the dense
tests, PyTorch SDPA on each sequence for plain calls, and the reference run in the inputs' dtype
where SDPA cannot follow (score modifiers, a gradient through the LSE).

The function allocates its own outputs, so the caching allocator's free memory is filled with
NaN bytes before each call (poison_cached_memory): an element the kernels never write is then
NaN and fails the comparison instead of passing on a stale value.
"""

import dataclasses
import itertools
import math
from dataclasses import dataclass

import cuda.tile as ct
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.ops.attention_cases import EPS, assert_close_to_reference, capture_training_step, max_error, ran_with
from tests.ops.conftest import requires_cuda
from tests.ops.test_attention_varlen_cpu import BAD_LENGTH_ARGUMENTS, valid_arguments
from tilegym import create_block_mask, tile_fmha_functional, tile_fmha_varlen
from tilegym.ops.attention import configs, dispatch
from tilegym.ops.attention import score_functions as sf
from tilegym.ops.attention.reference import attention_reference, causal_mask

pytestmark = requires_cuda

DEVICE = "cuda"
CHECK_VARLEN = "TILEGYM_CHECK_VARLEN"


# ---- helpers -----------------------------------------------------------------------------------


def cu_seqlens(lengths, device=DEVICE) -> torch.Tensor:
    """int32 cumulative lengths from 0, as flash_attn_varlen_func takes them."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


@dataclass(frozen=True)
class Packed:
    """A packed batch: q [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv] and the
    four length arguments of tile_fmha_varlen."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def lengths(self) -> tuple:
        """The arguments between v and scaling."""
        return self.cu_seqlens_q, self.cu_seqlens_k, self.max_seqlen_q, self.max_seqlen_k

    @property
    def sequences(self) -> int:
        return self.cu_seqlens_q.numel() - 1

    @property
    def stat_dtype(self) -> torch.dtype:
        return torch.float64 if self.q.dtype == torch.float64 else torch.float32


def pack(lengths_q, lengths_k=None, q_heads=3, kv_heads=3, head_dim=64, dtype=torch.bfloat16, *, value_dim=None,
         spare_q=0, spare_k=0) -> Packed:  # fmt: skip
    """Random inputs for sequences of the given lengths (lengths_k: as lengths_q when None),
    with spare_q query rows and spare_k key rows after the last sequence that belong to none.
    Tests build batches from length lists because the lengths are what each test is about."""
    lengths_k = lengths_q if lengths_k is None else lengths_k
    assert len(lengths_q) == len(lengths_k)
    total_q, total_k = sum(lengths_q) + spare_q, sum(lengths_k) + spare_k
    value_dim = head_dim if value_dim is None else value_dim

    def rows(total, heads, dim):
        return torch.randn(total, heads, dim, dtype=dtype, device=DEVICE)

    return Packed(
        rows(total_q, q_heads, head_dim), rows(total_k, kv_heads, head_dim), rows(total_k, kv_heads, value_dim),
        cu_seqlens(lengths_q), cu_seqlens(lengths_k), max(lengths_q, default=0), max(lengths_k, default=0),
    )  # fmt: skip


def _dense(rows: torch.Tensor) -> torch.Tensor:
    """[L, H, D] rows of one sequence as the dense path's [1, H, L, D]."""
    return rows.transpose(0, 1)[None]


def _grads(outputs, upstream, inputs) -> tuple:
    """torch.autograd.grad, with zeros for inputs no output depends on (a batch whose rows are all
    outside every sequence has none)."""
    pairs = [(o, u) for o, u in zip(outputs, upstream, strict=True) if o.requires_grad]
    if not pairs:
        return tuple(torch.zeros_like(t) for t in inputs)
    found = torch.autograd.grad([o for o, _ in pairs], inputs, [u for _, u in pairs], allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for t, g in zip(inputs, found, strict=True))


def varlen_reference(batch: Packed, d_out, causal: bool, kwargs: dict, compute_dtype, d_lse=None, per_sequence=None,
                     learnable=()):  # fmt: skip
    """(out [total_q, Hq, Dv], lse [Hq, total_q], grads) of attention_reference applied to each
    sequence alone, in compute_dtype; grads are dq, dk, dv, then dsinks when kwargs' sinks
    require grad. kwargs are tile_fmha_varlen's keyword arguments: an [N, Hq] alibi_slopes
    gives each sequence its row, sinks are shared by all (their gradient sums over sequences).
    Rows after the last sequence get out 0 and LSE -inf, hence no gradient. per_sequence:
    (sequence, query length, key length) -> more keyword arguments of attention_reference for that
    sequence (the meaning of a score function, as a bias); with learnable tensors (a score
    function's aux that takes a gradient), per_sequence also gets their copies in compute_dtype,
    whose gradients follow dq, dk, dv (and dsinks).

    The packed contract is "each sequence exactly as the dense call on its slice", so this is
    the reference by definition, and it is independent of how the kernels clamp and index."""
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (batch.q, batch.k, batch.v)]
    # Dropout's mask, which depends on the sequence, comes from per_sequence.
    ref_kwargs = {name: value for name, value in kwargs.items() if name != "dropout_p"}
    sinks = kwargs.get("sinks")
    if sinks is not None:
        ref_kwargs["sinks"] = sinks.detach().to(compute_dtype).requires_grad_(sinks.requires_grad)
        if sinks.requires_grad:
            leaves.append(ref_kwargs["sinks"])
    slopes = kwargs.get("alibi_slopes")
    q, k, v = leaves[:3]
    tables = [t.detach().to(compute_dtype).requires_grad_() for t in learnable]
    leaves += tables
    starts_q, starts_k = batch.cu_seqlens_q.tolist(), batch.cu_seqlens_k.tolist()
    outs, lses = [], []
    for s in range(batch.sequences):
        rows_q, rows_k = slice(starts_q[s], starts_q[s + 1]), slice(starts_k[s], starts_k[s + 1])
        if slopes is not None and slopes.dim() == 2:
            ref_kwargs["alibi_slopes"] = slopes[s]
        if per_sequence is not None:
            ref_kwargs |= per_sequence(s, rows_q.stop - rows_q.start, rows_k.stop - rows_k.start, *tables)
        out, lse = attention_reference(
            _dense(q[rows_q]), _dense(k[rows_k]), _dense(v[rows_k]), is_causal=causal, compute_dtype=compute_dtype,
            **ref_kwargs,
        )  # fmt: skip
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    spare = q.shape[0] - starts_q[-1]
    outs.append(q.new_zeros(spare, q.shape[1], v.shape[2]))
    lses.append(q.new_full((q.shape[1], spare), -math.inf))
    out, lse = torch.cat(outs), torch.cat(lses, dim=1)
    outputs, upstream = [out], [d_out.to(compute_dtype)]
    if d_lse is not None:
        outputs.append(lse)
        upstream.append(d_lse.to(compute_dtype))
    return out.detach(), lse.detach(), _grads(outputs, upstream, leaves)


def sdpa_baseline(batch: Packed, d_out, causal: bool, scaling=None):
    """(out, (dq, dk, dv)) of PyTorch SDPA in the inputs' dtype on each sequence: the error
    yardstick of plain calls, as test_attention._sdpa_baseline. SDPA has no bottom-right causal
    flag, so the mask is explicit; rows that see no key are given every key and then zeroed,
    sequences without keys give zeros. A backend that returns non-finite values (seen with
    negative scales) is replaced by MATH."""
    out, grads = _sdpa_run(batch, d_out, causal, scaling)
    if not all(t.isfinite().all() for t in (out, *grads)):
        with sdpa_kernel(SDPBackend.MATH):
            out, grads = _sdpa_run(batch, d_out, causal, scaling)
    return out, grads


def _sdpa_run(batch: Packed, d_out, causal: bool, scaling):
    q, k, v = leaves = [t.detach().requires_grad_() for t in (batch.q, batch.k, batch.v)]
    group = q.shape[1] // k.shape[1]
    starts_q, starts_k = batch.cu_seqlens_q.tolist(), batch.cu_seqlens_k.tolist()
    outs = []
    for s in range(batch.sequences):
        rows_q, rows_k = slice(starts_q[s], starts_q[s + 1]), slice(starts_k[s], starts_k[s + 1])
        seqlen_q, seqlen_k = rows_q.stop - rows_q.start, rows_k.stop - rows_k.start
        if seqlen_k == 0:
            outs.append(q.new_zeros(seqlen_q, q.shape[1], v.shape[2]))
            continue
        keys, values = (_dense(t[rows_k]).repeat_interleave(group, 1) for t in (k, v))
        mask = causal_mask(seqlen_q, seqlen_k, q.device) if causal else None
        sees_any = torch.ones(seqlen_q, 1, dtype=torch.bool, device=q.device)
        if mask is not None:
            sees_any = mask.any(-1, keepdim=True)
            mask = mask | ~sees_any
        out = F.scaled_dot_product_attention(_dense(q[rows_q]), keys, values, attn_mask=mask, scale=scaling)
        outs.append((out * sees_any)[0].transpose(0, 1))
    spare = q.shape[0] - starts_q[-1]
    outs.append(q.new_zeros(spare, q.shape[1], v.shape[2]))
    out = torch.cat(outs)
    return out.detach(), _grads([out], [d_out], leaves)


def yardstick(batch: Packed, d_out, causal: bool, kwargs: dict, d_lse=None, per_sequence=None, learnable=()):
    """(out, grads) whose errors against float64 bound ours: SDPA for plain calls, else the
    reference in the inputs' dtype."""
    if set(kwargs) <= {"scaling"} and d_lse is None and per_sequence is None:
        return sdpa_baseline(batch, d_out, causal, kwargs.get("scaling"))
    out, _, grads = varlen_reference(batch, d_out, causal, kwargs, batch.q.dtype, d_lse, per_sequence, learnable)
    return out, grads


def poison_cached_memory():
    """Fill the caching allocator's free memory with 0xFF bytes (NaN in every float dtype).

    The function under test allocates its outputs and gradients itself, so they cannot be
    pre-filled; emptying the cache and handing it back blocks of NaN makes the next allocations,
    large (split from the big block) and small (from the 2 MiB segments of 1 MiB blocks), start
    as NaN, and an element no kernel writes fails instead of passing on a stale value."""
    torch.cuda.empty_cache()
    small = [torch.full((1 << 20,), 255, dtype=torch.uint8, device=DEVICE) for _ in range(32)]
    large = torch.full((256 << 20,), 255, dtype=torch.uint8, device=DEVICE)
    del small, large


def run_varlen(batch: Packed, d_out, causal: bool, kwargs: dict, d_lse=None, functions=None, learnable=()):
    """(out, lse, grads) of tile_fmha_varlen as varlen_reference's, each allocated from poisoned
    memory. With d_lse, one call with return_lse=True and gradients through both outputs;
    without, the common call (return_lse=False) for out and gradients, and the LSE from a
    second call without autograd. functions: score function arguments (score_mod, ...), which
    take tile_fmha_functional's packed form instead; learnable: their aux tensors that take a
    gradient, after dq, dk, dv (and dsinks)."""
    leaves = [t.detach().requires_grad_() for t in (batch.q, batch.k, batch.v)]
    sinks = kwargs.get("sinks")
    inputs = leaves + ([sinks] if sinks is not None and sinks.requires_grad else []) + list(learnable)

    def attention(*tensors, **more):
        if functions is None:
            return tile_fmha_varlen(*tensors, *batch.lengths, is_causal=causal, **kwargs, **more)
        cu_q, cu_k, max_q, max_k = batch.lengths
        return tile_fmha_functional(
            *tensors, is_causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
            **kwargs, **functions, **more,
        )  # fmt: skip

    poison_cached_memory()
    if d_lse is None:
        out = attention(*leaves)
        assert isinstance(out, torch.Tensor), "return_lse=False returns the output alone"
        poison_cached_memory()
        grads = torch.autograd.grad(out, inputs, d_out)
        poison_cached_memory()
        with torch.no_grad():
            _, lse = attention(*leaves, return_lse=True)
    else:
        out, lse = attention(*leaves, return_lse=True)
        poison_cached_memory()
        grads = torch.autograd.grad((out, lse), inputs, (d_out, d_lse))
    return out.detach(), lse.detach(), grads


def assert_lse_close(lse, ref_lse, dtype):
    """-inf exactly where the reference's is, never NaN, and close elsewhere (absolute, as the
    dense tests)."""
    assert not lse.isnan().any(), "lse has NaN"
    sees_none = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), sees_none), "lse must be -inf exactly where the reference's is"
    assert bool((lse[sees_none] == -math.inf).all())
    seen = ~sees_none
    if seen.any():
        tolerance = (1e-5 if dtype != torch.float64 else 1e-12) * (1 + ref_lse[seen].abs().max().item())
        assert max_error(lse[seen], ref_lse[seen]) <= tolerance


def assert_rows_outside_sequences_are_empty(batch: Packed, out, lse, grads):
    """Query rows after cu_seqlens_q[-1]: out 0, LSE -inf, dq 0; key rows after cu_seqlens_k[-1]:
    dk = dv = 0. Exactly, not within a tolerance."""
    end_q, end_k = int(batch.cu_seqlens_q[-1]), int(batch.cu_seqlens_k[-1])
    dq, dk, dv = grads[:3]
    assert torch.equal(out[end_q:], torch.zeros_like(out[end_q:])), "out of rows outside every sequence"
    assert bool((lse[:, end_q:] == -math.inf).all()), "lse of rows outside every sequence"
    assert torch.equal(dq[end_q:], torch.zeros_like(dq[end_q:])), "dq of rows outside every sequence"
    for name, grad in (("dk", dk), ("dv", dv)):
        assert torch.equal(grad[end_k:], torch.zeros_like(grad[end_k:])), f"{name} of rows outside every sequence"


def check(batch: Packed, causal: bool, kwargs: dict | None = None, lse_grad: bool = False, functions=None,
          per_sequence=None, learnable=()):  # fmt: skip
    """tile_fmha_varlen's output, LSE and every gradient (dq, dk, dv, dsinks when sinks require
    grad, then the learnable aux tensors') against the per-sequence float64 reference, within the
    yardstick's error; d_lse flows into the LSE when lse_grad. functions: score function
    arguments, whose meaning the reference takes from per_sequence (see varlen_reference)."""
    kwargs = dict(kwargs or {})
    dtype = batch.q.dtype
    total_q, q_heads = batch.q.shape[:2]
    d_out = torch.randn(total_q, q_heads, batch.v.shape[2], dtype=dtype, device=DEVICE)
    d_lse = torch.randn(q_heads, total_q, dtype=batch.stat_dtype, device=DEVICE) if lse_grad else None
    ref_out, ref_lse, ref_grads = varlen_reference(
        batch, d_out, causal, kwargs, torch.float64, d_lse, per_sequence, learnable
    )  # fmt: skip
    base_out, base_grads = yardstick(batch, d_out, causal, kwargs, d_lse, per_sequence, learnable)
    out, lse, grads = run_varlen(batch, d_out, causal, kwargs, d_lse, functions, learnable)

    assert (out.shape, out.dtype) == ((total_q, q_heads, batch.v.shape[2]), dtype)
    assert (lse.shape, lse.dtype) == ((q_heads, total_q), batch.stat_dtype)
    assert_close_to_reference("out", out, base_out, ref_out, dtype)
    assert_lse_close(lse, ref_lse, dtype)
    if kwargs.get("sinks") is None:
        sees_none = torch.isinf(ref_lse)  # [Hq, total_q]
        no_key_rows = out.transpose(0, 1)[sees_none]
        assert torch.equal(no_key_rows, torch.zeros_like(no_key_rows)), "rows that see no key output zeros"
    sinks_grad = kwargs.get("sinks") is not None and kwargs["sinks"].requires_grad
    if sinks_grad:
        assert grads[3].dtype == kwargs["sinks"].dtype, "dsinks comes back in the sinks' dtype"
        # Rounded to that dtype (float32 sinks of float64 inputs), as the yardstick is too.
        base_grads = (*base_grads[:3], base_grads[3].to(grads[3].dtype), *base_grads[4:])
    names = ("dq", "dk", "dv", "dsinks")[: 4 if sinks_grad else 3] + tuple(f"d_aux{i}" for i in range(len(learnable)))
    assert len(grads) == len(names)
    for name, ours, base, ref in zip(names, grads, base_grads, ref_grads, strict=True):
        assert ours.shape == ref.shape, name
        assert_close_to_reference(name, ours, base, ref, dtype)
    assert_rows_outside_sequences_are_empty(batch, out, lse, grads)


def _sinks(q_heads, dtype=torch.float32):
    # Around the scores' own range, so that the sink takes a real share of each row.
    return (torch.randn(q_heads, device=DEVICE, dtype=dtype) * 2).requires_grad_()


def _slopes(*shape):
    return torch.rand(*shape, device=DEVICE) * 0.1 + 0.01


# ---- lengths -----------------------------------------------------------------------------------

# name: (query lengths, key lengths or None for the same).
LENGTHS = {
    "zero-first": ([0, 37, 64], None),
    "zero-middle": ([50, 0, 77], None),
    "zero-last": ([33, 91, 0], None),
    "ones": ([1, 1, 1, 1, 1], None),
    "odd-and-primes": ([7, 131, 251, 3, 97, 1], None),
    "around-tiles": ([63, 64, 65, 127, 128, 129, 257], None),
    "one-long-among-short": ([17] * 10 + [3000] + [17] * 10, None),
    "single": ([300], None),
    # Lq != Lk in each sequence; causal: the first Lq - Lk queries of 100/30 and 64/0 see no key.
    "sq-ne-sk": ([40, 100, 7, 0, 64, 13, 1], [90, 30, 7, 12, 0, 200, 50]),
    "sq-gt-sk": ([70, 33, 129, 5], [3, 1, 64, 5]),
    "sq-lt-sk": ([1, 20, 3, 64], [300, 57, 129, 65]),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(LENGTHS))
def test_op_varlen_lengths(name, dtype, causal):
    lengths_q, lengths_k = LENGTHS[name]
    check(pack(lengths_q, lengths_k, dtype=dtype), causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", ["zero-middle", "sq-ne-sk", "one-long-among-short"])
def test_op_varlen_rows_outside_every_sequence(name, causal):
    """cu_seqlens_q[-1] < total_q and cu_seqlens_k[-1] < total_k: the spare rows are left out
    (out 0, LSE -inf, gradients 0) and change nothing for the sequences."""
    lengths_q, lengths_k = LENGTHS[name]
    check(pack(lengths_q, lengths_k, 4, 2, spare_q=37, spare_k=130), causal, lse_grad=True)


@pytest.mark.parametrize(
    ("cu", "totals"),
    [([0], (0, 0)), ([0], (5, 3)), ([0, 0, 0], (5, 3)), ([0, 0, 0], (0, 0))],
    ids=["no-sequence-no-rows", "no-sequence", "empty-sequences", "empty-sequences-no-rows"],
)
def test_op_varlen_without_any_visible_row(cu, totals):
    """No sequence, or only empty ones: out 0, LSE -inf and zero gradients, for any total."""
    total_q, total_k = totals
    q = torch.randn(total_q, 4, 64, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(total_k, 2, 64, dtype=torch.bfloat16, device=DEVICE, requires_grad=True) for _ in range(2))
    cu_q, cu_k = (torch.tensor(cu, dtype=torch.int32, device=DEVICE) for _ in range(2))
    poison_cached_memory()
    out, lse = tile_fmha_varlen(q, k, v, cu_q, cu_k, 0, 0, return_lse=True)
    assert out.shape == (total_q, 4, 64) and lse.shape == (4, total_q)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == -math.inf).all())
    poison_cached_memory()
    grads = torch.autograd.grad((out, lse), (q, k, v), (torch.randn_like(out), torch.randn_like(lse)))
    assert all(torch.equal(g, torch.zeros_like(t)) for g, t in zip(grads, (q, k, v), strict=True))


def test_op_varlen_max_seqlen_is_an_upper_bound():
    """max_seqlen_q/k larger than every sequence (as a CUDA graph with fixed sizes gives them)."""
    batch = pack(*LENGTHS["sq-ne-sk"], 4, 2)
    check(dataclasses.replace(batch, max_seqlen_q=1000, max_seqlen_k=5000), True, lse_grad=True)


def test_op_varlen_max_seqlen_as_0d_tensors():
    """0-d integer tensors (GPU int32 and CPU int64) for max_seqlen_q/k give the ints' results."""
    batch = pack([30, 0, 77], [40, 9, 77], 4, 2)
    expected = tile_fmha_varlen(batch.q, batch.k, batch.v, *batch.lengths, return_lse=True)
    for make in (lambda n: torch.tensor(n, dtype=torch.int32, device=DEVICE), lambda n: torch.tensor(n)):
        lengths = (*batch.lengths[:2], make(batch.max_seqlen_q), make(batch.max_seqlen_k))
        got = tile_fmha_varlen(batch.q, batch.k, batch.v, *lengths, return_lse=True)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


# ---- head dims, dtypes, heads ------------------------------------------------------------------

MIXED_Q, MIXED_K = [0, 45, 1, 130, 77], [20, 45, 1, 100, 150]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 192, 256])
def test_op_varlen_head_dims(head_dim, causal):
    check(pack(MIXED_Q, MIXED_K, 4, 2, head_dim), causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_op_varlen_dtypes(dtype, causal):
    """Every dtype, with the LSE's gradient (fp64: the LSE is fp64 too)."""
    check(pack([3, 0, 45, 61, 1], [7, 5, 45, 30, 0], 4, 2, 64, dtype), causal, lse_grad=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "head_dim"), [(8, 2, 64), (4, 1, 128), (6, 1, 64)], ids=["gqa-4to1", "mqa-d128", "mqa"]
)
def test_op_varlen_grouped_heads(q_heads, kv_heads, head_dim, causal):
    check(pack(MIXED_Q, MIXED_K, q_heads, kv_heads, head_dim), causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("pair", [(192, 128), (64, 128), (128, 64), (256, 128)], ids=lambda p: f"qk{p[0]}-v{p[1]}")
def test_op_varlen_value_dim(pair, causal):
    """V's head dim different from Q's and K's (DeepSeek MLA: 192 and 128; (256, 128) sums dV and
    dK apart)."""
    check(pack(MIXED_Q, MIXED_K, 4, 2, pair[0], value_dim=pair[1]), causal)


# ---- score modifiers and the LSE ---------------------------------------------------------------

# name: (causal, keyword arguments given the number of query heads and of sequences).
MODIFIERS = {
    "scaling": (False, lambda h, n: {"scaling": 0.3}),
    "negative-scaling": (True, lambda h, n: {"scaling": -0.2}),
    "window-causal": (True, lambda h, n: {"window_size": (32, 0)}),
    "window-both-sides": (False, lambda h, n: {"window_size": (20, 9)}),
    "softcap": (True, lambda h, n: {"softcap": 5.0}),
    # bf16 and a cap under dispatch.BOUNDED_SOFTCAP_MAX: the cap is the forward's fixed max.
    "softcap-full-sinks": (False, lambda h, n: {"softcap": 30.0, "sinks": _sinks(h)}),
    "alibi-per-head": (True, lambda h, n: {"alibi_slopes": _slopes(h)}),
    "alibi-per-sequence": (False, lambda h, n: {"alibi_slopes": _slopes(n, h)}),
    "sinks": (True, lambda h, n: {"sinks": _sinks(h)}),
    "sinks-full": (False, lambda h, n: {"sinks": _sinks(h)}),
    "sinks-bf16": (True, lambda h, n: {"sinks": _sinks(h, torch.bfloat16)}),
    "everything": (False, lambda h, n: {"window_size": (40, 9), "softcap": 4.0, "alibi_slopes": _slopes(n, h),
                                        "sinks": _sinks(h)}),
    "everything-causal": (True, lambda h, n: {"window_size": (24, 0), "softcap": 30.0, "alibi_slopes": _slopes(h),
                                              "sinks": _sinks(h)}),
}  # fmt: skip


@pytest.mark.parametrize("lse_grad", [False, True], ids=["out-grad", "out-and-lse-grad"])
@pytest.mark.parametrize("name", list(MODIFIERS))
def test_op_varlen_modifiers(name, lse_grad):
    """Each modifier per sequence, over sequences with Lq != Lk (and, causal, rows that see no
    key): window sides and ALiBi distances measured from each sequence's own bottom-right."""
    causal, build = MODIFIERS[name]
    batch = pack(MIXED_Q + [90, 3], MIXED_K + [40, 0], 4, 2)
    check(batch, causal, build(4, batch.sequences), lse_grad)


_STEEP_SLOPES = (0.5, 0.25, 2**-4, 2**-8)


# ALiBi per sequence at D=64 on each running-max forward candidate (four 64x64 CTAs per SM or one
# 128x128 CTA), Lq != Lk, empty sequences, rows that see no key (causal).
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "config",
    configs.candidates(configs.FORWARD_LSE, "sm_90", 64, 2, configs.ScoreTables.ALIBI),
    ids=lambda config: f"{config.block_m}x{config.block_n}-occ{config.occupancy or 1}",
)
def test_op_varlen_alibi_forward_d64_configs(config, causal, force_config):
    batch = pack(MIXED_Q + [90, 3], MIXED_K + [40, 0], 4, 2, 64)
    force_config(configs.FORWARD_LSE, config)
    slopes = torch.tensor(_STEEP_SLOPES, device=DEVICE).repeat(batch.sequences, 1)
    check(batch, causal, {"alibi_slopes": slopes}, lse_grad=True)
    assert ran_with(configs.FORWARD_LSE, config)


# A sequence long enough for the fixed-max forward (D=128: from 2048 keys per query on average)
# among short ones, Lq != Lk in it; ALiBi's fixed max comes from the key tiles on each
# sequence's diagonal (masked when causal).
FIXED_MAX_PACKED = {
    "plain": lambda n: {},
    "alibi-per-head": lambda n: {"alibi_slopes": torch.tensor(_STEEP_SLOPES, device=DEVICE)},
    "alibi-per-sequence-sinks": lambda n: {
        "alibi_slopes": torch.tensor(_STEEP_SLOPES, device=DEVICE).repeat(n, 1),
        "sinks": _sinks(4),
    },
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(FIXED_MAX_PACKED))
def test_op_varlen_fixed_max_forward(name, causal, force_config):
    batch = pack([4300, 40, 0, 700], [4400, 33, 9, 700], 4, 2, 128)
    kwargs = FIXED_MAX_PACKED[name](batch.sequences)
    tables = configs.ScoreTables.ALIBI if "alibi_slopes" in kwargs else configs.ScoreTables.PLAIN
    config = configs.candidates(configs.FORWARD_LSE_FIXED_MAX, "sm_90", 128, 2, tables)[0]
    force_config(configs.FORWARD_LSE_FIXED_MAX, config)
    check(batch, causal, kwargs)
    assert ran_with(configs.FORWARD_LSE_FIXED_MAX, config)


def _fixed_max_packed_every_config():
    """(head dim, tables, config, causal) for every fixed-max candidate the tuner may pick for a
    packed batch: plain attention's (at D=64 from 4096 keys per query, so without a mask on this
    batch) and softcap's (any length)."""
    for tables in (configs.ScoreTables.PLAIN, configs.ScoreTables.SOFTCAP):
        for head_dim in (64, 128):
            for config in configs.candidates(configs.FORWARD_LSE_FIXED_MAX, "sm_90", head_dim, 2, tables):
                for causal in (False, True):
                    if not (causal and tables == configs.ScoreTables.PLAIN and head_dim == 64):
                        tiles = f"{config.block_m}x{config.block_n}"
                        name = f"d{head_dim}-{tables.value}-{tiles}-{'causal' if causal else 'full'}"
                        yield pytest.param(head_dim, tables, config, causal, id=name)


@pytest.mark.parametrize(("head_dim", "tables", "config", "causal"), list(_fixed_max_packed_every_config()))
def test_op_varlen_fixed_max_forward_every_config(head_dim, tables, config, causal, force_config):
    batch = pack([4300, 40, 0, 700], [4400, 33, 9, 700], 4, 2, head_dim)
    kwargs = {"softcap": 20.0} if tables == configs.ScoreTables.SOFTCAP else {}
    force_config(configs.FORWARD_LSE_FIXED_MAX, config)
    check(batch, causal, kwargs)
    assert ran_with(configs.FORWARD_LSE_FIXED_MAX, config)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_op_varlen_sinks_head_dims(head_dim):
    batch = pack(MIXED_Q, MIXED_K, 4, 2, head_dim)
    check(batch, True, {"sinks": _sinks(4), "window_size": (64, 0)}, lse_grad=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=str)
def test_op_varlen_sinks_dtypes(dtype):
    check(pack([3, 0, 45, 61], [7, 5, 45, 30], 4, 2, 64, dtype), True, {"sinks": _sinks(4)}, lse_grad=True)


def test_op_varlen_lse_alone_carries_the_gradient():
    """A loss of the LSE alone: the LSE's gradient reaches q and k, and v's gradient is zero."""
    batch = pack([7, 0, 12, 5], [9, 4, 12, 0], 2, 2, 32, torch.float64)
    q, k, v = (t.detach().requires_grad_() for t in (batch.q, batch.k, batch.v))
    _, lse = tile_fmha_varlen(q, k, v, *batch.lengths, return_lse=True)
    d_lse = torch.randn_like(lse)
    lse.backward(d_lse)
    d_out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=DEVICE)
    _, _, (ref_dq, ref_dk, _) = varlen_reference(batch, d_out, True, {}, torch.float64, d_lse)
    assert v.grad is None or torch.equal(v.grad, torch.zeros_like(v))
    assert max_error(q.grad, ref_dq) < 1e-10 and max_error(k.grad, ref_dk) < 1e-10


@pytest.mark.parametrize("with_sinks", [False, True], ids=["out", "out-lse-and-sinks"])
def test_op_varlen_gradcheck_fp64(with_sinks):
    """Finite differences on a tiny batch with an empty sequence and rows that see no key; with
    sinks, the LSE too (finite everywhere: a row without keys has the sink's LSE)."""
    batch = pack([3, 0, 5, 2], [4, 2, 5, 0], 2, 1, 32, torch.float64)
    inputs = [t.detach().requires_grad_() for t in (batch.q, batch.k, batch.v)]
    if with_sinks:
        inputs.append(_sinks(2, torch.float64))

    def attention(q, k, v, sinks=None):
        return tile_fmha_varlen(q, k, v, *batch.lengths, window_size=(3, 0), sinks=sinks, return_lse=with_sinks)

    assert torch.autograd.gradcheck(attention, tuple(inputs))


# ---- layouts and entry points ------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_op_varlen_packed_qkv_view(causal):
    """q, k, v as strided views of one [total, 3, H, D] tensor (qkv.unbind(1), no copy):
    gradients flow into qkv.grad, each third where it belongs."""
    lengths = [45, 0, 130, 1, 77]
    qkv = torch.randn(sum(lengths), 3, 4, 64, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    q, k, v = qkv.unbind(1)
    batch = Packed(q, k, v, cu_seqlens(lengths), cu_seqlens(lengths), max(lengths), max(lengths))
    d_out = torch.randn_like(q)
    ref_out, _, ref_grads = varlen_reference(batch, d_out, causal, {}, torch.float64)
    base_out, base_grads = yardstick(batch, d_out, causal, {})
    poison_cached_memory()
    out = tile_fmha_varlen(q, k, v, *batch.lengths, is_causal=causal)
    poison_cached_memory()
    out.backward(d_out)
    assert_close_to_reference("out", out, base_out, ref_out, torch.bfloat16)
    stacked = (torch.stack(grads, dim=1) for grads in (base_grads, ref_grads))
    assert_close_to_reference("qkv.grad", qkv.grad, *stacked, torch.bfloat16)


def test_op_varlen_functional():
    """tile_fmha_functional with cu_seqlens_q: the packed layout. training=True is
    tile_fmha_varlen; training=False (and None without a gradient wanted) the same values
    without autograd."""
    batch = pack(MIXED_Q, MIXED_K, 4, 2)
    q, k, v = (t.detach().requires_grad_() for t in (batch.q, batch.k, batch.v))
    packed = dict(zip(("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"), batch.lengths, strict=True))
    sinks = _sinks(4)
    kwargs = {"window_size": (50, 0), "sinks": sinks, **packed}
    d_out = torch.randn(q.shape[0], 4, v.shape[2], dtype=q.dtype, device=DEVICE)
    ref_out, ref_lse, _ = varlen_reference(batch, d_out, True, {"window_size": (50, 0), "sinks": sinks}, torch.float64)
    base_out, _ = yardstick(batch, d_out, True, {"window_size": (50, 0), "sinks": sinks})

    varlen_out, varlen_lse = tile_fmha_varlen(q, k, v, *batch.lengths, window_size=(50, 0), sinks=sinks,
                                              return_lse=True)  # fmt: skip
    out, lse = tile_fmha_functional(q, k, v, None, True, True, return_lse=True, **kwargs)
    assert out.grad_fn is not None and lse.grad_fn is not None
    assert torch.equal(out, varlen_out) and torch.equal(lse, varlen_lse)
    grads = torch.autograd.grad(out, (q, k, v, sinks), d_out)
    varlen_grads = torch.autograd.grad(varlen_out, (q, k, v, sinks), d_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, varlen_grads, strict=True))

    out = tile_fmha_functional(q, k, v, None, True, None, **kwargs)
    assert out.grad_fn is not None, "training=None with a gradient wanted trains"
    out, lse = tile_fmha_functional(q, k, v, None, True, False, return_lse=True, **kwargs)
    assert out.grad_fn is None and lse.grad_fn is None
    with torch.no_grad():
        assert tile_fmha_functional(q, k, v, None, True, None, **kwargs).grad_fn is None
    assert_close_to_reference("out (inference)", out, base_out, ref_out, torch.bfloat16)
    assert_lse_close(lse, ref_lse, torch.bfloat16)


# ---- torch.compile and CUDA graphs -------------------------------------------------------------

GRAPH_Q, GRAPH_K = [30, 0, 77, 5, 130], [40, 9, 77, 0, 130]


def _assert_like_eager(name, got, eager, reference, dtype):
    """As the dense graph tests: the eager call's values, and an error against float64 at most a
    tenth above the eager call's."""
    assert not got.isnan().any(), f"{name} has NaN"
    torch.testing.assert_close(got, eager, msg=lambda m: f"{name} differs from the eager call: {m}")
    bound = 1.1 * max_error(eager, reference) + EPS[dtype]
    assert max_error(got, reference) <= bound, f"{name}: error against float64 above the eager call's"


@pytest.mark.parametrize("mods", ["plain", "window-alibi-sinks"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_op_varlen_under_torch_compile(causal, mods):
    """torch.compile(fullgraph=True) of a function calling tile_fmha_varlen: no graph break, and
    the forward's and backward's results are the eager call's."""
    torch._dynamo.reset()
    batch = pack(GRAPH_Q, GRAPH_K, 4, 2)
    kwargs = {} if mods == "plain" else {"window_size": (24, 0) if causal else (24, 7), "alibi_slopes": _slopes(4)}
    sinks = None if mods == "plain" else _sinks(4)

    def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks):
        return tile_fmha_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, batch.max_seqlen_q, batch.max_seqlen_k, is_causal=causal,
            sinks=sinks, return_lse=True, **kwargs,
        )  # fmt: skip

    d_out, d_lse = torch.randn_like(batch.q), torch.randn(4, batch.q.shape[0], device=DEVICE)

    def step(fn):
        leaves = [t.detach().requires_grad_() for t in (batch.q, batch.k, batch.v)]
        inputs = leaves + ([sinks] if sinks is not None else [])
        out, lse = fn(*leaves, batch.cu_seqlens_q, batch.cu_seqlens_k, sinks)
        return (out.detach(), lse.detach(), *torch.autograd.grad((out, lse), inputs, (d_out, d_lse)))

    compiled = step(torch.compile(attention, fullgraph=True))
    eager = step(attention)
    ref_out, ref_lse, ref_grads = varlen_reference(batch, d_out, causal, {**kwargs, "sinks": sinks}, torch.float64,
                                                   d_lse)  # fmt: skip
    names = ("out", "lse", "dq", "dk", "dv", "dsinks")[: len(compiled)]
    for name, got, want, ref in zip(names, compiled, eager, (ref_out, ref_lse, *ref_grads), strict=True):
        if name == "lse":
            torch.testing.assert_close(got, want)
            assert_lse_close(got, ref, torch.bfloat16)
        else:
            _assert_like_eager(name, got, want, ref, torch.bfloat16)


@pytest.mark.parametrize("name", ["relative-table", "per-sequence"])
def test_op_varlen_functions_under_torch_compile(name):
    """torch.compile(fullgraph=True) of a packed call with a score function whose aux tensor
    takes a gradient, and a mask function: no graph break; the results are the eager call's
    (the aux gradient to rounding: atomic adds)."""
    torch._dynamo.reset()
    batch = pack(GRAPH_Q, GRAPH_K, 4, 2)
    if name == "relative-table":
        learnable, functions, _ = _learned_relative(4)
    else:
        learnable, functions, _ = _learned_per_sequence(4, batch.sequences)
    functions = {**functions, **sf.sliding_window_with_globals(16, 3)}
    cu_q, cu_k, max_q, max_k = batch.lengths

    def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, functions):
        return tile_fmha_functional(
            q, k, v, is_causal=True, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_q,
            max_seqlen_k=max_k, return_lse=True, **functions,
        )  # fmt: skip

    d_out, d_lse = torch.randn_like(batch.q), torch.randn(4, batch.q.shape[0], device=DEVICE)

    def step(fn):
        leaves = [t.detach().requires_grad_() for t in (batch.q, batch.k, batch.v)]
        out, lse = fn(*leaves, cu_q, cu_k, functions)
        return (out.detach(), lse.detach(), *torch.autograd.grad((out, lse), [*leaves, learnable], (d_out, d_lse)))

    compiled, eager = step(torch.compile(attention, fullgraph=True)), step(attention)
    for label, got, want in zip(("out", "lse", "dq", "dk", "dv", "d_aux"), compiled, eager, strict=True):
        tolerance = {"atol": 1e-3, "rtol": 1e-3} if label == "d_aux" else {"atol": 0, "rtol": 0}
        torch.testing.assert_close(got, want, **tolerance, msg=lambda m, n=label: f"{n}: {m}")


def _capture_training_step(batch: Packed, causal: bool):
    """A training step (forward with the LSE, backward through both) captured in a CUDA graph,
    after two warm-up steps on a side stream (compiles and tunes outside the capture). Returns
    the graph, its static inputs (q, k, v, d_out, d_lse as leaves) and its outputs (out, lse)."""
    q, k, v = (t.detach().requires_grad_() for t in (batch.q, batch.k, batch.v))
    d_out = torch.randn_like(q)
    d_lse = torch.randn(q.shape[1], q.shape[0], device=DEVICE)

    def step():
        out, lse = tile_fmha_varlen(q, k, v, *batch.lengths, is_causal=causal, return_lse=True)
        torch.autograd.backward((out, lse), (d_out, d_lse))
        return out, lse

    graph, outputs = capture_training_step(step, (q, k, v))
    return graph, (q, k, v, d_out, d_lse), outputs


def _replay_and_check(graph, batch: Packed, static_inputs, outputs, causal):
    """Poison the graph's outputs and gradients, replay, and check them against the reference
    of the batch's current contents."""
    q, k, v, d_out, d_lse = static_inputs
    out, lse = outputs
    with torch.no_grad():
        for t in (out, lse, q.grad, k.grad, v.grad):
            t.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    current = dataclasses.replace(batch, q=q, k=k, v=v)
    ref_out, ref_lse, ref_grads = varlen_reference(current, d_out, causal, {}, torch.float64, d_lse)
    base_out, base_grads = yardstick(current, d_out, causal, {}, d_lse)
    grads = (q.grad, k.grad, v.grad)
    assert_close_to_reference("out", out, base_out, ref_out, torch.bfloat16)
    assert_lse_close(lse, ref_lse, torch.bfloat16)
    for name, ours, base, ref in zip(("dq", "dk", "dv"), grads, base_grads, ref_grads, strict=True):
        assert_close_to_reference(name, ours, base, ref, torch.bfloat16)
    assert_rows_outside_sequences_are_empty(current, out, lse, grads)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_op_varlen_training_step_in_a_cuda_graph(causal, monkeypatch):
    """Captured with max_seqlen as ints (no host sync), replayed on new input values and new
    output gradients: the reference's results on the new values."""
    monkeypatch.delenv(CHECK_VARLEN, raising=False)
    batch = pack(GRAPH_Q, GRAPH_K, 4, 2, spare_q=11, spare_k=6)
    graph, static_inputs, outputs = _capture_training_step(batch, causal)
    with torch.no_grad():
        for t in static_inputs:
            t.copy_(torch.randn_like(t))
    _replay_and_check(graph, batch, static_inputs, outputs, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_op_varlen_cuda_graph_replays_new_lengths(causal, monkeypatch):
    """The cumulative lengths are read on the GPU: new contents of the captured cu_seqlens
    tensors (same number of sequences, each within max_seqlen) are honoured on replay."""
    monkeypatch.delenv(CHECK_VARLEN, raising=False)
    batch = pack(GRAPH_Q, GRAPH_K, 4, 2)
    graph, static_inputs, outputs = _capture_training_step(batch, causal)
    new_q, new_k = [130, 60, 0, 40, 12], [0, 100, 130, 26, 0]
    assert sum(new_q) == sum(GRAPH_Q) and max(new_q) <= batch.max_seqlen_q
    assert sum(new_k) == sum(GRAPH_K) and max(new_k) <= batch.max_seqlen_k
    batch.cu_seqlens_q.copy_(cu_seqlens(new_q))
    batch.cu_seqlens_k.copy_(cu_seqlens(new_k))
    _replay_and_check(graph, batch, static_inputs, outputs, causal)


# ---- score functions ---------------------------------------------------------------------------

# A score function sees each sequence alone: b is the sequence, q_idx and kv_idx count from its
# first row. name: (our arguments, the built-in ones beside them, and what the function means per
# sequence as reference arguments: varlen_reference's per_sequence).
_REACH = 16


def _relative_bias(table, seqlen_q, seqlen_k):
    """What relative_position_bias means on one sequence, as attention_reference's arguments."""
    rows = torch.arange(seqlen_q, device=DEVICE)[:, None]
    buckets = (torch.arange(seqlen_k, device=DEVICE)[None, :] - rows).clamp(-_REACH, _REACH) + _REACH
    return {"attn_bias": table[:, buckets][None]}


def _relative(q_heads):
    table = torch.randn(q_heads, 2 * _REACH + 1, device=DEVICE) * 0.5  # frozen (learned: test_op_varlen_aux_gradient)
    return sf.relative_position_bias(table, _REACH), {}, lambda s, lq, lk: _relative_bias(table.double(), lq, lk)


FUNCTIONS = {
    # inlined: as a function (the ready-made softcap runs as softcap= otherwise, predefined.py)
    "softcap": lambda h: (sf.inlined(sf.softcap(4.0)), {}, lambda s, lq, lk: {"softcap": 4.0}),
    "relative-table": _relative,
    "softcap-sinks-window": lambda h: (
        sf.inlined(sf.softcap(3.0)),
        {"sinks": _sinks(h), "window_size": (32, 0)},
        lambda s, lq, lk: {"softcap": 3.0},
    ),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_op_varlen_score_functions(name, head_dim, causal):
    functions, builtins, per_sequence = FUNCTIONS[name](4)
    batch = pack(MIXED_Q + [90, 3], MIXED_K + [40, 0], 4, 2, head_dim, spare_q=5, spare_k=3)
    check(batch, causal, builtins, lse_grad=True, functions=functions, per_sequence=per_sequence)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", ["softcap", "relative-table"])
def test_op_varlen_score_function_fixed_max_forward(name, causal, force_config):
    """A score function alone keeps a fixed row max on a packed batch with one long sequence
    (Lq != Lk) among short and empty ones: causal from the diagonal's masked tiles, without a mask
    from the key tile on its rows' diagonal, each sequence's own."""
    functions, builtins, per_sequence = FUNCTIONS[name](4)
    batch = pack([4300, 40, 0, 700], [4400, 33, 9, 700], 4, 2, 128)
    config = configs.candidates(configs.FORWARD_LSE_FIXED_MAX, "sm_90", 128, 2, configs.ScoreTables.FUNCTIONS)[0]
    force_config(configs.FORWARD_LSE_FIXED_MAX, config)
    check(batch, causal, builtins, functions=functions, per_sequence=per_sequence)
    assert ran_with(configs.FORWARD_LSE_FIXED_MAX, config)


_D192_SOFTCAP_FUNCTION = frozenset({"capped", "windowed", "functions"})


@pytest.mark.parametrize(
    "config",
    [None, *configs.call_candidates(configs.BACKWARD_DQ, "sm_90", 192, 192, torch.float16, _D192_SOFTCAP_FUNCTION)],
    ids=lambda config: "tuned" if config is None else f"{config.block_m}x{config.block_n}-w{config.num_worker_warps}",
)  # fmt: skip
def test_op_varlen_float16_d192_softcap_beside_a_bias_function(config, force_config):
    """float16 at D=192 with softcap= beside a score function: the dQ config that computed wrong
    gradients there (configs.FAULTY_CONFIGS) is never tried; the tuned call (config None) and
    each config it may take, forced, are right. The batch: two sequences, Lq != Lk, a frozen
    float16 bias function, causal in a window."""
    q_heads, lengths_q, lengths_k = 2, [127, 256], [129, 76]
    batch = pack(lengths_q, lengths_k, q_heads, 1, 192, torch.float16, spare_q=3, spare_k=5)
    bias = torch.randn(batch.sequences, q_heads, max(lengths_q), max(lengths_k), device=DEVICE, dtype=torch.float16)

    def per_sequence(s, seqlen_q, seqlen_k):
        return {"score_mod": lambda scores, b, h, q_idx, kv_idx: scores + bias[s, h, q_idx, kv_idx].to(scores.dtype)}

    if config is not None:
        force_config(configs.BACKWARD_DQ, config)
    builtins = {"softcap": 5.0, "window_size": (300, -1)}
    check(batch, True, builtins, functions=sf.additive_bias(bias), per_sequence=per_sequence)
    assert config is None or ran_with(configs.BACKWARD_DQ, config)


def test_op_varlen_score_function_sees_the_sequence():
    """b is the sequence and positions count within it: a function of b and kv_idx alone, against
    its meaning as a per-sequence bias."""

    def by_sequence(score, b, h, q_idx, kv_idx, aux):
        return score + ct.astype(b * 8 - kv_idx, score.dtype) * 0.0625

    def by_sequence_grad(grad, score, out, b, h, q_idx, kv_idx, aux):
        return grad

    lengths = [40, 0, 77, 1, 64]
    batch = pack(lengths, None, 4, 2, 64)

    def bias(sequence, seqlen_q, seqlen_k):
        cols = torch.arange(seqlen_k, device=DEVICE, dtype=torch.float64)
        return {"attn_bias": ((sequence * 8 - cols) * 0.0625).expand(seqlen_q, seqlen_k)}

    functions = {"score_mod": by_sequence, "score_mod_grad": by_sequence_grad}
    check(batch, True, functions=functions, per_sequence=bias)


# Aux tensors that take a gradient: aux_grad runs in the dK/dV kernel, b the sequence. name:
# (q_heads -> (the learnable tensor, our arguments, what they mean on one sequence given the
# tensor's reference copy)).
def _learned_relative(q_heads, dtype=torch.float32):
    table = (torch.randn(q_heads, 2 * _REACH + 1, device=DEVICE, dtype=dtype) * 0.5).requires_grad_()
    return table, sf.relative_position_bias(table, _REACH), lambda s, lq, lk, ref: _relative_bias(ref, lq, lk)


def _sequence_head_bias(score, b, h, q_idx, kv_idx, aux):
    return score + ct.astype(ct.gather(aux[0], (b, h)), score.dtype)


def _sequence_head_bias_grad(grad, score, b, h, q_idx, kv_idx, aux, aux_grads):
    ct.atomic_add(aux_grads[0], (b, h), ct.sum(grad))


def _learned_per_sequence(q_heads, sequences):
    """A bias per (sequence, head): its gradient is the sum of each sequence's own pairs."""
    bias = torch.randn(sequences, q_heads, device=DEVICE).requires_grad_()
    functions = {"score_mod": _sequence_head_bias, "score_mod_grad": sf.additive_grad, "aux": (bias,),
                 "aux_grad": _sequence_head_bias_grad}  # fmt: skip

    def meaning(sequence, seqlen_q, seqlen_k, ref):
        return {"attn_bias": ref[sequence][None, :, None, None].expand(1, q_heads, seqlen_q, seqlen_k)}

    return bias, functions, meaning


def _learned_bias_per_sequence(q_heads, batch):
    """score_functions.additive_bias with a [sequences, Hq, max Lq, max Lk] bias: each sequence
    reads its own from its first row (run as a function: attn_bias takes no packed batch)."""
    shape = (batch.sequences, q_heads, batch.max_seqlen_q, batch.max_seqlen_k)
    bias = torch.randn(shape, device=DEVICE).requires_grad_()

    def meaning(sequence, seqlen_q, seqlen_k, ref):
        return {"attn_bias": ref[sequence, :, :seqlen_q, :seqlen_k][None]}

    return bias, sf.additive_bias(bias), meaning


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", ["relative-table", "per-sequence", "additive-bias"])
def test_op_varlen_aux_gradient(name, head_dim, causal):
    """Empty sequences, a single row, Lq != Lk, GQA, spare rows and one sequence long enough for
    tiles beyond the table's reach; the aux tensor's gradient against the per-sequence reference's."""
    batch = pack(MIXED_Q + [90, 3, 700], MIXED_K + [40, 0, 650], 4, 2, head_dim, spare_q=5, spare_k=3)
    if name == "relative-table":
        learnable, functions, meaning = _learned_relative(4)
    elif name == "additive-bias":
        learnable, functions, meaning = _learned_bias_per_sequence(4, batch)
    else:
        learnable, functions, meaning = _learned_per_sequence(4, batch.sequences)
    check(batch, causal, lse_grad=True, functions=functions, per_sequence=meaning, learnable=[learnable])


def test_op_varlen_aux_gradient_fp16_sinks():
    batch = pack(MIXED_Q, MIXED_K, 4, 4, 64, torch.float16, spare_q=2)
    learnable, functions, meaning = _learned_relative(4)
    check(batch, True, {"sinks": _sinks(4)}, lse_grad=True, functions=functions, per_sequence=meaning,
          learnable=[learnable])  # fmt: skip


def _sequence_head_bias_grad_repeatable(grad, score, b, h, q_idx, kv_idx, aux, aux_grads):
    sf.add_to_aux_grad(aux_grads, 0, (b, h), ct.sum(grad))


@pytest.mark.parametrize("name", ["relative-table", "per-sequence"])
def test_op_varlen_aux_gradient_repeatable_under_deterministic_algorithms(name):
    """Under torch.use_deterministic_algorithms(True), aux gradients added through add_to_aux_grad
    are bitwise repeatable on packed batches too (empty sequences, Lq != Lk, GQA, spare rows),
    and within the per-sequence reference's tolerance."""
    batch = pack(MIXED_Q + [90, 3, 700], MIXED_K + [40, 0, 650], 4, 2, 64, spare_q=5, spare_k=3)
    if name == "relative-table":
        learnable, functions, meaning = _learned_relative(4)
    else:
        learnable, functions, meaning = _learned_per_sequence(4, batch.sequences)
        functions = {**functions, "aux_grad": _sequence_head_bias_grad_repeatable}
    d_out = torch.randn(batch.q.shape[0], 4, batch.v.shape[2], dtype=batch.q.dtype, device=DEVICE)
    try:
        torch.use_deterministic_algorithms(True)
        runs = [run_varlen(batch, d_out, True, {}, functions=functions, learnable=[learnable]) for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(False)
    (_, _, first), (_, _, second) = runs
    for label, a, b in zip(("dq", "dk", "dv", "d_aux"), first, second, strict=True):
        assert torch.equal(a, b), f"{label} differs between two deterministic runs"
    _, _, ref_grads = varlen_reference(batch, d_out, True, {}, torch.float64, None, meaning, [learnable])
    _, base_grads = yardstick(batch, d_out, True, {}, None, meaning, [learnable])
    for label, ours, base, ref in zip(("dq", "dk", "dv", "d_aux0"), first, base_grads, ref_grads, strict=True):
        assert_close_to_reference(label, ours, base, ref, batch.q.dtype)


# Masks see each sequence alone too (b the sequence, positions within it): given as mask_mod,
# or as a block mask made with the call's cumulative lengths. name: (causal, builder of the mask
# arguments and of what they mean per sequence, a boolean [Lq, Lk] of visible pairs).
def _prefix_lm(sequences):
    prefix = torch.randint(0, 60, (sequences,), dtype=torch.int32, device=DEVICE)

    def visible(sequence, seqlen_q, seqlen_k):
        rows, cols = _grid(seqlen_q, seqlen_k)
        return (cols < prefix[sequence]) | (cols <= rows)

    return sf.prefix_lm(prefix), visible


def _window_globals(sequences):
    def visible(sequence, seqlen_q, seqlen_k):
        rows, cols = _grid(seqlen_q, seqlen_k)
        return (rows - cols < 16) | (cols < 3)

    return sf.sliding_window_with_globals(16, 3), visible


def _grid(seqlen_q, seqlen_k):
    return torch.arange(seqlen_q, device=DEVICE)[:, None], torch.arange(seqlen_k, device=DEVICE)[None, :]


MASKS = {"prefix-lm": (False, _prefix_lm), "window-globals-causal": (True, _window_globals)}


@pytest.mark.parametrize("form", ["mask_mod", "block_mask"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", list(MASKS))
def test_op_varlen_masks(name, head_dim, form):
    """Empty sequences, a single row, Lq != Lk, GQA and spare rows, against each sequence's
    reference with its hidden pairs at -inf; the block mask made once serves forward and
    backward."""
    causal, build = MASKS[name]
    batch = pack(MIXED_Q + [90, 3], MIXED_K + [40, 0], 4, 2, head_dim, spare_q=5, spare_k=3)
    mask, visible = build(batch.sequences)
    if form == "block_mask":
        cu_q, cu_k, max_q, max_k = batch.lengths
        made = create_block_mask(mask["mask_mod"], None, None, max_q, max_k, mask_aux=mask.get("mask_aux"),
                                 cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)  # fmt: skip
        mask = {"block_mask": made}

    def hidden(sequence, seqlen_q, seqlen_k):
        seen = visible(sequence, seqlen_q, seqlen_k)
        bias = torch.zeros(seen.shape, dtype=torch.float64, device=DEVICE).masked_fill(~seen, -math.inf)
        return {"attn_bias": bias}

    check(batch, causal, lse_grad=True, functions=mask, per_sequence=hidden)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", list(MASKS))
def test_op_varlen_aux_gradient_with_a_mask(name, dtype, deterministic):
    """A learned relative-position table beside a mask: the table's gradient sums only the pairs
    each sequence's mask shows. The prefix-LM mask hides whole key tiles from every query, whose
    programs return at once (their gradients zeros). Every dtype, the gradient summed by atomic
    adds or, under torch.use_deterministic_algorithms, in fixed point (float64 keeps atomic adds,
    with a warning). The compiler failed on this form's kernels in each of two nearby ways of
    reading the mask's two counts in the key tiles' check (perf-notes#mask-counts-loaded-apart)."""
    causal, build = MASKS[name]
    batch = pack(MIXED_Q + [90, 3], MIXED_K + [40, 0], 4, 2, 64, dtype, spare_q=5, spare_k=3)
    mask, visible = build(batch.sequences)
    # A float32 table's gradient is rounded to float32: float64 inputs get a float64 table.
    table, functions, relative = _learned_relative(4, torch.float64 if dtype == torch.float64 else torch.float32)

    def meaning(sequence, seqlen_q, seqlen_k, ref):
        seen = visible(sequence, seqlen_q, seqlen_k)
        bias = relative(sequence, seqlen_q, seqlen_k, ref)["attn_bias"]
        return {"attn_bias": bias.masked_fill(~seen, -math.inf)}

    try:
        # warn_only: the references' cuBLAS matmuls would refuse to run without a workspace setting.
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
        check(batch, causal, lse_grad=True, functions={**functions, **mask}, per_sequence=meaning, learnable=[table])
    finally:
        torch.use_deterministic_algorithms(False)


# ---- the fused backward ------------------------------------------------------------------------

# "auto" takes it from 2048 keys (dispatch.fused_backward); forced here on short batches. Each
# sequence adds its dQ shares into its own rows of one fp32 sum; rows of no sequence stay 0.
FUSED_LENGTHS = ["zero-first", "zero-middle", "around-tiles", "sq-ne-sk", "sq-gt-sk", "sq-lt-sk"]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(3, 3), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("name", FUSED_LENGTHS)
def test_op_varlen_fused_backward(name, q_heads, kv_heads, head_dim, causal, monkeypatch):
    """Causal GQA takes the grouped form (dK and dV summed too)."""
    monkeypatch.setenv("TILEGYM_BACKWARD", "fused")
    lengths_q, lengths_k = LENGTHS[name]
    batch = pack(lengths_q, lengths_k, q_heads, kv_heads, head_dim, spare_q=5, spare_k=3)
    check(batch, causal, lse_grad=True)


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_op_varlen_fused_backward_sinks_window(head_dim, monkeypatch):
    monkeypatch.setenv("TILEGYM_BACKWARD", "fused")
    batch = pack(MIXED_Q + [90, 3], MIXED_K + [40, 0], 4, 2, head_dim)
    check(batch, True, {"sinks": _sinks(4), "window_size": (32, 0)}, lse_grad=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_op_varlen_fused_backward_alibi(head_dim, causal, monkeypatch):
    """ALiBi per sequence and head, GQA; causal takes the grouped form. Sq != Sk per sequence."""
    monkeypatch.setenv("TILEGYM_BACKWARD", "fused")
    lengths_q, lengths_k = MIXED_Q + [90, 3], MIXED_K + [40, 0]
    batch = pack(lengths_q, lengths_k, 4, 2, head_dim)
    check(batch, causal, {"alibi_slopes": _slopes(len(lengths_q), 4)}, lse_grad=True)


@pytest.mark.parametrize(("head_dim", "causal"), [(128, True), (64, False)], ids=["d128-causal", "d64-full"])
def test_op_varlen_fused_backward_chosen_for_long_sequences(head_dim, causal, force_config):
    """A sequence past FUSED_BACKWARD_MIN_SEQLEN_K keys among short ones: "auto" picks the fused
    backward for the whole batch (at D=64 only without a causal mask; causal query groups take
    its grouped form)."""
    fused = configs.BACKWARD_FUSED_GROUPED if causal else configs.BACKWARD_FUSED
    config = configs.candidates(fused, "sm_90", head_dim, 2)[0]
    force_config(fused, config)
    long = dispatch.FUSED_BACKWARD_MIN_SEQLEN_K + 37
    check(pack([long, 17, 0, 301], [long, 17, 5, 301], 4, 2, head_dim), causal, lse_grad=True)
    assert ran_with(fused, config)


# ---- determinism -------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_op_varlen_backward_is_deterministic(causal):
    """Two backward runs give bitwise-equal dq, dk, dv and dsinks (GQA 4:1, so each K/V head
    sums the gradients of four query heads): below FUSED_BACKWARD_MIN_SEQLEN_K keys "auto" runs
    the two-kernel backward; see the next test for longer ones."""
    batch = pack([17] * 6 + [700, 0, 301], [17] * 6 + [650, 40, 301], 8, 2, 128)
    q, k, v = (t.detach().requires_grad_() for t in (batch.q, batch.k, batch.v))
    sinks = _sinks(8)
    d_out = torch.randn_like(q)
    first, second = (
        torch.autograd.grad(
            tile_fmha_varlen(q, k, v, *batch.lengths, is_causal=causal, sinks=sinks), (q, k, v, sinks), d_out
        )
        for _ in range(2)
    )
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), first, second, strict=True):
        assert torch.equal(a, b), f"{name} differs between two runs"


def test_op_varlen_long_backward_is_deterministic_on_request():
    """From FUSED_BACKWARD_MIN_SEQLEN_K keys "auto" sums dQ in fp32 by reductions whose order
    varies; torch.use_deterministic_algorithms brings back the bitwise-repeatable backward."""
    long = dispatch.FUSED_BACKWARD_MIN_SEQLEN_K + 37
    batch = pack([long, 301, 17], None, 4, 2, 128)
    q, k, v = (t.detach().requires_grad_() for t in (batch.q, batch.k, batch.v))
    d_out = torch.randn_like(q)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        first, second = (
            torch.autograd.grad(tile_fmha_varlen(q, k, v, *batch.lengths, is_causal=True), (q, k, v), d_out)
            for _ in range(2)
        )
    finally:
        torch.use_deterministic_algorithms(False)
    for name, a, b in zip(("dq", "dk", "dv"), first, second, strict=True):
        assert torch.equal(a, b), f"{name} differs between two runs"


# ---- bad arguments and bad contents ------------------------------------------------------------


def _usable_afterwards():
    """A normal call after a rejected or inconsistent one: the CUDA context still works and the
    results are right."""
    check(pack([30, 0, 77], [40, 9, 77], 4, 2), True, lse_grad=True)


@pytest.mark.parametrize(("change", "error", "match"), BAD_LENGTH_ARGUMENTS)
def test_op_varlen_rejects_bad_lengths_arguments(change, error, match):
    """test_attention_varlen_cpu.py's checks on real GPU tensors."""
    arguments = valid_arguments(DEVICE)
    arguments.update(change(DEVICE))
    with pytest.raises(error, match=match):
        tile_fmha_varlen(**arguments)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda: {"max_seqlen_q": torch.tensor(-1)}, ValueError, "max_seqlen_q"),
        (lambda: {"max_seqlen_k": torch.tensor(-3, dtype=torch.int32, device=DEVICE)}, ValueError, "max_seqlen_k"),
        (lambda: {"q": torch.randn(12, 4, 64, dtype=torch.bfloat16)}, ValueError, r"\bq\b"),
        (lambda: {"k": torch.randn(15, 2, 64, dtype=torch.bfloat16)}, ValueError, r"\bk\b"),
    ],
    ids=["max-q-negative-tensor", "max-k-negative-tensor", "q-on-cpu", "k-on-cpu"],
)
def test_op_varlen_rejects_bad_values_on_the_gpu(change, error, match):
    """Negative 0-d tensor lengths (read on the host) and attention tensors off the GPU."""
    arguments = valid_arguments(DEVICE)
    arguments.update(change())
    with pytest.raises(error, match=match):
        tile_fmha_varlen(**arguments)
    _usable_afterwards()


# Cumulative lengths for 3 sequences over 200 rows with max_seqlen 100, each inconsistent.
BAD_CU = {
    "decreasing": [0, 80, 40, 140],
    "past-the-end": [0, 50, 150, 250],
    "longer-than-max": [0, 190, 200, 200],
    "first-not-zero": [30, 80, 100, 160],
    "negative": [-50, 20, 100, 100],
    "near-int32-max": [0, 100, 2**31 - 1, 2**31 - 1],
}


def _bad_batch(which: str, contents) -> Packed:
    batch = pack([60, 70, 70], None, 4, 2)
    bad = torch.tensor(contents, dtype=torch.int32, device=DEVICE)
    return dataclasses.replace(batch, max_seqlen_q=100, max_seqlen_k=100, **{f"cu_seqlens_{which}": bad})


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("which", ["q", "k"])
@pytest.mark.parametrize("name", list(BAD_CU))
def test_op_varlen_inconsistent_cu_seqlens_are_clamped(name, which, causal, monkeypatch):
    """Without TILEGYM_CHECK_VARLEN nothing reads the contents on the host: the kernels clamp
    them, so the call neither faults nor leaves anything unwritten (finite outputs and
    gradients of the right shapes), and the next call is right."""
    monkeypatch.delenv(CHECK_VARLEN, raising=False)
    batch = _bad_batch(which, BAD_CU[name])
    q, k, v = (t.detach().requires_grad_() for t in (batch.q, batch.k, batch.v))
    poison_cached_memory()
    out, lse = tile_fmha_varlen(q, k, v, *batch.lengths, is_causal=causal, return_lse=True)
    poison_cached_memory()
    grads = torch.autograd.grad((out, lse), (q, k, v), (torch.randn_like(out), torch.randn_like(lse)))
    torch.cuda.synchronize()
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    assert torch.isfinite(out).all(), "out has non-finite values"
    assert not lse.isnan().any() and not (lse == math.inf).any(), "lse has NaN or +inf"
    for grad_name, grad, t in zip(("dq", "dk", "dv"), grads, (q, k, v), strict=True):
        assert grad.shape == t.shape and torch.isfinite(grad).all(), f"{grad_name} has non-finite values"
    _usable_afterwards()


@pytest.mark.parametrize("which", ["q", "k"])
@pytest.mark.parametrize("name", list(BAD_CU))
def test_op_varlen_check_varlen_rejects_inconsistent_cu_seqlens(name, which, monkeypatch):
    """TILEGYM_CHECK_VARLEN=1: the host reads the cumulative lengths and raises, naming the
    argument, before any launch."""
    monkeypatch.setenv(CHECK_VARLEN, "1")
    batch = _bad_batch(which, BAD_CU[name])
    with pytest.raises(ValueError, match=f"cu_seqlens_{which}|max_seqlen_{which}"):
        tile_fmha_varlen(batch.q, batch.k, batch.v, *batch.lengths)
    _usable_afterwards()  # consistent lengths pass the check


def test_op_varlen_check_varlen_accepts_consistent_cu_seqlens(monkeypatch):
    """TILEGYM_CHECK_VARLEN=1 with consistent lengths (empty sequences, spare rows, a max_seqlen
    above every length): the same results as without the check."""
    batch = dataclasses.replace(pack(MIXED_Q, MIXED_K, 4, 2, spare_q=5, spare_k=3), max_seqlen_q=200)
    monkeypatch.setenv(CHECK_VARLEN, "1")
    checked = tile_fmha_varlen(batch.q, batch.k, batch.v, *batch.lengths, return_lse=True)
    monkeypatch.delenv(CHECK_VARLEN)
    unchecked = tile_fmha_varlen(batch.q, batch.k, batch.v, *batch.lengths, return_lse=True)
    assert all(torch.equal(a, b) for a, b in zip(checked, unchecked, strict=True))


# ---- rows outside every sequence ----------------------------------------------------------------

# (cu_seqlens_q, cu_seqlens_k) over 200 rows each, max_seqlen 100: consistent ones, then the
# inconsistent forms of BAD_CU on the keys' side.
UNCOVERED_CASES = {
    "exact": ([0, 60, 130, 200], [0, 90, 110, 200]),
    "spare-rows": ([0, 60, 130, 150], [0, 90, 110, 170]),
    "keys-without-queries": ([0, 0, 70, 70, 170], [0, 40, 100, 180, 190]),
    "queries-without-keys": ([0, 50, 120, 160], [0, 0, 80, 80]),
    **{f"keys-{name}": ([0, 60, 130, 190], contents) for name, contents in BAD_CU.items()},
}


def _clamped(cu, total, max_len) -> list[tuple[int, int]]:
    """Each sequence's rows as the kernels clamp them (kernels/packed.py clamped_rows)."""
    rows = []
    for s in range(len(cu) - 1):
        start = min(max(cu[s], 0), total)
        rows.append((start, min(max(cu[s + 1], start), total, start + max_len)))
    return rows


def _rows_with_gradients(cu, total, max_len, partner=None) -> torch.Tensor:
    """bool [total]: the rows of every clamped sequence; with partner (the queries' (cu, total,
    max_len), for keys), only of sequences that have queries."""
    rows = torch.zeros(total, dtype=torch.bool, device=DEVICE)
    partner_rows = None if partner is None else _clamped(*partner)
    for s, (start, end) in enumerate(_clamped(cu, total, max_len)):
        if partner_rows is None or partner_rows[s][1] > partner_rows[s][0]:
            rows[start:end] = True
    return rows


@pytest.mark.parametrize("choice", ["auto", "fused"])
@pytest.mark.parametrize("q_heads, kv_heads", [(3, 3), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("name", list(UNCOVERED_CASES))
def test_op_varlen_rows_outside_sequences_written_by_the_kernels(name, q_heads, kv_heads, choice, monkeypatch):
    """Outputs and gradients are allocated uninitialized (here over NaN): every row outside every
    sequence (before the first, between, after the last) reads out 0, LSE -inf, dq 0, and every
    key row outside a sequence with queries dk = dv = 0, exactly, whichever kernel wrote them (the
    two-kernel backward; fused, with dK and dV written by its programs (mha) or cast from fp32
    sums (gqa, causal)). Everything is finite, also with inconsistent lengths."""
    monkeypatch.delenv(CHECK_VARLEN, raising=False)
    monkeypatch.setenv("TILEGYM_BACKWARD", choice)
    cu_q, cu_k = UNCOVERED_CASES[name]
    total, max_len = 200, 100
    q = torch.randn(total, q_heads, 64, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(total, kv_heads, 64, dtype=torch.bfloat16, device=DEVICE, requires_grad=True) for _ in range(2))
    lengths = [torch.tensor(cu, dtype=torch.int32, device=DEVICE) for cu in (cu_q, cu_k)]
    poison_cached_memory()
    out, lse = tile_fmha_varlen(q, k, v, *lengths, max_len, max_len, is_causal=True, return_lse=True)
    poison_cached_memory()
    dq, dk, dv = torch.autograd.grad((out, lse), (q, k, v), (torch.randn_like(out), torch.randn_like(lse)))
    query_rows = _rows_with_gradients(cu_q, total, max_len)
    key_rows = _rows_with_gradients(cu_k, total, max_len, (cu_q, total, max_len))
    for what, tensor in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert bool(torch.isfinite(tensor).all()), f"{what} has non-finite values"
    assert not lse.isnan().any() and not (lse == math.inf).any(), "lse has NaN or +inf"
    assert torch.equal(out[~query_rows], torch.zeros_like(out[~query_rows])), "out outside every sequence"
    assert bool((lse[:, ~query_rows] == -math.inf).all()), "lse outside every sequence"
    assert torch.equal(dq[~query_rows], torch.zeros_like(dq[~query_rows])), "dq outside every sequence"
    for what, grad in (("dk", dk), ("dv", dv)):
        assert torch.equal(grad[~key_rows], torch.zeros_like(grad[~key_rows])), f"{what} of keys no query sees"
