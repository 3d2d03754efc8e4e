"""Candidate tile configs of every attention kernel: the only place tile sizes live.

Tables are keyed by kernel, GPU architecture and head-dim tile (the head dim rounded up to a
power of two). The first config of each list is the one used when autotuning is disabled,
so it must be a good, safe choice on its architecture: it compiles without spilling
registers. The autotuner times the rest of the list on the first call for a shape.

Configs for 4- and 8-byte element types (fp32, fp64) are separate and small: their tiles
take two to four times the registers and shared memory of fp16/bf16 tiles.
"""

from dataclasses import dataclass
from enum import Enum
from functools import cache

from tilegym.autotune import TileConfig
from tilegym.ops.attention.variants import (
    BACKWARD_DK,
    BACKWARD_DKDV,
    BACKWARD_DQ,
    BACKWARD_DV,
    BACKWARD_FUSED,
    BACKWARD_FUSED_GROUPED,
    BACKWARD_PREPROCESS,
    DEFAULT_VARIANTS,
    FORWARD,
    FORWARD_FIXED_MAX,
    FORWARD_LSE,
    FORWARD_LSE_FIXED_MAX,
)

# Tables are keyed by variant name (variants.py); DEFAULT_VARIANTS have one on every arch.
KERNELS = DEFAULT_VARIANTS
ARCHS = ("sm_80", "sm_90", "sm_100", "sm_120")
HEAD_DIMS = (32, 64, 80, 96, 128, 192, 256)
HEAD_DIM_TILES = (32, 64, 128, 256)


def head_dim_tile(head_dim: int) -> int:
    """Head dims are tiled at the next power of two; loads pad the rest with zeros."""
    return 1 << (head_dim - 1).bit_length()


# Head dims that the kernels tile as a main tile and a tail (kernels/head.py) instead of one tile
# padded to the next power of two: 192 = 128 + 64 and 96 = 64 + 32 do a quarter less work in every
# matmul over that dim (perf-notes#split-head-dim). The same split serves the head dim of Q and K
# and that of V. Config tables stay those of the padded tile.
SPLIT_HEAD_DIMS = {96: (64, 32), 192: (128, 64)}


def tables_head_dim(head_dim: int, value_dim: int) -> int:
    """The head dim whose tables serve a (Q/K head dim, V head dim) pair without tables of its own
    (PAIR_TABLES): the wider of the two (more registers)."""
    return max(head_dim, value_dim)


def head_dim_tiles(head_dim: int) -> tuple[int, int]:
    """(main tile, tail) of a head dim, Q's and K's or V's: the tail 0 where one tile holds it."""
    return SPLIT_HEAD_DIMS.get(head_dim, (head_dim_tile(head_dim), 0))


def _c(block_m, block_n=None, **hints) -> TileConfig:
    return TileConfig(block_m=block_m, block_n=block_n, **hints)


