"""Context parallelism (tilegym.parallel) against attention on the whole sequence.

Each case spawns one process per rank. Without GPUs the ranks talk over gloo on the CPU, with
the kernels replaced by the float64 reference (_reference_functional): that checks the sharding,
the gathered keys, the keys each chunk is given and the gradients' way back, exactly. With a GPU
the kernels run, checked against the float64 reference with our single-GPU call on the whole
sequence as the baseline of the tolerance rule: two ranks sharing the GPU over gloo, and with two
GPUs or more, a GPU per rank over NCCL.
"""

import zlib
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.ops.attention_cases import assert_close_to_reference, reference_run
from tests.ops.conftest import requires_cuda  # also: tests use each table's first config
from tests.ops.test_attention_varlen import cu_seqlens
from tilegym.ops.attention import dropout, score_functions
from tilegym.ops.attention.block_mask import create_block_mask
from tilegym.ops.attention.reference import attention_reference, dropout_kept
from tilegym.parallel import (
    SequenceSharding,
    context,
    context_parallel_attention,
    context_parallel_attention_varlen,
    packed,
    packed_positions,
    sequence_positions,
    shard_packed,
    shard_sequence,
    unshard_packed,
    unshard_sequence,
)


@dataclass(frozen=True)
class CpCase:
    why: str
    layout: str
    chunk: int  # positions per chunk: the sequence is chunk x (2 world or world)
    causal: bool = True
    batch: int = 1
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    value_dim: int = 64
    window_size: tuple | None = None
    softcap: float | None = None
    alibi: bool = False
    sinks: bool = False
    training: bool = True
    extra: dict = field(default_factory=dict)
    functions: str | None = None  # a case of _functions: relative, alibi, documents, documents-block
    bias: str | None = None  # "pairs": [Hq, S, S] with its gradient; "keys": [B, 1, 1, S]
    dropout: float = 0.0

    def __str__(self):
        return self.why


CASES = [
    CpCase("zigzag-causal-gqa", "zigzag", 37),  # a chunk that is no tile multiple
    CpCase("contiguous-causal-mha", "contiguous", 70, q_heads=3, kv_heads=3),
    CpCase("zigzag-full", "zigzag", 45, causal=False, batch=2),
    CpCase("contiguous-full-mqa", "contiguous", 64, causal=False, q_heads=4, kv_heads=1),
    CpCase("zigzag-window", "zigzag", 40, window_size=(50, 0)),  # reaches back over chunks
    CpCase("contiguous-window-short", "contiguous", 90, window_size=(7, -1)),
    CpCase("zigzag-alibi-softcap-sinks", "zigzag", 33, alibi=True, softcap=20.0, sinks=True),
    CpCase("zigzag-full-sinks", "zigzag", 29, causal=False, sinks=True, softcap=15.0),
    CpCase("zigzag-mla-dims", "zigzag", 48, head_dim=192, value_dim=128, q_heads=2, kv_heads=1),
    CpCase("zigzag-d128-scaled", "zigzag", 64, head_dim=128, value_dim=128, extra={"scaling": 0.3}),
    CpCase("zigzag-inference", "zigzag", 50, training=False, sinks=True),
    CpCase("zigzag-relative-table", "zigzag", 24, functions="relative"),  # a learned table, its gradient
    CpCase("zigzag-document-mask", "zigzag", 30, batch=2, functions="documents"),
    CpCase("zigzag-document-block-mask", "zigzag", 28, batch=2, functions="documents-block"),
    CpCase("contiguous-full-alibi-function", "contiguous", 36, causal=False, functions="alibi"),
    CpCase("zigzag-window-learned-bias", "zigzag", 26, window_size=(30, 0), bias="pairs"),  # views from key 0 on
    CpCase("contiguous-full-key-bias", "contiguous", 40, causal=False, batch=2, bias="keys"),
    CpCase("zigzag-causal-gqa-dropout", "zigzag", 37, dropout=0.3),
    CpCase("contiguous-full-dropout", "contiguous", 45, causal=False, batch=2, dropout=0.2),
    CpCase("zigzag-window-sinks-dropout", "zigzag", 40, window_size=(50, 0), sinks=True, dropout=0.25),
    CpCase("one-position-chunks", "zigzag", 1),
    CpCase("empty-sequence", "zigzag", 0),
]
CASE_BY_NAME = {case.why: case for case in CASES}


@dataclass(frozen=True)
class PackedCase:
    why: str
    units: tuple  # each sequence's length in units of 2 world rows
    causal: bool = True
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    window_size: tuple | None = None
    softcap: float | None = None
    alibi: str | None = None  # "head": [Hq]; "sequence": [N, Hq]
    sinks: bool = False
    training: bool = True
    functions: str | None = None  # a case of _functions: relative, alibi, documents, documents-block

    def __str__(self):
        return self.why


PACKED_CASES = [
    PackedCase("packed-causal-gqa", (5, 0, 1, 13, 7)),  # an empty sequence, one of 2 world rows
    PackedCase("packed-full-mha", (3, 9, 0, 4), causal=False, kv_heads=4),
    PackedCase("packed-window-alibi-softcap-sinks", (6, 11, 2), window_size=(25, 0), alibi="sequence",
               softcap=20.0, sinks=True),
    PackedCase("packed-one-sequence-d128", (16,), head_dim=128, alibi="head"),
    PackedCase("packed-inference", (4, 7), training=False),
    PackedCase("packed-document-mask", (5, 0, 8), functions="documents"),
    PackedCase("packed-document-block-mask", (4, 0, 7), functions="documents-block"),
    PackedCase("packed-relative-table", (4, 9), causal=False, functions="relative"),
    PackedCase("packed-empty-sequences", (0, 0)),
]  # fmt: skip
PACKED_CASE_BY_NAME = {case.why: case for case in PACKED_CASES}


