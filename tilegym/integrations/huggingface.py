"""Our attention as an attention implementation of Hugging Face transformers (5.x).

    import tilegym.integrations.huggingface as tilegym_hf

    tilegym_hf.register()  # once per process: the name "tilegym"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="tilegym")

A model then calls attention_forward in every attention layer, in training and generation.
Its masks are transformers' own SDPA masks (masking_utils.sdpa_mask): where SDPA would skip the
mask (causal or bidirectional attention without padding) the call runs plain attention; where a
mask is made (padding, sequences packed by position_ids, sliding or chunked windows, a model's
own overlays) the mask is read as a mask function, so its empty tiles are skipped and only tiles
it cuts are evaluated pair by pair (its tiles sorted once per step, not per layer). Each layer
computes what SDPA computes from the same mask, except that a query row that sees no key (a
padded row) gives zeros.

Packed sequences run the packed variable-length kernels: those a collator passes by
FlashAttention's keyword arguments (cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k;
e.g. DataCollatorWithFlattening with return_flash_attn_kwargs=True) where the model made no
mask, and those packed by position_ids where the model's mask is exactly their packing (checked
once per mask tensor; any other mask is read as it is). Softcapping (Gemma 2), attention sinks
(gpt-oss), sliding windows, GQA, the model's scaling and its attention dropout (in training)
are passed to the kernels. A position bias (T5) is refused.

Under context_parallel() each layer computes attention over whole sequences whose shares the
ranks of a process group hold (tilegym.parallel): no masks are made there, padding is refused.
"""

import contextlib
import warnings
from dataclasses import dataclass

import cuda.tile as ct
import torch

from tilegym.kept_values import KeptPerTensor
from tilegym.ops.attention.api import tile_fmha_functional
from tilegym.ops.attention.block_mask import BlockMask, create_block_mask

NAME = "tilegym"


def register(name: str = NAME) -> str:
    """Registers attention_forward and its mask function under name with transformers; returns
    the name, for ``attn_implementation=``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    return name


def attention_mask(*args, **kwargs):
    """transformers' SDPA mask: 4D bool (True: seen), or None where SDPA would rely on is_causal.
    A row that sees no key (a padded query) gives zeros. Under context_parallel, None: the layers
    see this rank's share of whole sequences, and a padding mask is refused."""
    if _CONTEXT_PARALLEL:
        padding = kwargs.get("attention_mask")
        if padding is not None and not bool(padding.all()):
            raise ValueError(
                "padding (an attention_mask with zeros) is not supported under context_parallel: pass whole "
                "sequences, or pack them with cu_seq_lens_q / cu_seq_lens_k"
            )
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


@dataclass(frozen=True)
class _ContextParallel:
    """The process group and layout of context_parallel."""

    group: object
    layout: str


_CONTEXT_PARALLEL: list[_ContextParallel] = []  # innermost last