# Hopper: 128-row tiles need 8 worker warps (two warpgroups) to hold their fp32 accumulators
# without spilling; 64-row tiles fit one warpgroup. The D=64/128 forward runs best on clusters
# of two CTAs, two per SM (perf-notes#forward-cta-clusters); the backward must stay at one CTA
# (a two-CTA dK/dV faulted). The backward's D=64/128 defaults run two CTAs per SM with small
# tiles, which hides the latency of their four dependent matmuls
# (perf-notes#backward-two-ctas-per-sm). D=64/128 entries hold only configs that won some of the
# 36 shape keys of the H100 training benchmark (perf-notes#tables-trimmed-to-winners): a single
# candidate is never tuned, which keeps a first call short.
_SM90_FORWARD = {
    32: [_c(128, 128, num_worker_warps=8), _c(128, 64), _c(64, 64)],
    # Four 64x64 CTAs per SM win at D=64 for sequences up to about 2048
    # (perf-notes#short-forward-64x64-occ4).
    64: [_c(128, 128, occupancy=2, num_ctas=2), _c(64, 64, occupancy=4)],
    128: [_c(128, 128, occupancy=2, num_ctas=2)],
    # D=256 (and 192): 128x128 at two warpgroups won every cell, 3-13% over 128x64
    # (perf-notes#d256-forward-tiles); 64x64 and 64x32 won none.
    256: [_c(128, 128, num_worker_warps=8), _c(128, 64, num_worker_warps=8)],
}
_SM90_DKDV = {
    32: [_c(64, 128, num_worker_warps=8), _c(64, 64), _c(128, 128, num_worker_warps=8)],
    64: [_c(64, 128, num_worker_warps=8), _c(64, 64, occupancy=2)],
    128: [_c(64, 64, occupancy=2)],
    # D=256: dK and dV take 2 x 64 x 256 fp32 accumulators; 16-row query tiles keep them in
    # registers.
    256: [_c(16, 64, num_worker_warps=8), _c(32, 64, num_worker_warps=8)],
}
_SM90_DQ = {
    32: [_c(128, 64, num_worker_warps=8), _c(64, 64)],
    64: [_c(64, 64, occupancy=2), _c(128, 64, num_worker_warps=8)],
    128: [_c(128, 64, num_worker_warps=8), _c(64, 64, occupancy=2)],
    # D=256 (and 192): 128 query rows per program read each K and V tile half as often; only 32-key
    # steps fit beside them (128x64 spills), 1-5% less backward time than 64x64
    # (perf-notes#wide-dq-and-192-apart).
    256: [_c(128, 32, num_worker_warps=8), _c(64, 64, num_worker_warps=8)],
}
# The fused backward (dK/dV kernel summing dQ by TMA reductions): where it is used,
# dispatch.FUSED_BACKWARD_MIN_SEQLEN_K says; only head dims with a table here take it. At D=64,
# 128x128 only: in the whole backward 64x128 ran 6-14% slower on every shape measured, dense
# and packed, full and causal, 2048 to 16384 keys, while timed alone it came close enough
# that fresh tunings of packed batches picked it (perf-notes#packed-fused-untuned,
# #tuner-against-whole-backward, #fused-d64-one-config).
_SM90_FUSED = {
    64: [_c(128, 128, num_worker_warps=8)],
    128: [_c(64, 128, num_worker_warps=8)],
}
# Tables of one (Q/K head dim, V head dim) pair, ahead of the head-dim tile's for plain scores
# (sinks allowed) in 16-bit types. BACKWARD_DV and BACKWARD_DK have no other tables: a pair that
# has them sums dV and dK in programs of their own (dispatch.split_dkdv).
# - (256, 256): both fp32 accumulators of block_n x 256 in one program left room only for 16-row
#   query tiles, where the small matmuls' fixed costs set the time; apart, 64x64 tiles compile
#   without spills (dK at one warpgroup: at two it spilled), and the backward took 19-22% less
#   time (perf-notes#dkdv-apart-d256). 128 keys also fit dV alone, dense (bwd 3.5-6% less,
#   perf-notes#mla-backward-tiles); packed they spill, so the tuner decides.
# - DeepSeek MLA's (192, 128): the dK/dV program's two accumulators are 192 + 128 columns wide,
#   not the 2 x 256 the D=256 table is sized for, so 128 keys per program fit at two warpgroups:
#   64-row query steps for causal masks (a few spills inside the loop, measured faster all the
#   same), 32-row steps without a mask (no spills; 64 rows spill and wait for each matmul there).
#   The dQ kernel holds 128 query rows. Backward 31-41% less time than on the D=256 tables.
# - (256, 128): dV and dK apart, each at 128 keys per program: dV's accumulator is 128 wide, and
#   dK's 256 fit beside a 128-wide dP; backward 9-19% less time than one joint program at 16-row
#   steps (perf-notes#mla-backward-tiles).
# - (192, 192): apart as (256, 128), at its first tiles; 20-23% less backward time than one joint
#   program at 16-row steps, measured with the 128-row dQ (perf-notes#wide-dq-and-192-apart).
_SM90_PAIRS = {
    (256, 256): {
        BACKWARD_DV: [_c(64, 64, num_worker_warps=8), _c(64, 128, num_worker_warps=8), _c(128, 64, num_worker_warps=8)],
        BACKWARD_DK: [_c(64, 64)],
    },
    (192, 128): {
        BACKWARD_DKDV: [_c(64, 128, num_worker_warps=8), _c(32, 128, num_worker_warps=8)],
        BACKWARD_DQ: [_c(128, 64, num_worker_warps=8)],
    },
    (256, 128): {
        BACKWARD_DV: [_c(128, 128, num_worker_warps=8), _c(64, 128, num_worker_warps=8)],
        BACKWARD_DK: [_c(64, 128, num_worker_warps=8)],
    },
    (192, 192): {
        BACKWARD_DV: [_c(128, 128, num_worker_warps=8)],
        BACKWARD_DK: [_c(64, 128, num_worker_warps=8)],
    },
}
# Causal grouped-query attention: one program per KV head and key tile made too few programs
# of too unequal lengths (GQA 8, D=128, S=4096: 284 TFLOPS against 375 with a program per
# query head, perf-notes#gqa-program-per-head). 128x128 spills at D=64 in that form; 64x128
# matched it there.
_SM90_FUSED_GROUPED = {d: [_c(64, 128, num_worker_warps=8)] for d in (64, 128)}
# The forward with a fixed row max per query tile (dispatch.FIXED_MAX_FORWARD_MIN_MEAN_KEYS
# says where): its end-of-tile overflow check costs each program a fixed time, and on two-CTA
# clusters far more (perf-notes#exp2-fma-fixed-max and #overflow-check-mean-keys), so one CTA of
# two warpgroups per SM (384 threads at 168 registers fill the register file; 64-row tiles at
# two CTAs per SM lost 5-13%, perf-notes#four-variants-lost). At D=64, 256x64 tiles won without
# a mask (perf-notes#d64-256x64-tiles) only while the 128x128 kernel waited for each matmul
# alone; since perf-notes#d64-serialized-matmuls 128x128 wins among single CTAs. At D=64 four
# 64x64 CTAs per SM follow as the tuner's second candidate (perf-notes#d64-fixed-max-four-ctas).
# ALiBi alone and a score function alone take this table too (dispatch.fixed_max_forward): at
# D=64 both configs ran faster for ALiBi than the 128x64 CTA it had (8-18%), though 128x128 keeps
# 5 values in local memory (causal, outside the loops) and four CTAs 4 inside them (without a
# mask); for softcap and ALiBi as functions four CTAs read -5 to +6% (perf-notes#functions-at-d64).
# At D=128 two 128x64 CTAs spill there (175 local loads and stores with softcap as a function:
# the overflow check's recompute loop is a third loop body).
_SM90_FORWARD_FIXED_MAX = {
    64: [_c(128, 128, num_worker_warps=8), _c(64, 64, occupancy=4)],
    128: [_c(128, 128, num_worker_warps=8)],
}
# With score modifiers (bias, softcap, ...) the D=128 dK/dV step holds more live tiles: at
# two CTAs per SM 64x64 spills there (and 64x128 at one), 32x128 and 64x64 at one do not.
_SM90_DKDV_MODIFIED = _SM90_DKDV | {128: [_c(32, 128, num_worker_warps=8), _c(64, 64)]}
# The D=64 dQ keeps the configs it had before occupancy 2: with a one-row bias, the 64x64
# occupancy-2 cubin (no local memory) is one the SASS disassembler cannot read, so CI could
# not check it for warpgroup MMA.
# D=256 with modifiers keeps the dQ configs measured before 128x32 (measured on plain scores only).
_SM90_DQ_MODIFIED = _SM90_DQ | {
    64: [_c(128, 64, num_worker_warps=8), _c(64, 64)],
    256: [_c(64, 64, num_worker_warps=8), _c(64, 32), _c(64, 64)],
}
# With score modifiers no config runs on CTA clusters (candidates() below). At D=64 four 64x64
# CTAs per SM, whose score work runs beside the others' matmuls, took 4-36% less running-max
# forward time than one 128x128 CTA with a bias, a one-row bias, a window, ALiBi or softcap,
# causal and not, 1024-4096 keys (128x64 slower still). A window without a causal mask keeps 96
# values in local memory there and still ran 11-36% faster (perf-notes#d64-running-max-four-ctas).
_SM90_FORWARD_MODIFIED = _SM90_FORWARD | {
    64: [_c(64, 64, occupancy=4), _c(128, 128, num_worker_warps=8)],
    128: [_c(128, 128, num_worker_warps=8)],
    # D=256 with modifiers keeps the configs measured before the plain table's 128x128.
    256: [_c(64, 64), _c(128, 64, num_worker_warps=8), _c(64, 32)],
}
# The modified forward's one CTA at D=128, then plain attention's CTA clusters, for the switch
# sets below that measured the clusters faster somewhere; the tuner picks.
_SM90_FORWARD_MODIFIED_OR_CLUSTERS = _SM90_FORWARD_MODIFIED | {
    128: [_c(128, 128, num_worker_warps=8), _c(128, 128, occupancy=2, num_ctas=2)],
}
# ALiBi alone: its forward keeps raw products as plain attention's does and adds two
# instructions per score (perf-notes#alibi-positions). The clusters were faster at causal 4096,
# 1-3% slower at 16384 and without a mask (they compile without spilling with ALiBi); at D=64
# the tuner chose one CTA over them.
_SM90_FORWARD_ALIBI = _SM90_FORWARD_MODIFIED_OR_CLUSTERS
# Softcap alone: its running-max forward (fp16 inputs, or a cap above
# dispatch.BOUNDED_SOFTCAP_MAX) ran 5-10% faster on the clusters from 4096 keys and 14% slower
# causal at 1024 (perf-notes#softcap-bounded-max).
_SM90_FORWARD_SOFTCAP = _SM90_FORWARD_MODIFIED_OR_CLUSTERS
# With the cap as its fixed max, softcap's two special-function instructions per score run while
# other CTAs' matmuls do: at D=64 four 64x64 CTAs per SM took 7-33% less forward time than one
# 128x128 CTA in every cell; at D=128 two 128x64 CTAs of one warpgroup each 3-14% less up to 4096
# keys and without a mask, 6% more causal at 16384 (perf-notes#fixed-max-four-ctas); the tuner picks.
_SM90_FORWARD_FIXED_MAX_SOFTCAP = {
    64: [_c(64, 64, occupancy=4)],
    128: [_c(128, 128, num_worker_warps=8), _c(128, 64, occupancy=2)],
}
# ALiBi's dK/dV kernel at D=128 also runs plain attention's 64x64 at two CTAs per SM, first: forced
# there, bwd -8 to -10% (perf-notes#function-dkdv), and clean since it converts integer positions.
_SM90_DKDV_ALIBI = _SM90_DKDV_MODIFIED | {128: [_c(64, 64, occupancy=2), *_SM90_DKDV_MODIFIED[128]]}
# The fused backward of ALiBi, softcap or an elementwise score function alone: plain attention's
# tiles, less D=64's 128x128, which keeps values in local memory there (ALiBi causal: 8 local
# loads and stores; softcap: 548, and a softcap function 491, inside its loops). With ALiBi at
# D=128 causal, 64x128 keeps loop bounds in local memory around its loops (17 stores, none
# inside them) and its backward ran 5-16% faster than two kernels, 64x64 40% slower
# (perf-notes#alibi-fused-d128); the grouped form takes plain attention's table as it is.
_SM90_FUSED_SCORES = _SM90_FUSED | {64: [_c(64, 128, num_worker_warps=8)]}
# A mask function alone keeps both D=64 tiles for the tuner: block masks skip tiles of their own
# shape, which the measurements above (no mask function among them) did not weigh.
_SM90_FUSED_MASKED = _SM90_FUSED | {64: _SM90_FUSED[64] + _SM90_FUSED_SCORES[64]}
# A mask function alone hides scores as a window does: the forward keeps raw products, and on
# plain attention's CTA clusters it ran 11-13% faster (D=128, a document mask, causal 4096 and
# 16384; perf-notes#mask-forward-clusters). One CTA of two warpgroups stays a candidate: a
# caller's mask may take more registers than the document mask they compiled clean with. Its
# dK/dV kernel runs plain attention's table too (D=128 at two CTAs per SM: bwd -14 to -17%).
_SM90_FORWARD_MASKED = _SM90_FORWARD_MODIFIED | {
    d: [_c(128, 128, occupancy=2, num_ctas=2), _c(128, 128, num_worker_warps=8)] for d in (64, 128)
}
# A caller's score function (with or without a mask): the modified dK/dV tiles first, then
# plain attention's 64x64 at two CTAs per SM, which spills with the built-in modifiers and with
# softcap as a function, but not with ALiBi or a relative-position table as functions, whose
# backward it ran 13-22% faster (perf-notes#function-dkdv); the tuner times all three.
_SM90_DKDV_FUNCTIONS = _SM90_DKDV_MODIFIED | {128: [*_SM90_DKDV_MODIFIED[128], _c(64, 64, occupancy=2)]}
# Its forward at D=128 also tries plain attention's CTA clusters: the tuner's pick ran 0-11%
# faster than one CTA (softcap and ALiBi as functions most; a relative-position table stays on
# one CTA, twice as fast there; perf-notes#function-forward-clusters). In training, with the
# fused backward, fwd+bwd -3 to -4% at 4096 keys, +2% (ALiBi) and -3% (softcap) at 16384
# (perf-notes#elementwise-functions-fused). At D=64 the clusters wait for each matmul; the
# modified table's four 64x64 CTAs per SM run one CTA's special-function work beside another's
# matmuls: softcap and ALiBi as functions fwd -4 to -19% up to 4096 keys
# (perf-notes#functions-at-d64).
_SM90_FORWARD_FUNCTIONS = _SM90_FORWARD_MODIFIED | {128: _SM90_FORWARD_MASKED[128]}
# A sliding window alone (sinks allowed) only hides scores, as a mask function does: at D=128 its
# forward on plain attention's CTA clusters took 6-9% less time than one CTA (a 1024-key window,
# causal, 4096 and 16384 keys), and its dK/dV kernel runs plain attention's 64x64 tiles at two CTAs
# per SM (compiled clean), where two kernels beat the fused backward (dispatch.fused_backward).
# At D=64 the clusters as a third candidate made the forward 15-22% slower at 16384 keys (the tuner
# took them without a mask): the modified table's four CTAs stay (perf-notes#window-tables).
_SM90_FORWARD_WINDOW = _SM90_FORWARD_FUNCTIONS
# The preprocess (the fused backward's row statistics) is a row reduction, memory bound: one
# config per head dim, never tuned.
_PREPROCESS = {32: [_c(128)], 64: [_c(128)], 128: [_c(64)], 256: [_c(32)]}
# On the H100 two CTAs per SM bring it from 69 to 58-59 us at 16384 tokens x 2048 wide, about
# 2.3 TB/s; no tile size or occupancy went lower (perf-notes#backward-side-kernels).
_SM90_PREPROCESS = _PREPROCESS | {64: [_c(128, occupancy=2)], 128: [_c(64, occupancy=2)]}

