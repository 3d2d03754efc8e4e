"""Ready-made score and mask functions for the attention functions' score_mod and mask_mod,
written in cuTile; each also shows how to write one's own.

Each factory returns the keyword arguments of one call, to spread into it::

    out = tile_fmha_with_backward(q, k, v, **softcap(30.0))
    out = tile_fmha_with_backward(q, k, v, is_causal=True, **document_mask(doc_ids))

score_mod_grad(grad, score, out, b, h, q_idx, kv_idx, aux) gets the gradient with respect to
score_mod's output, its input and its output, and returns the gradient with respect to its
input. Score functions get natural-unit scores (softmax scale applied) as fp32 tiles (fp64 for fp64
inputs), b and h as int32 scalars, q_idx and kv_idx as int32 index tiles that broadcast
against the scores (their orientation differs between kernels: write elementwise code), and
aux, the call's tensors as cuTile arrays (read with ct.gather). Numbers a function closes over
are compile-time constants (a kernel per value): learnable or per-call values go in aux.
Float literals reach the kernel rounded to fp32, beside fp64 scores too (_exact).

aux_grad adds its shares with add_to_aux_grad (bitwise repeatable under
torch.use_deterministic_algorithms); a score function of a few elementwise operations that reads
no table per score may be declared so with @elementwise, which lets it run on the fused
backward (the ready-made ALiBi and softcap are).

softcap, alibi, additive_bias and sliding_window are the built-in modifiers softcap=,
alibi_slopes=, attn_bias= and window_size= as functions: a call that passes one runs the
kernels' own code for the keyword argument wherever it computes the same (predefined.py);
inlined() gives copies that always run as written.

A factory called again with the same numbers returns the same function objects: the host
reads a function's fingerprint once per object, and torch.compile traces once per object. Its
numbers are globals of its functions' own copies, not closures (_specialized says why): a
function of one's own that closes over values runs under torch.compile at a graph break.
"""

import types
from functools import lru_cache

import cuda.tile as ct
import torch

from tilegym.launching import split_float
from tilegym.ops.attention import predefined
from tilegym.ops.attention.aux_gradients import FIXED_SCALE, MAGNITUDE_LIMIT, MAGNITUDE_SCALE, SHARE_LIMIT


def add_to_aux_grad(aux_grads, slot, index, values):
    """aux_grad's way to add values into the gradient of aux tensor `slot` at index, as
    ct.atomic_add(aux_grads[slot], index, values) would: index is a tuple with one index (tile or
    scalar) per dim of the aux tensor. An aux_grad that adds only through this function gets
    bitwise-repeatable gradients under torch.use_deterministic_algorithms(True), where its
    buffers are fixed-point integers (aux_gradients.py)."""
    target = aux_grads[slot]
    if target.dtype == ct.int64:
        ct.atomic_add(target, (0,) + index, ct.astype(ct.floor(values * FIXED_SCALE + 0.5), ct.int64))
        size = ct.abs(values)
        units = ct.where(size < SHARE_LIMIT, ct.ceil(size * MAGNITUDE_SCALE), MAGNITUDE_LIMIT)
        ct.atomic_add(target, (1,) + index, ct.astype(units, ct.int64))
    else:
        ct.atomic_add(target, index, values)


add_to_aux_grad.sums_repeatably = True  # aux_gradients.adds_atomically: the adds it makes are


def elementwise(score_mod):
    """Declares score_mod a few elementwise operations per score, reading no memory per score
    (scalars per head, as ALiBi's slopes, are fine): such a function alone then runs on the fused
    backward at D=80-128 as plain attention does, where ALiBi and softcap as functions ran 11-30%
    faster than on two kernels. A function that reads a table per score was slower there (a
    relative-position table: +35%), so undeclared functions keep two kernels. Returns score_mod."""
    score_mod.elementwise = True
    return score_mod


def additive_grad(grad, score, out, b, h, q_idx, kv_idx, aux):
    """score_mod_grad of any score_mod that adds a term to the score: d(score + x)/d score = 1."""
    return grad


def softcap(cap: float, approximate: bool | None = None) -> dict:
    """Gemma 2's soft capping: score -> cap * tanh(score / cap), with its gradient.

    approximate: None, the tanh softcap= takes for the call's inputs: the hardware one (good to
    2^-11, below what they carry) for 16-bit inputs, the exact one for float32 and float64; True,
    the hardware tanh for any inputs but float64 (which it cannot take: the call is refused);
    False, the exact tanh (slower) for any inputs."""
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    if approximate is not None and not isinstance(approximate, bool):
        raise TypeError(f"approximate must be a bool or None, got {type(approximate).__name__}")
    score_mod, score_mod_grad = _softcap_functions(float(cap), approximate)
    return {"score_mod": score_mod, "score_mod_grad": score_mod_grad}