def _alibi_slopes(heads: int, device) -> torch.Tensor:
    """ALiBi's usual float32 slopes, one per query head."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], device=device)


# The caller's functions of the function cases (ready-made cuTile ones), each with its meaning in
# PyTorch: what the float64 reference runs, and the CPU stand-in in the kernels' place.
_REACH = 20


def _relative_twin(scores, b, h, q_idx, kv_idx, aux):
    return scores + aux[0][h, (kv_idx - q_idx).clamp(-_REACH, _REACH) + _REACH].to(scores.dtype)


def _alibi_twin(scores, b, h, q_idx, kv_idx, aux):
    return scores - aux[0][h].to(scores.dtype) * (q_idx - kv_idx).abs().to(scores.dtype)


def _documents_twin(b, h, q_idx, kv_idx, mask_aux):
    docs = mask_aux[0].long()
    return docs[b, q_idx] == docs[b, kv_idx]


def _functions(name: str, rows: int, length: int, q_heads: int, device, training: bool, generator, cu=None) -> dict:
    """The keyword arguments of a function case on the whole sequence (rows of length positions:
    batch entries, or the sequences of a packed batch with cumulative lengths cu), its tensors
    drawn by generator."""
    if name == "relative":
        table = torch.randn(q_heads, 2 * _REACH + 1, generator=generator, dtype=torch.float64) * 0.5
        table = table.to(device, torch.float64 if device.type == "cpu" else torch.float32)  # the stand-in's precision
        return score_functions.relative_position_bias(table.requires_grad_(training), _REACH)
    if name == "alibi":
        return score_functions.alibi(_alibi_slopes(q_heads, device), length, length)
    starts = torch.rand(rows, length, generator=generator) < 0.15  # a new document at about 1 in 7 positions
    documents = score_functions.document_mask(starts.int().cumsum(-1).int().to(device))
    if name == "documents-block":  # the same mask as a block mask made for the whole sequence or batch
        return {"block_mask": create_block_mask(
            documents["mask_mod"], rows if cu is None else None, None, length, length, device,
            mask_aux=documents["mask_aux"], cu_seqlens_q=cu, cu_seqlens_k=cu,
        )}  # fmt: skip
    return documents


_TWINS = {}


def _twin_of(functions: dict):
    """attention_reference's score_mod for the caller's functions and tensors in functions: b,
    q_idx and kv_idx as the functions see them."""
    if not _TWINS:
        _TWINS[score_functions.relative_position_bias(torch.zeros(1, 2 * _REACH + 1), _REACH)["score_mod"]] = (
            _relative_twin
        )
        _TWINS[score_functions.alibi(torch.zeros(1), 1, 1)["score_mod"]] = _alibi_twin
        _TWINS[score_functions.document_mask(torch.zeros(1, 1))["mask_mod"]] = _documents_twin
    score_twin, mask_twin = _TWINS.get(functions.get("score_mod")), _TWINS.get(functions.get("mask_mod"))
    assert (score_twin is None) == (functions.get("score_mod") is None), "a score function without its twin"
    assert (mask_twin is None) == (functions.get("mask_mod") is None), "a mask function without its twin"
    aux, mask_aux = functions.get("aux") or (), functions.get("mask_aux") or ()

    def score_mod(scores, b, h, q_idx, kv_idx):
        if score_twin is not None:
            scores = score_twin(scores, b, h, q_idx, kv_idx, aux)
        if mask_twin is not None:
            scores = scores.masked_fill(~mask_twin(b, h, q_idx, kv_idx, mask_aux), -torch.inf)
        return scores

    return score_mod


_FUNCTION_ARGUMENTS = ("score_mod", "score_mod_grad", "aux", "aux_grad", "mask_mod", "mask_aux")


def _split_functions(kwargs: dict) -> dict:
    """The function arguments of kwargs, taken out of it (a block mask as its mask_mod and
    mask_aux)."""
    block_mask = kwargs.pop("block_mask", None)
    if block_mask is not None:
        kwargs["mask_mod"], kwargs["mask_aux"] = block_mask.mask_mod, block_mask.mask_aux
    return {name: kwargs.pop(name) for name in _FUNCTION_ARGUMENTS if kwargs.get(name) is not None}


def _unwrapped_twin(functions: dict):
    """The twin of functions as context parallelism passes them to a call (wrapped, the call's
    offsets last in aux and mask_aux): the caller's functions at the whole sequence's positions."""
    wrapped = next(functions[role] for role in ("score_mod", "mask_mod") if role in functions)
    rows_per_row = wrapped.__globals__["_CALL_ROWS_PER_ROW"]
    caller = {role: function.wraps for role, function in functions.items() if role in ("score_mod", "mask_mod")}
    offsets = (functions["aux"] if "score_mod" in functions else functions["mask_aux"])[-1].long()
    if "score_mod" in functions:
        caller["aux"] = functions["aux"][:-1]
    elif "aux" in functions:
        caller["aux"] = functions["aux"]
    if "mask_mod" in functions:
        caller["mask_aux"] = functions["mask_aux"][:-1]
    inner = _twin_of(caller)

    def score_mod(scores, b, h, q_idx, kv_idx):
        return inner(scores, b // rows_per_row, h, q_idx + offsets[b, 0], kv_idx + offsets[b, 1])

    return score_mod


def _reference_functional(q, k, v, scaling=None, is_causal=True, training=None, *, return_lse=False, **kwargs):
    """tile_fmha_functional's meaning for the arguments context parallelism passes: dense, or
    packed (cu_seqlens_q, ...), sequence by sequence."""
    assert return_lse and isinstance(training, bool)
    kwargs = {name: value for name, value in kwargs.items() if value is not None}
    rate = kwargs.pop("dropout_p", 0.0)
    if rate:  # the chunk's rows of the whole sequence's mask (its seed's first row)
        seed = dropout.call_seed(q.device)
        kept = dropout_kept(seed, rate, q.shape[0], q.shape[1], q.shape[2], k.shape[2]).to(q.device)
        kwargs.update(dropout_kept=kept, dropout_scale=dropout.kept_scale(rate))
    functions = _split_functions(kwargs)
    if functions:
        kwargs["score_mod"] = _unwrapped_twin(functions)
    cu_q, cu_k = kwargs.pop("cu_seqlens_q", None), kwargs.pop("cu_seqlens_k", None)
    if cu_q is None:
        out, lse = attention_reference(q, k, v, scaling, is_causal, **kwargs)
        return out.to(q.dtype), lse.to(_lse_dtype(q.dtype))
    longest = kwargs.pop("max_seqlen_q"), kwargs.pop("max_seqlen_k")
    assert cu_q.dtype == cu_k.dtype == torch.int32 and all(type(n) is int for n in longest)
    lengths = [(cu_q[s + 1] - cu_q[s]).item() for s in range(cu_q.numel() - 1)]
    assert longest[0] == max(lengths, default=0)
    out, lse = _packed_reference(q, k, v, cu_q.tolist(), cu_k.tolist(), scaling, is_causal, kwargs)
    return out.to(q.dtype), lse.to(_lse_dtype(q.dtype))


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _packed_reference(q, k, v, cu_q: list, cu_k: list, scaling, causal: bool, kwargs: dict):
    """(out [total_q, Hq, Dv], lse [Hq, total_q]) of a packed batch by the float64 reference,
    sequence by sequence, differentiable; alibi_slopes [N, Hq] gives each sequence its row."""
    outs, lses = [], []
    for s in range(len(cu_q) - 1):
        one = dict(kwargs)
        slopes = one.get("alibi_slopes")
        if slopes is not None and slopes.dim() == 2:
            one["alibi_slopes"] = slopes[s]
        if "score_mod" in one:  # b counts the batch's sequences
            one["score_mod"] = lambda scores, b, *rest, s=s, twin=kwargs["score_mod"]: twin(scores, b + s, *rest)
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        parts = (t[span].transpose(0, 1)[None] for t, span in ((q, rows), (k, keys), (v, keys)))
        out, lse = attention_reference(*parts, scaling, causal, **one)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    if not outs:
        return q.new_zeros((0, q.shape[1], v.shape[2]), dtype=torch.float64), q.new_zeros((q.shape[1], 0))
    return torch.cat(outs), torch.cat(lses, dim=-1)


def _inputs(case: CpCase, length: int, dtype, device):
    """Whole-sequence tensors and arguments, the same on every rank (a seed per case)."""
    generator = torch.Generator().manual_seed(zlib.crc32(case.why.encode()))

    def draw(*shape, scale=1.0):
        return (torch.randn(shape, generator=generator, dtype=torch.float64) * scale).to(device=device, dtype=dtype)

    q = draw(case.batch, case.q_heads, length, case.head_dim)
    k = draw(case.batch, case.kv_heads, length, case.head_dim)
    v = draw(case.batch, case.kv_heads, length, case.value_dim)
    d_out = draw(case.batch, case.q_heads, length, case.value_dim)
    d_lse = draw(case.batch, case.q_heads, length, scale=0.5)
    kwargs = dict(case.extra)
    if case.dropout:
        kwargs["dropout_p"] = case.dropout
    if case.window_size is not None:
        kwargs["window_size"] = case.window_size
    if case.softcap is not None:
        kwargs["softcap"] = case.softcap
    if case.alibi:
        kwargs["alibi_slopes"] = _alibi_slopes(case.q_heads, device)
    if case.sinks:
        sink_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        kwargs["sinks"] = draw(case.q_heads).to(sink_dtype).requires_grad_(case.training)
    if case.functions:
        kwargs.update(_functions(case.functions, case.batch, length, case.q_heads, device, case.training, generator))
    if case.bias == "pairs":
        kwargs["attn_bias"] = draw(case.q_heads, length, length, scale=0.5).requires_grad_(case.training)
    elif case.bias == "keys":
        kwargs["attn_bias"] = draw(case.batch, 1, 1, length, scale=2.0)
    return (q, k, v, d_out, d_lse), kwargs


def _learned(kwargs: dict) -> list:
    """The aux tensors of kwargs that require grad."""
    return [t for t in kwargs.get("aux") or () if t.requires_grad]


def _function_reference(q, k, v, d_out, d_lse, causal: bool, kwargs: dict, cu: list | None = None):
    """(out, lse, grads) of the float64 reference for a function case (dense, or packed by cu):
    grads holds dq, dk, dv, then the gradient of each learned aux tensor."""
    plain = dict(kwargs)
    functions = _split_functions(plain)
    assert not plain.get("sinks"), "function cases run without sinks"
    if "aux" in functions:
        functions["aux"] = tuple(t.detach().double().requires_grad_(t.requires_grad) for t in functions["aux"])
    inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    plain["score_mod"] = _twin_of(functions)
    if cu is None:
        out, lse = attention_reference(*inputs, None, causal, **plain)
    else:
        out, lse = _packed_reference(*inputs, cu, cu, None, causal, plain)
    learned = _learned(functions)
    grads = torch.autograd.grad([out, lse], inputs + learned, [d_out.double(), d_lse.double()])
    return out, lse, grads


def _rank_seed(rank: int, device) -> torch.Tensor:
    """A dropout seed of its own per rank: context parallelism must use rank 0's on every rank."""
    return torch.tensor([1000 + 7 * rank, 2000 + 11 * rank, 0, 0], dtype=torch.int32, device=device)


