"""Score and mask functions written in cuTile (score_mod, mask_mod, block masks), on the GPU
against the float64 reference; every test skips without CUDA.

Each case pairs the ready-made functions of score_functions.py with what they mean in plain
PyTorch: a bias tensor (built from the same tables, so that autograd gives the reference
gradient of a learnable table) or a -inf mask. Our errors must be within the tolerance rule of
attention_cases against that reference, the same reference run in the inputs' dtype being the
yardstick. Outputs come from a caching allocator filled with NaN first (poisoned).
"""

import dataclasses
import math

import cuda.tile as ct
import pytest
import torch

from tests.ops.attention_cases import (
    GQA_4TO1,
    MQA,
    ODD_LENGTHS,
    SQ_GT_SK,
    Case,
    assert_close_to_reference,
    capture_training_step,
    make_inputs,
    max_error,
    ran_with,
    reference_run,
)
from tests.ops.conftest import requires_cuda
from tilegym import (
    UserFunctionError,
    create_block_mask,
    fmha_forward_with_lse,
    tile_fmha,
    tile_fmha_functional,
    tile_fmha_with_backward,
)
from tilegym.ops.attention import configs, dispatch
from tilegym.ops.attention import score_functions as sf
from tilegym.ops.attention.reference import attention_reference

pytestmark = requires_cuda

DOCS = Case("docs", 2, 4, 2, 300, 300, 64)
WIDE = Case("wide", 2, 2, 1, 333, 333, 128)


def _poison_allocator():
    """Fill the blocks the caching allocator will hand out next with NaN."""
    filler = torch.full((64 * 1024 * 1024,), math.nan, device="cuda")
    del filler


def _positions(case: Case):
    rows = torch.arange(case.seqlen_q, device="cuda")[:, None]
    cols = torch.arange(case.seqlen_k, device="cuda")[None, :]
    return rows, cols


def _hide(visible: torch.Tensor) -> torch.Tensor:
    """A bias that hides what is not visible."""
    return torch.zeros(visible.shape, dtype=torch.float64, device="cuda").masked_fill(~visible, -math.inf)


def _doc_ids(case: Case, documents: int = 4) -> torch.Tensor:
    """int32 [B, S]: each row cut into `documents` runs of random lengths."""
    ids = torch.empty((case.batch, case.seqlen_q), dtype=torch.int32, device="cuda")
    for b in range(case.batch):
        cuts = torch.sort(torch.randperm(case.seqlen_q - 1)[: documents - 1] + 1).values.tolist()
        bounds = [0, *cuts, case.seqlen_q]
        for doc, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            ids[b, start:end] = doc
    return ids


# Each builder: (case, dtype) -> (our keyword arguments, reference keyword arguments as
# attention_reference takes them given fp64 tensors, and the learnable tensors (ours, and
# the reference's view of them) whose gradients to compare).
# The ready-made softcap and ALiBi run as the switches they stand for (predefined.py; tested
# below); sf.inlined runs them as functions, as one's own would.
def _softcap(case, dtype):
    cap = 4.0
    capped = sf.softcap(cap, approximate=dtype in (torch.float16, torch.bfloat16))
    return sf.inlined(capped), {"softcap": cap}, []


def _alibi(case, dtype):
    slopes = torch.rand(case.q_heads, device="cuda") * 0.2 + 0.01
    return sf.inlined(sf.alibi(slopes, case.seqlen_q, case.seqlen_k)), {"alibi_slopes": slopes}, []


