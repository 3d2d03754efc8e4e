"""Every compiled form of the attention kernels, by name: the one registry that tuning (the
names key the config tables in configs.py and the tune cache), launching, the ahead-of-time
compile tests, the SASS tools and the benchmarks read.

A variant is a kernel with some compile-time parameters pinned (LSE written or not, a fixed
row max, dQ summed into the dK/dV kernel, ...). The score modifiers' switches are not pinned:
they come from the call, and a variant says which of them it takes.
"""

from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class Variant:
    name: str  # the tuning name: config tables, tune-cache keys, the AOT symbol
    kernel_name: str  # the kernel's name in tilegym.ops.attention.kernels
    fixed: MappingProxyType  # compile-time parameter -> the value this variant pins
    tiles: str  # "query" or "key": the sequence whose tiles grid axis 0 counts
    heads: str  # "query" or "kv": the heads grid axis 1 counts (axis 2 is the batch)
    # The sets of score switches (SCORE_SWITCHES) it compiles with: a call runs it if its
    # switches fall within one of them (takes_switches).
    modifiers: tuple
    default: bool  # has a config table on every arch; the others only where they win
    about: str

    def takes_switches(self, switches: frozenset) -> bool:
        return any(switches <= allowed for allowed in self.modifiers)

    @property
    def kernel(self):
        """The CachedKernel; imported on first use, so that the registry loads without cuTile."""
        from tilegym.ops.attention import kernels

        return getattr(kernels, self.kernel_name)


# The compile-time switches of the modifiers that change or hide scores, as
# score_mods.ScoreMods.switches names those of a call: the kernels' switch parameters, and
# "functions" and "masks" for the caller's score and mask functions (inlined into kernel
# copies). Sinks and the LSE's gradient touch only each row's statistics: every variant that
# takes them does.
SCORE_SWITCHES = frozenset({"bias_mode", "windowed", "capped", "alibi", "functions", "masks"})
PLAIN_SCORES = (frozenset(),)
ANY_SCORES = (SCORE_SWITCHES,)
# The fused backward compiles without spilling with a sliding window (it only hides scores) on
# its plain tables, and with ALiBi on tables of its own (configs.ALIBI_TABLES); with both
# together it spilled (sm_90: 21 local loads).
WINDOW_OR_ALIBI = (frozenset({"windowed"}), frozenset({"alibi"}))
# A mask function alone hides scores as a window does (block-mask tile lists instead of ranges):
# perf-notes#fused-backward-masks, and for the grouped form perf-notes#grouped-fused-masks.
WINDOW_ALIBI_OR_MASKS = (*WINDOW_OR_ALIBI, frozenset({"masks"}))
# Softcap alone spills inside the fused backward's loops at D=128 (causal: 39 local loads and
# stores) and still ran 20-23% faster than two kernels (perf-notes#fused-backward-softcap); in
# the grouped form (21 inside its loops) it is unmeasured.
WINDOW_ALIBI_MASKS_OR_SOFTCAP = (*WINDOW_ALIBI_OR_MASKS, frozenset({"capped"}))
# A score function alone, where it is declared elementwise (score_functions.elementwise;
# dispatch.fused_backward checks): ALiBi and softcap as functions ran 11-30% faster there
# (perf-notes#elementwise-functions-fused).
FUSED_MODIFIERS = (*WINDOW_ALIBI_MASKS_OR_SOFTCAP, frozenset({"functions"}))
# The fixed-max forward: plain scores, or ALiBi alone, whose scores fall with distance from the
# diagonal it starts from (kernels/forward.py, _key_loops), or a score function alone, which
# starts there too (perf-notes#function-fixed-max), or softcap alone, whose cap bounds every
# score (perf-notes#softcap-bounded-max).
FIXED_MAX_SCORES = (frozenset({"alibi"}), frozenset({"functions"}), frozenset({"capped"}))


def _variant(name, kernel_name, grid, about, modifiers=ANY_SCORES, default=True, **fixed) -> Variant:
    tiles, heads = grid
    return Variant(name, kernel_name, MappingProxyType(fixed), tiles, heads, tuple(modifiers), default, about)