# Ampere-class parts (sm_80, sm_120) have no warpgroup MMA: plain 64/128 tiles.
_SM80_FORWARD = {
    32: [_c(128, 64), _c(64, 64)],
    64: [_c(128, 64), _c(64, 64), _c(128, 32)],
    128: [_c(128, 64), _c(64, 64), _c(128, 32)],
    256: [_c(64, 32), _c(64, 64)],
}
_SM80_BACKWARD = {
    32: [_c(64, 64), _c(64, 128)],
    64: [_c(64, 64), _c(64, 128)],
    128: [_c(64, 64), _c(32, 64)],
    256: [_c(32, 32), _c(32, 64)],
}
# Blackwell: large tiles, and pairs of CTAs for the forward.
_SM100_FORWARD = {
    32: [_c(128, 128), _c(128, 128, num_ctas=2), _c(128, 64)],
    64: [_c(128, 128), _c(128, 128, num_ctas=2), _c(128, 64)],
    128: [_c(128, 128), _c(128, 128, num_ctas=2), _c(128, 64)],
    256: [_c(64, 64), _c(128, 64), _c(64, 32)],
}
_SM100_BACKWARD = {
    32: [_c(64, 128), _c(128, 128), _c(64, 64)],
    64: [_c(64, 128), _c(128, 128), _c(64, 64)],
    128: [_c(64, 128), _c(64, 64), _c(128, 128)],
    256: [_c(64, 64), _c(32, 64), _c(32, 32)],
}