def _additive_bias(case, dtype, shape=None):
    """A learnable bias through score_functions.additive_bias, as written (its gradient by aux_grad's
    adds); shape: each dim 1 or the call's (broadcast: one entry takes many pairs' adds)."""
    shape = shape or (case.batch, case.q_heads, case.seqlen_q, case.seqlen_k)
    bias = torch.randn(shape, device="cuda", dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    bias.requires_grad_()
    return sf.inlined(sf.additive_bias(bias)), {"attn_bias": lambda table: table}, [bias]


def _head_and_key_bias(case, dtype):
    return _additive_bias(case, dtype, (1, case.q_heads, 1, case.seqlen_k))


def _sliding_window(case, dtype, left=20, right=7):
    window = sf.inlined(sf.sliding_window(left, right, case.seqlen_q, case.seqlen_k))
    return window, {"window_size": (left, right)}, []


def _relative(case, dtype, max_distance=16):
    table_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    table = (torch.randn(case.q_heads, 2 * max_distance + 1, device="cuda", dtype=table_dtype) * 0.5).requires_grad_()
    rows, cols = _positions(case)
    buckets = (cols - rows).clamp(-max_distance, max_distance) + max_distance

    def bias(table64):
        return table64[:, buckets][None]  # [1, H, Sq, Sk]

    return sf.relative_position_bias(table, max_distance), {"attn_bias": bias}, [table]


def _documents(case, dtype):
    ids = _doc_ids(case)
    visible = ids[:, None, :, None] == ids[:, None, None, :]
    return sf.document_mask(ids), {"attn_bias": lambda _: _hide(visible)}, []


def _prefix_lm(case, dtype):
    prefix = torch.tensor([37, 150][: case.batch], dtype=torch.int32, device="cuda")
    rows, cols = _positions(case)
    visible = (cols[None] < prefix[:, None, None].long()) | (cols <= rows)[None]
    return sf.prefix_lm(prefix), {"attn_bias": lambda _: _hide(visible[:, None])}, []


def _window_globals(case, dtype):
    rows, cols = _positions(case)
    visible = (rows - cols < 40) | (cols < 4)
    return sf.sliding_window_with_globals(40, 4), {"attn_bias": lambda _: _hide(visible)}, []


def _key_padding(case, dtype):
    lengths = torch.tensor([case.seqlen_k - 13, case.seqlen_k // 3][: case.batch], dtype=torch.int32, device="cuda")
    cols = torch.arange(case.seqlen_k, device="cuda")
    visible = cols[None, :] < lengths[:, None].long()
    return sf.key_padding(lengths), {"attn_bias": lambda _: _hide(visible[:, None, None, :])}, []


def _key_is_valid(b, h, q_idx, kv_idx, mask_aux):
    return ct.gather(mask_aux[0], (b, kv_idx)) != 0


def _valid_keys(case, dtype):
    """A mask from a per-key table (int32 [B, Sk], nonzero: the key is seen), empty without keys."""
    flags = (torch.rand(case.batch, case.seqlen_k, device="cuda") < 0.7).to(torch.int32)
    visible = flags[:, None, None, :] != 0
    return {"mask_mod": _key_is_valid, "mask_aux": (flags,)}, {"attn_bias": lambda _: _hide(visible)}, []


def _relative_in_documents(case, dtype):
    ours, ref, learnable = _relative(case, dtype)
    doc_ours, doc_ref, _ = _documents(case, dtype)
    bias, hide = ref["attn_bias"], doc_ref["attn_bias"]
    return {**ours, **doc_ours}, {"attn_bias": lambda table: bias(table) + hide(None)}, learnable


def _relative_prefix_lm(case, dtype):
    ours, ref, learnable = _relative(case, dtype)
    mask_ours, mask_ref, _ = _prefix_lm(case, dtype)
    bias, hide = ref["attn_bias"], mask_ref["attn_bias"]
    return {**ours, **mask_ours}, {"attn_bias": lambda table: bias(table) + hide(None)}, learnable


def _relative_in_a_window(case, dtype):
    ours, ref, learnable = _relative(case, dtype)
    return {**ours, "window_size": (5, 0)}, {**ref, "window_size": (5, 0)}, learnable


def _head_tilt_score(score, b, h, q_idx, kv_idx, aux):
    return score + ct.astype(ct.gather(aux[0], (h,)), score.dtype)


def _head_tilt_grad(grad, score, b, h, q_idx, kv_idx, aux, aux_grads):
    sf.add_to_aux_grad(aux_grads, 0, (h,), ct.sum(grad))


def _learned_head_tilt_in_a_window(case, dtype):
    """A learned bias per head (one sum per tile and head for its gradient), in a window."""
    tilt = torch.randn(case.q_heads, device="cuda", dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    tilt.requires_grad_()
    ours = {"score_mod": _head_tilt_score, "score_mod_grad": sf.additive_grad, "aux": (tilt,),
            "aux_grad": _head_tilt_grad, "window_size": (5, 0)}  # fmt: skip
    return ours, {"attn_bias": lambda table: table[None, :, None, None], "window_size": (5, 0)}, [tilt]


# name -> (case, causal, builder)
CASES = {
    "softcap": (ODD_LENGTHS, False, _softcap),
    "softcap-gqa-causal": (GQA_4TO1, True, _softcap),
    "alibi-causal": (MQA, True, _alibi),
    "alibi-sq-gt-sk": (SQ_GT_SK, False, _alibi),
    "relative-table": (GQA_4TO1, False, _relative),
    "relative-table-causal": (ODD_LENGTHS, True, _relative),
    "documents": (DOCS, False, _documents),
    "documents-causal": (DOCS, True, _documents),
    "prefix-lm": (DOCS, False, _prefix_lm),
    "window-globals-causal": (WIDE, True, _window_globals),
    "key-padding-causal": (WIDE, True, _key_padding),
    "key-padding-sq-lt-sk": (Case("sq-lt-sk", 2, 4, 4, 100, 300, 64), False, _key_padding),
    "relative-in-documents-causal": (DOCS, True, _relative_in_documents),
    "additive-bias": (GQA_4TO1, False, _additive_bias),
    "additive-bias-broadcast-causal": (SQ_GT_SK, True, _head_and_key_bias),
    "sliding-window": (Case("sq-lt-sk", 2, 4, 2, 100, 300, 64), False, _sliding_window),
    "sliding-window-causal": (ODD_LENGTHS, True, _sliding_window),
    # An aux gradient where a mask or window leaves whole key tiles seen by no query: their dK/dV
    # programs return at once (they hung with the aux gradient's adds in the kernel). 64x128
    # tiles (D=64) and D=128's, GQA, Sq < Sk, a table read per score and one sum per tile and head.
    "relative-prefix-lm-unseen-keys": (Case("prefix-sq-lt-sk", 2, 4, 2, 77, 300, 64), False, _relative_prefix_lm),
    "relative-prefix-lm-unseen-keys-d128": (Case("prefix-sq-lt-sk", 2, 4, 2, 77, 300, 128), False, _relative_prefix_lm),
    "relative-window-unseen-keys": (Case("window-sq-lt-sk", 1, 4, 2, 10, 600, 64), True, _relative_in_a_window),
    "relative-window-unseen-keys-d128": (Case("window-sq-lt-sk", 2, 2, 1, 10, 600, 128), True, _relative_in_a_window),
    "head-tilt-window-unseen-keys-d128": (
        Case("window-sq-lt-sk", 1, 4, 4, 10, 600, 128),
        True,
        _learned_head_tilt_in_a_window,
    ),
    # No keys: a learned per-key bias of no entries is taken, its gradient zeros of its shape.
    "key-bias-without-keys": (Case("no-keys", 1, 8, 1, 37, 0, 32), False, _head_and_key_bias),
    "relative-table-without-keys": (Case("no-keys", 2, 4, 2, 19, 0, 64), True, _relative),
    # A mask read from a per-key table: with keys, and without (its table of no entries is taken).
    "valid-keys-sq-lt-sk": (Case("sq-lt-sk", 2, 4, 2, 100, 300, 64), False, _valid_keys),
    "valid-keys-without-keys": (Case("no-keys", 2, 4, 2, 37, 0, 64), True, _valid_keys),
}


def _reference(q, k, v, causal, ref_kwargs, learnable, compute_dtype):
    """(out, lse, tensors to differentiate) of the reference in compute_dtype."""
    inputs = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v)]
    tables = [t.detach().to(compute_dtype).requires_grad_() for t in learnable]
    kwargs = dict(ref_kwargs)
    if "attn_bias" in kwargs:
        kwargs["attn_bias"] = kwargs["attn_bias"](tables[0] if tables else None).to(compute_dtype)
    out, lse = attention_reference(*inputs, is_causal=causal, compute_dtype=compute_dtype, **kwargs)
    return out, lse, inputs + tables


def check_case(case: Case, dtype, causal: bool, build):
    q, k, v = make_inputs(case, dtype)
    ours_kwargs, ref_kwargs, learnable = build(case, dtype)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    d_out = torch.randn_like(q)
    d_lse = torch.randn(q.shape[:3], device="cuda", dtype=torch.float64 if dtype == torch.float64 else torch.float32)

    _poison_allocator()
    out, lse = tile_fmha_with_backward(*leaves, is_causal=causal, return_lse=True, **ours_kwargs)
    grads = torch.autograd.grad([out, lse], leaves + learnable, [d_out, d_lse])

    ref_out, ref_lse, ref_inputs = _reference(q, k, v, causal, ref_kwargs, learnable, torch.float64)
    ref_grads = torch.autograd.grad([ref_out, ref_lse], ref_inputs, [d_out.double(), d_lse.double()])
    base_dtype = torch.float64 if dtype == torch.float64 else dtype
    base_out, base_lse, base_inputs = _reference(q, k, v, causal, ref_kwargs, learnable, base_dtype)
    base_grads = torch.autograd.grad([base_out, base_lse], base_inputs, [d_out.to(base_dtype), d_lse.to(base_dtype)])

    assert_close_to_reference("out", out, base_out, ref_out, dtype)
    sees_none = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), sees_none), "lse must be -inf exactly where a row sees no key"
    scale = 1 + ref_lse[~sees_none].abs().max().item() if (~sees_none).any() else 1
    assert max_error(lse[~sees_none], ref_lse[~sees_none]) <= (1e-12 if dtype == torch.float64 else 1e-5) * scale
    names = ["dq", "dk", "dv"] + [f"d_aux{i}" for i in range(len(learnable))]
    for name, ours, base, ref in zip(names, grads, base_grads, ref_grads, strict=True):
        assert_close_to_reference(name, ours, base, ref, dtype)


@pytest.mark.parametrize("name", list(CASES))
def test_op_attention_programmable(name):
    case, causal, build = CASES[name]
    check_case(case, torch.bfloat16, causal, build)


# The fused backward with a mask function alone, forced on rows shorter than "auto" fuses from
# (D=128, 2048 keys): D=64 and 128, causal and not, grouped queries with a causal mask (its
# grouped form: a program per query head) and without, Sq != Sk.
FUSED_MASK_CASES = {
    "documents-causal-d128": (Case("docs-d128", 2, 4, 4, 300, 300, 128), True, _documents),
    "documents-gqa-d128": (Case("docs-gqa", 1, 8, 2, 257, 257, 128), False, _documents),
    "documents-gqa-causal-d128": (Case("docs-gqa", 2, 8, 2, 300, 300, 128), True, _documents),
    "key-padding-gqa-causal-d64": (Case("gqa-sq-lt-sk", 2, 4, 1, 100, 300, 64), True, _key_padding),
    "documents-causal-d64": (Case("docs-d64", 2, 4, 4, 300, 300, 64), True, _documents),
    "prefix-lm-d128": (Case("prefix-d128", 2, 4, 4, 300, 300, 128), False, _prefix_lm),
    "window-globals-causal": (Case("wide-mha", 2, 2, 2, 333, 333, 128), True, _window_globals),
    "key-padding-sq-lt-sk": (Case("sq-lt-sk", 2, 4, 4, 100, 300, 128), False, _key_padding),
}


@pytest.mark.parametrize("name", list(FUSED_MASK_CASES))
def test_op_attention_masks_fused_backward(name, monkeypatch, force_config):
    case, causal, build = FUSED_MASK_CASES[name]
    monkeypatch.setenv("TILEGYM_BACKWARD", "fused")
    grouped = causal and case.q_heads > case.kv_heads
    fused = configs.BACKWARD_FUSED_GROUPED if grouped else configs.BACKWARD_FUSED
    config = configs.candidates(fused, "sm_90", case.head_dim, 2, configs.ScoreTables.MASKS)[0]
    force_config(fused, config)
    check_case(case, torch.bfloat16, causal, build)
    assert ran_with(fused, config)


