"""Block masks: which tiles of a mask_mod are empty, partly or fully visible, made once per mask
and reused by every launch (forward and backward) that runs with it.

A BlockMask holds the caller's mask_mod, its tensors (mask_aux) and the sizes it covers. The
kernels' tiles differ from kernel to kernel and config to config, so the mask keeps, per
tiling and mask rule (causal, window), the lists its kernels read: for each row of tiles, the
partly visible tiles (run with the mask evaluated), then the fully visible ones (run without),
every other tile skipped. Each is computed on the GPU on first use (one kernel evaluating
mask_mod on every pair, then a sort), without a host synchronisation, and kept.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tilegym.ops.attention import programmable
from tilegym.ops.attention.packing import CuSeqlens, check_cu_seqlens
from tilegym.ops.attention.problem import sizes_score_nothing
from tilegym.ops.attention.programmable import UserFunctions

# Tile kinds, as the classifying kernel writes them (kernels/block_mask.py).
_PARTIAL = 1
_FULL = 2


@dataclass(frozen=True)
class MaskRule:
    """What besides mask_mod decides a pair's visibility in a call: the kernels' causal switch and
    window sides (launch._modifier_arguments' values); packed, the rows of the call's arrays,
    which clamp each sequence's length (kernels/packed.py)."""

    causal: bool
    windowed: bool
    window_left: int
    window_right: int
    total_q: int = 0
    total_k: int = 0


@dataclass(frozen=True)
class TileListTensors:
    """The lists of one tiling (kernels/state.TileLists): counts [B, H, rows, 2] and tiles
    [B, H, rows, 2, tiles], int32."""

    counts: torch.Tensor
    tiles: torch.Tensor


class BlockMask:
    """mask_mod over [batch, heads, seqlen_q, seqlen_k], batch or heads 1 where the mask is the
    same for every batch entry or head; or, packed (cu_seqlens), over each sequence of a packed
    batch, batch counting the sequences and seqlen_q, seqlen_k the longest lengths. Made by
    create_block_mask; pass it as block_mask= to the attention functions."""

    def __init__(
        self, mask_mod, batch: int, heads: int, seqlen_q: int, seqlen_k: int, mask_aux, device, cu_seqlens=None
    ):
        self.mask_mod = mask_mod
        self.functions: UserFunctions = programmable.user_functions(mask_mod=mask_mod)
        self.batch, self.heads, self.seqlen_q, self.seqlen_k = batch, heads, seqlen_q, seqlen_k
        self.mask_aux = mask_aux
        self.device = device
        self.cu_seqlens: CuSeqlens | None = cu_seqlens
        self._lists: dict[tuple, TileListTensors] = {}

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.batch, self.heads, self.seqlen_q, self.seqlen_k

    def __repr__(self) -> str:
        return f"BlockMask(mask_mod={self.mask_mod.__qualname__}, shape={list(self.shape)})"

    def tile_lists(self, block_m: int, block_n: int, rule: MaskRule, key_major: bool) -> TileListTensors:
        """The lists for [block_m, block_n] tiles under rule: one row per query tile, or per key
        tile (key_major, the dK/dV kernel's)."""
        key = (block_m, block_n, rule, key_major)
        found = self._lists.get(key)
        if found is None:
            kinds = self._tile_kinds(block_m, block_n, rule)
            found = self._lists[key] = _lists_of(kinds.transpose(2, 3) if key_major else kinds)
        return found

    def _tile_kinds(self, block_m: int, block_n: int, rule: MaskRule) -> torch.Tensor:
        key = ("kinds", block_m, block_n, rule)
        if key in self._lists:
            return self._lists[key]
        from tilegym.ops.attention import launch

        kinds = launch.classify_tiles(self, block_m, block_n, rule)
        self._lists[key] = kinds
        return kinds


def _lists_of(kinds: torch.Tensor) -> TileListTensors:
    """Counts and ascending tile indices of each row's partial and full tiles."""
    partial, full = kinds == _PARTIAL, kinds == _FULL
    counts = torch.stack([partial.sum(-1), full.sum(-1)], dim=-1).to(torch.int32)
    # A stable sort of "not chosen" puts the chosen tiles first, in ascending order.
    firsts = [torch.sort((~chosen).to(torch.int8), dim=-1, stable=True).indices for chosen in (partial, full)]
    tiles = torch.stack(firsts, dim=-2).to(torch.int32).contiguous()
    return TileListTensors(counts.contiguous(), tiles)


def create_block_mask(
    mask_mod: Callable,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device="cuda",
    mask_aux=None,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> BlockMask:
    """A BlockMask of mask_mod over [B, H, Q_LEN, KV_LEN] (FlexAttention's create_block_mask).

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx, mask_aux) -> bool tile``, cuTile code:
            b and h are int32 scalars, q_idx and kv_idx int32 index tiles that broadcast
            against each other, mask_aux the tuple of tensors below (cuTile arrays, read with
            ``ct.gather``). True where query q_idx attends to key kv_idx.
        B, H: batch entries and query heads; None (or 1) when the mask is the same for all
            (mask_mod is then called with 0 for that index when the tiles are sorted, and with
            the real index inside the kernels).
        Q_LEN, KV_LEN: the query and key lengths of the calls it serves.
        device: where the mask's tensors and lists live.
        mask_aux: up to 4 tensors mask_mod reads (document ids, lengths, ...).
        cu_seqlens_q, cu_seqlens_k: a mask for packed batches with these cumulative lengths
            (int32 [N + 1] on the device, the very tensors the calls pass): B is then N (or
            None), Q_LEN and KV_LEN the calls' max_seqlen_q and max_seqlen_k, and mask_mod
            sees the sequence as b and positions within it, as score_mod does.

    The tiles are sorted on first use by each kernel tiling (one kernel run each, cached in the
    mask), so a mask made once serves every later call, forward and backward. Call the
    attention once outside a CUDA graph capture before capturing it (as for tuning).

    Example::

        def same_document(b, h, q_idx, kv_idx, mask_aux):
            doc = mask_aux[0]
            return ct.gather(doc, q_idx) == ct.gather(doc, kv_idx)

        mask = create_block_mask(same_document, None, None, 4096, 4096, mask_aux=(doc_ids,))
        out = tile_fmha_with_backward(q, k, v, is_causal=True, block_mask=mask)
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    _check_mask_mod(mask_mod)
    sizes = {}
    for name, value, optional in (("B", B, True), ("H", H, True), ("Q_LEN", Q_LEN, False), ("KV_LEN", KV_LEN, False)):
        if value is None and optional:
            value = 1
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if optional else 0):
            raise ValueError(f"{name} must be a positive int{' or None' if optional else ''}, got {value!r}")
        sizes[name] = value
    cu_seqlens = _packed_lengths(cu_seqlens_q, cu_seqlens_k, B, torch.empty(0, device=device))
    batch = sizes["B"] if cu_seqlens is None else cu_seqlens.q.numel() - 1
    return _block_mask(mask_mod, batch, sizes["H"], sizes["Q_LEN"], sizes["KV_LEN"], mask_aux, device, cu_seqlens)


def _check_mask_mod(mask_mod) -> None:
    if not isinstance(mask_mod, type(create_block_mask)):
        raise TypeError(f"mask_mod must be a Python function (def or lambda), got {type(mask_mod).__name__}")


def _block_mask(mask_mod, batch, heads, seqlen_q, seqlen_k, mask_aux, device, cu_seqlens) -> BlockMask:
    """A BlockMask of checked sizes and lengths, with mask_mod and mask_aux checked. An empty
    mask_aux tensor (a per-key table without keys) is refused only where a call the mask serves
    scores something: otherwise no kernel reads it, the tiles' sort included."""
    _check_mask_mod(mask_mod)
    read = not sizes_score_nothing(batch, heads, seqlen_q, seqlen_k, packed=cu_seqlens is not None)
    mask_aux = programmable.check_aux(mask_aux, torch.empty(0, device=device), "mask_aux", read=read)
    return BlockMask(mask_mod, batch, heads, seqlen_q, seqlen_k, mask_aux, device, cu_seqlens)


def _packed_lengths(cu_seqlens_q, cu_seqlens_k, batch, probe) -> CuSeqlens | None:
    """create_block_mask's cumulative lengths, checked as a packed call's are (packing.py), both
    or neither, N matching B where B is given."""
    if cu_seqlens_q is None and cu_seqlens_k is None:
        return None
    cu_seqlens = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, probe)
    if batch is not None and batch != cu_seqlens_q.numel() - 1:
        raise ValueError(f"B must be None or the number of sequences ({cu_seqlens_q.numel() - 1}), got {batch}")
    return cu_seqlens


def check_block_mask(
    block_mask,
    mask_mod,
    mask_aux,
    q: torch.Tensor,
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    cu_seqlens: CuSeqlens | None = None,
):
    """The call's BlockMask: block_mask checked against the call's sizes, or one made for this
    call from mask_mod; None without either. cu_seqlens: a packed call's cumulative lengths
    (batch counts its sequences, seqlen_q and seqlen_k are its longest lengths)."""
    if block_mask is None:
        if mask_mod is None:
            if mask_aux is not None:
                raise ValueError("mask_aux is given without mask_mod or block_mask")
            return None
        # The call's own sizes, which may be empty (a batch of none), and its lengths, checked.
        return _block_mask(mask_mod, batch, heads, seqlen_q, seqlen_k, mask_aux, q.device, cu_seqlens)
    if mask_mod is not None or mask_aux is not None:
        raise ValueError("give either block_mask or mask_mod (with mask_aux), not both: a block mask holds its own")
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a BlockMask (create_block_mask), got {type(block_mask).__name__}")
    _check_mask_packing(block_mask.cu_seqlens, cu_seqlens)
    if (block_mask.seqlen_q, block_mask.seqlen_k) != (seqlen_q, seqlen_k):
        raise ValueError(
            f"block_mask covers Q_LEN={block_mask.seqlen_q}, KV_LEN={block_mask.seqlen_k}, but the call has "
            f"Sq={seqlen_q}, Sk={seqlen_k}"
        )
    if block_mask.batch not in (1, batch) or block_mask.heads not in (1, heads):
        raise ValueError(
            f"block_mask has B={block_mask.batch}, H={block_mask.heads}; the call needs 1 or its batch ({batch}) "
            f"and 1 or its query heads ({heads})"
        )
    if block_mask.device != q.device:
        raise ValueError(f"block_mask is on {block_mask.device}, q on {q.device}")
    return block_mask


def _check_mask_packing(made_for: CuSeqlens | None, call: CuSeqlens | None) -> None:
    """A packed call needs a block mask made with its very cumulative-length tensors (their
    contents are read on the GPU only), a dense call one made without."""
    if made_for is None and call is None:
        return
    if made_for is None:
        raise ValueError(
            "block_mask was made for dense batches; a packed batch needs one made with its cu_seqlens_q and "
            "cu_seqlens_k (create_block_mask(..., cu_seqlens_q=..., cu_seqlens_k=...))"
        )
    if call is None:
        raise ValueError("block_mask was made for a packed batch (cu_seqlens_q); this call is dense")
    if made_for.q is not call.q or made_for.k is not call.k:
        raise ValueError(
            "block_mask was made with other cu_seqlens_q / cu_seqlens_k tensors than this call's: pass the same "
            "tensors to create_block_mask and to the call"
        )