# fp32 / fp64 run for accuracy (gradcheck, fp32 training), not speed: one small config each.
# Their products run on the CUDA cores and the compiler spills at any tile size; smaller
# tiles keep compile times to seconds.
_WIDE_FORWARD = {d: [_c(32, 32)] for d in HEAD_DIM_TILES} | {256: [_c(32, 16)]}
_WIDE_BACKWARD = _WIDE_FORWARD
_WIDE_PREPROCESS = {d: [_c(32)] for d in HEAD_DIM_TILES}

TABLES = {
    "sm_80": {
        FORWARD: _SM80_FORWARD,
        FORWARD_LSE: _SM80_FORWARD,
        BACKWARD_PREPROCESS: _PREPROCESS,
        BACKWARD_DKDV: _SM80_BACKWARD,
        BACKWARD_DQ: _SM80_BACKWARD,
        BACKWARD_FUSED: {},
        BACKWARD_FUSED_GROUPED: {},
        BACKWARD_DV: {},
        BACKWARD_DK: {},
        FORWARD_FIXED_MAX: {},
        FORWARD_LSE_FIXED_MAX: {},
    },
    "sm_90": {
        FORWARD: _SM90_FORWARD,
        FORWARD_LSE: _SM90_FORWARD,
        BACKWARD_PREPROCESS: _SM90_PREPROCESS,
        BACKWARD_DKDV: _SM90_DKDV,
        BACKWARD_DQ: _SM90_DQ,
        BACKWARD_FUSED: _SM90_FUSED,
        BACKWARD_FUSED_GROUPED: _SM90_FUSED_GROUPED,
        BACKWARD_DV: {},  # pairs only (PAIR_TABLES)
        BACKWARD_DK: {},
        FORWARD_FIXED_MAX: _SM90_FORWARD_FIXED_MAX,
        FORWARD_LSE_FIXED_MAX: _SM90_FORWARD_FIXED_MAX,
    },
    "sm_100": {
        FORWARD: _SM100_FORWARD,
        FORWARD_LSE: _SM100_FORWARD,
        BACKWARD_PREPROCESS: _PREPROCESS,
        BACKWARD_DKDV: _SM100_BACKWARD,
        BACKWARD_DQ: _SM100_BACKWARD,
        BACKWARD_FUSED: {},
        BACKWARD_FUSED_GROUPED: {},
        BACKWARD_DV: {},
        BACKWARD_DK: {},
        FORWARD_FIXED_MAX: {},
        FORWARD_LSE_FIXED_MAX: {},
    },
    "sm_120": {
        FORWARD: _SM80_FORWARD,
        FORWARD_LSE: _SM80_FORWARD,
        BACKWARD_PREPROCESS: _PREPROCESS,
        BACKWARD_DKDV: _SM80_BACKWARD,
        BACKWARD_DQ: _SM80_BACKWARD,
        BACKWARD_FUSED: {},
        BACKWARD_FUSED_GROUPED: {},
        BACKWARD_DV: {},
        BACKWARD_DK: {},
        FORWARD_FIXED_MAX: {},
        FORWARD_LSE_FIXED_MAX: {},
    },
}
WIDE_TABLE = {
    FORWARD: _WIDE_FORWARD,
    FORWARD_LSE: _WIDE_FORWARD,
    BACKWARD_PREPROCESS: _WIDE_PREPROCESS,
    BACKWARD_DKDV: _WIDE_BACKWARD,
    BACKWARD_DQ: _WIDE_BACKWARD,
    BACKWARD_FUSED: {},
    BACKWARD_FUSED_GROUPED: {},
    BACKWARD_DV: {},
    BACKWARD_DK: {},
    FORWARD_FIXED_MAX: {},
    FORWARD_LSE_FIXED_MAX: {},
}


