"""Which kernels a call runs: the fused or the two-kernel backward, a fixed or a running row max
in the forward. Each threshold sits beside the measurement that set it (perf-notes); a variant
without a config table on the GPU's arch is never chosen."""

import math

import torch

from tilegym import env
from tilegym.ops.attention import configs
from tilegym.ops.attention.problem import AttentionProblem
from tilegym.ops.attention.variants import (
    BACKWARD_DK,
    BACKWARD_DV,
    BACKWARD_FUSED,
    BACKWARD_FUSED_GROUPED,
    FORWARD_FIXED_MAX,
    VARIANTS,
)

# The fused backward (dK/dV kernel summing dQ by TMA reductions) beats the two-kernel one from
# 4096 keys on: at D=64 by 1-10% (perf-notes#fused-backward-tma-dq), at D=128 by 3-16% once each
# step's dQ share is summed during the next step (perf-notes#dq-share-next-step); at 2048 keys
# it wins without a mask and ties with one, at 1024 it loses causal
# (perf-notes#causal-mask-fused-threshold).
FUSED_BACKWARD_MIN_SEQLEN_K = 2048
# Where each key tile sees few query tiles, the fused backward won only at D=128: with a sliding
# window of 1024 keys (bwd +4-11% at 4096 and 16384 keys, D=64 -1 to -9%;
# perf-notes#fused-backward-window) and on packed batches of lengths in [128, 4096] (bwd 0 to
# +10%, D=64 causal -6%; perf-notes#fused-backward-packed), and a mask function (a document
# mask at 16384 keys: bwd -11%; perf-notes#fused-backward-masks). Keyed by head-dim tile.
FUSED_SHORT_LOOPS_HEAD_DIM_TILES = (128,)
# Packed without a window or a mask function the fused backward also won at D=64: full, bwd -4
# to -5%, fwd+bwd -3 to -8% (perf-notes#fused-backward-packed); causal, once the dK/dV loop read
# its statistics at a tile index, bwd -2 to -5% plain, -4% with ALiBi, level with sinks; not in
# the grouped form (causal GQA 8:1: +7%), which keeps FUSED_SHORT_LOOPS_HEAD_DIM_TILES
# (perf-notes#packed-stats-tile-aligned).
FUSED_PACKED_HEAD_DIM_TILES = (64, 128)
# Softcap alone, and a score function alone declared elementwise (score_functions.elementwise)
# without an aux gradient, take the fused backward where they were measured, forced or not:
# dense, at these head-dim tiles (softcap bwd -20 to -23% at D=128,
# perf-notes#fused-backward-softcap, and -15 to -18% at D=64, perf-notes#fixed-max-four-ctas;
# ALiBi and softcap as functions -11 to -30% at D=128, perf-notes#elementwise-functions-fused,
# and -1 to -9% and -12 to -16% at D=64, perf-notes#functions-at-d64).
FUSED_SCORES_HEAD_DIM_TILES = (64, 128)

# The fixed-max forward saves a third of the softmax's instructions, but its end-of-tile
# overflow check costs each program a fixed time (perf-notes#exp2-fma-fixed-max and
# #overflow-check-mean-keys): it wins only where a query row attends to many keys on average
# (half of a square causal length), from 2048 at D=128 and 4096 at D=64; below, it was up to 10%
# and 18% slower. Keyed by head-dim tile.
FIXED_MAX_FORWARD_MIN_MEAN_KEYS = {64: 4096, 128: 2048}

# Softcap alone bounds every score by the cap, which the forward then takes as each row's fixed
# max from the first step (kernels/forward.py, _key_loops): probabilities fall to 2^(-2 cap
# log2 e) at worst. Capped at 2^-100 they stay normal in fp32 and in bf16 P, with 26 bits of
# fp32's range left for P V's products; fp16 P would end at 2^-24, so 16-bit means bf16 only.
BOUNDED_SOFTCAP_MAX = 100 / (2 * math.log2(math.e))

_BACKWARD_CHOICES = ("auto", "fused", "two-kernel")


def backward_choice() -> str:
    """TILEGYM_BACKWARD: auto (default), fused or two-kernel; anything else is a ValueError."""
    return env.choice("TILEGYM_BACKWARD", _BACKWARD_CHOICES, "auto")