# A score function declared elementwise (ALiBi, softcap) alone takes the fused backward at
# D=64-128 (64x128 tiles at D=64), dense, ungrouped: forced here on rows shorter than "auto" fuses
# from; causal and not, Sq != Sk, GQA without a causal mask, fp16.
FUSED_FUNCTION_CASES = {
    "alibi-causal-d128": (Case("alibi-d128", 2, 4, 4, 300, 300, 128), True, _alibi, torch.bfloat16),
    "alibi-sq-gt-sk-d96": (Case("alibi-d96", 2, 4, 2, 333, 200, 96), False, _alibi, torch.bfloat16),
    "softcap-gqa-d128": (Case("softcap-gqa", 2, 8, 2, 257, 257, 128), False, _softcap, torch.bfloat16),
    "softcap-causal-sq-lt-sk": (Case("softcap-d128", 2, 4, 4, 150, 300, 128), True, _softcap, torch.float16),
    "alibi-causal-sq-gt-sk-d64": (Case("alibi-d64", 2, 4, 4, 301, 170, 64), True, _alibi, torch.bfloat16),
    "softcap-gqa-odd-d64": (Case("softcap-gqa-d64", 2, 4, 2, 77, 150, 64), False, _softcap, torch.bfloat16),
    "softcap-causal-sq-lt-sk-d64": (Case("softcap-d64", 1, 2, 2, 333, 640, 64), True, _softcap, torch.float16),
}


@pytest.mark.parametrize("name", list(FUSED_FUNCTION_CASES))
def test_op_attention_elementwise_functions_fused_backward(name, monkeypatch, force_config):
    case, causal, build, dtype = FUSED_FUNCTION_CASES[name]
    monkeypatch.setenv("TILEGYM_BACKWARD", "fused")
    config = configs.candidates(configs.BACKWARD_FUSED, "sm_90", case.head_dim, 2, configs.ScoreTables.FUNCTIONS)[0]
    force_config(configs.BACKWARD_FUSED, config)
    check_case(case, dtype, causal, build)
    assert ran_with(configs.BACKWARD_FUSED, config)


def test_op_attention_aux_and_one_row_bias_gradients_with_unseen_key_tiles():
    """A learned bias per key ([B, 1, 1, Sk], one row) beside a learned relative table, in a window
    that hides key tiles from every query: their programs return early and write the bias
    gradient's zeros there too (its buffer starts uninitialized)."""
    case = Case("window-sq-lt-sk", 2, 4, 2, 10, 600, 64)
    q, k, v = make_inputs(case, torch.bfloat16)
    table = (torch.randn(case.q_heads, 33, device="cuda") * 0.5).requires_grad_()
    bias = torch.randn(case.batch, 1, 1, case.seqlen_k, device="cuda").requires_grad_()
    leaves = [t.requires_grad_() for t in (q, k, v)]
    d_out = torch.randn_like(q)
    _poison_allocator()
    out = tile_fmha_with_backward(
        *leaves, is_causal=True, window_size=(5, 0), attn_bias=bias, **sf.relative_position_bias(table, 16)
    )
    grads = torch.autograd.grad(out, leaves + [table, bias], d_out)

    def reference(dtype):
        inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, table, bias)]
        table_ref = inputs[3]

        def relative(scores, b, h, q_idx, kv_idx):
            return scores + table_ref[h, (kv_idx - q_idx).clamp(-16, 16) + 16]

        ref_out, _ = attention_reference(*inputs[:3], is_causal=True, compute_dtype=dtype, window_size=(5, 0),
                                         attn_bias=inputs[4], score_mod=relative)  # fmt: skip
        return ref_out, torch.autograd.grad(ref_out, inputs, d_out.to(dtype))

    ref_out, ref_grads = reference(torch.float64)
    base_out, base_grads = reference(torch.bfloat16)
    assert_close_to_reference("out", out, base_out, ref_out, torch.bfloat16)
    for name, ours, base, ref in zip(
        ["dq", "dk", "dv", "d_table", "d_bias"], grads, base_grads, ref_grads, strict=True
    ):
        assert_close_to_reference(name, ours, base, ref, torch.bfloat16)
    assert torch.all(grads[4][..., :585] == 0), "keys no query sees get a zero bias gradient"


def _far_keys_score(score, b, h, q_idx, kv_idx, aux):
    return score + ct.where(kv_idx < 64, 100.0, 0.0)


def _far_keys_bias_tensor(case):
    cols = torch.arange(case.seqlen_k, device="cuda")
    return torch.where(cols < 64, 100.0, 0.0).double()[None, None, None, :]


def _far_keys(case, dtype):
    """The first 64 keys score 100 above the rest, also in query rows past the sequence (Q zero
    there): exp2 of their base-2 scores overflows unless the row's LSE is subtracted first."""
    bias = _far_keys_bias_tensor(case)
    return {"score_mod": _far_keys_score, "score_mod_grad": sf.additive_grad}, {"attn_bias": lambda _: bias}, []


@sf.elementwise
def _far_keys_score_elementwise(score, b, h, q_idx, kv_idx, aux):
    return score + ct.where(kv_idx < 64, 100.0, 0.0)


def _far_keys_elementwise(case, dtype):
    """_far_keys declared elementwise, which takes the fused backward where forced."""
    ours, ref, learnable = _far_keys(case, dtype)
    return {**ours, "score_mod": _far_keys_score_elementwise}, ref, learnable


def _far_keys_one_row_bias(case, dtype):
    """_far_keys as the built-in one-row bias, which scores rows past the sequence alike."""
    bias = _far_keys_bias_tensor(case)
    return {"attn_bias": bias.to(dtype)}, {"attn_bias": lambda _: bias}, []


# A causal score function alone keeps a fixed row max from the diagonal's tiles at long rows
# (dispatch.fixed_max_forward: 2048 keys per query on average at D=128, 4096 at D=64): square
# and Sq < Sk, with a table read per score; at D=64 (one CTA or four 64x64 CTAs per SM, as the
# tuner picks) short query rows keep the float64 reference small, with an overflow that forces
# the running max again. Each candidate of the case's head dim forced.
_LONG = 2 * dispatch.FIXED_MAX_FORWARD_MIN_MEAN_KEYS[128] + 3


def _keys_for_fixed_max_d64(seqlen_q: int) -> int:
    """Keys past FIXED_MAX_FORWARD_MIN_MEAN_KEYS[64] per causal query row on average."""
    return dispatch.FIXED_MAX_FORWARD_MIN_MEAN_KEYS[64] + seqlen_q // 2 + 5