@contextlib.contextmanager
def context_parallel(group=None, layout: str = "zigzag"):
    """Within it, each call of a model on our attention holds this rank's share of its
    sequences (tilegym.parallel), and every attention layer computes attention over the whole
    sequences across the ranks of group.

    One sequence per batch row: input_ids ``[B, L]`` this rank's share of ``[B, world x L]``
    (``tilegym.parallel.shard_sequence(ids, dim=1, layout=layout)``) and position_ids its
    global positions (``sequence_positions``). Packed sequences: FlashAttention's keyword
    arguments of the whole batch (cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, as
    a flattening collator makes them; every length a multiple of 2 x world), input_ids
    ``[1, T]`` this rank's rows (``shard_packed``) and position_ids their positions
    (``packed_positions``). Training calls without a cache and without padding; the labels'
    shift crosses shares, so pass ``shift_labels`` shifted on the whole sequence and sharded
    alike, and reduce the loss and the gradients over the group."""
    from tilegym.parallel.sharding import LAYOUTS

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    _CONTEXT_PARALLEL.append(_ContextParallel(group, layout))
    try:
        yield
    finally:
        _CONTEXT_PARALLEL.pop()


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """One attention layer's call, as transformers makes it: query ``[B, Hq, Sq, D]``, key and
    value ``[B, Hkv, Sk, D]`` (and Dv), attention_mask from attention_mask above (or the caller's
    own 4D mask: bool, True seen, or additive float). Returns ``([B, Sq, Hq, Dv], None)``."""
    if position_bias is not None:
        raise ValueError("a position bias (T5-style position_bias) is not supported by tilegym attention")
    if kwargs.get("output_attentions"):
        warnings.warn("tilegym attention returns no attention weights (output_attentions)", stacklevel=2)
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    modifiers = {"softcap": softcap, "sinks": s_aux}
    packing = _given_packing(kwargs, query.shape[0])
    # transformers passes the module's rate in training and 0 in eval.
    modifiers["dropout_p"] = dropout
    if _CONTEXT_PARALLEL:
        parallel = _CONTEXT_PARALLEL[-1]
        out = _context_parallel(
            parallel, query, key, value, attention_mask, scaling, causal, sliding_window, modifiers, packing
        )
        return out, None
    if packing is None and attention_mask is not None and not torch.compiler.is_compiling():
        # Sequences packed by position_ids: transformers made a mask of the whole row; where it
        # is exactly the packing's own, the packed kernels compute the same, with no mask to read.
        packing = _packing_of(attention_mask, kwargs.get("position_ids"), causal, sliding_window, query, key)
        if packing is not None:
            attention_mask = None
    if packing is not None and attention_mask is None:
        out = _packed(query, key, value, scaling, causal, _window(sliding_window, causal), modifiers, packing)
        return out, None
    if packing is not None:
        # A mask made over the whole packed row (a sliding window, say) does not know the
        # sequences: a pair is seen where both the mask and the packing allow it.
        same = _same_sequence(packing.cu_seqlens_q, packing.cu_seqlens_k, query.shape[2], key.shape[2])
        is_bool = attention_mask.dtype == torch.bool
        attention_mask = attention_mask & same if is_bool else attention_mask.masked_fill(~same, -torch.inf)
    if attention_mask is None:
        # As SDPA runs it without a mask: causal only for several queries, and a causal prefill
        # into a longer (static) cache reads only the first Sq keys (SDPA's causal mask is
        # top-left aligned; ours, bottom-right, agrees once Sk = Sq).
        seqlen_q = query.shape[2]
        causal = causal and seqlen_q > 1
        if causal and key.shape[2] > seqlen_q:
            key, value = key[:, :, :seqlen_q], value[:, :, :seqlen_q]
        window = _window(sliding_window, causal)
        out = tile_fmha_functional(query, key, value, scaling, causal, window_size=window, **modifiers)
    else:
        # The mask holds the causal rule, the window and the padding: it alone decides.
        out = tile_fmha_functional(
            query, key, value, scaling, False, **modifiers, **_as_mask(attention_mask, query, key)
        )
    return out.transpose(1, 2).contiguous(), None


