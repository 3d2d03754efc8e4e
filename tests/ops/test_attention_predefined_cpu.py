"""The ready-made softcap, ALiBi, bias and window functions run as the built-in modifiers they
stand for where those compute the same (predefined.py), and as written elsewhere: decided on the
CPU, from shapes, dtypes and the functions' marks."""

import pytest
import torch

from tests.ops.test_attention_cpu import _RecordingLauncher
from tilegym.ops.attention import api, launch, predefined
from tilegym.ops.attention import score_functions as sf
from tilegym.ops.attention.caller_functions import CallerFunctions

B, HQ, HKV, SQ, SK, D = 2, 4, 2, 16, 24, 64


def _dense(dtype=torch.bfloat16, seqlen_q=SQ, seqlen_k=SK):
    return torch.randn(B, HQ, seqlen_q, D, dtype=dtype), torch.randn(B, HKV, seqlen_k, D, dtype=dtype)


def _mods(**given):
    fields = {"attn_bias": None, "window_size": None, "softcap": None, "alibi_slopes": None, "sinks": None}
    return api._Mods(**{**fields, **given})


def _functions(kwargs: dict) -> CallerFunctions:
    names = ("score_mod", "score_mod_grad", "aux", "aux_grad", "mask_mod", "mask_aux", "block_mask")
    return CallerFunctions.of(*(kwargs.get(name) for name in names))


def _lower(kwargs, mods=None, q=None, k=None, is_causal=True, cu_seqlens=None):
    if q is None:
        q, k = _dense()
    return predefined.lower(mods or _mods(), _functions(kwargs), q, k, is_causal, cu_seqlens)


def test_op_predefined_softcap_becomes_the_switch_where_it_computes_the_same():
    """softcap(cap) is softcap=cap: the hardware tanh for 16-bit inputs, the exact one for 32-
    and 64-bit, by default or asked for; after a bias or ALiBi (the switch comes first), with a
    softcap already, or with the other tanh asked for, it stays a function. A mask function
    beside it stays."""
    for approximate in (None, True):
        mods, functions = _lower(sf.softcap(30.0, approximate))
        assert mods.softcap == 30.0 and functions is None
    for dtype in (torch.float32, torch.float64):
        for approximate in (None, False):
            mods, functions = _lower(sf.softcap(30.0, approximate), q=_dense(dtype)[0], k=_dense(dtype)[1])
            assert mods.softcap == 30.0 and functions is None
        mods, functions = _lower(sf.softcap(30.0, approximate=True), q=_dense(dtype)[0], k=_dense(dtype)[1])
        assert mods.softcap is None and functions.score_mod is not None, "the hardware tanh asked of 32/64 bits"
    mods, functions = _lower(sf.softcap(30.0, approximate=False))
    assert mods.softcap is None and functions.score_mod is not None, "the exact tanh asked of 16 bits"
    bias = torch.zeros(1, 1, SQ, SK)
    for before in ({"attn_bias": bias}, {"alibi_slopes": torch.ones(HQ)}, {"softcap": 5.0}):
        mods, functions = _lower(sf.softcap(30.0), mods=_mods(**before))
        assert mods.softcap == before.get("softcap") and functions.score_mod is not None, before
    ids = torch.zeros(B, SQ, dtype=torch.int32)
    mods, functions = _lower({**sf.softcap(30.0), **sf.document_mask(ids)})
    assert mods.softcap == 30.0 and functions.score_mod is None and functions.mask_mod is not None
    assert functions.mask_aux == (ids,)
    mods, functions = _lower({**sf.softcap(30.0), "mask_aux": (ids,)})
    assert functions.mask_aux == (ids,), "tensors without their function stay, for the checks to refuse"
    mods, functions = _lower({"score_mod_grad": sf.softcap(30.0)["score_mod_grad"]})
    assert functions.score_mod_grad is not None, "a gradient without its function stays, for the checks to refuse"


def test_op_predefined_alibi_becomes_the_switch_at_its_lengths():
    slopes = torch.rand(HQ)
    mods, functions = _lower(sf.alibi(slopes, SQ, SK))
    assert mods.alibi_slopes is slopes and functions is None
    # Other lengths than the call's, slopes the switch reads otherwise or wants a gradient of,
    # ALiBi given twice: a function.
    for kwargs, given in (
        (sf.alibi(slopes, SQ, SQ), {}),
        (sf.alibi(torch.rand(B, HQ), SQ, SK), {}),
        (sf.alibi(slopes.double(), SQ, SK), {}),
        (sf.alibi(slopes.clone().requires_grad_(), SQ, SK), {}),
        (sf.alibi(slopes, SQ, SK), {"alibi_slopes": slopes}),
    ):
        mods, functions = _lower(kwargs, mods=_mods(**given))
        assert functions is not None and functions.score_mod is not None
    # After the softcap switch and beside a bias: the same order as the switches.
    mods, functions = _lower(sf.alibi(slopes, SQ, SK), mods=_mods(softcap=4.0, attn_bias=torch.zeros(SK)))
    assert mods.alibi_slopes is slopes and functions is None