FIXED_MAX_FUNCTION_CASES = {
    "alibi-square": (Case("fixed-max-alibi", 1, 2, 1, _LONG, _LONG, 128), _alibi),
    "alibi-300-queries": (Case("fixed-max-alibi-300", 1, 2, 2, 300, _LONG // 2 + 153, 128), _alibi),
    "softcap-gqa": (Case("fixed-max-softcap", 1, 4, 2, _LONG, _LONG, 128), _softcap),
    "relative-table": (Case("fixed-max-relative", 1, 2, 1, _LONG, _LONG, 128), _relative),
    "alibi-d64": (Case("fixed-max-alibi-d64", 1, 2, 2, 300, _keys_for_fixed_max_d64(300), 64), _alibi),
    "softcap-gqa-d64": (Case("fixed-max-softcap-d64", 1, 4, 2, 601, _keys_for_fixed_max_d64(601), 64), _softcap),
    "overflow-d64": (Case("fixed-max-overflow-d64", 1, 2, 1, 1000, _keys_for_fixed_max_d64(1000), 64), _far_keys),
}
FIXED_MAX_FUNCTION_CONFIG = configs.candidates(
    configs.FORWARD_LSE_FIXED_MAX, "sm_90", 128, 2, configs.ScoreTables.FUNCTIONS
)[0]


def _fixed_max_function_params():
    for name, (case, build) in FIXED_MAX_FUNCTION_CASES.items():
        tables = configs.ScoreTables.FUNCTIONS
        for config in configs.candidates(configs.FORWARD_LSE_FIXED_MAX, "sm_90", case.head_dim, 2, tables):
            tiles = f"{config.block_m}x{config.block_n}-occ{config.occupancy or 1}"
            yield pytest.param(case, build, config, id=f"{name}-{tiles}")


@pytest.mark.parametrize(("case", "build", "config"), list(_fixed_max_function_params()))
def test_op_attention_function_fixed_max_forward(case, build, config, force_config):
    force_config(configs.FORWARD_LSE_FIXED_MAX, config)
    check_case(case, torch.bfloat16, True, build)
    assert ran_with(configs.FORWARD_LSE_FIXED_MAX, config)


# Without a mask a score function alone keeps a fixed row max from the key tile on its rows'
# diagonal (bottom-right aligned) once a row sees enough keys (FIXED_MAX_FORWARD_MIN_MEAN_KEYS):
# Sq < Sk and Sq > Sk (early rows' diagonal before the first key: they start at key tile 0), GQA,
# keys not a whole number of tiles (the masked end comes last), a table read per score, keys that
# overflow the start's row max (the recompute); at D=64 each candidate.
def _full_fixed_max_cases():
    long_keys = {head_dim: dispatch.FIXED_MAX_FORWARD_MIN_MEAN_KEYS[head_dim] + 53 for head_dim in (64, 128)}
    cases = {
        "alibi-sq-lt-sk": (Case("full-fixed-max-alibi", 1, 2, 2, 300, long_keys[128], 128), _alibi),
        "softcap-gqa-sq-gt-sk": (
            Case("full-fixed-max-softcap", 1, 4, 2, long_keys[128] + 400, long_keys[128], 128),
            _softcap,
        ),
        "relative-table": (Case("full-fixed-max-relative", 1, 2, 1, 500, long_keys[128], 128), _relative),
        "overflow": (Case("full-fixed-max-overflow", 1, 2, 1, 1000, long_keys[128], 128), _far_keys),
        "softcap-gqa-d64": (Case("full-fixed-max-softcap-d64", 1, 4, 2, 601, long_keys[64], 64), _softcap),
        "overflow-d64": (Case("full-fixed-max-overflow-d64", 1, 2, 1, 300, long_keys[64], 64), _far_keys),
    }
    for name, (case, build) in cases.items():
        for config in configs.candidates(
            configs.FORWARD_LSE_FIXED_MAX, "sm_90", case.head_dim, 2, configs.ScoreTables.FUNCTIONS
        ):
            yield pytest.param(
                case, build, config, id=f"{name}-{config.block_m}x{config.block_n}-occ{config.occupancy or 1}"
            )


@pytest.mark.parametrize(("case", "build", "config"), list(_full_fixed_max_cases()))
def test_op_attention_function_fixed_max_forward_without_a_mask(case, build, config, force_config):
    force_config(configs.FORWARD_LSE_FIXED_MAX, config)
    check_case(case, torch.bfloat16, False, build)
    assert ran_with(configs.FORWARD_LSE_FIXED_MAX, config)


def test_op_attention_function_fixed_max_forward_recomputes_after_overflow(force_config):
    """Keys scored far above the diagonal's row max overflow the fixed-max forward's
    probabilities: each query tile is computed again with a running max. The rows, 4099, leave
    the last query tile part empty, whose rows score 100 on those keys too: the backward must
    give them probability 0 (gradients checked)."""
    case = Case("fixed-max-overflow", 1, 2, 1, _LONG, _LONG, 128)
    force_config(configs.FORWARD_LSE_FIXED_MAX, FIXED_MAX_FUNCTION_CONFIG)
    check_case(case, torch.bfloat16, True, _far_keys)
    assert ran_with(configs.FORWARD_LSE_FIXED_MAX, FIXED_MAX_FUNCTION_CONFIG)


# Far keys on the other backward paths: the fused backward (a function declared elementwise)
# and the built-in one-row bias on two kernels, rows not a whole number of tiles.
FAR_KEYS_CASES = {
    "function-fused": (Case("far-keys-fused", 1, 2, 2, 1027, 1027, 128), True, _far_keys_elementwise, True),
    "one-row-bias": (Case("far-keys-bias", 1, 2, 1, 1027, 1027, 128), True, _far_keys_one_row_bias, False),
    "one-row-bias-d64-full": (Case("far-keys-bias-d64", 2, 2, 2, 300, 517, 64), False, _far_keys_one_row_bias, False),
}


@pytest.mark.parametrize("name", list(FAR_KEYS_CASES))
def test_op_attention_far_keys_backward(name, monkeypatch, force_config):
    case, causal, build, fused = FAR_KEYS_CASES[name]
    if fused:
        monkeypatch.setenv("TILEGYM_BACKWARD", "fused")
        config = configs.candidates(configs.BACKWARD_FUSED, "sm_90", 128, 2, configs.ScoreTables.FUNCTIONS)[0]
        force_config(configs.BACKWARD_FUSED, config)
    check_case(case, torch.bfloat16, causal, build)
    if fused:
        assert ran_with(configs.BACKWARD_FUSED, config)


# A score function's training forward (with the LSE) at D=64 and 128 (the same candidates as its
# inference forward): each forced, with the backward after it.
TRAINING_FORWARD_FUNCTION_CONFIGS = [
    pytest.param(
        head_dim,
        config,
        id=f"d{head_dim}-{config.block_m}x{config.block_n}-ctas{config.num_ctas or 1}-occ{config.occupancy or 1}",
    )  # fmt: skip
    for head_dim in (64, 128)
    for config in configs.candidates(configs.FORWARD_LSE, "sm_90", head_dim, 2, configs.ScoreTables.FUNCTIONS)
]


@pytest.mark.parametrize(("head_dim", "config"), TRAINING_FORWARD_FUNCTION_CONFIGS)
@pytest.mark.parametrize("name", ["alibi-sq-gt-sk", "softcap-gqa-causal", "relative-in-documents-causal"])
def test_op_attention_programmable_training_forward_configs(name, head_dim, config, force_config):
    case, causal, build = CASES[name]
    case = dataclasses.replace(case, why=f"{case.why}-d{head_dim}", head_dim=head_dim)
    force_config(configs.FORWARD_LSE, config)
    check_case(case, torch.bfloat16, causal, build)
    assert ran_with(configs.FORWARD_LSE, config)


# A score function's inference forward at D=128 runs on one CTA or plain attention's CTA
# clusters, as the tuner picks: each candidate forced, GQA and Sq != Sk, with a table read per
# score and with a mask.
FORWARD_FUNCTION_CONFIGS = configs.candidates(configs.FORWARD, "sm_90", 128, 2, configs.ScoreTables.FUNCTIONS)


@pytest.mark.parametrize(
    "config", FORWARD_FUNCTION_CONFIGS, ids=lambda c: f"{c.block_m}x{c.block_n}-ctas{c.num_ctas or 1}"
)
@pytest.mark.parametrize(
    "name", ["softcap-gqa-causal", "alibi-sq-gt-sk", "relative-table-causal", "relative-in-documents-causal"]
)
def test_op_attention_programmable_inference_forward_configs(name, config, force_config):
    case, causal, build = CASES[name]
    case = dataclasses.replace(case, why=f"{case.why}-d128", head_dim=128)
    q, k, v = make_inputs(case, torch.bfloat16)
    ours_kwargs, ref_kwargs, learnable = build(case, torch.bfloat16)
    force_config(configs.FORWARD, config)
    _poison_allocator()
    out = tile_fmha(q, k, v, is_causal=causal, **ours_kwargs)
    ref_out, _, _ = _reference(q, k, v, causal, ref_kwargs, learnable, torch.float64)
    base_out, _, _ = _reference(q, k, v, causal, ref_kwargs, learnable, torch.bfloat16)
    assert_close_to_reference("out", out, base_out, ref_out, torch.bfloat16)
    assert ran_with(configs.FORWARD, config)


@pytest.mark.parametrize("name", ["softcap-gqa-causal", "relative-table", "documents-causal", "key-padding-causal"])
def test_op_attention_programmable_fp16(name):
    case, causal, build = CASES[name]
    check_case(case, torch.float16, causal, build)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", ["softcap", "alibi-sq-gt-sk", "relative-in-documents-causal", "prefix-lm"])
def test_op_attention_programmable_wide_dtypes(name, dtype):
    case, causal, build = CASES[name]
    small = Case("small", case.batch, 4, 2, 45 if case.seqlen_q == case.seqlen_k else 37, 45, 64)
    check_case(small, dtype, causal, build)


@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 192, 256])
def test_op_attention_programmable_head_dims(head_dim):
    case = Case(f"d{head_dim}", 2, 4, 2, 150, 150, head_dim)
    check_case(case, torch.bfloat16, True, _relative_in_documents)