def _with_mask(kwargs: dict, length: int, case: CpCase, device) -> dict:
    """kwargs for the reference: dropout_p as the whole sequence's mask from rank 0's seed."""
    kwargs = dict(kwargs)
    rate = kwargs.pop("dropout_p", 0.0)
    if rate:
        kept = dropout_kept(_rank_seed(0, "cpu"), rate, case.batch, case.q_heads, length, length).to(device)
        kwargs.update(dropout_kept=kept, dropout_scale=dropout.kept_scale(rate))
    return kwargs


def _check_case(case: CpCase, rank: int, world: int, dtype, device) -> None:
    sharding = SequenceSharding(case.layout, world, case.chunk * (2 * world if case.layout == "zigzag" else world))
    (q, k, v, d_out, d_lse), kwargs = _inputs(case, sharding.length, dtype, device)
    dropout.new_seed = lambda on: _rank_seed(rank, on)

    def share(t, dim=2):
        return sharding.shard(t, rank, dim)

    leaves = [share(t).detach().requires_grad_(case.training) for t in (q, k, v)]
    out, lse = context_parallel_attention(
        *leaves, is_causal=case.causal, layout=case.layout, return_lse=True, training=case.training, **kwargs
    )
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert out.shape == share(d_out).shape and lse.shape == share(d_lse).shape and lse.dtype == lse_dtype
    if case.training:
        torch.autograd.backward([out, lse], [share(d_out), share(d_lse)])
    sinks, bias = kwargs.get("sinks"), kwargs.get("attn_bias")
    learned_bias = bias is not None and bias.requires_grad
    if sinks is not None and case.training:
        dist.all_reduce(sinks.grad)  # each rank's rows' part
    if learned_bias:
        dist.all_reduce(bias.grad)  # likewise
    for table in _learned(kwargs):
        dist.all_reduce(table.grad)

    if case.functions:
        ref_out, ref_lse, ref_grads = _function_reference(q, k, v, d_out, d_lse, case.causal, kwargs)
    else:
        ref_kwargs = _with_mask(kwargs, sharding.length, case, device)
        ref_out, ref_lse, ref_grads = reference_run(q, k, v, d_out, case.causal, ref_kwargs, torch.float64, d_lse=d_lse)
    ours = {"out": out, "lse": lse}
    expected = {"out": share(ref_out), "lse": share(ref_lse)}
    if case.training:
        ours.update(dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)
        expected.update(dq=share(ref_grads[0]), dk=share(ref_grads[1]), dv=share(ref_grads[2]))
        further = iter(ref_grads[3:])  # reference_run's order: attn_bias, sinks; or the learned aux
        if learned_bias:
            ours["dbias"], expected["dbias"] = bias.grad, next(further)
        if sinks is not None:
            ours["dsinks"], expected["dsinks"] = sinks.grad, next(further)
        for table in _learned(kwargs):
            ours["daux"], expected["daux"] = table.grad, next(further)
    if dtype == torch.float64:  # the reference stood in for the kernels: the same sums
        for name, value in ours.items():
            torch.testing.assert_close(value, expected[name].to(value.dtype), rtol=1e-9, atol=1e-9, msg=name)
        return
    with dropout.drawn_as(_rank_seed(0, device)):
        baseline = _one_gpu_run(case, (q, k, v, d_out, d_lse), kwargs)
    for name, value in ours.items():
        base = baseline[name] if name in _WHOLE_GRADIENTS else share(baseline[name])
        assert_close_to_reference(f"{case}: {name}", value, base, expected[name], dtype)


