"""The torch.library operators that torch.compile sees (custom_ops.py), on the CPU: their
fake implementations give the real outputs' shapes and dtypes and check their arguments."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import tilegym  # noqa: F401  (registers the operators)

# The functions key and tensors of a call without score or mask functions.
_NO_FUNCTIONS = ("", [], [])


def _fake(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
def test_attention_operator_shapes(dtype):
    with FakeTensorMode():
        q, kv = _fake(2, 8, 300, 64, dtype=dtype), _fake(2, 2, 301, 64, dtype=dtype)
        out, lse = torch.ops.tilegym.attention(
            q, kv, kv, None, None, None, None, True, None, None, True, *_NO_FUNCTIONS
        )
        assert (out.shape, out.dtype, out.is_contiguous()) == (q.shape, dtype, True)
        assert (lse.shape, lse.dtype) == ((2, 8, 300), torch.float64 if dtype == torch.float64 else torch.float32)
        out, lse = torch.ops.tilegym.attention(
            q, kv, kv, None, None, None, None, True, None, None, False, *_NO_FUNCTIONS
        )
        assert out.shape == q.shape and lse.numel() == 0


def test_attention_backward_operator_shapes():
    with FakeTensorMode():
        q, kv = _fake(2, 4, 77, 128), _fake(2, 4, 93, 128)
        bias = _fake(1, 4, 1, 93, dtype=torch.float32)
        sinks = _fake(4, dtype=torch.bfloat16)
        out, lse = torch.ops.tilegym.attention(
            q, kv, kv, bias, None, sinks, 0.5, False, [10, 3], 20.0, True, *_NO_FUNCTIONS
        )
        args = (out, lse, q, kv, kv, out, lse, bias, None, sinks, 0.5, False, [10, 3], 20.0)
        dq, dk, dv, d_bias, d_sinks, d_aux = torch.ops.tilegym.attention_backward(*args, True, True, *_NO_FUNCTIONS)
        assert [t.shape for t in (dq, dk, dv)] == [q.shape, kv.shape, kv.shape]
        assert (d_bias.shape, d_bias.dtype) == (bias.shape, torch.float32)
        assert (d_sinks.shape, d_sinks.dtype) == (sinks.shape, torch.bfloat16)
        _, _, _, d_bias, d_sinks, d_aux = torch.ops.tilegym.attention_backward(*args, False, False, *_NO_FUNCTIONS)
        assert d_bias.numel() == 0 and d_sinks.numel() == 0 and d_aux == []


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"head_dim": 7}, ValueError, "head dim 7 is not supported"),
        ({"kv_heads": 3}, ValueError, r"q's head count \(4\) must be a multiple"),
        ({"window": [4, -3]}, ValueError, "window_size sides must be >= 0"),
        ({"softcap": -1.0}, ValueError, "softcap must be a finite number"),
        ({"bias_shape": (2, 4, 5, 9)}, ValueError, "attn_bias of shape"),
    ],
    ids=lambda x: next(iter(x)) if isinstance(x, dict) else None,
)
def test_attention_operator_checks_its_arguments(change, error, match):
    """Traced calls fail as eager ones do, with the argument named."""
    with FakeTensorMode():
        head_dim = change.get("head_dim", 64)
        q, kv = _fake(2, 4, 50, head_dim), _fake(2, change.get("kv_heads", 2), 60, head_dim)
        bias = _fake(*change["bias_shape"]) if "bias_shape" in change else None
        with pytest.raises(error, match=match):
            torch.ops.tilegym.attention(
                q, kv, kv, bias, None, None, None, False, change.get("window"), change.get("softcap"), True,
                *_NO_FUNCTIONS,
            )  # fmt: skip


def test_attention_operators_take_functions_by_key():
    """A call with score functions passes the key they are registered under and their tensors:
    the fake implementations check them and give the aux tensors' gradients where the key holds
    an aux_grad; an unknown key is refused."""
    from tilegym.ops.attention import score_functions as sf
    from tilegym.ops.attention.caller_functions import operator_key

    table = torch.zeros(4, 9)
    relative = sf.relative_position_bias(table, 4)
    functions = (relative["score_mod"], relative["score_mod_grad"], relative["aux_grad"], None)
    learned, frozen = operator_key(*functions, True, True), operator_key(*functions, True, False)
    assert learned and frozen and learned != frozen, "the key holds aux_grad only where the table learns"
    with FakeTensorMode():
        q, kv = _fake(2, 4, 77, 64), _fake(2, 2, 93, 64)
        aux = [_fake(4, 9, dtype=torch.float32)]
        out, lse = torch.ops.tilegym.attention(
            q, kv, kv, None, None, None, None, True, None, None, True, learned, aux, []
        )
        args = (out, lse, q, kv, kv, out, lse, None, None, None, None, True, None, None, False, False)
        for key, expected in ((learned, [(4, 9)]), (frozen, [])):
            *_, d_aux = torch.ops.tilegym.attention_backward(*args, key, aux, [])
            assert [tuple(d.shape) for d in d_aux] == expected
        with pytest.raises(ValueError, match="no score or mask functions are registered"):
            torch.ops.tilegym.attention(q, kv, kv, None, None, None, None, True, None, None, True, "0" * 64, aux, [])