def _predefined_and_keyword(case, dtype, causal):
    """name -> (a ready-made function's arguments, the keyword arguments it stands for, the
    learnable tensors)."""
    slopes = torch.rand(case.q_heads, device="cuda") * 0.2 + 0.01
    bias = torch.randn(1, case.q_heads, case.seqlen_q, case.seqlen_k, device="cuda").requires_grad_()
    return {
        "softcap": (sf.softcap(4.0), {"softcap": 4.0}, []),
        "alibi": (sf.alibi(slopes, case.seqlen_q, case.seqlen_k), {"alibi_slopes": slopes}, []),
        "bias": (sf.additive_bias(bias), {"attn_bias": bias}, [bias]),
        # and-ed with causal, nothing right of the diagonal: window_size's right side must be 0
        "window": (sf.sliding_window(24, 5, case.seqlen_q, case.seqlen_k), {"window_size": (24, 0 if causal else 5)},
                   []),
    }  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", ["softcap", "alibi", "bias", "window"])
def test_op_predefined_functions_are_the_builtin_modifiers(name, causal, dtype):
    """The ready-made softcap, ALiBi, bias and window run the kernels' code for the keyword
    argument they stand for (predefined.py): the same bits, gradients included (a bias's summed
    by the same kernels). GQA 4:1, Sq != Sk."""
    case = GQA_4TO1
    q, k, v = make_inputs(case, dtype, requires_grad=True)
    function, keyword, learnable = _predefined_and_keyword(case, dtype, causal)[name]
    d_out = torch.randn_like(q)
    results = []
    for kwargs in (function, keyword):
        out, lse = tile_fmha_with_backward(q, k, v, is_causal=causal, return_lse=True, **kwargs)
        results.append((out, lse, *torch.autograd.grad(out, [q, k, v, *learnable], d_out)))
    names = ["out", "lse", "dq", "dk", "dv"] + ["d_bias"] * len(learnable)
    for label, got, want in zip(names, *results, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=lambda m, n=label: f"{name} {n}: {m}")
    reference, _ = attention_reference(q, k, v, is_causal=causal, **keyword)
    baseline, _ = attention_reference(q, k, v, is_causal=causal, compute_dtype=dtype, **keyword)
    assert_close_to_reference("out", results[0][0], baseline, reference, dtype)


def _softcap_30_grad(grad, score, out, b, h, q_idx, kv_idx, aux):
    """d/ds 30 tanh(s / 30), written by a caller: keeps score_functions.softcap(30.0) a function.
    Divides by 30 (an fp32): 1 / 30 as a literal would reach the kernel rounded to fp32."""
    capped = out / 30.0
    return grad * (1.0 - capped * capped)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_op_default_softcap_takes_the_exact_tanh_on_wide_inputs(dtype):
    """score_functions.softcap(cap) left to pick its tanh, on 32/64-bit inputs: alone it runs
    softcap= (the same bits); kept a function (a gradient of the caller's) it runs the exact tanh,
    within the dtype's tolerance of the float64 reference (the hardware tanh, 2^-11, misses
    float32's by far and has no float64 form). A cap of 30: 1 / 30 is no fp32, so float64 runs
    on both halves of the split constants."""
    case = Case("small", 2, 4, 2, 45, 61, 64)
    q, k, v = make_inputs(case, dtype, requires_grad=True)
    q = (q * 8).detach().requires_grad_()  # scores of the cap's size: its tanh bends them
    d_out = torch.randn_like(q)
    ref_out, _, ref_grads = reference_run(q, k, v, d_out, True, {"softcap": 30.0}, torch.float64)
    base_out, _, base_grads = reference_run(q, k, v, d_out, True, {"softcap": 30.0}, dtype)
    results = []
    for kwargs in ({"softcap": 30.0}, sf.softcap(30.0), {**sf.softcap(30.0), "score_mod_grad": _softcap_30_grad}):
        _poison_allocator()
        out = tile_fmha_with_backward(q, k, v, is_causal=True, **kwargs)
        grads = torch.autograd.grad(out, [q, k, v], d_out)
        for name, ours, base, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (base_out, *base_grads),
                                         (ref_out, *ref_grads), strict=True):  # fmt: skip
            assert_close_to_reference(name, ours, base, ref, dtype)
        results.append((out, *grads))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def _three_quarters(score, b, h, q_idx, kv_idx, aux):
    return score * 0.75


def _three_quarters_grad(grad, score, out, b, h, q_idx, kv_idx, aux):
    return grad * 0.75


def _functions_after_a_bias(name, case):
    """(is_causal, our functions and keyword arguments besides attn_bias, their meaning as
    attention_reference's score_mod and keyword arguments)."""
    if name == "score-function":
        return (
            False,
            {"score_mod": _three_quarters, "score_mod_grad": _three_quarters_grad},
            (lambda s, b, h, i, j: s * 0.75),
            {},
        )
    if name == "two-softcaps":
        # softcap= comes before the bias, the function after it: only the function's tanh lies
        # between the bias and the scores.
        return (
            True,
            {**sf.softcap(5.0, False), "softcap": 30.0},
            (lambda s, b, h, i, j: 5.0 * torch.tanh(s / 5.0)),
            {"softcap": 30.0},
        )
    # A block mask whose empty tiles the kernels skip: the bias's gradient is 0 there.
    prefix = torch.tensor([37, 150], dtype=torch.int32, device="cuda")
    functions = sf.prefix_lm(prefix)
    mask = create_block_mask(functions["mask_mod"], case.batch, None, case.seqlen_q, case.seqlen_k,
                             mask_aux=functions["mask_aux"])  # fmt: skip

    def hidden(s, b, h, i, j):
        return s.masked_fill(~((j < prefix.long()[b]) | (j <= i)), -math.inf)

    return False, {"block_mask": mask}, hidden, {}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("bias_shape", ["full", "keys"])
@pytest.mark.parametrize("name", ["score-function", "two-softcaps", "block-mask"])
def test_op_bias_gradient_with_caller_functions(name, bias_shape, dtype):
    """A learnable attn_bias beside the caller's functions: its gradient is that of the scores
    it is added to, back through a score function applied after it but not through softcap=,
    applied before; and 0 on the tiles a block mask skips. Sq != Sk, GQA."""
    case = Case("bias-behind", 2, 4, 2, 197, 261, 64)
    causal, ours, meaning, keywords = _functions_after_a_bias(name, case)
    shape = (
        (case.batch, case.q_heads, case.seqlen_q, case.seqlen_k)
        if bias_shape == "full"
        else (case.batch, 1, 1, case.seqlen_k)
    )
    bias = torch.randn(shape, device="cuda", dtype=dtype).requires_grad_()
    q, k, v = make_inputs(case, dtype, requires_grad=True)
    d_out = torch.randn_like(q)
    _poison_allocator()
    out = tile_fmha_with_backward(q, k, v, is_causal=causal, attn_bias=bias, **ours)
    grads = torch.autograd.grad(out, [q, k, v, bias], d_out)
    _assert_close_to_the_reference(out, grads, q, k, v, d_out, causal, {"attn_bias": bias, "score_mod": meaning,
                                                                         **keywords})  # fmt: skip


