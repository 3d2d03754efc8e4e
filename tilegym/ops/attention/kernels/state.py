"""Named state that kernel code passes between its functions: frozen dataclasses, which cuTile
flattens into the values they hold (no cost over loose values). Fields that are compile-time
constants stay constant through them, so a switch read from a dataclass still removes code.

Kernel parameters themselves stay flat (cuda-tile 1.7 takes no dataclass parameters); each
kernel builds these from its parameters first thing.
"""

from dataclasses import dataclass
from typing import Any

# Every field holds a cuTile value (a tile, a scalar, an array or a constant), typed by the
# compiler: the annotations only name the fields.
Value = Any


@dataclass(frozen=True)
class HeadSplit:
    """How a head dim is tiled (head.py): a main tile of `width` columns, and a `tail` tile of
    that many columns after it (0: none). Both compile-time."""

    width: Value
    tail: Value


@dataclass(frozen=True)
class Tiling:
    """Tile sizes of a program, all compile-time: query rows, key rows, and the head dims as
    tiled, that of Q and K (also dQ and dK) and that of V (also the output, dO and dV)."""

    block_m: Value
    block_n: Value
    qk: Value  # HeadSplit
    value: Value  # HeadSplit


@dataclass(frozen=True)
class HeadParts:
    """Rows of an array over its head dim as a HeadSplit tiles it: the main tile, and the tail
    after it (0 when there is none)."""

    main: Value  # [rows, width]
    tail: Value  # [rows, tail], or 0


@dataclass(frozen=True)
class Switches:
    """The score modifiers' compile-time switches (score_mods.py): all off for plain attention."""

    windowed: Value
    capped: Value
    bias_mode: Value  # BIAS_NONE, BIAS_ONE_ROW or BIAS_PER_ROW
    alibi: Value
    user: Value  # UserFunctions: the caller's score and mask functions, each None when not given


@dataclass(frozen=True)
class UserFunctions:
    """The caller's functions (user.py), compile-time constants: a kernel built with them is a
    copy of the module's kernel whose globals name them (tilegym/ops/attention/programmable.py).
    None where not given."""

    score_mod: Value  # (score, b, h, q_idx, kv_idx, aux) -> score
    score_mod_grad: Value  # (grad, score, b, h, q_idx, kv_idx, aux) -> grad of score_mod's input
    aux_grad: Value  # (grad, score, b, h, q_idx, kv_idx, aux, aux_grads): adds into aux_grads
    mask_mod: Value  # (b, h, q_idx, kv_idx, mask_aux) -> bool


@dataclass(frozen=True)
class UserArgs:
    """What the caller's functions are given besides tiles: the batch entry (the sequence of a
    packed batch) and query head, and the caller's tensors."""

    b: Value
    h: Value
    aux: Value  # tuple of AUX_SLOTS arrays
    mask_aux: Value  # tuple of AUX_SLOTS arrays
    aux_grads: Value  # tuple of AUX_SLOTS arrays (the dK/dV kernel; aux_gradients.buffers), else ()
    sums_aux_grads: Value  # compile-time: this kernel calls aux_grad (only one kernel may)


@dataclass(frozen=True)
class TileLists:
    """A block mask's tiles for one tiling (block_mask.py): for each row of tiles (a query tile,
    or a key tile in the dK/dV kernel), how many tiles are partly visible and fully visible, and
    which; every other tile is skipped. Rows are indexed at the mask's batch and head, which
    broadcast (size 1) or match the call's."""

    counts: Value  # [B or 1, H or 1, rows, 2] int32: partial, full
    tiles: Value  # [B or 1, H or 1, rows, 2, tiles] int32, the partial ones then the full ones
    b: Value
    h: Value


@dataclass(frozen=True)
class SeqLens:
    """Sequence lengths as int32 (tiles.seqlens)."""

    q: Value
    k: Value


@dataclass(frozen=True)
class HeadMods:
    """The score modifiers' runtime values for one (batch, query head), in the accumulator dtype
    where they are floats. bias_b and bias_h index the bias, clamped where it broadcasts."""

    bias: Value  # the Bias array
    bias_b: Value
    bias_h: Value
    slope_log2: Value  # ALiBi slope * log2(e); 0 without ALiBi
    softcap_in: Value  # scale / softcap: the tanh's argument from a raw product
    softcap_log2: Value  # softcap * log2(e)
    window_left: Value
    window_right: Value


@dataclass(frozen=True)
class Segments:
    """Tiles one program visits along the other sequence: [full_start, full_end) need no mask;
    [start, full_start) and [full_end, end) do; the rest are skipped. A masked segment that is
    always empty for the mask at hand is left out at compile time (masked_before and
    masked_after are constants), so no loop is emitted for it."""

    start: Value
    full_start: Value
    full_end: Value
    end: Value
    masked_before: Value
    masked_after: Value