def _check_packed_case(case: PackedCase, rank: int, world: int, dtype, device) -> None:
    lengths = [units * 2 * world for units in case.units]
    cu = cu_seqlens(lengths, device)
    total, longest = int(cu[-1]), max(lengths)
    generator = torch.Generator().manual_seed(zlib.crc32(case.why.encode()))

    def draw(*shape, scale=1.0):
        return (torch.randn(shape, generator=generator, dtype=torch.float64) * scale).to(device=device, dtype=dtype)

    q, k, v = (
        draw(total, case.q_heads, case.head_dim),
        draw(total, case.kv_heads, case.head_dim),
        draw(total, case.kv_heads, case.head_dim),
    )
    d_out, d_lse = draw(total, case.q_heads, case.head_dim), draw(case.q_heads, total, scale=0.5)
    kwargs = {}
    if case.window_size is not None:
        kwargs["window_size"] = case.window_size
    if case.softcap is not None:
        kwargs["softcap"] = case.softcap
    if case.alibi:
        slopes = _alibi_slopes(case.q_heads, device)
        kwargs["alibi_slopes"] = slopes if case.alibi == "head" else torch.stack(
            [slopes * (1 + s) for s in range(len(lengths))]
        )  # fmt: skip
    if case.sinks:
        kwargs["sinks"] = draw(case.q_heads).to(_lse_dtype(dtype)).requires_grad_(case.training)
    if case.functions:
        kwargs.update(
            _functions(case.functions, len(lengths), longest, case.q_heads, device, case.training, generator, cu)
        )

    leaves = [shard_packed(t, cu).detach().requires_grad_(case.training) for t in (q, k, v)]
    out, lse = context_parallel_attention_varlen(
        *leaves, cu, longest, is_causal=case.causal, return_lse=True, training=case.training, **kwargs
    )
    local = leaves[0].shape[0]
    assert out.shape == (local, case.q_heads, case.head_dim) and lse.shape == (case.q_heads, local)
    if case.training:
        torch.autograd.backward([out, lse], [shard_packed(d_out, cu), shard_packed(d_lse.T, cu).T])
    sinks = kwargs.get("sinks")
    if sinks is not None and case.training:
        dist.all_reduce(sinks.grad)
    for table in _learned(kwargs):
        dist.all_reduce(table.grad)

    cu_list = cu.tolist()
    if case.functions:
        ref_out, ref_lse, ref_grads = _function_reference(q, k, v, d_out, d_lse, case.causal, kwargs, cu_list)
    else:
        inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref_kwargs = dict(kwargs)
        if sinks is not None:
            ref_kwargs["sinks"] = sinks.detach().double().requires_grad_()
            inputs.append(ref_kwargs["sinks"])
        ref_out, ref_lse = _packed_reference(*inputs[:3], cu_list, cu_list, None, case.causal, ref_kwargs)
        ref_grads = torch.autograd.grad([ref_out, ref_lse], inputs, [d_out.double(), d_lse.double()])
    ours = {"out": out, "lse": lse.T}
    expected = {"out": shard_packed(ref_out, cu), "lse": shard_packed(ref_lse.T, cu)}
    if case.training:
        for index, name in enumerate(("dq", "dk", "dv")):
            ours[name], expected[name] = leaves[index].grad, shard_packed(ref_grads[index], cu)
        if sinks is not None:
            ours["dsinks"], expected["dsinks"] = sinks.grad, ref_grads[3]
        for table in _learned(kwargs):
            ours["daux"], expected["daux"] = table.grad, ref_grads[3]
    if dtype == torch.float64:
        for name, value in ours.items():
            torch.testing.assert_close(value, expected[name].to(value.dtype), rtol=1e-9, atol=1e-9, msg=name)
        return
    packing = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": longest, "max_seqlen_k": longest}
    baseline = _one_gpu_run(case, (q, k, v, d_out, d_lse), kwargs, **packing)
    for name, value in ours.items():
        base = baseline[name] if name in _WHOLE_GRADIENTS else shard_packed(baseline[name], cu)
        assert_close_to_reference(f"{case}: {name}", value, base, expected[name], dtype)


_WHOLE_GRADIENTS = ("dbias", "dsinks", "daux")  # of tensors every rank holds whole: not shares


