"""Checks of tile_fmha_varlen's arguments that need no GPU: the packed layout's validation, before
any launch, with errors that name the argument.

The attention tensors' checks run on real CPU tensors: their type, rank, dtype and shape checks
come before the CUDA device check, as in the dense path. The checks of cu_seqlens_q/k and
max_seqlen_q/k run on fake CUDA tensors (FakeTensorMode: shapes, dtypes and devices without
data or a GPU), so that every device check passes and the check under test is the one that
fails, whatever the order of the checks. These checks read no tensor contents (the fake
implementation torch.compile traces cannot either); the contents checks of
TILEGYM_CHECK_VARLEN and the 0-d tensor lengths, which do, are in test_attention_varlen.py.
"""

import inspect
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import tilegym
from tilegym import tile_fmha_functional, tile_fmha_varlen
from tilegym.autotune import TileConfig
from tilegym.ops.attention import launch, packing
from tilegym.ops.attention.configs import BACKWARD_FUSED_GROUPED

# Two sequences, GQA 2:1: queries of lengths 5 and 7, keys of lengths 7 and 8.
TOTAL_Q, TOTAL_K, Q_HEADS, KV_HEADS, HEAD_DIM = 12, 15, 4, 2, 64


def valid_arguments(device) -> dict:
    """The keyword arguments of a valid packed call on device; tests change one of them."""

    def rows(total, heads, head_dim=HEAD_DIM):
        return torch.randn(total, heads, head_dim, dtype=torch.bfloat16, device=device)

    return {
        "q": rows(TOTAL_Q, Q_HEADS),
        "k": rows(TOTAL_K, KV_HEADS),
        "v": rows(TOTAL_K, KV_HEADS),
        "cu_seqlens_q": torch.tensor([0, 5, 12], dtype=torch.int32, device=device),
        "cu_seqlens_k": torch.tensor([0, 7, 15], dtype=torch.int32, device=device),
        "max_seqlen_q": 7,
        "max_seqlen_k": 8,
    }


def _varlen(**arguments):
    return tile_fmha_varlen(**arguments)


def _functional(training):
    def call(**arguments):
        return tile_fmha_functional(
            arguments.pop("q"), arguments.pop("k"), arguments.pop("v"), None, True, training, **arguments
        )

    return call


# Every entry point of the packed layout: tile_fmha_varlen, and tile_fmha_functional given
# cu_seqlens_q (differentiable and inference).
CALLERS = [
    pytest.param(_varlen, id="varlen"),
    pytest.param(_functional(True), id="functional-training"),
    pytest.param(_functional(False), id="functional-inference"),
]


def _int32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


# (changed arguments, built on a device; error; a pattern the message must contain). The
# message patterns never match the device check's "q must be a CUDA tensor".
BAD_ATTENTION_TENSORS = [
    pytest.param(lambda a: {"q": a["q"].tolist()}, TypeError, r"\bq\b", id="q-not-tensor"),
    pytest.param(lambda a: {"k": None}, TypeError, r"\bk\b", id="k-not-tensor"),
    pytest.param(lambda a: {"v": "v"}, TypeError, r"\bv\b", id="v-not-tensor"),
    pytest.param(lambda a: {"q": a["q"][None]}, ValueError, "q must have 3 dimensions", id="q-dense-layout"),
    pytest.param(lambda a: {"k": a["k"][:, 0]}, ValueError, "k must have 3 dimensions", id="k-rank-2"),
    pytest.param(lambda a: {"v": a["v"][None]}, ValueError, "v must have 3 dimensions", id="v-rank-4"),
    pytest.param(lambda a: {"k": a["k"].half()}, TypeError, "dtype", id="mixed-dtypes"),
    pytest.param(lambda a: {n: a[n].int() for n in "qkv"}, TypeError, "dtype", id="int-dtype"),
    pytest.param(lambda a: {n: a[n][..., :48] for n in "qkv"}, ValueError, "head dim", id="head-dim-48"),
    pytest.param(lambda a: {"k": a["k"][..., :32]}, ValueError, "head dim", id="k-head-dim-differs"),
    pytest.param(lambda a: {"v": a["v"][..., :48]}, ValueError, "head dim", id="v-head-dim-48"),
    pytest.param(lambda a: {"q": a["q"][:, :3]}, ValueError, "multiple", id="heads-not-a-multiple"),
    pytest.param(lambda a: {"v": a["v"][:-1]}, ValueError, r"\bk\b.*\bv\b|\bv\b.*\bk\b", id="k-v-totals-differ"),
    pytest.param(
        lambda a: {"v": torch.cat([a["v"], a["v"]], dim=1)},
        ValueError,
        r"\bk\b.*\bv\b|\bv\b.*\bk\b",
        id="k-v-heads-differ",
    ),  # fmt: skip
]


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize(("change", "error", "match"), BAD_ATTENTION_TENSORS)
def test_op_varlen_rejects_bad_attention_tensors(caller, change, error, match):
    arguments = valid_arguments("cpu")
    arguments.update(change(arguments))
    with pytest.raises(error, match=match):
        caller(**arguments)


