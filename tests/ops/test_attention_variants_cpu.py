"""Score modifiers without a GPU: argument checks, dBias reduction, launch arguments, reference."""

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from tests.ops.test_attention_cpu import _RecordingLauncher
from tilegym import tile_fmha_with_backward
from tilegym.ops.attention import configs, launch, score_mods
from tilegym.ops.attention import problem as problem_mod
from tilegym.ops.attention.reference import attention_reference, causal_mask, window_mask
from tilegym.ops.attention.score_mods import BIAS_ONE_ROW, BIAS_PER_ROW, ScoreMods


def _q(batch=2, heads=4, seqlen_q=10, head_dim=32):
    return torch.randn(batch, heads, seqlen_q, head_dim)


@pytest.mark.parametrize(
    "window, causal, expected",
    [
        (None, False, (None, False)),
        ((-1, -1), False, (None, False)),
        ((-1, 0), False, (None, True)),
        ((-1, -1), True, (None, True)),
        ((8, -1), True, ((8, 0), False)),
        ((8, 0), True, ((8, 0), False)),
        ((3, 5), False, ((3, 5), False)),
        ([0, 0], False, ((0, 0), False)),
    ],
)
def test_op_window_merges_causal(window, causal, expected):
    assert score_mods.check_window(window, causal, seqlen_q=100, seqlen_k=100) == expected


_HUGE = 2**31 - 1


@pytest.mark.parametrize(
    "window, causal, seqlen_q, seqlen_k, expected",
    [
        ((_HUGE, 0), True, 100, 100, (None, True)),
        ((0, _HUGE), False, 100, 100, ((0, -1), False)),
        ((_HUGE, _HUGE), False, 100, 100, (None, False)),
        ((2**80, 3), False, 100, 100, ((-1, 3), False)),
        # The left side reaches every key from Sk - 1 on, the right side from Sq - 1 on.
        ((99, 0), True, 100, 100, (None, True)),
        ((98, 0), True, 100, 100, ((98, 0), False)),
        ((4, 9), False, 10, 300, ((4, -1), False)),
        ((4, 8), False, 10, 300, ((4, 8), False)),
        ((299, 2), False, 10, 300, ((-1, 2), False)),
        ((0, 0), False, 1, 50, ((0, -1), False)),
        ((0, 0), True, 1, 50, ((0, 0), False)),
    ],
)
def test_op_window_sides_past_the_sequences_are_unbounded(window, causal, seqlen_q, seqlen_k, expected):
    """A side at or past the keys it could reach means unbounded, however large: the kernels
    then never add it to a position (2**31 - 1 overflowed their int32 sums)."""
    assert score_mods.check_window(window, causal, seqlen_q, seqlen_k) == expected


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (7, 300), (300, 7), (2**28, 2**28)])
@pytest.mark.parametrize("window", [(_HUGE, 0), (0, _HUGE), (_HUGE, _HUGE), (_HUGE - 5, 3), (3, _HUGE - 5)])
def test_op_window_kernel_sums_fit_int32(window, seqlen_q, seqlen_k):
    """Every sum the kernels form from a window side and a position stays within int32: the
    values the launcher hands over at the largest accepted sequences, with the extreme sides."""
    checked, _ = score_mods.check_window(window, False, seqlen_q, seqlen_k)
    problem = problem_mod.AttentionProblem(1, 1, 1, seqlen_q, seqlen_k, 64, torch.float16, 0.1, False,
                                      ScoreMods(window=checked))  # fmt: skip
    values = launch._modifier_arguments(problem, score_mods.NO_TENSORS, torch.empty(1))
    left, right = values["window_left"], values["window_right"]
    block = configs.MAX_BLOCK
    last_row, last_col, shift = seqlen_q + block, seqlen_k + block, abs(seqlen_k - seqlen_q)
    extremes = (last_row + shift + right + block, last_col + shift + left + block, -(left + right + shift + block))
    assert all(abs(value) <= 2**31 - 1 for value in extremes)


@pytest.mark.parametrize(
    "window, causal, error, message",
    [
        ((4, 2), True, ValueError, "right side must be 0 or -1"),
        ((-2, 3), False, ValueError, "-1 for unbounded"),
        ((1.5, 3), False, TypeError, "pair of ints"),
        ((True, 3), False, TypeError, "pair of ints"),
        ((1, 2, 3), False, TypeError, "pair of ints"),
        (5, False, TypeError, "pair of ints"),
    ],
)
def test_op_window_rejects(window, causal, error, message):
    with pytest.raises(error, match=message):
        score_mods.check_window(window, causal, seqlen_q=100, seqlen_k=100)