@lru_cache(maxsize=64)
def _softcap_functions(cap: float, approximate: bool | None):
    # None compiles as True (the same kernels) where the call's inputs are 16-bit; lowering swaps
    # in the exact copy for wider inputs (predefined.lower).
    rounding = None if approximate is False else ct.RoundingMode.APPROX
    (cap_hi, cap_lo), (inverse_hi, inverse_lo) = split_float(cap), split_float(1.0 / cap)
    score, grad = _specialized(
        (_softcap_score, _softcap_grad), _CAP=cap_hi, _CAP_LO=cap_lo, _INVERSE=inverse_hi, _INVERSE_LO=inverse_lo,
        _ROUNDING=rounding,
    )  # fmt: skip
    exact = _softcap_functions(cap, False) if approximate is None else None
    return predefined.mark(elementwise(score), predefined.Softcap(cap, approximate, grad, exact)), grad


# Constants of the templates below, set per copy (_specialized).
_CAP = _CAP_LO = _INVERSE = _INVERSE_LO = _ROUNDING = _REACH = _WINDOW = _GLOBAL_TOKENS = _SHIFT = _LOW = _HIGH = None


def _exact(hi, lo, dtype):
    """The number split into hi + lo (launching.split_float) in dtype: float literals reach the
    kernel rounded to fp32, so float64 scores rebuild it from both (1 / cap is rarely an fp32)."""
    if dtype == ct.float64:
        return ct.full((1,), hi, ct.float64) + ct.full((1,), lo, ct.float64)
    return hi


def _softcap_score(score, b, h, q_idx, kv_idx, aux):
    inverse = _exact(_INVERSE, _INVERSE_LO, score.dtype)
    return _exact(_CAP, _CAP_LO, score.dtype) * ct.tanh(score * inverse, rounding_mode=_ROUNDING)


def _softcap_grad(grad, score, out, b, h, q_idx, kv_idx, aux):
    # d/ds cap tanh(s / cap) = 1 - tanh^2, read from the output: no second tanh.
    capped = out * _exact(_INVERSE, _INVERSE_LO, out.dtype)
    return grad * (1.0 - capped * capped)


def inlined(functions: dict) -> dict:
    """A factory's keyword arguments whose functions run inlined as written, never as the
    built-in code they stand for (predefined.py): the same numbers through the mechanism a
    function of one's own takes, to compare the two. The same copies for the same functions.
    A softcap left to pick its tanh runs the hardware one so copied, as softcap(cap, True) does
    (float64 inputs then need softcap(cap, False))."""
    return {name: _inlined_copy(value) if hasattr(value, "predefined") else value for name, value in functions.items()}


@lru_cache(maxsize=64)
def _inlined_copy(function: types.FunctionType) -> types.FunctionType:
    """function without its mark, under a code object of its own (so that torch.compile does not
    take it for the original); same fingerprint, so the same kernels."""
    copy = own_code_copy(function, function.__globals__)
    copy.__dict__.update({key: item for key, item in function.__dict__.items() if key != "predefined"})
    return copy


def own_code_copy(function: types.FunctionType, namespace: dict) -> types.FunctionType:
    """function under a code object of its own, reading its globals from namespace."""
    copy = types.FunctionType(function.__code__.replace(), namespace, function.__name__, function.__defaults__,
                              function.__closure__)  # fmt: skip
    copy.__qualname__ = function.__qualname__
    return copy


def _specialized(templates: tuple, **constants) -> tuple:
    """Copies of module-level template functions whose globals also hold constants: functions
    that close over nothing, each under a code object of its own. torch.compile tells functions
    apart by their code object alone (its guards), so closures of one code over other constants
    would share a compiled graph; these do not, and pass through the operators by key
    (caller_functions). Templates call each other by name, which names the copies here."""
    namespace = {**globals(), **constants}
    copies = []
    for template in templates:
        copy = own_code_copy(template, namespace)
        namespace[template.__name__] = copy
        copies.append(copy)
    return tuple(copies)


def _alibi_template(score, b, h, q_idx, kv_idx, aux):
    # Positions become floats before they broadcast: a conversion per row and per column, not
    # per score (one costs as much as an exp2). Exact below 2^24 tokens.
    slope = ct.gather(aux[0], h)
    query_positions = ct.astype(q_idx + _SHIFT, score.dtype)
    return score - slope * ct.abs(query_positions - ct.astype(kv_idx, score.dtype))