@pytest.mark.parametrize("caller", CALLERS)
def test_op_varlen_rejects_cpu_tensors(caller):
    """Valid arguments on the CPU (cu_seqlens on q's device): only the attention tensors' device is
    wrong, and the error names q, as in the dense path."""
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        caller(**valid_arguments("cpu"))


# (changed arguments, given the device the valid ones are on; error; the name the message must
# contain). Shared with test_attention_varlen.py, which runs them on a real GPU.
BAD_LENGTH_ARGUMENTS = [
    pytest.param(lambda device: {"cu_seqlens_q": [0, 5, 12]}, TypeError, "cu_seqlens_q", id="cu-q-list"),
    pytest.param(lambda device: {"cu_seqlens_k": None}, TypeError, "cu_seqlens_k", id="cu-k-none"),
    pytest.param(
        lambda device: {"cu_seqlens_q": torch.tensor([0, 5, 12], device=device)},
        TypeError,
        "cu_seqlens_q",
        id="cu-q-int64",
    ),  # fmt: skip
    pytest.param(
        lambda device: {"cu_seqlens_k": torch.tensor([0.0, 7.0, 15.0], device=device)},
        TypeError,
        "cu_seqlens_k",
        id="cu-k-float",
    ),  # fmt: skip
    pytest.param(
        lambda device: {"cu_seqlens_q": _int32([[0, 5, 12]], device)}, ValueError, "cu_seqlens_q", id="cu-q-2d"
    ),
    pytest.param(lambda device: {"cu_seqlens_k": _int32(0, device)}, ValueError, "cu_seqlens_k", id="cu-k-0d"),
    pytest.param(lambda device: {"cu_seqlens_q": _int32([], device)}, ValueError, "cu_seqlens_q", id="cu-q-empty"),
    pytest.param(
        lambda device: {"cu_seqlens_k": _int32([0, 7, 10, 15], device)},
        ValueError,
        "cu_seqlens",
        id="cu-lengths-differ",
    ),  # fmt: skip
    pytest.param(
        lambda device: {"cu_seqlens_q": _int32([0, 5, 12], "cpu")}, ValueError, "cu_seqlens_q", id="cu-q-on-cpu"
    ),  # fmt: skip
    pytest.param(
        lambda device: {"cu_seqlens_k": _int32([0, 7, 15], "cpu")}, ValueError, "cu_seqlens_k", id="cu-k-on-cpu"
    ),  # fmt: skip
    pytest.param(lambda device: {"max_seqlen_q": 7.0}, TypeError, "max_seqlen_q", id="max-q-float"),
    pytest.param(lambda device: {"max_seqlen_k": True}, TypeError, "max_seqlen_k", id="max-k-bool"),
    pytest.param(lambda device: {"max_seqlen_q": None}, TypeError, "max_seqlen_q", id="max-q-none"),
    pytest.param(lambda device: {"max_seqlen_k": "8"}, TypeError, "max_seqlen_k", id="max-k-str"),
    pytest.param(
        lambda device: {"max_seqlen_q": torch.tensor(7.0, device=device)},
        TypeError,
        "max_seqlen_q",
        id="max-q-float-tensor",
    ),  # fmt: skip
    pytest.param(lambda device: {"max_seqlen_k": _int32([8], device)}, TypeError, "max_seqlen_k", id="max-k-1d-tensor"),
    pytest.param(lambda device: {"max_seqlen_q": -1}, ValueError, "max_seqlen_q", id="max-q-negative"),
    pytest.param(lambda device: {"max_seqlen_k": -8}, ValueError, "max_seqlen_k", id="max-k-negative"),
]


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize(("change", "error", "match"), BAD_LENGTH_ARGUMENTS)
def test_op_varlen_rejects_bad_lengths_arguments(caller, change, error, match):
    with FakeTensorMode():
        arguments = valid_arguments("cuda")
        arguments.update(change("cuda"))
        with pytest.raises(error, match=match):
            caller(**arguments)


@pytest.mark.parametrize("name", ["k", "v"])
def test_op_varlen_rejects_mixed_devices(name):
    """k or v on the CPU while q is on the GPU (fake CUDA tensors): the error names it."""
    with FakeTensorMode():
        arguments = valid_arguments("cuda")
        arguments[name] = torch.randn(arguments[name].shape, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=rf"\b{name}\b"):
            tile_fmha_varlen(**arguments)