PAIR_TABLES = {"sm_90": _SM90_PAIRS}


class ScoreTables(Enum):
    """Which tables a call's score switches pick (score_tables)."""

    PLAIN = "plain"  # TABLES
    ALIBI = "alibi"  # ALIBI_TABLES where they name the kernel, else as MODIFIED
    MASKS = "masks"  # MASK_TABLES where they name the kernel, else as MODIFIED
    FUNCTIONS = "functions"  # FUNCTION_TABLES where they name the kernel, else as MODIFIED
    SOFTCAP = "softcap"  # SOFTCAP_TABLES where they name the kernel, else as MODIFIED
    WINDOW = "window"  # WINDOW_TABLES where they name the kernel, else as MODIFIED
    MODIFIED = "modified"  # MODIFIED_TABLES where they name the kernel, else TABLES; single CTAs


# The switch sets with tables of their own; any other modified set takes MODIFIED's.
_OWN_TABLES = {
    frozenset({"alibi"}): ScoreTables.ALIBI,
    frozenset({"masks"}): ScoreTables.MASKS,
    frozenset({"functions"}): ScoreTables.FUNCTIONS,
    frozenset({"functions", "masks"}): ScoreTables.FUNCTIONS,
    frozenset({"capped"}): ScoreTables.SOFTCAP,
    frozenset({"windowed"}): ScoreTables.WINDOW,
}


