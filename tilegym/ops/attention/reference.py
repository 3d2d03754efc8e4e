"""Attention in plain PyTorch: the reference for tests and benchmarks.

Computes in float64 by default (any dtype can be asked for), on whatever device the inputs
are, with the same conventions as the kernels: GQA by repeating K/V heads, bottom-right
causal masking, the score modifiers of score_mods.py (sinks included), and rows that see no key
(or only -inf biases) giving output 0 and LSE -inf (the sink's logit, with sinks).
Differentiable (attn_bias and sinks included), and the gradients of rows that see no key are 0,
never NaN.
"""

import math

import torch


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """[Sq, Sk] bool, True where query i sees key j: j <= i + (Sk - Sq) (bottom-right aligned)."""
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_k, device=device)[None, :]
    return cols <= rows + (seqlen_k - seqlen_q)


def window_mask(seqlen_q: int, seqlen_k: int, left: int, right: int, device=None) -> torch.Tensor:
    """[Sq, Sk] bool, True where i + d - left <= j <= i + d + right (d = Sk - Sq; -1 unbounded)."""
    offset = torch.arange(seqlen_k, device=device)[None, :] - torch.arange(seqlen_q, device=device)[:, None]
    offset = offset - (seqlen_k - seqlen_q)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= offset >= -left
    if right >= 0:
        visible &= offset <= right
    return visible


def attention_reference(
    q,
    k,
    v,
    scaling=None,
    is_causal=True,
    compute_dtype=torch.float64,
    *,
    attn_bias=None,
    window_size=None,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
    score_mod=None,
    dropout_kept=None,
    dropout_scale=1.0,
):
    """(out, lse) with out in compute_dtype and lse [B, Hq, Sq] in compute_dtype; differentiable
    in q, k, v, attn_bias and sinks.

    dropout_kept: bool [B, Hq, Sq, Sk] (dropout_kept()), the probabilities kept, each then
    multiplied by dropout_scale; the LSE is that of all of them.

    score_mod: the meaning of a call's score and mask functions in PyTorch,
    ``score_mod(scores, b, h, q_idx, kv_idx) -> scores`` with -inf where a pair is hidden; the
    indices are int64 tensors that broadcast against scores [B, Hq, Sq, Sk]. Applied after the
    built-in modifiers, as the kernels apply the caller's functions."""
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scaling is None else scaling
    group = q.shape[1] // k.shape[1] if k.shape[1] else 1
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    seqlen_q, seqlen_k = q.shape[-2], k.shape[-2]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if attn_bias is not None:
        scores = scores + attn_bias.to(compute_dtype)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(compute_dtype).reshape(-1, q.shape[1], 1, 1)
        distance = (torch.arange(seqlen_q, device=q.device)[:, None] + (seqlen_k - seqlen_q)
                    - torch.arange(seqlen_k, device=q.device)[None, :]).abs()  # fmt: skip
        scores = scores - slopes * distance.to(compute_dtype)
    if score_mod is not None:
        scores = score_mod(scores, *_indices(scores.shape, q.device))
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    if is_causal:
        visible = causal_mask(seqlen_q, seqlen_k, q.device)
    if window_size is not None:
        visible = visible & window_mask(seqlen_q, seqlen_k, *window_size, device=q.device)
    # A -inf bias hides a key like a mask does.
    visible = visible & (scores != -torch.inf)
    sees_any = visible.any(dim=-1, keepdim=True)  # [B, H, Sq, 1]
    # Fill masked scores with a finite value first so that no -inf - (-inf) reaches autograd.
    finite_scores = scores.masked_fill(~visible, 0.0)
    hidden = finite_scores.masked_fill(~visible, -torch.inf)
    if seqlen_k:
        row_max = hidden.amax(dim=-1, keepdim=True)
    else:  # no key at all: amax has nothing to reduce
        row_max = hidden.new_full((*hidden.shape[:-1], 1), -torch.inf)
    if sinks is not None:
        # The sink joins each row as one more logit, without a value.
        sink = sinks.to(compute_dtype).reshape(1, -1, 1, 1).expand_as(row_max)
        sees_any = sees_any | (sink != -torch.inf)
        row_max = torch.maximum(row_max, sink)
    row_max = torch.where(sees_any, row_max, torch.zeros_like(row_max)).detach()
    weights = torch.exp(finite_scores - row_max) * visible
    row_sum = weights.sum(dim=-1, keepdim=True)
    if sinks is not None:
        row_sum = row_sum + torch.exp(sink - row_max)
    safe_sum = torch.where(sees_any, row_sum, torch.ones_like(row_sum))
    probs = weights / safe_sum
    if dropout_kept is not None:
        probs = probs * dropout_kept * dropout_scale
    out = torch.matmul(probs, v)
    lse = torch.where(sees_any, row_max + torch.log(safe_sum), torch.full_like(row_sum, -torch.inf))
    return out, lse.squeeze(-1)


