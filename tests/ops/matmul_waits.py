"""How much work the compiler overlaps with each warpgroup matmul, read from sm_90 SASS.

A warpgroup issues a matmul as a group of `HGMMA` instructions, the last marked `gsb0`, and
waits for it with `WARPGROUP.DEPBAR.LE gsb0, N` (N groups may still be in flight). Whatever
the warpgroup issues between a group's last `HGMMA` and that wait runs under the matmul; with
cuda-tile 1.7 that is next to nothing in every hot kernel (perf-notes sections 23 and 41),
which is what bounds our ratios to cuDNN. `python -m tests.ops.matmul_waits` prints the counts
for the kernels behind the README's table, so a new compiler can be judged in a minute.
"""

import re
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import cuda.tile as ct

from tests.ops import aot
from tilegym.ops.attention import configs

# The kernels of the training benchmark's rows at their default sm_90 configs, no mask.
HOT_KERNELS = (
    ("fused backward, D=128", configs.BACKWARD_FUSED, 128),
    ("fused backward, D=64", configs.BACKWARD_FUSED, 64),
    ("forward with LSE, running max, D=128", configs.FORWARD_LSE, 128),
    ("forward with LSE, fixed max, D=128", configs.FORWARD_LSE_FIXED_MAX, 128),
    ("forward with LSE, fixed max, D=64", configs.FORWARD_LSE_FIXED_MAX, 64),
)

_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_WAIT = re.compile(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)")


@dataclass(frozen=True)
class Wait:
    in_flight: int  # groups the wait lets run on
    inside: int  # instructions issued between the group's first and last HGMMA
    after: int  # instructions issued between the group's last HGMMA and the wait


def matmul_waits(sass_text: str) -> list[Wait]:
    """The matmul waits of a SASS listing, each with the group before it on the fall-through path.

    Predicated branches (loop back edges, retries of barrier waits) may fall through, so they
    do not end a path; an unconditional branch, EXIT or RET does.
    """
    waits = []
    inside = None  # instructions since the open group's first HGMMA; None outside a group
    group = None  # (inside, after) of the last closed group; None before any or after a branch
    for line in sass_text.splitlines():
        found = _INSTRUCTION.search(line)
        if not found or found.group(1).startswith("NOP"):
            continue
        instruction = found.group(1)
        wait = _WAIT.search(instruction)
        if wait:
            if group is not None:
                waits.append(Wait(int(wait.group(1), 16), *group))
                # Past a wait for all groups, a further wait has nothing to wait for.
                group = group if waits[-1].in_flight else None
        elif "HGMMA" in instruction:
            inside = inside or 0
            if instruction.endswith("gsb0"):
                group, inside = (inside, 0), None
        elif re.match(r"(BRA|EXIT|RET)\b", instruction):
            # The next address is not reached from here: count along fall-through paths only.
            inside = group = None
        else:
            inside = None if inside is None else inside + 1
            group = None if group is None else (group[0], group[1] + 1)
    return waits


def summary(waits: list[Wait]) -> str:
    if not waits:
        return "no matmul wait follows its group on a fall-through path"
    after = [wait.after for wait in waits]
    inside = [wait.inside for wait in waits]
    return (
        f"{len(waits)} waits, {sum(wait.in_flight > 0 for wait in waits)} letting a group run on; "
        f"instructions between a group's last HGMMA and its wait: median {statistics.median(after):g}, "
        f"max {max(after)}; among its own HGMMAs: median {statistics.median(inside):g}, max {max(inside)}"
    )


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for label, kernel, head_dim in HOT_KERNELS:
            config = configs.candidates(kernel, "sm_90", head_dim, 2)[0]
            cubin = aot.compile_cubin(kernel, ct.bfloat16, head_dim, config, False, "sm_90", Path(tmp) / "k.cubin")
            print(f"{label} ({config.block_m}x{config.block_n}): {summary(matmul_waits(aot.sass(cubin)))}")


if __name__ == "__main__":
    main()