def fused_backward(problem: AttentionProblem, candidates, bias_grad: bool) -> str | None:
    """The fused backward's variant (dQ summed by the dK/dV kernel), or None for two kernels.

    Fused only for calls, dense or packed, whose score switches the variant takes (a sliding
    window, ALiBi, a mask function or softcap, sinks; Variant.modifiers), without dBias, V no
    wider than Q, where the arch has a fused table (candidates(name) is not empty), never under
    torch.use_deterministic_algorithms
    (the order of the fp32 sums varies between runs); "auto" also needs
    FUSED_BACKWARD_MIN_SEQLEN_K keys (packed: in the longest sequence), with a window, a mask
    function a head dim in FUSED_SHORT_LOOPS_HEAD_DIM_TILES (packed, ungrouped and without them:
    FUSED_PACKED_HEAD_DIM_TILES), and a window alone dense and ungrouped only where it
    spans FUSED_BACKWARD_MIN_SEQLEN_K keys (keys_per_query); ALiBi alone as plain attention (D=128:
    bwd 5-22% faster than two kernels, perf-notes#alibi-fused-d128); softcap alone, or a score function alone
    declared elementwise without an aux gradient, only dense at a head dim in
    FUSED_SCORES_HEAD_DIM_TILES, and not in the grouped form. Causal grouped-query attention takes
    the grouped form: a program per query head (perf-notes#gqa-program-per-head).
    """
    choice = backward_choice()
    if choice == "two-kernel" or torch.are_deterministic_algorithms_enabled():
        return None
    grouped = problem.causal and problem.query_group_size > 1
    name = BACKWARD_FUSED_GROUPED if grouped else BACKWARD_FUSED
    if not VARIANTS[name].takes_switches(problem.mods.switches) or bias_grad or not candidates(name):
        return None
    tile = configs.head_dim_tile(problem.tuning_head_dim)
    switches = problem.mods.switches
    if not switches.isdisjoint({"capped", "functions"}):
        if tile not in FUSED_SCORES_HEAD_DIM_TILES or problem.packing is not None:
            return None
    user = problem.mods.user
    if "functions" in switches and not (user.elementwise and user.aux_grad is None):
        return None
    if problem.value_dim > problem.head_dim:
        # A V wider than Q adds dV accumulators the fused tables were not sized for: Dqk=64 with
        # Dv=128 spills on the D=128 table's 64x128 tiles (sm_90, 145 local loads and stores).
        return None
    if choice == "fused":
        return name
    masks = "masks" in problem.mods.switches
    hidden = problem.mods.window is not None or masks
    if problem.packing is not None and not (hidden or grouped):
        if tile not in FUSED_PACKED_HEAD_DIM_TILES:
            return None
    elif (hidden or problem.packing is not None) and tile not in FUSED_SHORT_LOOPS_HEAD_DIM_TILES:
        return None
    return name if keys_per_query(problem, grouped) >= FUSED_BACKWARD_MIN_SEQLEN_K else None


def keys_per_query(problem: AttentionProblem, grouped: bool) -> int:
    """The keys "auto" weighs against FUSED_BACKWARD_MIN_SEQLEN_K: seqlen_k (packed: the longest
    sequence's), or for a dense, ungrouped window on the window's own tables (a window alone,
    configs.ScoreTables.WINDOW) the most a query row sees, left + right + 1 where no side is
    unbounded (-1).

    So a window alone shorter than FUSED_BACKWARD_MIN_SEQLEN_K runs two kernels: on plain
    attention's dK/dV tiles at two CTAs per SM (configs.WINDOW_TABLES) they beat the fused backward
    at D=128 with a 1024-key window (bwd -4 to -9%, fwd+bwd -1 to -6%, causal, 4096 and 16384 keys;
    perf-notes#window-tables). Wider windows keep it, as plain attention's lengths do, and so do
    packed batches and causal query groups (level there, perf-notes#window-tiles-and-paths)."""
    own_tables = configs.score_tables(problem.mods.switches) is configs.ScoreTables.WINDOW
    if not own_tables or problem.packing is not None or grouped:
        return problem.seqlen_k
    left, right = problem.mods.window
    if left < 0 or right < 0:
        return problem.seqlen_k
    return min(left + right + 1, problem.seqlen_k)


def split_dkdv(problem: AttentionProblem, candidates) -> bool:
    """Whether the two-kernel backward sums dV and dK in launches of their own (BACKWARD_DV, then
    BACKWARD_DK), each program holding one accumulator: plain scores (sinks allowed), for the head
    dim pairs whose tables name both (configs.PAIR_TABLES: (256, 256), (256, 128), (192, 192)).
    (192, 128) runs one program at 128 keys (perf-notes#mla-backward-tiles); other pairs are
    unmeasured apart."""
    return problem.mods.plain_scores and bool(candidates(BACKWARD_DV)) and bool(candidates(BACKWARD_DK))


def fixed_max_forward(problem: AttentionProblem, candidates) -> bool:
    """Whether the forward keeps a fixed row max per query tile (kernels/forward.py, _key_loops):
    plain attention (sinks allowed), or ALiBi alone or a score function alone, with enough
    keys per query for it to win, or softcap alone where bounded_softcap says, where the
    arch has a table for it (16-bit inputs; fp32 and fp64 keep the running max).
    Not with int64 indexing: that twin of the fixed-max kernel compiles to a 1.7 MB cubin, where
    the running-max one is ordinary."""
    # The variant's switches say which calls it takes: plain scores, ALiBi alone, a score function
    # alone (each causal or not) or softcap alone.
    switches = problem.mods.switches
    if not VARIANTS[FORWARD_FIXED_MAX].takes_switches(switches):
        return False
    if problem.wide_index or not candidates(FORWARD_FIXED_MAX):
        return False
    if "capped" in switches:
        # No overflow check to pay for: any length, causal or not.
        return bounded_softcap(problem)
    min_keys = FIXED_MAX_FORWARD_MIN_MEAN_KEYS[configs.head_dim_tile(problem.tuning_head_dim)]
    return mean_keys_per_query(problem) >= min_keys


def bounded_softcap(problem: AttentionProblem) -> bool:
    """Whether softcap's cap can be the forward's fixed row max: bf16 inputs and a cap of at most
    BOUNDED_SOFTCAP_MAX (Gemma 2's 50 keeps the running max)."""
    return problem.dtype == torch.bfloat16 and problem.mods.softcap <= BOUNDED_SOFTCAP_MAX


def mean_keys_per_query(problem: AttentionProblem) -> float:
    """Keys a query row attends to, on average; causal rows are aligned at the bottom right, so
    the last min(seqlen_q, seqlen_k) rows see seqlen_k - seen + 1 up to seqlen_k keys."""
    if not problem.causal:
        return problem.seqlen_k
    seen = min(problem.seqlen_q, problem.seqlen_k)
    return seen * (2 * problem.seqlen_k - seen + 1) / 2 / problem.seqlen_q