@dataclass(frozen=True)
class ForwardState:
    """The online softmax of a query tile: row max (raw units or base-2 scores, see
    modifiers.keeps_raw_scores), row sum and output accumulator."""

    row_max: Value
    row_sum: Value
    acc: Value  # HeadParts [block_m, Dv]


@dataclass(frozen=True)
class Scoring:
    """What turns raw products q.k into scores and masks, shared by every step of a program."""

    qk_scale_log2: Value  # softmax scale * log2(e), in the accumulator dtype
    seqlens: Value  # SeqLens
    mods: Value  # HeadMods
    switches: Value  # Switches
    tiling: Value  # Tiling
    causal: Value  # compile-time; off under a window, which carries its own right side
    user: Value  # UserArgs
    dropout: Value  # Dropout (dropout.py), or 0 where no probability is computed for V


@dataclass(frozen=True)
class Dropout:
    """Attention dropout of one program's sequence and query head (dropout.py)."""

    on: Value  # compile-time: the kernel drops probabilities
    stream: Value  # uint32 [1, 1]: the hash of the seed, the sequence and the query head and the call's first row
    threshold: Value  # int32: a probability is dropped where its 16-bit half of a hash is below it
    scale: Value  # 1 / (1 - rate), in the accumulator dtype


@dataclass(frozen=True)
class ForwardTile:
    """What every step of a forward program shares: its query tile and where it reads keys."""

    q: Value  # HeadParts [block_m, D]
    K: Value
    V: Value
    b: Value
    kv_head: Value
    q_tile: Value
    rows: Value  # [block_m, 1] query indices
    scoring: Value  # Scoring


@dataclass(frozen=True)
class DqTile:
    """What every step of a dQ program shares."""

    q: Value  # HeadParts [block_m, D]
    d_out: Value  # HeadParts [block_m, Dv]
    lse: Value  # [block_m, 1] base-2 LSE
    delta: Value  # [block_m, 1]
    K: Value
    V: Value
    b: Value
    kv_head: Value
    q_tile: Value
    rows: Value  # [block_m, 1] query indices
    scoring: Value  # Scoring


@dataclass(frozen=True)
class KeyTile:
    """What every step of a dK/dV program shares for one query head: its key tile, the arrays
    it reads per query tile, and where it writes dBias and dQ shares."""

    k: Value  # HeadParts [block_n, D]
    v: Value  # HeadParts [block_n, Dv]
    Q: Value
    dOut: Value
    LseBase2: Value
    Delta: Value
    stat_tile: Value  # LseBase2's and Delta's tile index of query tile 0 (packed: not 0)
    DBias: Value
    DQSum: Value
    dq_scale: Value  # the softmax scale, applied to each dQ share
    b: Value
    q_head: Value
    kv_tile: Value
    cols: Value  # [block_n, 1] key indices
    scoring: Value  # Scoring
    bias_grad: Value  # compile-time: BIAS_NONE, or the bias mode whose gradient is written
    sum_dq: Value  # compile-time: the fused backward, dQ summed here
    sums_dv: Value  # compile-time: the program sums dV (its `part` is not DKDV_KEY)
    sums_dk: Value  # compile-time: the program sums dK (its `part` is not DKDV_VALUE)
    exp2_split: Value  # compile-time: half of P on the FMA pipe in unmasked steps (backward._exp2_split)


@dataclass(frozen=True)
class QueryStep:
    """One step of a dK/dV program once P is known: its query tile and what dK's share needs
    (key-major: [block_n, block_m] tiles, [1, block_m] rows)."""

    q_tile: Value
    q: Value  # HeadParts [block_m, D]
    d_out: Value  # HeadParts [block_m, Dv]
    delta: Value  # [1, block_m]
    rows: Value  # [1, block_m] query indices
    scores: Value  # the scores and what their gradient needs (modifiers.scores)
    capped_tanh: Value
    natural: Value
    probs: Value  # P^T
    # dV's operand, dropout.dropped_cast of P^T, where made before dP: always with dropout (dP's
    # mask), else where dV is summed before dK; 0 otherwise
    probs_v: Value


@dataclass(frozen=True)
class KeyState:
    """A dK/dV program's sums (key-major) and its dQ share held for the next step
    (backward._holds_dq_share): pending_dq belongs to query tile pending_tile."""

    d_key: Value  # HeadParts [block_n, D]
    d_value: Value  # HeadParts [block_n, Dv]
    d_bias_row: Value  # [block_n, 1] column sums of dBias (BIAS_ONE_ROW)
    pending_dq: Value
    pending_tile: Value


@dataclass(frozen=True)
class RowStats:
    """A query tile's backward statistics as [block_m] tiles: Delta_i = sum_d Out_id dOut_id,
    and the LSE in base 2 (+inf for a row that saw no key)."""

    delta: Value
    lse_base2: Value