def score_tables(switches: frozenset) -> ScoreTables:
    """The tables for a call's score switches (score_mods.ScoreMods.switches): ALiBi alone, a
    mask function alone, a score function (with or without a mask), softcap alone and a sliding
    window alone have their own."""
    if not switches:
        return ScoreTables.PLAIN
    return _OWN_TABLES.get(switches, ScoreTables.MODIFIED)


def _sm90_forwards(forward: dict, fixed_max: dict | None = None) -> dict:
    """A score family's sm_90 forward entries: the inference and training forwards share one
    table, and so do their fixed-max variants."""
    entries = {("sm_90", FORWARD): forward, ("sm_90", FORWARD_LSE): forward}
    if fixed_max is not None:
        entries |= {("sm_90", FORWARD_FIXED_MAX): fixed_max, ("sm_90", FORWARD_LSE_FIXED_MAX): fixed_max}
    return entries


# Tables that replace TABLES[arch][kernel] when any score modifier is on.
MODIFIED_TABLES = {
    **_sm90_forwards(_SM90_FORWARD_MODIFIED),
    ("sm_90", BACKWARD_DKDV): _SM90_DKDV_MODIFIED,
    ("sm_90", BACKWARD_DQ): _SM90_DQ_MODIFIED,
}
# Tables that replace those for calls with ALiBi alone, a mask function alone, a score function.
ALIBI_TABLES = {
    **_sm90_forwards(_SM90_FORWARD_ALIBI, _SM90_FORWARD_FIXED_MAX),
    ("sm_90", BACKWARD_FUSED): _SM90_FUSED_SCORES,
    ("sm_90", BACKWARD_DKDV): _SM90_DKDV_ALIBI,
}
# A mask function alone runs the fused backward on plain attention's tiles: at D=128
# the document mask spills there (17 local stores; a window with global tokens and prefix-LM do
# not) and still ran 11% faster than two kernels at 16384 keys; 64x64 tiles, clean, were 15-45%
# slower (perf-notes#fused-backward-masks).
MASK_TABLES = {
    **_sm90_forwards(_SM90_FORWARD_MASKED),
    ("sm_90", BACKWARD_DKDV): _SM90_DKDV,
    ("sm_90", BACKWARD_FUSED): _SM90_FUSED_MASKED,
}
FUNCTION_TABLES = {
    **_sm90_forwards(_SM90_FORWARD_FUNCTIONS, _SM90_FORWARD_FIXED_MAX),
    ("sm_90", BACKWARD_DKDV): _SM90_DKDV_FUNCTIONS,
    ("sm_90", BACKWARD_FUSED): _SM90_FUSED_SCORES,
}
SOFTCAP_TABLES = {
    **_sm90_forwards(_SM90_FORWARD_SOFTCAP, _SM90_FORWARD_FIXED_MAX_SOFTCAP),
    ("sm_90", BACKWARD_FUSED): _SM90_FUSED_SCORES,
}
WINDOW_TABLES = {
    **_sm90_forwards(_SM90_FORWARD_WINDOW),
    ("sm_90", BACKWARD_DKDV): _SM90_DKDV,
}
SCORE_TABLES = {
    ScoreTables.MODIFIED: MODIFIED_TABLES,
    ScoreTables.ALIBI: ALIBI_TABLES,
    ScoreTables.MASKS: MASK_TABLES,
    ScoreTables.FUNCTIONS: FUNCTION_TABLES,
    ScoreTables.SOFTCAP: SOFTCAP_TABLES,
    ScoreTables.WINDOW: WINDOW_TABLES,
}