def test_op_predefined_bias_becomes_attn_bias():
    q, k = _dense()
    for shape in ((B, HQ, SQ, SK), (1, HQ, 1, SK), (B, 1, SQ, 1), (1, 1, 1, 1)):
        bias = torch.randn(shape, requires_grad=True)
        mods, functions = _lower(sf.additive_bias(bias), q=q, k=k)
        assert mods.attn_bias is bias and functions is None, shape
    for bias, given in (
        (torch.randn(B, HQ, SQ, SK - 1), {}),  # not the call's keys: the function reads what it has
        (torch.randn(B, HQ, SQ, SK, dtype=torch.float16), {}),  # neither q's dtype nor float32
        (torch.randn(B, HQ, SQ, SK), {"attn_bias": torch.zeros(SK)}),
    ):
        mods, functions = _lower(sf.additive_bias(bias), mods=_mods(**given), q=q, k=k)
        assert functions.score_mod is not None and functions.aux == (bias,)
    with pytest.raises(ValueError, match="bias must be a 4-D tensor"):
        sf.additive_bias(torch.zeros(SQ, SK))


def test_op_predefined_window_becomes_window_size():
    mods, functions = _lower(sf.sliding_window(5, 3, SQ, SK), is_causal=False)
    assert mods.window_size == (5, 3) and functions is None
    mods, functions = _lower(sf.sliding_window(5, 3, SQ, SK), is_causal=True)
    assert mods.window_size == (5, 0) and functions is None, "and-ed with causal: nothing to the right"
    mods, functions = _lower(sf.sliding_window(-1, 2, SQ, SK), is_causal=False)
    assert mods.window_size == (-1, 2)
    for kwargs, given in (
        (sf.sliding_window(5, 3, SQ, SQ), {}),
        (sf.sliding_window(5, 3, SQ, SK), {"window_size": (8, 8)}),
    ):
        mods, functions = _lower(kwargs, mods=_mods(**given), is_causal=False)
        assert functions.mask_mod is not None and mods.window_size == given.get("window_size")
    for bad in ((-2, 0), (1.5, 0), (True, 0)):
        with pytest.raises(ValueError, match="left must be an int"):
            sf.sliding_window(*bad, SQ, SK)


def test_op_predefined_softcap_left_to_pick_its_tanh_stays_a_function_with_the_switchs():
    """Where the default softcap(cap) stays a function (after a bias here), it runs the tanh
    softcap= would take: as written for 16-bit inputs, the approximate=False copy for 32/64-bit
    ones (its gradient too, unless the caller gave another)."""
    auto, exact, hardware = sf.softcap(30.0), sf.softcap(30.0, approximate=False), sf.softcap(30.0, True)
    bias = _mods(attn_bias=torch.zeros(1, 1, SQ, SK))
    _, functions = _lower(auto, mods=bias)
    assert (functions.score_mod, functions.score_mod_grad) == (auto["score_mod"], auto["score_mod_grad"])
    for dtype in (torch.float32, torch.float64):
        q, k = _dense(dtype)
        _, functions = _lower(auto, mods=bias, q=q, k=k)
        assert (functions.score_mod, functions.score_mod_grad) == (exact["score_mod"], exact["score_mod_grad"])
        _, functions = _lower(hardware, mods=bias, q=q, k=k)
        assert functions.score_mod is hardware["score_mod"], "the tanh asked for"

        def own_grad(grad, score, out, b, h, q_idx, kv_idx, aux):
            return grad

        _, functions = _lower({**auto, "score_mod_grad": own_grad}, q=q, k=k)
        assert (functions.score_mod, functions.score_mod_grad) == (exact["score_mod"], own_grad)
    from tilegym.ops.attention import programmable

    assert programmable.fingerprint(auto["score_mod"]) == programmable.fingerprint(hardware["score_mod"])
    with pytest.raises(TypeError, match="approximate"):
        sf.softcap(30.0, approximate=1)