def _one_gpu_run(case, tensors, kwargs, **call_kwargs) -> dict:
    """Our single-GPU call (tile_fmha_functional) on the whole sequence or batch: the baseline
    of the tolerance rule. call_kwargs: a packed batch's lengths. The LSE as [rows, Hq] packed."""
    from tilegym import tile_fmha_functional

    q, k, v, d_out, d_lse = tensors
    leaves = [t.detach().requires_grad_(case.training) for t in (q, k, v)]
    kwargs = dict(kwargs)
    for name in ("sinks", "attn_bias"):
        if name in kwargs:
            kwargs[name] = kwargs[name].detach().requires_grad_(kwargs[name].requires_grad)
    if kwargs.get("aux") is not None:
        kwargs["aux"] = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in kwargs["aux"])
    out, lse = tile_fmha_functional(
        *leaves, is_causal=case.causal, training=case.training, return_lse=True, **kwargs, **call_kwargs
    )
    result = {"out": out, "lse": lse.T if call_kwargs else lse}
    if case.training:
        torch.autograd.backward([out, lse], [d_out, d_lse])
        result.update(dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)
        if "sinks" in kwargs:
            result["dsinks"] = kwargs["sinks"].grad
        if "attn_bias" in kwargs and kwargs["attn_bias"].requires_grad:
            result["dbias"] = kwargs["attn_bias"].grad
        for table in _learned(kwargs):
            result["daux"] = table.grad
    return result


def _worker(rank: int, world: int, backend: str, init_file: str, case_names: list, dtype_name: str) -> None:
    device = torch.device("cpu")
    if dtype_name != "float64":  # the kernels: a GPU per rank over NCCL, or all on one over gloo
        device = torch.device("cuda", rank if backend == "nccl" else 0)
        torch.cuda.set_device(device)
    else:
        for module in (context, packed):
            module.tile_fmha_functional = _reference_functional
        # The kernels' checks want CUDA tensors.
        context.check_inputs = packed.check_packed_inputs = lambda *args, **kwargs: None
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for name in case_names:
            if name in CASE_BY_NAME:
                _check_case(CASE_BY_NAME[name], rank, world, getattr(torch, dtype_name), device)
            else:
                _check_packed_case(PACKED_CASE_BY_NAME[name], rank, world, getattr(torch, dtype_name), device)
        _check_helpers(rank, world, device)
        _check_compiled(rank, world, device)
        _check_input_forms(rank, world, device)
        _check_checkpointed(rank, world, device)
    finally:
        dist.destroy_process_group()


def _check_input_forms(rank: int, world: int, device) -> None:
    """q, k and v as strided views of one [B, L, 3, H, D] tensor (and of one packed [T, 3, H, D]
    tensor), and k and v without gradients: the values and gradients of contiguous inputs."""
    dtype = torch.float64 if device.type == "cpu" else torch.bfloat16
    lengths = [2 * world * n for n in (3, 0, 5)]
    cu = cu_seqlens(lengths, device)
    forms = (
        (torch.randn(2, 8 * world, 3, 2, 64, dtype=torch.float64), lambda t: shard_sequence(t, dim=1),
         lambda t, i: t[:, :, i].transpose(1, 2), context_parallel_attention),
        (torch.randn(int(cu[-1]), 3, 2, 64, dtype=torch.float64), lambda t: shard_packed(t, cu), lambda t, i: t[:, i],
         lambda *t: context_parallel_attention_varlen(*t, cu, max(lengths))),
    )  # fmt: skip
    for whole, share_of, part, attention in forms:
        share = share_of(whole.to(device, dtype))
        packed_leaf = share.clone().requires_grad_()
        views = [part(packed_leaf, i) for i in range(3)]
        copies = [part(share, i).contiguous().requires_grad_() for i in range(3)]
        query_only = part(share, 0).contiguous().requires_grad_()
        outs = [attention(*views), attention(*copies), attention(query_only, *(t.detach() for t in copies[1:]))]
        for out in outs:
            out.float().square().sum().backward()
        torch.testing.assert_close(outs[0], outs[1])
        torch.testing.assert_close(outs[2], outs[1])
        for i in range(3):
            torch.testing.assert_close(part(packed_leaf.grad, i), copies[i].grad)
        torch.testing.assert_close(query_only.grad, copies[0].grad)


def _check_compiled(rank: int, world: int, device) -> None:
    """A function calling context_parallel_attention under torch.compile: the same values and
    gradients as called eagerly (the call itself runs eagerly, at a graph break)."""
    dtype = torch.float64 if device.type == "cpu" else torch.bfloat16
    whole = [torch.randn(1, 2, 8 * world, 64, dtype=torch.float64).to(device, dtype) for _ in range(3)]
    results = []
    for fn in (
        lambda *t: context_parallel_attention(*t) * 2,
        torch.compile(lambda *t: context_parallel_attention(*t) * 2, backend="eager"),
    ):
        leaves = [shard_sequence(t).requires_grad_() for t in whole]
        out = fn(*leaves)
        out.sum().backward()
        results.append([out, *(t.grad for t in leaves)])
    for eager, compiled in zip(*results, strict=True):
        assert torch.equal(eager, compiled)


def _check_checkpointed(rank: int, world: int, device) -> None:
    """Under activation checkpointing (torch.utils.checkpoint, either form), whose backward runs
    the forward's collectives again: the values and gradients of the plain call."""
    from torch.utils.checkpoint import checkpoint

    dtype = torch.float64 if device.type == "cpu" else torch.bfloat16
    lengths = [2 * world * n for n in (4, 1, 6)]
    cu = cu_seqlens(lengths, device)
    dense = [torch.randn(1, 2, 8 * world, 64, dtype=torch.float64) for _ in range(3)]
    packed_whole = [torch.randn(int(cu[-1]), 2, 64, dtype=torch.float64) for _ in range(3)]
    forms = (
        ([shard_sequence(t.to(device, dtype)) for t in dense], context_parallel_attention),
        ([shard_packed(t.to(device, dtype), cu) for t in packed_whole],
         lambda *t: context_parallel_attention_varlen(*t, cu, max(lengths), window_size=(5, 0))),
    )  # fmt: skip

    def layer(attention, q, k, v):  # a layer's attention between two elementwise operations
        return attention(q * 1.5, k, v).float().square()

    for shares, attention in forms:
        results = []
        for wrap in (
            lambda attention, *t: layer(attention, *t),
            lambda attention, *t: checkpoint(layer, attention, *t, use_reentrant=False),
            lambda attention, *t: checkpoint(layer, attention, *t, use_reentrant=True),
        ):
            leaves = [t.clone().requires_grad_() for t in shares]
            out = wrap(attention, *leaves)
            out.sum().backward()
            results.append([out, *(t.grad for t in leaves)])
        for plain, *checkpointed in zip(*results, strict=True):
            for value in checkpointed:
                torch.testing.assert_close(value, plain)