def test_op_varlen_signature():
    """The call as flash_attn_varlen_func's: positional packed arguments, then the dense
    function's scaling and is_causal, then keyword-only modifiers; tile_fmha_functional takes
    the packed arguments as keywords."""
    parameters = inspect.signature(tile_fmha_varlen).parameters
    positional = ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "scaling", "is_causal"]
    assert list(parameters)[: len(positional)] == positional
    assert parameters["scaling"].default is None and parameters["is_causal"].default is True
    keyword_only = {"window_size": None, "softcap": None, "alibi_slopes": None, "sinks": None, "return_lse": False}
    for name, default in keyword_only.items():
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert parameters[name].default is default, name
    functional = inspect.signature(tile_fmha_functional).parameters
    for name in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"):
        assert functional[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert "tile_fmha_varlen" in tilegym.__all__


@pytest.mark.parametrize("value_dim", [HEAD_DIM, 128], ids=["dv-d", "dv-128"])
def test_op_varlen_fake_implementations_give_the_shapes_of_the_real_ones(value_dim):
    """torch.compile traces the operators' fake implementations: out [total_q, Hq, Dv] in q's
    dtype, lse [Hq, total_q] float32, and the backward's gradients in their inputs' shapes."""
    with FakeTensorMode():
        arguments = valid_arguments("cuda")
        arguments["v"] = torch.randn(TOTAL_K, KV_HEADS, value_dim, dtype=torch.bfloat16, device="cuda")
        sinks = torch.zeros(Q_HEADS, dtype=torch.float32, device="cuda")
        packed = [arguments[name] for name in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")]
        lengths = (arguments["max_seqlen_q"], arguments["max_seqlen_k"])
        settings = (None, True, None, None)  # scaling, is_causal, window_size, softcap
        no_functions = ("", [], [])  # the functions key and tensors of a call without them
        out, lse = torch.ops.tilegym.attention_varlen(*packed, *lengths, None, sinks, *settings, *no_functions)
        assert (out.shape, out.dtype) == ((TOTAL_Q, Q_HEADS, value_dim), torch.bfloat16)
        assert (lse.shape, lse.dtype) == ((Q_HEADS, TOTAL_Q), torch.float32)
        q, k, v = packed[:3]
        grads = torch.ops.tilegym.attention_varlen_backward(
            torch.randn_like(out), torch.randn_like(lse), q, k, v, out, lse, *packed[3:], *lengths, None, sinks,
            *settings, True, *no_functions,
        )  # fmt: skip
        assert [tuple(g.shape) for g in grads[:4]] == [tuple(q.shape), tuple(k.shape), tuple(v.shape), (Q_HEADS,)]
        assert grads[4] == []


# ---- the fused backward's fp32 sums ------------------------------------------------------------


def test_op_varlen_fused_sums_cast_in_one_pass():
    """The fused backward's fp32 dQ sum (and grouped, dK and dV sums) is laid out as the gradient
    it is cast into: packed, rows outside heads, so copy_to is one contiguous pass; dense, [B, H,
    S, D] contiguous as before. The cast covers every row of the gradient, which is why a packed
    gradient cast from a sum needs no zeros from the kernels in its rows outside sequences."""

    launcher = SimpleNamespace(candidates=lambda name: (TileConfig(64, 128), TileConfig(128, 64)))
    total, heads, head_dim = 300, 4, 96
    packed = [packing.empty_rows(total, heads, head_dim, torch.empty(0, dtype=torch.bfloat16)) for _ in range(3)]
    dense = [torch.empty(2, heads, 150, head_dim, dtype=torch.bfloat16) for _ in range(3)]
    for gradients, rows_outside_heads in ((packed, True), (dense, False)):
        targets = launch._fused_targets(launcher, BACKWARD_FUSED_GROUPED, *gradients)
        assert targets.grouped
        for total_sum, gradient in zip((targets.dq, targets.dk, targets.dv), gradients, strict=True):
            # Rows padded to whole tiles of every candidate (128), D to its tile (128).
            assert total_sum.shape[:2] == gradient.shape[:2]
            assert total_sum.shape[2] % 128 == 0 and total_sum.shape[2] >= gradient.shape[2]
            assert total_sum.shape[3] == 128
            assert (total_sum.stride(2) > total_sum.stride(1)) == rows_outside_heads
            assert total_sum.is_contiguous() != rows_outside_heads
        targets.zero()
        for total_sum in (targets.dq, targets.dk, targets.dv):
            assert torch.equal(total_sum, torch.zeros_like(total_sum))
            total_sum.normal_()
        poisoned = [torch.full_like(g, float("nan")) for g in gradients]
        targets.copy_to(*poisoned)
        for total_sum, gradient in zip((targets.dq, targets.dk, targets.dv), poisoned, strict=True):
            rows, dim = gradient.shape[2], gradient.shape[3]
            assert torch.equal(gradient, total_sum[:, :, :rows, :dim].to(gradient.dtype))