_WORD = 0xFFFFFFFF


def _times(x: torch.Tensor, factor: int) -> torch.Tensor:
    """x * factor mod 2^32 for int64 x in [0, 2^32), without leaving int64's range."""
    low, high = x & 0xFFFF, x >> 16
    return (low * factor + (((high * factor) & 0xFFFF) << 16)) & _WORD


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """kernels/dropout.py's mixer, on int64 tensors holding uint32 values."""
    from tilegym.ops.attention.kernels.dropout import MIX_FIRST, MIX_SECOND

    x = x ^ (x >> 16)
    x = _times(x, MIX_FIRST)
    x = x ^ (x >> 15)
    x = _times(x, MIX_SECOND)
    return x ^ (x >> 16)


def dropout_kept(seed, rate: float, batch: int, heads: int, seqlen_q: int, seqlen_k: int, first_sequence: int = 0):
    """bool [batch, heads, Sq, Sk]: which probabilities the kernels keep under dropout at rate
    with seed (int32 [SEED_WORDS]: its third word the sequence row of query row 0), computed as
    kernels/dropout.py does; first_sequence: the sequence number of batch entry 0 (a packed
    batch's sequences one at a time)."""
    from tilegym.ops.attention import dropout
    from tilegym.ops.attention.kernels import dropout as device

    low, high, first_row = (int(word) for word in seed.tolist()[:3])
    heads_ = torch.arange(heads, dtype=torch.int64).reshape(1, -1, 1, 1)
    sequences = torch.arange(first_sequence, first_sequence + batch, dtype=torch.int64).reshape(-1, 1, 1, 1)
    stream = _mix32((low + _times(heads_, device.HEAD_STEP)) & _WORD)
    stream = _mix32(stream ^ high)
    stream = _mix32((stream + _times(sequences, device.SEQUENCE_STEP)) & _WORD)  # [B, H, 1, 1]
    rows = _times(
        torch.arange(first_row, first_row + seqlen_q, dtype=torch.int64).reshape(1, 1, -1, 1), device.ROW_STEP
    )
    cols = torch.arange(seqlen_k, dtype=torch.int64).reshape(1, 1, 1, -1)
    span = device.PAIR_SPAN
    pairs = ((cols // (2 * span)) * span) | (cols % span)  # keys j and j + 8 of a block of 16
    hashed = _mix32(((stream + rows) & _WORD) ^ _times(pairs, device.COLUMN_STEP))
    bits = device.KEPT_BITS
    half = torch.where((cols // span) % 2 == 1, hashed >> bits, hashed & ((1 << bits) - 1))
    return half >= dropout.threshold(rate)


def _indices(shape, device) -> tuple:
    """(b, h, q_idx, kv_idx) of scores of that [B, H, Sq, Sk] shape, each broadcasting along its dim."""
    return tuple(torch.arange(size, device=device).reshape([-1 if d == dim else 1 for d in range(4)])
                 for dim, size in enumerate(shape))  # fmt: skip


def attention_naive(q, k, v, scaling=None, is_causal=True):
    """Row by row in Python floats: slow and obviously right, to check the reference against."""
    batch, q_heads, seqlen_q, head_dim = q.shape
    kv_heads, seqlen_k = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scaling is None else scaling
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((batch, q_heads, seqlen_q), -math.inf, dtype=torch.float64)
    qd, kd, vd = (t.double().cpu().tolist() for t in (q, k, v))
    for b in range(batch):
        for h in range(q_heads):
            kv_head = h // (q_heads // kv_heads)
            for i in range(seqlen_q):
                keys = [j for j in range(seqlen_k) if not is_causal or j <= i + seqlen_k - seqlen_q]
                if not keys:
                    continue
                scores = [scale * sum(a * c for a, c in zip(qd[b][h][i], kd[b][kv_head][j], strict=True)) for j in keys]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                lse[b, h, i] = top + math.log(total)
                for d in range(head_dim):
                    out[b, h, i, d] = sum(w * vd[b][kv_head][j][d] for w, j in zip(weights, keys, strict=True)) / total
    return out, lse