def test_op_predefined_on_packed_batches():
    """Softcap always; ALiBi and the window where every sequence has Sk = Sq (one cumulative-length
    tensor for both, functions made for equal lengths); the bias never (attn_bias takes no packed
    batch: it runs as a function, per sequence)."""
    q, k = torch.randn(12, HQ, D, dtype=torch.bfloat16), torch.randn(12, HKV, D, dtype=torch.bfloat16)
    cu, other = torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([0, 5, 12], dtype=torch.int32)
    slopes = torch.rand(HQ)
    mods, functions = _lower(sf.softcap(4.0), q=q, k=k, cu_seqlens=(cu, other))
    assert mods.softcap == 4.0 and functions is None
    for kwargs, lowered in ((sf.alibi(slopes, 7, 7), "alibi_slopes"), (sf.sliding_window(3, 0, 7, 7), "window_size")):
        mods, functions = _lower(kwargs, q=q, k=k, cu_seqlens=(cu, cu))
        assert getattr(mods, lowered) is not None and functions is None
        mods, functions = _lower(kwargs, q=q, k=k, cu_seqlens=(cu, other))
        assert getattr(mods, lowered) is None and functions is not None, "lengths that may differ per sequence"
    mods, functions = _lower(sf.alibi(slopes, 5, 7), q=q, k=k, cu_seqlens=(cu, cu))
    assert functions is not None
    mods, functions = _lower(sf.additive_bias(torch.zeros(2, HQ, 7, 7)), q=q, k=k, cu_seqlens=(cu, cu))
    assert mods.attn_bias is None and functions.score_mod is not None


def test_op_predefined_functions_as_written():
    """inlined() copies run as functions (same kernels: same fingerprint), as do the ready-made
    functions with a score_mod_grad or aux_grad of the caller's."""
    from tilegym.ops.attention import programmable

    for kwargs in (sf.softcap(30.0), sf.alibi(torch.rand(HQ), SQ, SK), sf.sliding_window(5, 0, SQ, SK)):
        copies = sf.inlined(kwargs)
        mods, functions = _lower(copies)
        assert functions is not None and mods == _mods()
        assert sf.inlined(kwargs) == copies, "the same copies each time"
        for role in ("score_mod", "mask_mod"):
            if role in kwargs:
                assert programmable.fingerprint(copies[role]) == programmable.fingerprint(kwargs[role])
                assert getattr(copies[role], "elementwise", None) == getattr(kwargs[role], "elementwise", None)

    def own_grad(grad, score, out, b, h, q_idx, kv_idx, aux):
        return grad

    mods, functions = _lower({**sf.softcap(30.0), "score_mod_grad": own_grad})
    assert functions.score_mod_grad is own_grad and not mods.softcap
    # Without its gradient it stays a function: training then refuses it as it would any.
    mods, functions = _lower({"score_mod": sf.softcap(30.0)["score_mod"]})
    assert functions.score_mod is not None and not mods.softcap
    bias = sf.additive_bias(torch.zeros(B, HQ, SQ, SK))
    mods, functions = _lower({**bias, "aux_grad": None})
    assert functions.score_mod is not None and mods.attn_bias is None


class _Recorder(_RecordingLauncher):
    """Records the problem of each launcher too."""

    problems: list = []

    def __init__(self, problem, device, block_mask=None):
        super().__init__(problem, device, block_mask)
        self.problems.append(problem)


def test_op_predefined_under_torch_compile(monkeypatch):
    """A compiled step traced with softcap(3) lowers it to softcap=3 in the graph; called with
    softcap(4) it traces again (its guards see the other function): the launches' problems carry
    3 and then 4, with no functions."""
    from tilegym.ops.attention import custom_ops
    from tilegym.ops.attention.problem import AttentionProblem
    from tilegym.ops.attention.score_mods import NO_TENSORS, ScoreMods

    monkeypatch.setattr(launch, "_Launcher", _Recorder)
    monkeypatch.setattr(launch, "compile_backward_ahead", lambda *args, **kwargs: None)
    seen = []

    def checked_on_the_cpu(q, k, v, scaling, is_causal, attn_bias, window_size, softcap, *rest, **more):
        """The problem a CUDA call would get, with the softcap the operator was given."""
        seen.append(softcap)
        batch, q_heads, seqlen_q, head_dim = q.shape
        problem = AttentionProblem(
            batch, q_heads, k.shape[1], seqlen_q, k.shape[2], head_dim, q.dtype, head_dim**-0.5, is_causal,
            mods=ScoreMods(softcap=float(softcap or 0.0)),
        )  # fmt: skip
        return problem, NO_TENSORS

    monkeypatch.setattr(custom_ops, "check_inputs", checked_on_the_cpu)
    torch._dynamo.reset()
    q, k = _dense(seqlen_k=SQ)
    v = torch.randn_like(k)

    def step(q, k, v, functions):
        return api.tile_fmha(q, k, v, is_causal=True, **functions)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for cap in (3.0, 4.0, 3.0):
        seen.clear()
        _Recorder.problems = []
        compiled(q, k, v, sf.softcap(cap))
        assert set(seen) == {cap}, seen
        assert [p.mods.softcap for p in _Recorder.problems] == [cap] and _Recorder.problems[0].mods.user is None