@cache
def candidates(
    kernel: str,
    arch: str,
    head_dim: int,
    element_size: int,
    scores: ScoreTables = ScoreTables.PLAIN,
    value_dim: int | None = None,
) -> tuple[TileConfig, ...]:
    """The configs to try for one kernel, first one the default; scores: the tables the call's
    score switches pick (score_tables); value_dim: V's head dim where it differs from head_dim
    (the tables of the wider, unless PAIR_TABLES hold the pair).

    With score modifiers no config runs on CTA clusters outside the tables of ALiBi, a mask,
    softcap or a window alone, or a score function (measured there on sm_90): the two-CTA
    forward faulted on a misaligned address with a one-row bias on Hopper
    (perf-notes#forward-cta-clusters).
    Cached: every launch asks.
    """
    value_dim = head_dim if value_dim is None else value_dim
    pair = PAIR_TABLES.get(arch, {}).get((head_dim, value_dim), {})
    if kernel in pair and element_size == 2 and scores == ScoreTables.PLAIN:
        return tuple(pair[kernel])
    head_dim = tables_head_dim(head_dim, value_dim)
    key = (arch, kernel)
    own = SCORE_TABLES.get(scores, {})
    if element_size > 2:
        table = WIDE_TABLE[kernel]
    elif key in own:
        table = own[key]
    elif scores != ScoreTables.PLAIN and key in MODIFIED_TABLES:
        table = MODIFIED_TABLES[key]
    else:
        table = TABLES[arch][kernel]
    choices = table.get(head_dim_tile(head_dim), ())  # empty only for the fused backward
    # Clusters only from a family's own table (MODIFIED_TABLES hold none: a CPU test says so).
    if scores != ScoreTables.PLAIN and table is not own.get(key):
        choices = [config for config in choices if (config.num_ctas or 1) == 1]
    return tuple(choices)


