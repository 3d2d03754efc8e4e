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
"""

import cuda.tile as ct
import torch


def additive_grad(grad, score, out, b, h, q_idx, kv_idx, aux):
    """score_mod_grad of any score_mod that adds a term to the score: d(score + x)/d score = 1."""
    return grad


def softcap(cap: float, approximate: bool = True) -> dict:
    """Gemma 2's soft capping: score -> cap * tanh(score / cap), with its gradient.

    approximate: the hardware tanh, good to 2^-11 (below what 16-bit inputs carry, and what
    softcap= uses for them); False for float32 and float64 inputs (a slower, exact tanh)."""
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    inverse = 1.0 / cap
    rounding = ct.RoundingMode.APPROX if approximate else None

    def softcap_score(score, b, h, q_idx, kv_idx, aux):
        return cap * ct.tanh(score * inverse, rounding_mode=rounding)

    def softcap_grad(grad, score, out, b, h, q_idx, kv_idx, aux):
        # d/ds cap tanh(s / cap) = 1 - tanh^2, read from the output: no second tanh.
        capped = out * inverse
        return grad * (1.0 - capped * capped)

    return {"score_mod": softcap_score, "score_mod_grad": softcap_grad}


def _alibi_score(score, b, h, q_idx, kv_idx, aux):
    # Positions become floats before they broadcast: a conversion per row and per column, not
    # per score (one costs as much as an exp2). Exact below 2^24 tokens.
    slope = ct.gather(aux[0], h)
    query_positions = ct.astype(q_idx + ct.gather(aux[1], 0), score.dtype)
    return score - slope * ct.abs(query_positions - ct.astype(kv_idx, score.dtype))


def alibi(slopes: torch.Tensor, seqlen_q: int, seqlen_k: int) -> dict:
    """ALiBi: score - slope[h] * |i + Sk - Sq - j| (bottom-right aligned, as alibi_slopes);
    slopes float32 [Hq]."""
    offset = torch.tensor([seqlen_k - seqlen_q], dtype=torch.int32, device=slopes.device)
    return {"score_mod": _alibi_score, "score_mod_grad": additive_grad, "aux": (slopes, offset)}


def relative_position_bias(table: torch.Tensor, max_distance: int) -> dict:
    """T5-style learned relative positions: score + table[h, clamp(j - i, -max_distance,
    max_distance) + max_distance] with table [Hq, 2 * max_distance + 1]. When table requires
    grad it gets one, summed by atomic adds (its last bits vary from run to run).

    A tile whose pairs all lie beyond max_distance on one side reads one end of the table once
    instead of an entry per score: with long sequences, most tiles."""
    expected = 2 * max_distance + 1
    if table.dim() != 2 or table.shape[1] != expected:
        raise ValueError(f"table must be [heads, 2 * max_distance + 1 = {expected}], got {list(table.shape)}")

    def bucket(q_idx, kv_idx):
        return ct.minimum(ct.maximum(kv_idx - q_idx, -max_distance), max_distance) + max_distance

    def end_bucket(q_idx, kv_idx):
        """The table end every pair of the tile falls in (0 or 2 * max_distance), or -1 if some
        pair is within max_distance: two reductions of the index tiles, not one per score."""
        if ct.max(kv_idx) - ct.min(q_idx) < -max_distance:
            end = 0
        elif ct.min(kv_idx) - ct.max(q_idx) > max_distance:
            end = 2 * max_distance
        else:
            end = -1
        return end

    def relative_score(score, b, h, q_idx, kv_idx, aux):
        end = end_bucket(q_idx, kv_idx)
        if end >= 0:
            result = score + ct.astype(ct.gather(aux[0], (h, end)), score.dtype)
        else:
            result = score + ct.astype(ct.gather(aux[0], (h, bucket(q_idx, kv_idx))), score.dtype)
        return result

    def relative_table_grad(grad, score, b, h, q_idx, kv_idx, aux, aux_grads):
        # Pairs farther apart than max_distance share the table's two end buckets: one sum per
        # tile for each, since one atomic add per pair would all land on one address. Pairs
        # within it add one by one, and only in tiles that have some.
        offset = kv_idx - q_idx
        ct.atomic_add(aux_grads[0], (h, 0), ct.sum(ct.where(offset < -max_distance, grad, 0.0)))
        ct.atomic_add(aux_grads[0], (h, 2 * max_distance), ct.sum(ct.where(offset > max_distance, grad, 0.0)))
        near = (offset >= -max_distance) & (offset <= max_distance)
        if ct.sum(ct.where(near, 1, 0)) > 0:
            # Far pairs get an index past the table, which the bounds check drops.
            index = ct.where(near, offset + max_distance, 2 * max_distance + 1)
            ct.atomic_add(aux_grads[0], (h, index), grad)

    return {
        "score_mod": relative_score,
        "score_mod_grad": additive_grad,
        "aux": (table,),
        "aux_grad": relative_table_grad,
    }


def _same_document(b, h, q_idx, kv_idx, mask_aux):
    docs = mask_aux[0]
    return ct.gather(docs, (b, q_idx)) == ct.gather(docs, (b, kv_idx))


def document_mask(doc_ids: torch.Tensor) -> dict:
    """Queries see only keys of their own document: doc_ids int32 [B, S], one id per token
    (several documents packed in one row, Sq = Sk). Combine with is_causal for causal
    documents."""
    return {"mask_mod": _same_document, "mask_aux": (doc_ids,)}


def prefix_lm(prefix_length: torch.Tensor) -> dict:
    """Prefix-LM: every query sees the prefix (keys below prefix_length[b], int32 [B]) and the
    keys up to itself. Call with is_causal=False."""

    def prefix_or_causal(b, h, q_idx, kv_idx, mask_aux):
        return (kv_idx < ct.gather(mask_aux[0], b)) | (kv_idx <= q_idx)

    return {"mask_mod": prefix_or_causal, "mask_aux": (prefix_length,)}


def sliding_window_with_globals(window: int, global_tokens: int) -> dict:
    """Each query sees the `window` keys up to itself and the first `global_tokens` keys
    (attention sinks as tokens, Longformer's globals). Call with is_causal=True."""

    def window_or_global(b, h, q_idx, kv_idx, mask_aux):
        return (q_idx - kv_idx < window) | (kv_idx < global_tokens)

    return {"mask_mod": window_or_global}


def _within_length(b, h, q_idx, kv_idx, mask_aux):
    return kv_idx < ct.gather(mask_aux[0], b)


def key_padding(lengths: torch.Tensor) -> dict:
    """Keys at or past lengths[b] (int32 [B]) are padding, hidden from every query."""
    return {"mask_mod": _within_length, "mask_aux": (lengths,)}