@pytest.mark.parametrize(
    "softcap, error, message",
    [("2", TypeError, "softcap must be a float"), (True, TypeError, "softcap must be a float"),
     (-1.0, ValueError, "softcap must be a finite"), (math.inf, ValueError, "softcap must be a finite"),
     (1e-300, ValueError, "float32 range")],
)  # fmt: skip
def test_op_softcap_rejects(softcap, error, message):
    with pytest.raises(error, match=message):
        score_mods.check_softcap(softcap, 0.125)


def test_op_softcap_off_values():
    """0 turns softcap off, as in FlashAttention; the README says the same."""
    assert score_mods.check_softcap(None, 0.1) == 0.0 and score_mods.check_softcap(0, 0.1) == 0.0
    assert score_mods.check_softcap(0.0, 0.1) == 0.0 and score_mods.check_softcap(30, 0.1) == 30.0


@pytest.mark.parametrize("value", [10**400, -(10**400)])
def test_op_softcap_beyond_float_is_a_value_error(value):
    with pytest.raises(ValueError, match="softcap must be a finite"):
        score_mods.check_softcap(value, 0.125)


@pytest.mark.parametrize(
    "shape, mode, kernel_shape",
    [
        ((2, 4, 10, 12), BIAS_PER_ROW, (2, 4, 10, 12)),
        ((10, 12), BIAS_PER_ROW, (1, 1, 10, 12)),
        ((4, 1, 12), BIAS_ONE_ROW, (1, 4, 1, 12)),
        ((2, 1, 10, 1), BIAS_PER_ROW, (2, 1, 10, 12)),
        ((12,), BIAS_ONE_ROW, (1, 1, 1, 12)),
    ],
)
def test_op_bias_shapes(shape, mode, kernel_shape):
    got_mode, bias = score_mods.check_bias(torch.randn(shape), _q(), seqlen_k=12, q_heads=4)
    assert got_mode == mode and tuple(bias.shape) == kernel_shape and bias.stride(-1) == 1


def test_op_bias_expanded_dims_read_once():
    expanded = torch.randn(1, 1, 10, 12).expand(2, 4, 10, 12)
    _, bias = score_mods.check_bias(expanded, _q(), seqlen_k=12, q_heads=4)
    assert tuple(bias.shape) == (1, 1, 10, 12) and bias.data_ptr() == expanded.data_ptr()
    rows = torch.randn(1, 1, 1, 12).expand(2, 4, 10, 12)
    assert score_mods.check_bias(rows, _q(), 12, 4)[0] == BIAS_ONE_ROW, "no grad: the query dim shrinks too"
    rows.requires_grad_()
    assert score_mods.check_bias(rows, _q(), 12, 4)[0] == BIAS_PER_ROW, "dBias needs every row"


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: [1.0], TypeError, "attn_bias must be a torch.Tensor"),
        (lambda: torch.randn(10, 12, dtype=torch.float16), TypeError, "attn_bias must have q's dtype"),
        (lambda: torch.randn(3, 4, 10, 12), ValueError, "does not broadcast"),
        (lambda: torch.randn(1, 2, 4, 10, 12), ValueError, "does not broadcast"),
        (lambda: torch.randn(10, 11), ValueError, "does not broadcast"),
    ],
    ids=["not-tensor", "dtype", "batch", "rank", "keys"],
)
def test_op_bias_rejects(make, error, message):
    with pytest.raises(error, match=message):
        score_mods.check_bias(make(), _q(), seqlen_k=12, q_heads=4)


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: torch.rand(4, dtype=torch.float64), TypeError, "alibi_slopes must be torch.float32"),
        (lambda: torch.rand(3), ValueError, "alibi_slopes must have shape"),
        (lambda: torch.rand(1, 4, 1), ValueError, "alibi_slopes must have shape"),
        (lambda: 0.5, TypeError, "alibi_slopes must be a torch.Tensor"),
    ],
)
def test_op_alibi_rejects(make, error, message):
    with pytest.raises(error, match=message):
        score_mods.check_alibi(make(), _q(), q_heads=4)


def test_op_alibi_shapes():
    assert tuple(score_mods.check_alibi(torch.rand(4), _q(), 4).shape) == (1, 4)
    assert tuple(score_mods.check_alibi(torch.rand(2, 4), _q(), 4).shape) == (2, 4)