FORWARD = "attention_forward"
FORWARD_LSE = "attention_forward_lse"
FORWARD_FIXED_MAX = "attention_forward_fixed_max"
FORWARD_LSE_FIXED_MAX = "attention_forward_lse_fixed_max"
BACKWARD_PREPROCESS = "attention_backward_preprocess"
BACKWARD_DKDV = "attention_backward_dkdv"
BACKWARD_DQ = "attention_backward_dq"
BACKWARD_FUSED = "attention_backward_fused"
BACKWARD_FUSED_GROUPED = "attention_backward_fused_grouped"
BACKWARD_DV = "attention_backward_dv"
BACKWARD_DK = "attention_backward_dk"

# What a program of the dK/dV kernel sums (its `part`): both, or only dV or only dK, each then
# in a launch of its own.
DKDV_BOTH, DKDV_VALUE, DKDV_KEY = 0, 1, 2

_FORWARD_KERNEL = "attention_forward_kernel"
_DKDV_KERNEL = "attention_backward_dkdv_kernel"
_QUERY_TILES = ("query", "query")  # (tiles, heads) of the grid
_KEY_TILES = ("key", "kv")
_NO_DQ = {"sum_dq": False, "sum_dkdv": False, "part": DKDV_BOTH}

VARIANTS: MappingProxyType = MappingProxyType(
    {
        variant.name: variant
        for variant in (
            _variant(
                FORWARD,
                _FORWARD_KERNEL,
                _QUERY_TILES,
                "inference forward, running row max",
                write_lse=False,
                fixed_max=False,
            ),
            _variant(
                FORWARD_LSE,
                _FORWARD_KERNEL,
                _QUERY_TILES,
                "training forward (writes the LSE), running row max",
                write_lse=True,
                fixed_max=False,
            ),
            _variant(
                FORWARD_FIXED_MAX,
                _FORWARD_KERNEL,
                _QUERY_TILES,
                "inference forward, a fixed row max per query tile",
                modifiers=FIXED_MAX_SCORES,
                default=False,
                write_lse=False,
                fixed_max=True,
            ),
            _variant(
                FORWARD_LSE_FIXED_MAX,
                _FORWARD_KERNEL,
                _QUERY_TILES,
                "training forward, a fixed row max per query tile",
                modifiers=FIXED_MAX_SCORES,
                default=False,
                write_lse=True,
                fixed_max=True,
            ),
            _variant(
                BACKWARD_PREPROCESS,
                "attention_backward_preprocess_kernel",
                _QUERY_TILES,
                "row statistics of the fused backward",
                modifiers=PLAIN_SCORES,
            ),
            _variant(
                BACKWARD_DKDV, _DKDV_KERNEL, _KEY_TILES, "dK and dV (and dBias) of the two-kernel backward", **_NO_DQ
            ),
            _variant(
                BACKWARD_DQ,
                "attention_backward_dq_kernel",
                _QUERY_TILES,
                "dQ and the row statistics of the two-kernel backward",
            ),
            _variant(
                BACKWARD_FUSED,
                _DKDV_KERNEL,
                _KEY_TILES,
                "fused backward: dK, dV and dQ summed by TMA reductions",
                modifiers=FUSED_MODIFIERS,
                default=False,
                sum_dq=True,
                sum_dkdv=False,
                part=DKDV_BOTH,
            ),
            _variant(
                BACKWARD_FUSED_GROUPED,
                _DKDV_KERNEL,
                ("key", "query"),
                "fused backward of causal GQA: a program per query head, dK and dV summed too",
                modifiers=WINDOW_ALIBI_OR_MASKS,
                default=False,
                sum_dq=True,
                sum_dkdv=True,
                part=DKDV_BOTH,
            ),
            _variant(
                BACKWARD_DV,
                _DKDV_KERNEL,
                _KEY_TILES,
                "dV alone, before BACKWARD_DK: the two-kernel backward's dK/dV of wide heads, whose two "
                "accumulators do not fit in one program at large tiles",
                modifiers=PLAIN_SCORES,
                default=False,
                **_NO_DQ | {"part": DKDV_VALUE},
            ),
            _variant(
                BACKWARD_DK,
                _DKDV_KERNEL,
                _KEY_TILES,
                "dK (and dBias) alone, after BACKWARD_DV",
                modifiers=PLAIN_SCORES,
                default=False,
                **_NO_DQ | {"part": DKDV_KEY},
            ),
        )
    }
)

# Variants with a config table on every arch: the others have tables only where they were
# measured to win, and dispatch.py uses them only where a table exists.
DEFAULT_VARIANTS = tuple(name for name, variant in VARIANTS.items() if variant.default)