def _context_parallel(
    parallel: _ContextParallel, query, key, value, mask, scaling, causal, sliding_window, modifiers, packing
):
    """One layer's call under context_parallel, as [B, L, Hq, Dv]: query, key and value hold
    this rank's share (context_parallel says how)."""
    from tilegym.parallel import context_parallel_attention, context_parallel_attention_varlen

    if mask is not None:
        raise ValueError(
            "an attention mask reached a layer under context_parallel, where the layers see shares of whole "
            "sequences: pass no mask of your own"
        )
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"context_parallel computes self-attention over shares of whole sequences, got {query.shape[2]} "
            f"queries and {key.shape[2]} keys (a cache? call the model with use_cache=False)"
        )
    window = _window(sliding_window, causal)
    if packing is not None:
        rate = modifiers.pop("dropout_p")
        if rate:
            raise ValueError(
                f"attention dropout ({rate}) is not supported under context_parallel() on packed sequences; "
                "set the model's attention dropout to 0 (e.g. config.attention_dropout = 0.0)"
            )
        same = packing.cu_seqlens_k is packing.cu_seqlens_q or torch.equal(packing.cu_seqlens_k, packing.cu_seqlens_q)
        if not same:
            raise ValueError("context_parallel computes self-attention: cu_seq_lens_k must equal cu_seq_lens_q")
        longest = _longest(packing.max_seqlen_q, packing.cu_seqlens_q)
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, D], views
        out = context_parallel_attention_varlen(
            q, k, v, packing.cu_seqlens_q, longest, scaling, causal, group=parallel.group, window_size=window,
            **modifiers,
        )  # fmt: skip
        return out[None]
    out = context_parallel_attention(
        query, key, value, scaling, causal, group=parallel.group, layout=parallel.layout, window_size=window,
        **modifiers,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous()


def _window(sliding_window: int | None, causal: bool):
    """transformers' sliding window (a query sees the last sliding_window keys, itself included)
    as window_size (left, right); None: no window."""
    if sliding_window is None:
        return None
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


@dataclass(frozen=True)
class _Packing:
    """Sequences packed into a batch of one row: int32 cumulative lengths on the row's device,
    and the longest lengths where known (None: read from the cumulative lengths)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int | torch.Tensor | None = None
    max_seqlen_k: int | torch.Tensor | None = None


def _given_packing(kwargs: dict, batch: int) -> _Packing | None:
    """The packing FlashAttention's keyword arguments describe (cu_seq_lens_q, cu_seq_lens_k,
    max_length_q, max_length_k); None without them."""
    cu_seqlens_q, cu_seqlens_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_seqlens_q is None or cu_seqlens_k is None:
        return None
    if batch != 1:
        raise ValueError(f"cu_seq_lens_q and cu_seq_lens_k describe a batch packed into one row; the batch has {batch}")
    return _Packing(
        cu_seqlens_q.to(torch.int32),
        cu_seqlens_k.to(torch.int32),
        kwargs.get("max_length_q"),
        kwargs.get("max_length_k"),
    )


def _packed(query, key, value, scaling, causal, window, modifiers, packing: _Packing) -> torch.Tensor:
    """The packed row's attention on the packed kernels, as [1, total, Hq, Dv]."""
    # A length given as a tensor costs one host synchronisation, as in FlashAttention's path.
    max_seqlen_q = _longest(packing.max_seqlen_q, packing.cu_seqlens_q)
    max_seqlen_k = _longest(packing.max_seqlen_k, packing.cu_seqlens_k)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [total, heads, D], views
    out = tile_fmha_functional(
        q, k, v, scaling, causal, window_size=window, cu_seqlens_q=packing.cu_seqlens_q,
        cu_seqlens_k=packing.cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **modifiers,
    )  # fmt: skip
    return out[None]