@dataclass(frozen=True)
class FaultyConfig:
    """A config seen to compute wrong results for one kernel, input dtype and Q/K head dim in calls
    that set all of switches (score_mods.ScoreMods.switches): call_candidates leaves it out of
    those calls' candidates, the other configs of the table kept."""

    kernel: str
    dtype: str  # the inputs' torch dtype, by name
    head_dim: int
    switches: frozenset
    config: TileConfig


FAULTY_CONFIGS = (
    # float16, D=192 (split 128 + 64), softcap= beside a frozen bias function: dQ RMS error 0.02-0.06
    # against the float16 reference's 1.7e-4, varying from run to run, packed with or without a
    # mask, window or causal mask; right with the table's two other configs, bfloat16, D=256, a
    # dense batch, a learned bias, or either modifier alone (perf-notes#faulty-dq-config).
    FaultyConfig(BACKWARD_DQ, "float16", 192, frozenset({"capped", "functions"}), _c(64, 64, num_worker_warps=8)),
)


@cache
def call_candidates(
    kernel: str, arch: str, head_dim: int, value_dim: int, dtype, switches: frozenset
) -> tuple[TileConfig, ...]:
    """The configs a call tries for one kernel: candidates() for its inputs' torch dtype and score
    switches (score_mods.ScoreMods.switches), less the FAULTY_CONFIGS that match them. Cached:
    every launch asks."""
    choices = candidates(kernel, arch, head_dim, dtype.itemsize, score_tables(switches), value_dim)
    name = str(dtype).removeprefix("torch.")
    faulty = {
        entry.config
        for entry in FAULTY_CONFIGS
        if (entry.kernel, entry.dtype, entry.head_dim) == (kernel, name, head_dim) and entry.switches <= switches
    }
    return tuple(config for config in choices if config not in faulty)


def _all_configs():
    tables = [*(table for kernels in TABLES.values() for table in kernels.values()), *WIDE_TABLE.values()]
    tables += [table for family in SCORE_TABLES.values() for table in family.values()]
    tables += [kernels for pairs in PAIR_TABLES.values() for kernels in pairs.values()]
    return [config for table in tables for choices in table.values() for config in choices]


# The longest tile along a sequence in any table: a buffer padded to whole tiles of any config
# has at most this many extra rows.
MAX_BLOCK = max(max(config.block_m, config.block_n or 0) for config in _all_configs())