@pytest.mark.parametrize("shape", [(2, 4, 10, 12), (10, 12), (4, 1, 12), (2, 1, 10, 1), (1, 4, 1, 1)])
def test_op_bias_grad_reduced_to_bias_shape(shape):
    """The kernels' [B, Hq, rows, Sk] buffer, summed over broadcast dims, is autograd's dBias."""
    mode, _ = score_mods.check_bias(torch.randn(shape), _q(), 12, 4)
    rows = 1 if mode == BIAS_ONE_ROW else 10
    per_element = torch.randn(2, 4, 10, 12, dtype=torch.float64)
    buffer = per_element.sum(2, keepdim=True) if rows == 1 else per_element
    bias = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(bias.expand(2, 4, 10, 12), bias, per_element)[0]
    mods = ScoreMods(bias_mode=mode, bias_shape=shape)
    assert torch.allclose(score_mods.reduce_bias_grad(buffer, mods, torch.float64), expected)


def test_op_shape_key_names_modifiers():
    mods = ScoreMods(bias_mode=BIAS_ONE_ROW, bias_shape=(8,), window=(4, 0), softcap=2.0, alibi=True)
    problem = problem_mod.AttentionProblem(2, 8, 2, 1000, 1025, 128, torch.bfloat16, 0.1, False, mods)
    assert problem.shape_key("sm_90").endswith("|bias-row|window|softcap|alibi")


def test_op_launch_arguments_with_modifiers(monkeypatch):
    """With every modifier on, each launch passes one value per kernel parameter, the bias,
    slopes and dBias buffer in their places, the switches on, and the batch on grid axis 2."""
    monkeypatch.setattr(launch, "_Launcher", _RecordingLauncher)
    _RecordingLauncher.launches = []
    batch = 3
    q = torch.randn(batch, 4, 40, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, 2, 24, 64, dtype=torch.bfloat16) for _ in range(2))
    bias = torch.randn(4, 1, 24, dtype=torch.bfloat16)
    slopes = torch.rand(batch, 4)
    mode, kernel_bias = score_mods.check_bias(bias, q, 24, 4)
    mods = ScoreMods(bias_mode=mode, bias_shape=tuple(bias.shape), window=(5, 0), softcap=3.0, alibi=True)
    problem = problem_mod.AttentionProblem(batch, 4, 2, 40, 24, 64, torch.bfloat16, 0.125, False, mods)
    tensors = score_mods.ModTensors(kernel_bias, score_mods.check_alibi(slopes, q, 4))
    out, lse = launch.forward(q, k, v, problem, with_lse=True, mod_tensors=tensors)
    d_bias = launch.backward(
        torch.randn_like(q), q, k, v, out, lse, problem, mod_tensors=tensors, bias_grad=True
    ).d_bias
    assert d_bias.shape == bias.shape and d_bias.dtype == bias.dtype

    for name, kernel, grid, args, _config in _RecordingLauncher.launches:
        parameters = list(inspect.signature(kernel._pyfunc).parameters)
        assert len(args) == len(parameters), name
        values = dict(zip(parameters, args, strict=True))
        if name == configs.BACKWARD_PREPROCESS:
            continue
        assert values["Bias"].data_ptr() == kernel_bias.data_ptr() and values["Slopes"].shape == (batch, 4)
        assert (values["windowed"], values["capped"], values["bias_mode"], values["alibi"]) == (True, True, mode, True)
        assert values["causal"] is False and (values["window_left"], values["window_right"]) == (5, 0)
        assert math.isclose(values["softcap"] + values["softcap_lo"], 3.0)
        assert math.isclose(values["softcap_in"] + values["softcap_in_lo"], 0.125 / 3.0, rel_tol=1e-12)
        if name == configs.BACKWARD_DKDV:
            assert values["bias_grad"] == mode and values["DBias"].shape == (batch, 4, 1, 24)
        assert grid[2] == batch, f"{name}: the kernels index the bias and slopes by the batch on grid axis 2"


def _sdpa_fp64(q, k, v, mask, causal=False):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)