def _assert_close_to_the_reference(out, grads, q, k, v, d_out, causal, kwargs):
    """out and grads (dq, dk, dv, then attn_bias's) against reference_run's in float64, within
    the rule's distance of its run in the inputs' dtype."""
    dtype = q.dtype
    ref_out, _, ref_grads = reference_run(q, k, v, d_out, causal, kwargs, torch.float64)
    base_out, _, base_grads = reference_run(q, k, v, d_out, causal, kwargs, dtype)
    for label, got, base, ref in zip(("out", "dq", "dk", "dv", "d_bias"), (out, *grads), (base_out, *base_grads),
                                     (ref_out, *ref_grads), strict=True):  # fmt: skip
        assert_close_to_reference(label, got, base.to(got.dtype), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_op_sixteen_bit_aux_with_its_gradient(dtype):
    """A learnable bias in the inputs' 16-bit dtype, run as a function (inlined) after softcap=:
    its aux gradient and every other against the reference. The backward reads such a tensor as
    a float32 copy (aux_gradients.read_wide), where the 16-bit one did not compile."""
    case = Case("aux16", 1, 4, 2, 150, 97, 64)
    bias = torch.randn(1, case.q_heads, case.seqlen_q, case.seqlen_k, device="cuda", dtype=dtype).requires_grad_()
    q, k, v = make_inputs(case, dtype, requires_grad=True)
    d_out = torch.randn_like(q)
    _poison_allocator()
    out = tile_fmha_with_backward(q, k, v, is_causal=True, softcap=30.0, **sf.inlined(sf.additive_bias(bias)))
    grads = torch.autograd.grad(out, [q, k, v, bias], d_out)
    assert grads[3].dtype == dtype
    _assert_close_to_the_reference(out, grads, q, k, v, d_out, True, {"softcap": 30.0, "attn_bias": bias})


def test_op_attention_programmable_gradcheck():
    """float64 gradcheck of a score function (softcap) in q, k, v, and of an aux gradient (a
    relative-position table)."""
    case = Case("tiny", 1, 2, 1, 9, 11, 32)
    q, k, v = make_inputs(case, torch.float64, requires_grad=True)
    capped = sf.inlined(sf.softcap(2.0, approximate=False))
    assert torch.autograd.gradcheck(
        lambda q, k, v: tile_fmha_with_backward(q, k, v, is_causal=True, **capped), (q, k, v), eps=1e-6, atol=1e-7
    )
    table = torch.randn(case.q_heads, 9, dtype=torch.float64, device="cuda", requires_grad=True)

    def with_table(table):
        kwargs = sf.relative_position_bias(table, 4)
        return tile_fmha_with_backward(q.detach(), k.detach(), v.detach(), is_causal=False, **kwargs)

    assert torch.autograd.gradcheck(with_table, (table,), eps=1e-6, atol=1e-7)


def test_op_attention_programmable_public_functions():
    """Every public function takes the functions, and gives the same values."""
    case, causal, build = CASES["relative-in-documents-causal"]
    q, k, v = make_inputs(case, torch.bfloat16)
    kwargs, _, _ = build(case, torch.bfloat16)
    trained, trained_lse = tile_fmha_with_backward(q, k, v, is_causal=causal, return_lse=True, **kwargs)
    inferred = tile_fmha(q, k, v, is_causal=causal, **kwargs)
    with_lse, lse = fmha_forward_with_lse(q, k, v, is_causal=causal, **kwargs)
    functional = tile_fmha_functional(q, k, v, is_causal=causal, training=False, **kwargs)
    for out in (inferred, with_lse, functional):
        torch.testing.assert_close(out, trained, atol=0, rtol=0)
    torch.testing.assert_close(lse, trained_lse, atol=0, rtol=0)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    assert tile_fmha_functional(*leaves, is_causal=causal, **kwargs).grad_fn is not None


def test_op_attention_block_mask_reused():
    """A block mask made once serves forward and backward of later calls: its tile lists are
    made on first use per tiling and not again; results are bitwise repeatable."""
    case = DOCS
    q, k, v = make_inputs(case, torch.bfloat16, requires_grad=True)
    docs = sf.document_mask(_doc_ids(case))
    mask = create_block_mask(
        docs["mask_mod"], case.batch, None, case.seqlen_q, case.seqlen_k, mask_aux=docs["mask_aux"]
    )
    d_out = torch.randn_like(q)
    first_out = tile_fmha_with_backward(q, k, v, is_causal=True, block_mask=mask)
    first = torch.autograd.grad(first_out, (q, k, v), d_out)
    made = len(mask._lists)
    assert made >= 2  # the kinds of at least one tiling, and its lists
    second_out = tile_fmha_with_backward(q, k, v, is_causal=True, block_mask=mask)
    second = torch.autograd.grad(second_out, (q, k, v), d_out)
    assert len(mask._lists) == made, "a second call must reuse the mask's lists"
    torch.testing.assert_close(second_out, first_out, atol=0, rtol=0)
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # The same mask through mask_mod per call gives the same values.
    per_call = tile_fmha_with_backward(q, k, v, is_causal=True, **docs)
    torch.testing.assert_close(per_call, first_out, atol=0, rtol=0)


def test_op_attention_block_mask_skips_empty_tiles():
    """The lists hold exactly the tiles the mask touches: a block-diagonal document mask of two
    halves, tiled at 64, lists no tile across the halves and runs the diagonal ones unmasked."""
    case = Case("halves", 1, 1, 1, 256, 256, 64)
    ids = torch.zeros((1, 256), dtype=torch.int32, device="cuda")
    ids[:, 128:] = 1
    docs = sf.document_mask(ids)
    mask = create_block_mask(docs["mask_mod"], 1, 1, 256, 256, mask_aux=docs["mask_aux"])
    from tilegym.ops.attention.block_mask import MaskRule

    lists = mask.tile_lists(64, 64, MaskRule(False, False, 512, 512), key_major=False)
    counts = lists.counts[0, 0].tolist()
    assert counts == [[0, 2], [0, 2], [0, 2], [0, 2]], counts
    assert lists.tiles[0, 0, 2, 1, :2].tolist() == [2, 3]
    causal = mask.tile_lists(64, 64, MaskRule(True, False, 512, 512), key_major=True)
    # Key tile 1 (keys 64-127): seen in full by query tile 1 (diagonal: partly), 1 only.
    assert causal.counts[0, 0].tolist() == [[1, 1], [1, 0], [1, 1], [1, 0]]
    q, k, v = make_inputs(case, torch.bfloat16)
    out = tile_fmha(q, k, v, is_causal=False, block_mask=mask)
    visible = ids[0, :, None] == ids[0, None, :]
    ref, _ = attention_reference(q, k, v, is_causal=False, attn_bias=_hide(visible))
    assert max_error(out, ref) < 2e-2


def test_op_attention_programmable_kernels_are_keyed_by_function():
    """Two functions that differ only in a closed-over constant get different kernels and
    results; the same function defined twice shares one."""
    case = ODD_LENGTHS
    q, k, v = make_inputs(case, torch.bfloat16)
    outs = {cap: tile_fmha(q, k, v, is_causal=False, **sf.inlined(sf.softcap(cap))) for cap in (1.0, 8.0)}
    refs = {cap: attention_reference(q, k, v, is_causal=False, softcap=cap)[0] for cap in (1.0, 8.0)}
    for cap in outs:
        assert max_error(outs[cap], refs[cap]) < 3e-2
    assert max_error(outs[1.0], outs[8.0]) > 0.05
    again = tile_fmha(q, k, v, is_causal=False, **sf.inlined(sf.softcap(1.0)))
    torch.testing.assert_close(again, outs[1.0], atol=0, rtol=0)


def _not_compilable(score, b, h, q_idx, kv_idx, aux):
    return score + torch.ones(1)  # PyTorch inside a kernel: cuTile refuses it


def test_op_attention_programmable_compile_error_names_the_function():
    """A function cuTile cannot compile is a UserFunctionError naming it and its file before any
    launch; the GPU stays usable."""
    q, k, v = make_inputs(ODD_LENGTHS, torch.bfloat16)
    with pytest.raises(UserFunctionError, match=r"_not_compilable.*test_attention_programmable\.py:\d+"):
        tile_fmha(q, k, v, score_mod=_not_compilable)
    out = tile_fmha(q, k, v, is_causal=False, **sf.softcap(4.0))
    assert torch.isfinite(out).all()
    torch.cuda.synchronize()


def test_op_attention_programmable_bad_arguments():
    q, k, v = make_inputs(ODD_LENGTHS, torch.bfloat16, requires_grad=True)
    capped = sf.inlined(sf.softcap(4.0))  # a function as written (the ready-made one is softcap=)
    with pytest.raises(ValueError, match="score_mod_grad"):
        tile_fmha_with_backward(q, k, v, score_mod=capped["score_mod"])
    with pytest.raises(ValueError, match="score_mod_grad is given without score_mod"):
        tile_fmha(q, k, v, score_mod_grad=capped["score_mod_grad"])
    with pytest.raises(TypeError, match="score_mod must be a Python function"):
        tile_fmha(q, k, v, score_mod="softcap")
    table = torch.randn(3, 9, device="cuda", requires_grad=True)
    relative = sf.relative_position_bias(table, 4)
    with pytest.raises(ValueError, match="no aux_grad"):
        tile_fmha_with_backward(q, k, v, **{**relative, "aux_grad": None})
    with pytest.raises(ValueError, match=r"aux\[0\] must be on q's device"):
        tile_fmha(q, k, v, **{**relative, "aux": (table.detach().cpu(),)})
    with pytest.raises(ValueError, match="at most 4"):
        tile_fmha(q, k, v, **{**relative, "aux": (table,) * 5})
    captured = torch.ones(1, device="cuda")
    with pytest.raises(TypeError, match="uses the tensor 'captured'"):
        tile_fmha(q, k, v, score_mod=lambda s, b, h, i, j, aux: s + captured)
    docs = sf.document_mask(_doc_ids(DOCS))
    mask = create_block_mask(docs["mask_mod"], None, None, 300, 300, mask_aux=docs["mask_aux"])
    with pytest.raises(ValueError, match="block_mask covers Q_LEN=300"):
        tile_fmha(q, k, v, block_mask=mask)
    with pytest.raises(ValueError, match="either block_mask or mask_mod"):
        tile_fmha(q, k, v, block_mask=mask, mask_mod=docs["mask_mod"])
    # Packed batches take score functions, aux gradients and masks (test_attention_varlen); a
    # block mask serves only the kind of batch it was made for.
    cu = torch.tensor([0, 77], dtype=torch.int32, device="cuda")
    packed = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": 77, "max_seqlen_k": 77}
    rows = [t[0].transpose(0, 1) for t in (q, k, v)]
    dense_mask = create_block_mask(docs["mask_mod"], None, None, 77, 77, mask_aux=docs["mask_aux"])
    with pytest.raises(ValueError, match="made for dense batches"):
        tile_fmha_functional(*rows, **packed, block_mask=dense_mask)
    other = cu.clone()
    packed_mask = create_block_mask(docs["mask_mod"], None, None, 77, 77, mask_aux=docs["mask_aux"],
                                    cu_seqlens_q=other, cu_seqlens_k=other)  # fmt: skip
    with pytest.raises(ValueError, match="other cu_seqlens_q"):
        tile_fmha_functional(*rows, **packed, block_mask=packed_mask)
    with pytest.raises(ValueError, match="made for a packed batch"):
        tile_fmha(q, k, v, block_mask=packed_mask)


def _head_bias(score, b, h, q_idx, kv_idx, aux):
    return score + ct.astype(ct.gather(aux[0], h), score.dtype)


def _head_bias_grad_atomic(grad, score, b, h, q_idx, kv_idx, aux, aux_grads):
    ct.atomic_add(aux_grads[0], h, ct.sum(grad))


def _head_bias_grad(grad, score, b, h, q_idx, kv_idx, aux, aux_grads):
    sf.add_to_aux_grad(aux_grads, 0, (h,), ct.sum(grad))


def _learned_head_bias(case, dtype, aux_grad=_head_bias_grad):
    """A learnable bias per query head: every pair of a head adds into one entry (the most
    colliding adds there are)."""
    bias = (torch.randn(case.q_heads, device="cuda") * 0.5).requires_grad_()
    ours = {"score_mod": _head_bias, "score_mod_grad": sf.additive_grad, "aux": (bias,), "aux_grad": aux_grad}
    return ours, {"attn_bias": lambda table: table[None, :, None, None]}, [bias]


REPEATABLE_AUX_CASES = {
    "relative-table-causal": (ODD_LENGTHS, True, _relative),
    "head-bias-gqa": (GQA_4TO1, False, _learned_head_bias),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(REPEATABLE_AUX_CASES))
def test_op_attention_aux_gradient_repeatable_under_deterministic_algorithms(name, dtype):
    """Under torch.use_deterministic_algorithms(True), an aux_grad that adds through
    add_to_aux_grad sums in fixed point: two backward passes give bitwise-equal gradients, the aux
    gradient within the reference's tolerance and within 1e-5 of the atomic fp32 sums. The LSE
    takes a gradient too: without it a head bias's gradient would sum to about 0 (a softmax
    row's gradient does), rounding alone."""
    case, causal, build = REPEATABLE_AUX_CASES[name]
    q, k, v = make_inputs(case, dtype)
    ours_kwargs, ref_kwargs, learnable = build(case, dtype)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    d_out = torch.randn_like(q)
    d_lse = torch.randn(q.shape[:3], device="cuda")

    def gradients():
        _poison_allocator()
        out, lse = tile_fmha_with_backward(*leaves, is_causal=causal, return_lse=True, **ours_kwargs)
        return torch.autograd.grad([out, lse], leaves + learnable, [d_out, d_lse])

    try:
        torch.use_deterministic_algorithms(True)
        first, second = gradients(), gradients()
    finally:
        torch.use_deterministic_algorithms(False)
    for label, a, b in zip(("dq", "dk", "dv", "d_aux"), first, second, strict=True):
        assert torch.equal(a, b), f"{label} differs between two deterministic runs"
    atomic = gradients()[-1]
    assert atomic.dtype == first[-1].dtype == learnable[0].dtype
    torch.testing.assert_close(first[-1], atomic, rtol=1e-5, atol=1e-5 * atomic.abs().max().item())
    ref_out, ref_lse, ref_inputs = _reference(q, k, v, causal, ref_kwargs, learnable, torch.float64)
    ref_grads = torch.autograd.grad([ref_out, ref_lse], ref_inputs, [d_out.double(), d_lse.double()])
    base_out, base_lse, base_inputs = _reference(q, k, v, causal, ref_kwargs, learnable, dtype)
    base_grads = torch.autograd.grad([base_out, base_lse], base_inputs, [d_out, d_lse.to(dtype)])
    for label, ours, base, ref in zip(("dq", "dk", "dv"), first[:3], base_grads[:3], ref_grads[:3], strict=True):
        assert_close_to_reference(label, ours, base, ref, dtype)
    if dtype == torch.float32:
        # A sum over every pair of a head: PyTorch's float32 reference sums exact products, the
        # kernels' (any sum of theirs, atomic or fixed point) those of their float32 matmuls.
        assert max_error(first[-1], ref_grads[-1]) <= 1e-5 * ref_grads[-1].abs().max().item()
    else:
        assert_close_to_reference("d_aux0", first[-1], base_grads[-1], ref_grads[-1], dtype)


def test_op_attention_aux_gradient_out_of_fixed_point_range_is_nan():
    """Fixed-point sums never wrap silently: shares far too large give NaN in the deterministic
    aux gradient (where the atomic sums stay finite), and the other gradients are unchanged."""
    case = GQA_4TO1
    q, k, v = make_inputs(case, torch.float32)
    ours_kwargs, _, learnable = _learned_head_bias(case, torch.float32)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    d_out = torch.randn_like(q) * 1e12
    out = tile_fmha_with_backward(*leaves, is_causal=False, **ours_kwargs)
    atomic = torch.autograd.grad(out, leaves + learnable, d_out, retain_graph=True)
    try:
        torch.use_deterministic_algorithms(True)
        fixed = torch.autograd.grad(out, leaves + learnable, d_out)
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.isfinite(atomic[-1]).all() and torch.isnan(fixed[-1]).all()
    for a, b in zip(atomic[:3], fixed[:3], strict=True):
        torch.testing.assert_close(a, b)


def test_op_attention_aux_gradient_refused_under_deterministic_algorithms():
    """An aux_grad that adds by ct.atomic_add itself, or any aux gradient of float64 inputs,
    is not repeatable: torch.use_deterministic_algorithms refuses it before any launch (warns
    with warn_only); a frozen table runs."""
    case = GQA_4TO1
    q, k, v = make_inputs(case, torch.bfloat16, requires_grad=True)
    kwargs, _, (bias,) = _learned_head_bias(case, torch.bfloat16, aux_grad=_head_bias_grad_atomic)
    out = tile_fmha_with_backward(q, k, v, **kwargs)
    q64, k64, v64 = make_inputs(case, torch.float64, requires_grad=True)
    table_kwargs, _, (table,) = _relative(case, torch.float64)
    out64 = tile_fmha_with_backward(q64, k64, v64, **table_kwargs)
    try:
        torch.use_deterministic_algorithms(True)
        with pytest.raises(RuntimeError, match="aux_grad adds with ct.atomic_add"):
            out.backward(torch.ones_like(out), retain_graph=True)
        assert bias.grad is None and q.grad is None
        with pytest.raises(RuntimeError, match="float64"):
            out64.sum().backward()
        assert table.grad is None
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match="aux_grad"):
            out.backward(torch.ones_like(out))
        assert bias.grad is not None and torch.isfinite(bias.grad).all()
        frozen = tile_fmha_with_backward(q, k, v, **{**kwargs, "aux": (bias.detach(),)})
        torch.use_deterministic_algorithms(True)
        frozen.sum().backward()
    finally:
        torch.use_deterministic_algorithms(False)