def alibi(slopes: torch.Tensor, seqlen_q: int, seqlen_k: int) -> dict:
    """ALiBi: score - slope[h] * |i + Sk - Sq - j| (bottom-right aligned, as alibi_slopes);
    slopes float32 [Hq]. A call with these lengths runs alibi_slopes=slopes (predefined.py); a
    kernel per Sk - Sq otherwise."""
    return {"score_mod": _alibi_function(int(seqlen_k) - int(seqlen_q)), "score_mod_grad": additive_grad,
            "aux": (slopes,)}  # fmt: skip


@lru_cache(maxsize=64)
def _alibi_function(shift: int):
    (score,) = _specialized((_alibi_template,), _SHIFT=shift)
    return predefined.mark(elementwise(score), predefined.Alibi(shift, additive_grad))


def additive_bias(bias: torch.Tensor) -> dict:
    """score + bias[b, h, i, j]: attn_bias as a score function. bias is 4-D, each dim 1 (shared
    by every batch entry, head, query or key) or the call's; q's dtype or float32 for the
    built-in code to run it (predefined.py), which dense calls then do. When bias requires grad
    it gets one, summed over the dims it broadcasts. On a packed batch b is the sequence and i, j
    count within it, so a [sequences, heads, max_seqlen_q, max_seqlen_k] bias gives each
    sequence its own (run as a function, by atomic adds into the gradient)."""
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor, got {type(bias).__name__}")
    if bias.dim() != 4:
        raise ValueError(f"bias must be a 4-D tensor [B or 1, H or 1, Sq or 1, Sk or 1], got {list(bias.shape)}")
    return {"score_mod": _bias_score, "score_mod_grad": additive_grad, "aux": (bias,), "aux_grad": _bias_grad}


def _bias_index(b, h, q_idx, kv_idx, bias):
    """The bias entry of each pair, a dim of size 1 read at 0."""
    last_query, last_key = bias.shape[2] - 1, bias.shape[3] - 1
    return (
        min(b, bias.shape[0] - 1),
        min(h, bias.shape[1] - 1),
        ct.minimum(q_idx, last_query),
        ct.minimum(kv_idx, last_key),
    )


def _bias_score(score, b, h, q_idx, kv_idx, aux):
    return score + ct.astype(ct.gather(aux[0], _bias_index(b, h, q_idx, kv_idx, aux[0])), score.dtype)


def _bias_grad(grad, score, b, h, q_idx, kv_idx, aux, aux_grads):
    add_to_aux_grad(aux_grads, 0, _bias_index(b, h, q_idx, kv_idx, aux[0]), grad)


predefined.mark(_bias_score, predefined.AdditiveBias(additive_grad, _bias_grad))


def relative_position_bias(table: torch.Tensor, max_distance: int) -> dict:
    """T5-style learned relative positions: score + table[h, clamp(j - i, -max_distance,
    max_distance) + max_distance] with table [Hq, 2 * max_distance + 1]. When table requires
    grad it gets one, summed by atomic adds (its last bits vary from run to run; bitwise
    repeatable under torch.use_deterministic_algorithms(True), add_to_aux_grad).

    A tile whose pairs all lie beyond max_distance on one side reads one end of the table once
    instead of an entry per score: with long sequences, most tiles."""
    expected = 2 * max_distance + 1
    if table.dim() != 2 or table.shape[1] != expected:
        raise ValueError(f"table must be [heads, 2 * max_distance + 1 = {expected}], got {list(table.shape)}")
    score_mod, aux_grad = _relative_functions(int(max_distance))
    return {"score_mod": score_mod, "score_mod_grad": additive_grad, "aux": (table,), "aux_grad": aux_grad}


@lru_cache(maxsize=64)
def _relative_functions(max_distance: int):
    templates = (_relative_bucket, _relative_end_bucket, _relative_score, _relative_table_grad)
    return _specialized(templates, _REACH=max_distance)[2:]


def _relative_bucket(q_idx, kv_idx):
    return ct.minimum(ct.maximum(kv_idx - q_idx, -_REACH), _REACH) + _REACH


def _relative_end_bucket(q_idx, kv_idx):
    """The table end every pair of the tile falls in (0 or 2 * reach), or -1 if some pair is
    within reach: two reductions of the index tiles, not one per score."""
    if ct.max(kv_idx) - ct.min(q_idx) < -_REACH:
        end = 0
    elif ct.min(kv_idx) - ct.max(q_idx) > _REACH:
        end = 2 * _REACH
    else:
        end = -1
    return end


def _relative_score(score, b, h, q_idx, kv_idx, aux):
    end = _relative_end_bucket(q_idx, kv_idx)
    if end >= 0:
        result = score + ct.astype(ct.gather(aux[0], (h, end)), score.dtype)
    else:
        result = score + ct.astype(ct.gather(aux[0], (h, _relative_bucket(q_idx, kv_idx))), score.dtype)
    return result