def test_op_reference_bias_alibi_window_match_sdpa():
    """The reference's bias, ALiBi and window agree with SDPA given the same float mask."""
    q = torch.randn(2, 4, 9, 16, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 13, 16, dtype=torch.float64) for _ in range(2))
    bias = torch.randn(2, 1, 9, 13, dtype=torch.float64)
    slopes = torch.rand(4, dtype=torch.float32)
    rows, cols = torch.arange(9)[:, None], torch.arange(13)[None, :]
    alibi = -slopes.double()[:, None, None] * (rows + 4 - cols).abs()
    visible = window_mask(9, 13, 3, 2) & causal_mask(9, 13)
    mask = (bias + alibi).masked_fill(~visible, -math.inf)
    out, _ = attention_reference(q, k, v, is_causal=True, attn_bias=bias, alibi_slopes=slopes, window_size=(3, 2))
    assert torch.allclose(out, _sdpa_fp64(q, k, v, mask), atol=1e-12)


def test_op_reference_softcap():
    q = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 6, 8, dtype=torch.float64) for _ in range(2))
    scores = 2.0 * torch.tanh(q @ k.transpose(-1, -2) / math.sqrt(8) / 2.0)
    expected = torch.softmax(scores, dim=-1) @ v
    out, lse = attention_reference(q, k, v, is_causal=False, softcap=2.0)
    assert torch.allclose(out, expected, atol=1e-12)
    assert torch.allclose(lse, torch.logsumexp(scores, dim=-1), atol=1e-12)


def test_op_reference_rows_hidden_by_bias():
    q, k, v = (torch.randn(1, 1, 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    bias = torch.zeros(4, 4, dtype=torch.float64)
    bias[1] = -math.inf
    bias = bias.requires_grad_()
    out, lse = attention_reference(q, k, v, is_causal=False, attn_bias=bias)
    assert torch.equal(out[0, 0, 1], torch.zeros(8, dtype=torch.float64)) and lse[0, 0, 1] == -math.inf
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v, bias))


def test_op_reference_score_mod_after_the_builtin_modifiers():
    """score_mod sees the scores after softcap, bias and ALiBi, with index tensors along their
    dims, and may hide pairs with -inf; a score_mod that adds a bias is attn_bias."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 5, 8, dtype=torch.float64), *torch.randn(2, 2, 3, 7, 8, dtype=torch.float64)
    bias = torch.randn(2, 3, 5, 7, dtype=torch.float64)
    slopes = torch.rand(3, dtype=torch.float64)
    seen = []

    def added(scores, b, h, i, j):
        seen.append((b.shape, h.shape, i.shape, j.shape))
        return scores + bias[b, h, i, j]

    for causal in (False, True):
        got = attention_reference(q, k, v, is_causal=causal, softcap=3.0, alibi_slopes=slopes, score_mod=added)
        want = attention_reference(q, k, v, is_causal=causal, softcap=3.0, alibi_slopes=slopes, attn_bias=bias)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    assert seen[0] == ((2, 1, 1, 1), (1, 3, 1, 1), (1, 1, 5, 1), (1, 1, 1, 7))
    # Applied last: a tanh of its own after softcap=.
    capped = attention_reference(q, k, v, is_causal=False, softcap=3.0, score_mod=lambda s, b, h, i, j: torch.tanh(s))
    scores = torch.tanh(3.0 * torch.tanh(q @ k.transpose(-1, -2) / math.sqrt(8) / 3.0))
    torch.testing.assert_close(capped[0], torch.softmax(scores, dim=-1) @ v, atol=1e-12, rtol=0)
    # -inf hides a pair as a bias does.
    upper = torch.arange(7)[None] > torch.arange(5)[:, None]
    hidden = attention_reference(
        q, k, v, is_causal=False, score_mod=lambda s, b, h, i, j: s.masked_fill(j > i, -math.inf)
    )
    hidden_by_bias = attention_reference(
        q, k, v, is_causal=False, attn_bias=torch.zeros(5, 7, dtype=torch.float64).masked_fill(upper, -math.inf)
    )
    torch.testing.assert_close(hidden, hidden_by_bias, atol=1e-12, rtol=0)


@pytest.mark.parametrize("mask", ["none", "causal", "window", "mask_mod"])
def test_op_bias_gradient_starts_as_zeros_where_tiles_are_skipped(mask, monkeypatch):
    """A full bias's gradient is written tile by tile by the dK/dV kernel, which never visits the
    tiles a mask skips: the causal mask, a window and a mask function's block mask get zeros
    to start from, an unmasked call an uninitialized tensor (NaN here)."""
    from tilegym.ops.attention import programmable

    def lower_left(b, h, q_idx, kv_idx, mask_aux):
        return kv_idx <= q_idx

    user = programmable.user_functions(mask_mod=lower_left) if mask == "mask_mod" else None
    mods = ScoreMods(bias_mode=BIAS_PER_ROW, bias_shape=(1, 2, 6, 9), window=(3, 0) if mask == "window" else None,
                     user=user)  # fmt: skip
    problem = problem_mod.AttentionProblem(1, 2, 2, 6, 9, 64, torch.float32, 0.125, mask == "causal", mods)
    q, k, v = torch.randn(1, 2, 6, 64), torch.randn(1, 2, 9, 64), torch.randn(1, 2, 9, 64)
    monkeypatch.setattr(torch, "empty", lambda shape, **kwargs: torch.full(shape, math.nan, **kwargs))
    tensors = score_mods.ModTensors(bias=torch.randn(1, 2, 6, 9))
    *_, d_bias = launch._gradients(q, k, v, problem, (q, k, v), tensors, True)
    assert d_bias.shape == (1, 2, 6, 9)
    assert (d_bias.isnan() if mask == "none" else d_bias == 0).all()


# ---- sinks ------------------------------------------------------------------------------------


def test_op_reference_sinks_join_the_softmax_denominator():
    """The reference's sinks against a softmax over the scores plus one column per head."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 5, 8, dtype=torch.float64), *torch.randn(2, 2, 1, 7, 8, dtype=torch.float64)
    sinks = torch.randn(3, dtype=torch.float64)
    out, lse = attention_reference(q, k, v, is_causal=True, sinks=sinks)  # GQA 3:1
    k, v = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(8)
    scores = scores.masked_fill(~causal_mask(5, 7), -math.inf)
    with_sink = torch.cat([scores, sinks.reshape(1, 3, 1, 1).expand(2, 3, 5, 1)], dim=-1)
    probs = torch.softmax(with_sink, dim=-1)
    torch.testing.assert_close(out, probs[..., :-1] @ v)
    torch.testing.assert_close(lse, torch.logsumexp(with_sink, dim=-1))