def _same_sequence(cu_seqlens_q, cu_seqlens_k, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """bool [Sq, Sk]: whether query row i and key row j belong to one packed sequence (rows past
    the last sequence belong to none)."""

    def sequence_of(cu_seqlens, rows):
        positions = torch.arange(rows, device=cu_seqlens.device)
        found = torch.searchsorted(cu_seqlens.to(torch.int64), positions, right=True) - 1
        return torch.where(positions < cu_seqlens[-1], found, -1)

    of_query, of_key = sequence_of(cu_seqlens_q, seqlen_q), sequence_of(cu_seqlens_k, seqlen_k)
    return (of_query[:, None] == of_key[None, :]) & (of_query[:, None] >= 0)


def _longest(given, cu_seqlens: torch.Tensor) -> int:
    if given is None:
        return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
    return int(given)


def _as_mask(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> dict:
    """Keyword arguments that apply a 4D mask ``[B or 1, 1 or Hq, Sq, Sk]``: a bool one as a mask
    function reading it, an additive float one as attn_bias."""
    (batch, heads, seqlen_q), seqlen_k = query.shape[:3], key.shape[2]
    fits = mask.dim() == 4 and mask.shape[0] in (1, batch) and mask.shape[1] in (1, heads)
    if not fits or tuple(mask.shape[2:]) != (seqlen_q, seqlen_k):
        raise ValueError(
            f"attention_mask must have shape [1 or {batch}, 1 or {heads}, {seqlen_q}, {seqlen_k}], "
            f"got {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        return {"attn_bias": mask}
    compiling = torch.compiler.is_compiling()
    # The kernels index the mask by the call's batch entry: a mask of one entry is expanded. The
    # kernels read int8 (a view of the bool mask; inductor has no bool bitcast, so a copy there).
    seen = mask.to(torch.int8) if compiling else mask.view(torch.int8)
    seen = seen.expand(batch, *mask.shape[1:])
    per_head = seen.shape[1] > 1
    mask_mod, mask_aux = (_seen_by_head, (seen,)) if per_head else (_seen_by_batch_entry, (seen[:, 0],))
    if compiling:
        # A mask function stays in a compiled graph; a block mask would break it.
        return {"mask_mod": mask_mod, "mask_aux": mask_aux}
    return {"block_mask": _block_mask(mask, mask_mod, mask_aux, (batch, heads, seqlen_q, seqlen_k), per_head)}


# Kept per mask tensor: transformers passes one mask to all layers of a kind (two kinds, sliding
# and full), so a block mask is sorted, and a packing checked, once per step.
_BLOCK_MASKS = KeptPerTensor()
_PACKINGS = KeptPerTensor()


def _block_mask(mask, mask_mod, mask_aux, sizes, per_head: bool) -> BlockMask:
    """A BlockMask reading mask_aux by mask_mod, sorted per batch entry of the mask (one entry
    for all when it has one) and per head only where it differs by head."""
    batch, heads, seqlen_q, seqlen_k = sizes
    return _BLOCK_MASKS.value_for(
        mask, sizes,
        lambda: create_block_mask(
            mask_mod, mask.shape[0], heads if per_head else None, seqlen_q, seqlen_k, mask.device, mask_aux
        ),
    )  # fmt: skip


def _packing_of(mask, position_ids, causal: bool, sliding_window, query, key) -> _Packing | None:
    """The packing that position_ids describe (a sequence starts wherever a position does not
    follow the one before) where mask is exactly its own, with the causal rule and the sliding
    window; else None. Worked out once per mask tensor, with two host synchronisations (the
    sequences' starts and the comparison)."""
    seqlen = query.shape[2]
    one_row = query.shape[0] == 1 and mask.dtype == torch.bool and tuple(mask.shape) == (1, 1, seqlen, seqlen)
    if not one_row or key.shape[2] != seqlen or position_ids is None or position_ids.numel() != seqlen:
        return None
    context = (causal, sliding_window)
    found = _PACKINGS.value_for(
        mask, context, lambda: _packing_if_exact(mask[0, 0], position_ids.reshape(-1), causal, sliding_window),
        (position_ids,),
    )  # fmt: skip
    return found or None


def _packing_if_exact(mask, positions, causal: bool, sliding_window) -> _Packing | bool:
    """_packing_of's work; False where the mask is not the packing's own."""
    seqlen = positions.numel()
    starts = torch.ones(seqlen, dtype=torch.bool, device=mask.device)
    starts[1:] = positions[1:] != positions[:-1] + 1
    end = torch.tensor([seqlen], device=mask.device)
    cu_seqlens = torch.cat([starts.nonzero().reshape(-1), end]).to(torch.int32)
    expected = _same_sequence(cu_seqlens, cu_seqlens, seqlen, seqlen)
    # Each rule by comparing a column of query rows with a row of key rows: bool [S, S] results
    # only, no [S, S] integer distances (2 GiB at 16384 tokens).
    query_rows, key_rows = torch.arange(seqlen, device=mask.device)[:, None], torch.arange(seqlen, device=mask.device)
    if causal:
        expected &= key_rows <= query_rows
    if sliding_window is not None:
        expected &= key_rows > query_rows - sliding_window
        if not causal:
            expected &= key_rows < query_rows + sliding_window
    if not torch.equal(mask, expected):
        return False
    longest = _longest(None, cu_seqlens)  # once per mask, not once per layer
    return _Packing(cu_seqlens, cu_seqlens, longest, longest)


def _seen_by_batch_entry(b, h, q_idx, kv_idx, mask_aux):
    return ct.gather(mask_aux[0], (b, q_idx, kv_idx)) != 0


def _seen_by_head(b, h, q_idx, kv_idx, mask_aux):
    return ct.gather(mask_aux[0], (b, h, q_idx, kv_idx)) != 0