def test_op_attention_programmable_in_a_cuda_graph():
    """A training step with a score function (its table learnable) and a block mask, captured and
    replayed on new inputs, gives the eager step's values."""
    case, causal, build = CASES["relative-in-documents-causal"]
    q, k, v = make_inputs(case, torch.bfloat16, requires_grad=True)
    kwargs, _, (table,) = build(case, torch.bfloat16)
    mask = create_block_mask(kwargs.pop("mask_mod"), case.batch, None, case.seqlen_q, case.seqlen_k,
                             mask_aux=kwargs.pop("mask_aux"))  # fmt: skip
    d_out = torch.randn_like(q)
    leaves = (q, k, v, table)

    def step():
        out = tile_fmha_with_backward(q, k, v, is_causal=causal, block_mask=mask, **kwargs)
        out.backward(d_out)
        return out

    graph, out = capture_training_step(step, leaves)

    with torch.no_grad():
        for t in (q, k, v, d_out):
            t.copy_(torch.randn_like(t))
        table.mul_(2.0)
        for t in (out, *[leaf.grad for leaf in leaves]):
            t.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    got = (out.clone(), *[leaf.grad.clone() for leaf in leaves])

    for t in leaves:
        t.grad = None
    eager_out = step()
    want = (eager_out, *[leaf.grad for leaf in leaves])
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=False):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    # The table's gradient is summed by atomic adds: equal to rounding.
    torch.testing.assert_close(got[4], want[4], atol=1e-3, rtol=1e-3)