def _check_helpers(rank: int, world: int, device) -> None:
    """shard_sequence, unshard_sequence and sequence_positions agree with each other."""
    for layout in ("zigzag", "contiguous"):
        whole = torch.arange(2 * 3 * 4 * world, device=device).reshape(2, 4 * world, 3).float()
        mine = shard_sequence(whole, dim=1, layout=layout)
        positions = sequence_positions(4 * world, layout=layout, device=device)
        torch.testing.assert_close(mine, whole[:, positions])
        torch.testing.assert_close(unshard_sequence(mine, dim=1, layout=layout), whole)
    lengths = [0, 6 * world, 2 * world, 0, 10 * world]
    cu = cu_seqlens(lengths, device)
    whole = torch.arange(int(cu[-1]), device=device)
    mine = shard_packed(whole, cu)
    assert torch.equal(unshard_packed(mine, cu), whole)
    starts = torch.repeat_interleave(cu[:-1].long(), torch.tensor(lengths, device=device))
    assert torch.equal(packed_positions(cu, mine.numel()), mine - starts[mine])


def _spawn(world: int, backend: str, tmp_path, case_names: list, dtype_name: str) -> None:
    mp.spawn(_worker, args=(world, backend, str(tmp_path / "rendezvous"), case_names, dtype_name), nprocs=world)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_context_parallel_matches_the_whole_sequence(world, tmp_path):
    _spawn(world, "gloo", tmp_path, [*CASE_BY_NAME, *PACKED_CASE_BY_NAME], "float64")


_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_GPUS < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("world", sorted({2, min(_GPUS, 4)}))
def test_op_context_parallel(world, dtype_name, tmp_path):
    _spawn(world, "nccl", tmp_path, [*CASE_BY_NAME, *PACKED_CASE_BY_NAME], dtype_name)


@requires_cuda
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_op_context_parallel_ranks_sharing_a_gpu(dtype_name, tmp_path):
    """Two ranks on one GPU, talking over gloo: the kernels, the keys each chunk is given and the
    gradients' way back as on one GPU per rank, on a machine with a single GPU."""
    _spawn(2, "gloo", tmp_path, [*CASE_BY_NAME, *PACKED_CASE_BY_NAME], dtype_name)


def _check_captured(rank: int, world: int, device) -> None:
    """A training step of each call (dense with a window, dense with a document mask, packed)
    captured in a CUDA graph with its collectives, then replayed on new inputs (the packed
    batch's lengths reordered in its cu_seqlens, new document ids) with its output and gradients
    poisoned first: the eager call's results on those inputs."""
    from tests.ops.attention_cases import capture_training_step

    generator = torch.Generator(device=device).manual_seed(11)

    def randn(*shape):  # the same on every rank: each takes its share
        return torch.randn(shape, device=device, generator=generator)

    def cumulative(units):  # lengths of 2 world rows each unit
        return cu_seqlens([2 * world * n for n in units], device)

    def documents(length):
        return (randn(1, length) > 1.0).int().cumsum(-1).int()  # a new document at about 1 in 6 positions

    units, reordered = (40, 3, 65), (65, 40, 3)  # the same total and longest
    length = 96 * world
    for form in ("window", "documents", "packed"):
        cu, docs = cumulative(units), documents(length)
        rows = int(cu[-1]) if form == "packed" else length
        shapes = [(rows, heads, 64) if form == "packed" else (1, heads, rows, 64) for heads in (4, 2, 2, 4)]

        def share(t, form=form, cu=cu):
            return shard_packed(t, cu) if form == "packed" else shard_sequence(t)

        def attention(q, k, v, form=form, cu=cu, docs=docs):
            if form == "packed":
                return context_parallel_attention_varlen(q, k, v, cu, 2 * world * max(units))
            if form == "documents":
                return context_parallel_attention(q, k, v, **score_functions.document_mask(docs))
            return context_parallel_attention(q, k, v, window_size=(100, 0))

        *leaves, d_out = (share(randn(*shape)).bfloat16() for shape in shapes)
        for t in leaves:
            t.requires_grad_()

        def step(attention=attention, leaves=leaves, d_out=d_out):
            out = attention(*leaves)
            out.backward(d_out)
            return out

        graph, out = capture_training_step(step, leaves)
        with torch.no_grad():
            cu.copy_(cumulative(reordered))
            docs.copy_(documents(length))
            for t, shape in zip([*leaves, d_out], shapes, strict=True):
                t.copy_(share(randn(*shape)).bfloat16())
            for t in (out, *(leaf.grad for leaf in leaves)):
                t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        del graph  # before the process group goes

        eager_leaves = [t.detach().clone().requires_grad_() for t in leaves]
        eager_out = attention(*eager_leaves)
        eager_out.backward(d_out)
        got = (out, *(t.grad for t in leaves))
        eager = (eager_out, *(t.grad for t in eager_leaves))
        for part, ours, theirs in zip(("out", "dq", "dk", "dv"), got, eager, strict=True):
            assert not ours.isnan().any(), f"{form} {part}: NaN after the replay"
            where = f"{form} {part} differs from the eager call"
            torch.testing.assert_close(ours, theirs, msg=lambda m, where=where: f"{where}: {m}")


@requires_cuda
def test_op_context_parallel_in_a_cuda_graph_one_rank(one_rank_group):
    _check_captured(0, 1, torch.device("cuda", 0))