def test_op_reference_sinks_on_rows_without_keys():
    """A row that sees no key puts all its mass on the sink: output 0, LSE the sink's logit;
    a -inf sink is no sink at all."""
    q, k, v = torch.randn(1, 2, 6, 8, dtype=torch.float64), *torch.randn(2, 1, 2, 2, 8, dtype=torch.float64)
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
    out, lse = attention_reference(q, k, v, is_causal=True, sinks=sinks)
    assert torch.equal(out[:, :, :4], torch.zeros_like(out[:, :, :4]))
    assert torch.equal(lse[0, :, 0], sinks.detach())
    (out.sum() + lse.sum()).backward()
    assert torch.isfinite(sinks.grad).all()
    plain_out, plain_lse = attention_reference(q, k, v, is_causal=True)
    no_sink_out, no_sink_lse = attention_reference(q, k, v, is_causal=True, sinks=torch.full((2,), -math.inf))
    assert torch.equal(no_sink_out, plain_out) and torch.equal(no_sink_lse, plain_lse)


@pytest.mark.parametrize(
    "sinks, error, message",
    [
        ([0.0, 1.0], TypeError, "sinks must be a torch.Tensor"),
        (torch.zeros(2, dtype=torch.int64), TypeError, "sinks must be a floating-point tensor"),
        (torch.zeros(3), ValueError, r"sinks must have shape \[q heads\] = \[2\], got \[3\]"),
        (torch.zeros(1, 2), ValueError, r"sinks must have shape \[q heads\]"),
        (torch.zeros(2, device="meta"), ValueError, "sinks must be on q's device"),
    ],
    ids=["list", "int", "length", "rank", "device"],
)
def test_op_sinks_checked(sinks, error, message):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(error, match=message):
        score_mods.check_sinks(sinks, q, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_op_sinks_kernel_dtype(dtype):
    """The kernels read sinks in their accumulators' dtype: float32, float64 for float64 inputs."""
    q = torch.randn(1, 2, 4, 8, dtype=dtype)
    kernel_sinks = score_mods.check_sinks(torch.randn(2, dtype=torch.bfloat16), q, 2)
    assert kernel_sinks.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert kernel_sinks.is_contiguous()


def test_op_return_lse_must_be_a_bool():
    q = k = v = torch.randn(1, 1, 4, 64)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        tile_fmha_with_backward(q, k, v, return_lse=1)