def _compile_cases(case):
    """name -> (our keyword arguments, the learnable tensors, fullgraph): module-level functions
    (ALiBi, a mask function), closures (softcap, a learned relative table) and a block mask,
    which runs eagerly at a graph break."""
    slopes = torch.rand(case.q_heads, device="cuda") * 0.1
    table = (torch.randn(case.q_heads, 2 * 16 + 1, device="cuda") * 0.5).requires_grad_()
    ids = _doc_ids(case)
    documents = sf.document_mask(ids)
    mask = create_block_mask(documents["mask_mod"], case.batch, None, case.seqlen_q, case.seqlen_k,
                             mask_aux=documents["mask_aux"])  # fmt: skip
    return {
        "alibi": (sf.alibi(slopes, case.seqlen_q, case.seqlen_k), [], True),
        "softcap-documents": ({**sf.softcap(4.0), **documents}, [], True),
        "learned-table": (sf.relative_position_bias(table, 16), [table], True),
        "block-mask": ({**sf.softcap(4.0), "block_mask": mask}, [], False),
    }


@pytest.mark.parametrize("name", ["alibi", "softcap-documents", "learned-table", "block-mask"])
def test_op_attention_programmable_under_torch_compile(name):
    """torch.compile(fullgraph=True) keeps a call with score and mask functions in one graph
    (the operators take the functions by key), a block mask runs at a graph break; values and
    gradients (a learned table's too) are the eager call's."""
    torch._dynamo.reset()
    case = Case("compile", 2, 4, 2, 300, 300, 64)
    q, k, v = make_inputs(case, torch.bfloat16, requires_grad=True)
    kwargs, learnable, fullgraph = _compile_cases(case)[name]

    def attention(q, k, v, kwargs):
        out, lse = tile_fmha_with_backward(q, k, v, is_causal=True, return_lse=True, **kwargs)
        return out * 2.0, lse

    d_out, d_lse = torch.randn_like(q), torch.randn(q.shape[:3], device="cuda")
    leaves = [q, k, v, *learnable]
    results = []
    for fn in (torch.compile(attention, fullgraph=fullgraph), attention, torch.compile(attention, fullgraph=fullgraph)):
        out, lse = fn(q, k, v, kwargs)
        results.append((out, lse, *torch.autograd.grad((out, lse), leaves, (d_out, d_lse))))
    names = ["out", "lse", "dq", "dk", "dv"] + ["d_table"] * len(learnable)
    for compiled in (results[0], results[2]):  # traced, then from the compiled graph
        for label, got, want in zip(names, compiled, results[1], strict=True):
            # A table's gradient is summed by atomic adds: equal to rounding.
            tolerance = {"atol": 1e-3, "rtol": 1e-3} if label == "d_table" else {"atol": 0, "rtol": 0}
            torch.testing.assert_close(got, want, **tolerance, msg=lambda m, n=label: f"{n}: {m}")
    # Inference under compile too, and without a gradient for the table.
    with torch.no_grad():
        compiled_out = torch.compile(tile_fmha, fullgraph=fullgraph)(q, k, v, is_causal=True, **kwargs)
        torch.testing.assert_close(compiled_out, tile_fmha(q, k, v, is_causal=True, **kwargs), atol=0, rtol=0)


def _scaled_by(factor):
    """A closure: under torch.compile it runs at a graph break."""

    def scaled(score, b, h, q_idx, kv_idx, aux):
        return score * factor

    return {"score_mod": scaled}


def test_op_attention_programmable_compile_tells_functions_apart():
    """One compiled function called with ready-made functions of other numbers (softcap 3 and 5,
    copies of one template) traces each and runs its kernels; called with closures of one code
    over other numbers, it runs them eagerly at a graph break, each with its own values."""
    torch._dynamo.reset()
    q, k, v = make_inputs(ODD_LENGTHS, torch.bfloat16)
    for fullgraph, make in ((True, sf.softcap), (False, _scaled_by)):
        compiled = torch.compile(lambda q, k, v, kwargs: tile_fmha(q, k, v, **kwargs), fullgraph=fullgraph)
        for value in (3.0, 5.0, 3.0, 0.5):
            got = compiled(q, k, v, make(value))
            torch.testing.assert_close(got, tile_fmha(q, k, v, **make(value)), atol=0, rtol=0)
        assert not torch.equal(compiled(q, k, v, make(3.0)), compiled(q, k, v, make(5.0)))


def test_op_attention_mask_mod_sees_real_batch_and_head():
    """mask_mod gets each program's batch entry and query head: a mask hiding odd keys for head
    1 of batch entry 1 only."""
    case = Case("bh", 2, 2, 1, 70, 70, 64)
    q, k, v = make_inputs(case, torch.bfloat16)

    def odd_keys_hidden_for_b1_h1(b, h, q_idx, kv_idx, mask_aux):
        return ((kv_idx & 1) == 0) | (b != 1) | (h != 1)

    out = tile_fmha(q, k, v, is_causal=True, mask_mod=odd_keys_hidden_for_b1_h1)
    visible = torch.ones((2, 2, 70, 70), dtype=torch.bool, device="cuda")
    visible[1, 1, :, 1::2] = False
    ref, _ = attention_reference(q, k, v, is_causal=True, attn_bias=_hide(visible))
    assert max_error(out, ref) < 2e-2


def test_op_attention_score_mod_sees_indices():
    """score_mod gets q_idx and kv_idx as positions in the call (Sq != Sk) in every kernel."""
    case = Case("idx", 1, 2, 2, 50, 90, 64)
    q, k, v = make_inputs(case, torch.float32, requires_grad=True)

    def position_bias(score, b, h, q_idx, kv_idx, aux):
        return score + ct.astype(q_idx * 3 - kv_idx * 2 + h, score.dtype) * 0.01

    def position_bias_grad(grad, score, out, b, h, q_idx, kv_idx, aux):
        return grad

    out = tile_fmha_with_backward(q, k, v, is_causal=False, score_mod=position_bias, score_mod_grad=position_bias_grad)
    rows, cols = _positions(case)
    heads = torch.arange(2, device="cuda")[:, None, None]
    bias = ((rows * 3 - cols * 2)[None] + heads).double()[None] * 0.01
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_reference(*ref_inputs, is_causal=False, attn_bias=bias)
    assert max_error(out, ref) < 1e-4
    d_out = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), d_out)
    theirs = torch.autograd.grad(ref, ref_inputs, d_out.double())
    for a, b in zip(ours, theirs, strict=True):
        assert max_error(a, b) < 1e-4