def _captured_worker(rank: int, world: int, init_file: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        _check_captured(rank, world, device)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(_GPUS < 2, reason="needs 2 CUDA GPUs")
def test_op_context_parallel_in_a_cuda_graph(tmp_path):
    mp.spawn(_captured_worker, args=(2, str(tmp_path / "rendezvous")), nprocs=2)


@pytest.mark.parametrize("rows_per_row", [1, 2], ids=["dense", "packed"])
def test_functions_at_global_positions_compile_into_the_kernels(rows_per_row):
    """The wrapped functions (functions.py) compile for sm_90 into the forward, dQ and dK/dV
    kernels (bf16, D=64, each table's first config) with the offsets in the aux slot after the
    caller's: a learned relative table with its gradient, ALiBi (declared elementwise, so also
    the fused backward) and a document mask, also into the kernel that sorts a block mask's
    tiles."""
    import tempfile
    from pathlib import Path

    import cuda.tile as ct
    from cuda.tile.compilation import CallingConvention, KernelSignature, ScalarConstraint, export_kernel

    from tests.ops import sass
    from tilegym.ops.attention import configs, programmable
    from tilegym.ops.attention.kernels.block_mask import block_mask_kernel
    from tilegym.ops.attention.score_mods import ScoreMods
    from tilegym.ops.attention.variants import BACKWARD_DKDV, BACKWARD_DQ, BACKWARD_FUSED, FORWARD_LSE
    from tilegym.parallel.functions import ChunkFunctions, WholeSizes

    if sass.cuobjdump() is None:
        pytest.skip("cuobjdump not installed")
    q = torch.zeros(1, 2, 8, 64)
    offsets = torch.zeros(2, 2, dtype=torch.int32)
    relative = score_functions.relative_position_bias(torch.zeros(2, 2 * _REACH + 1), _REACH)
    documents = score_functions.document_mask(torch.zeros(2, 8, dtype=torch.int32))
    alibi = score_functions.alibi(torch.ones(2), 8, 8)
    cases = (
        (relative, {"Aux0": (ct.float32, 2), "Aux1": (ct.int32, 2), "AuxGrad0": (ct.float32, 2)}, False),
        (alibi, {"Aux0": (ct.float32, 1), "Aux1": (ct.int32, 2)}, False),
        (documents, {"MaskAux0": (ct.int32, 2), "MaskAux1": (ct.int32, 2)}, True),
    )
    with tempfile.TemporaryDirectory() as workdir:
        for given, arrays, masks in cases:
            arguments = ChunkFunctions.of(q, rows_per_row, WholeSizes(2, 2, 8), **given).arguments(offsets)
            functions = programmable.user_functions(
                *(arguments.get(role) for role in ("score_mod", "score_mod_grad", "aux_grad", "mask_mod"))
            )
            tables = configs.score_tables(ScoreMods(user=functions).switches)
            assert functions.elementwise == (given is alibi), "the copies keep the declaration"
            variants = (FORWARD_LSE, BACKWARD_FUSED) if functions.elementwise else (FORWARD_LSE, BACKWARD_DQ,
                                                                                  BACKWARD_DKDV)  # fmt: skip
            for variant in variants:
                config = configs.candidates(variant, "sm_90", 64, 2, tables)[0]
                path = sass.compile_cubin(variant, ct.bfloat16, 64, config, True, "sm_90", Path(workdir) / "k.cubin",
                                          {"block_sparse": masks, "varlen": rows_per_row == 2}, functions=functions,
                                          arrays=arrays)  # fmt: skip
                assert "HGMMA" in sass.disassemble(path), variant
            if masks:
                kernel = programmable.user_kernel(block_mask_kernel, functions)
                aux = [sass.array_constraint(*arrays.get(f"MaskAux{slot}", (ct.float32, 1))) for slot in range(4)]
                parameters = [sass.array_constraint(ct.int8, 4), *aux, *[sass.array_constraint(ct.int32, 1)] * 2,
                              *[ScalarConstraint(ct.int32)] * 6, 128, 64, True, False, rows_per_row == 2]  # fmt: skip
                signature = KernelSignature(parameters, CallingConvention.cutile_python_v2())
                export_kernel(kernel, [signature.with_mangled_symbol("sort_tiles")], str(Path(workdir) / "s.cubin"),
                              gpu_code="sm_90", output_format="cubin")  # fmt: skip


def test_sharding_layouts():
    sharding = SequenceSharding("zigzag", 3, 12)
    assert [[(s.start, s.stop, s.local_start) for s in sharding.spans(r)] for r in range(3)] == [
        [(0, 2, 0), (10, 12, 2)], [(2, 4, 0), (8, 10, 2)], [(4, 6, 0), (6, 8, 2)],
    ]  # fmt: skip
    whole = torch.arange(12)
    gathered = torch.cat([sharding.shard(whole, r, 0) for r in range(3)])
    assert torch.equal(sharding.unshard(gathered, 0), whole)
    assert torch.equal(sharding.positions(1), torch.tensor([2, 3, 8, 9]))
    # Causal pairs per rank: the zigzag layout balances them, the contiguous one does not.
    for layout, balanced in (("zigzag", True), ("contiguous", False)):
        sharding = SequenceSharding(layout, 4, 64)
        pairs = {sum(p + 1 for p in sharding.positions(r).tolist()) for r in range(4)}
        assert (len(pairs) == 1) == balanced, (layout, pairs)
    contiguous = SequenceSharding("contiguous", 4, 8)
    assert torch.equal(contiguous.positions(3), torch.tensor([6, 7]))


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda: SequenceSharding("ring", 2, 8), ValueError, "layout"),
        (lambda: SequenceSharding("zigzag", 2, 10), ValueError, "pad it to a multiple of 4"),
        (lambda: SequenceSharding("zigzag", 0, 8), ValueError, "world"),
        (lambda: SequenceSharding.of_share("zigzag", 2, 5), ValueError, "not even"),
        (lambda: SequenceSharding("contiguous", 2, 8).spans(2), ValueError, "rank"),
    ],
)
def test_sharding_refusals(make, error, words):
    with pytest.raises(error, match=words):
        make()


def test_refused_without_a_process_group():
    q = torch.randn(1, 2, 8, 64)
    with pytest.raises(ValueError, match="init_process_group"):
        context_parallel_attention(q, q, q)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _document_block_mask(length: int):
    documents = score_functions.document_mask(torch.zeros(1, length, dtype=torch.int32))
    return create_block_mask(documents["mask_mod"], None, None, length, length, "cpu", mask_aux=documents["mask_aux"])