def _relative_table_grad(grad, score, b, h, q_idx, kv_idx, aux, aux_grads):
    # Pairs farther apart than the reach share the table's two end buckets: one sum per tile for
    # each, since one atomic add per pair would all land on one address. Pairs within it add one
    # by one, and only in tiles that have some.
    offset = kv_idx - q_idx
    add_to_aux_grad(aux_grads, 0, (h, 0), ct.sum(ct.where(offset < -_REACH, grad, 0.0)))
    add_to_aux_grad(aux_grads, 0, (h, 2 * _REACH), ct.sum(ct.where(offset > _REACH, grad, 0.0)))
    near = (offset >= -_REACH) & (offset <= _REACH)
    if ct.sum(ct.where(near, 1, 0)) > 0:
        # Far pairs get an index past the table, which the bounds check drops.
        index = ct.where(near, offset + _REACH, 2 * _REACH + 1)
        add_to_aux_grad(aux_grads, 0, (h, index), grad)


def _same_document(b, h, q_idx, kv_idx, mask_aux):
    docs = mask_aux[0]
    return ct.gather(docs, (b, q_idx)) == ct.gather(docs, (b, kv_idx))


def document_mask(doc_ids: torch.Tensor) -> dict:
    """Queries see only keys of their own document: doc_ids int32 [B, S], one id per token
    (several documents packed in one row, Sq = Sk). Combine with is_causal for causal
    documents."""
    return {"mask_mod": _same_document, "mask_aux": (doc_ids,)}


def _prefix_or_causal(b, h, q_idx, kv_idx, mask_aux):
    return (kv_idx < ct.gather(mask_aux[0], b)) | (kv_idx <= q_idx)


def prefix_lm(prefix_length: torch.Tensor) -> dict:
    """Prefix-LM: every query sees the prefix (keys below prefix_length[b], int32 [B]) and the
    keys up to itself. Call with is_causal=False."""
    return {"mask_mod": _prefix_or_causal, "mask_aux": (prefix_length,)}


def sliding_window_with_globals(window: int, global_tokens: int) -> dict:
    """Each query sees the `window` keys up to itself and the first `global_tokens` keys
    (attention sinks as tokens, Longformer's globals). Call with is_causal=True."""
    return {"mask_mod": _window_or_global(int(window), int(global_tokens))}


@lru_cache(maxsize=64)
def _window_or_global(window: int, global_tokens: int):
    return _specialized((_window_or_global_template,), _WINDOW=window, _GLOBAL_TOKENS=global_tokens)[0]


def _window_or_global_template(b, h, q_idx, kv_idx, mask_aux):
    return (q_idx - kv_idx < _WINDOW) | (kv_idx < _GLOBAL_TOKENS)


def _within_length(b, h, q_idx, kv_idx, mask_aux):
    return kv_idx < ct.gather(mask_aux[0], b)


def key_padding(lengths: torch.Tensor) -> dict:
    """Keys at or past lengths[b] (int32 [B]) are padding, hidden from every query."""
    return {"mask_mod": _within_length, "mask_aux": (lengths,)}


def sliding_window(left: int, right: int, seqlen_q: int, seqlen_k: int) -> dict:
    """window_size=(left, right) as a mask function: query i sees keys i + d - left ... i + d +
    right, d = Sk - Sq, a side of -1 unbounded; and-ed with is_causal as window_size is. A call
    with these lengths runs window_size (predefined.py): its tiles are ranges, no block mask."""
    for name, side in (("left", left), ("right", right)):
        if isinstance(side, bool) or not isinstance(side, int) or side < -1:
            raise ValueError(f"{name} must be an int >= 0, or -1 for unbounded, got {side!r}")
    return {"mask_mod": _window_function(left, right, int(seqlen_k) - int(seqlen_q))}


# Beyond any distance between positions (Sq + Sk < 2^29): an unbounded side.
_UNBOUNDED_SIDE = 2**30


@lru_cache(maxsize=64)
def _window_function(left: int, right: int, shift: int):
    low = -left if left >= 0 else -_UNBOUNDED_SIDE
    high = right if right >= 0 else _UNBOUNDED_SIDE
    (mask,) = _specialized((_window_template,), _LOW=low, _HIGH=high, _SHIFT=shift)
    return predefined.mark(mask, predefined.Window(left, right, shift))


def _window_template(b, h, q_idx, kv_idx, mask_aux):
    offset = kv_idx - (q_idx + _SHIFT)
    return (offset >= _LOW) & (offset <= _HIGH)