def _arguments(**changes):
    q = torch.randn(1, 2, 8, 64)
    arguments = {"q": q, "k": q, "v": q, "is_causal": True}
    arguments.update(changes)
    return arguments


@pytest.mark.parametrize(
    "changes, error, words",
    [
        ({"q": torch.randn(2, 8, 64)}, ValueError, "q must be"),
        ({"k": torch.randn(1, 2, 6, 64)}, ValueError, "same positions"),
        ({"v": "v"}, TypeError, "v must be a torch.Tensor"),
        ({"q": torch.randn(1, 2, 7, 64), "k": torch.randn(1, 2, 7, 64), "v": torch.randn(1, 2, 7, 64)}, ValueError,
         "not even"),
        ({"layout": "ring"}, ValueError, "layout"),
        ({"is_causal": False, "window_size": (4, 4)}, ValueError, "window_size needs is_causal=True"),
        ({"is_causal": False, "alibi_slopes": torch.ones(2)}, ValueError, "alibi_slopes needs is_causal=True"),
        ({"is_causal": 1}, TypeError, "is_causal"),
        ({"return_lse": 1}, TypeError, "return_lse must be a bool"),
        ({"training": 0}, TypeError, "training must be a bool or None"),
        ({"group": "world"}, TypeError, "group"),
        ({"block_mask": object()}, TypeError, "block_mask must be a BlockMask"),
        ({"block_mask": _document_block_mask(4)}, ValueError, "covers Q_LEN=4, KV_LEN=4, but the call has Sq=8"),
        ({"block_mask": _document_block_mask(8), "mask_mod": _documents_twin}, ValueError, "either block_mask or"),
        ({"attn_bias": torch.randn(2, 8, 4)}, ValueError, r"attn_bias of shape \(2, 8, 4\) does not broadcast"),
        ({"attn_bias": torch.randn(8, 8).double()}, TypeError, "attn_bias must have q's dtype"),
        ({"attn_bias": "bias"}, TypeError, "attn_bias must be a torch.Tensor"),
        ({"score_mod": _relative_twin, "aux": (torch.ones(1),) * 4}, ValueError, "at most 3"),
        ({"mask_mod": "documents"}, TypeError, "mask_mod must be a Python function"),
        ({"aux": (torch.ones(1),)}, ValueError, "aux and mask_aux need score_mod or mask_mod"),
        ({"dropout_p": 1.0}, ValueError, "dropout_p must be in"),
        ({"dropout_p": 0.1, "training": False}, ValueError, "dropout applies to training calls only"),
        ({}, ValueError, "CUDA tensor"),  # the kernels' own checks, before the collective
    ],
)  # fmt: skip
def test_refusals(one_rank_group, changes, error, words):
    with pytest.raises(error, match=words):
        context_parallel_attention(**_arguments(**changes))


def _packed_arguments(**changes):
    q = torch.randn(8, 2, 64)
    arguments = {
        "q": q, "k": q, "v": q, "cu_seqlens": torch.tensor([0, 2, 8], dtype=torch.int32), "max_seqlen": 6,
        "is_causal": True,
    }  # fmt: skip
    arguments.update(changes)
    return arguments


@pytest.mark.parametrize(
    "changes, error, words",
    [
        ({"q": torch.randn(1, 8, 2, 64)}, ValueError, r"q must be \[T, H, D\]"),
        ({"v": torch.randn(6, 2, 64)}, ValueError, "same positions"),
        ({"q": torch.randn(7, 2, 64), "k": torch.randn(7, 2, 64), "v": torch.randn(7, 2, 64)}, ValueError, "not even"),
        ({"cu_seqlens": torch.tensor([0, 2, 8])}, TypeError, "cu_seqlens must be torch.int32"),
        ({"cu_seqlens": [0, 2, 8]}, TypeError, "cu_seqlens must be a torch.Tensor"),
        ({"max_seqlen": 5}, ValueError, "max_seqlen .5. must be a multiple of 2"),
        ({"max_seqlen": 6.0}, TypeError, "max_seqlen must be an int"),
        ({"is_causal": False, "window_size": (2, 2)}, ValueError, "window_size needs is_causal=True"),
        ({"training": "yes"}, TypeError, "training must be a bool or None"),
        ({"return_lse": None}, TypeError, "return_lse must be a bool"),
        ({}, ValueError, "CUDA tensor"),  # the packed kernels' own checks, before the collective
    ],
)  # fmt: skip
def test_packed_refusals(one_rank_group, changes, error, words):
    with pytest.raises(error, match=words):
        context_parallel_attention_varlen(**_packed_arguments(**changes))


@pytest.mark.parametrize(
    "cu, words",
    [([0, 3, 8], "multiple of 2"), ([0, 2, 6], "from 0 to the batch's 8 rows"), ([0, 6, 2, 8], "must not decrease"),
     ([0, 8], "more than max_seqlen")],
)  # fmt: skip
def test_packed_lengths_checked_on_request(one_rank_group, monkeypatch, cu, words):
    cu = torch.tensor(cu, dtype=torch.int32)
    if "max_seqlen" not in words:  # shard_packed takes no max_seqlen
        with pytest.raises(ValueError, match=words):
            shard_packed(torch.randn(8, 2), cu)
    monkeypatch.setenv("TILEGYM_CHECK_VARLEN", "1")
    with pytest.raises(ValueError, match=words):
        context_parallel_attention_varlen(**_packed_arguments(cu_seqlens=cu))


def test_packed_plans_kept_per_cu_seqlens():
    """One plan per batch: kept for the same cu_seqlens tensor, made again when its contents
    change in place or for another tensor."""
    packed._PLANS.clear()
    sharding = packed.PackedSharding(2)
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    first = packed._plan(sharding, cu, 1, 6, 8, True)
    assert packed._plan(sharding, cu, 1, 6, 8, True) is first
    assert packed._plan(sharding, cu.clone(), 1, 6, 8, True) is not first
    cu[1] = 4
    changed = packed._plan(sharding, cu, 1, 6, 8, True)
    assert changed is not first and not torch.equal(changed.cu_seqlens_q, first.cu_seqlens_q)
