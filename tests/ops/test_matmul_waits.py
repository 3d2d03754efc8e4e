"""The reading of matmul waits, loops and spills from SASS (tests/ops/sass.py: matmul_waits,
matmuls_serialized, matmul_loops, spills_in_matmul_loops), on hand-written listings."""

from tests.ops.sass import (
    MatmulLoop,
    Wait,
    matmul_loops,
    matmul_waits,
    matmuls_serialized,
    spills_in_matmul_loops,
    summary,
)


def _listing(*instructions: str) -> str:
    return "\n".join(
        f"        /*{16 * i:04x}*/                   {text} ;   /* 0x000000000000794d */"
        for i, text in enumerate(instructions)
    )


GROUP = (
    "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT",
    "MUFU.EX2 R0, R0",
    "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24, gsb0",
)


def test_matmul_wait_counts_work_inside_and_after_its_group():
    text = _listing(*GROUP, "FMUL R1, R1, R2", "NOP", "FADD R3, R3, R4", "WARPGROUP.DEPBAR.LE gsb0, 0x0")
    assert matmul_waits(text) == [Wait(in_flight=0, inside=1, after=2)]


def test_matmul_waits_keep_a_group_in_flight_until_the_wait_for_all():
    text = _listing(
        *GROUP,
        "HGMMA.64x128x16.F32.BF16 R88, R152, gdesc[UR12].tnspB, R88, gsb0",
        "MEMBAR.ALL.CTA",
        "WARPGROUP.DEPBAR.LE gsb0, 0x1",
        "FADD R3, R3, R4",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "FADD R3, R3, R4",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",  # nothing left to wait for: not counted
    )
    assert matmul_waits(text) == [Wait(1, 0, 1), Wait(0, 0, 2)]
    assert summary(matmul_waits(text)).startswith("2 waits, 1 letting a group run on")


def test_matmul_waits_follow_fall_through_paths_only():
    # A predicated branch may fall through; past an unconditional one the wait belongs to
    # whatever jumps there, so it is not counted.
    through = _listing(*GROUP, "@!P0 BRA 0x40", "WARPGROUP.DEPBAR.LE gsb0, 0x0")
    assert matmul_waits(through) == [Wait(0, 1, 1)]
    jumped = _listing(*GROUP, "BRA 0x80", "WARPGROUP.DEPBAR.LE gsb0, 0x0")
    assert matmul_waits(jumped) == []
    assert summary(matmul_waits(jumped)).startswith("no matmul wait")


def test_matmuls_serialized_when_every_hgmma_closes_its_own_group():
    alone = (
        "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], RZ, !UPT, gsb0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], R24, gsb0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
    )
    assert matmuls_serialized(_listing(*alone))
    assert not matmuls_serialized(_listing(*GROUP, "WARPGROUP.DEPBAR.LE gsb0, 0x0"))
    assert not matmuls_serialized(_listing(*alone, *GROUP))  # one real group: ptxas pipelined them
    assert not matmuls_serialized(_listing("FADD R3, R3, R4"))


def test_spills_in_matmul_loops_counts_only_the_innermost_matmul_loops():
    # 0x00-0x30: a loop with a matmul (0x30 branches back to 0x00); 0x40-0x60: a loop without
    # one; 0x70: EXIT; 0x80-0x90: a slow path after it, jumping back into the body (no loop).
    def listing(spill_at):
        body = [*GROUP[:1], "FADD R3, R3, R4", "NOP", "@P0 BRA 0x0", "NOP", "NOP", "@P1 BRA 0x40", "EXIT"]
        body += ["NOP", "BRA 0x20"]
        body[spill_at] = "STL [R1+0x4], R3"
        return _listing(*body)

    assert spills_in_matmul_loops(listing(2)) == 1  # inside the matmul loop
    assert spills_in_matmul_loops(listing(4)) == 0  # between loops
    assert spills_in_matmul_loops(listing(5)) == 0  # in the loop without a matmul
    assert spills_in_matmul_loops(listing(8)) == 0  # on the slow path


def test_matmul_loops_are_the_innermost_loops_with_a_matmul_and_their_opcodes():
    # 0x00-0x50: an outer loop (0x50 branches back to 0x00) around 0x10-0x30, an inner loop with
    # a matmul; 0x60-0x70: a loop without one; 0x80: EXIT; 0x90: a slow path jumping back.
    listing = _listing(
        "MOV R0, RZ",
        GROUP[0],
        "@!P0 LDGSTS.E [R2], desc[UR4][R4.64]",
        "@P0 BRA 0x10",
        "IADD3 R0, R0, 0x1, RZ",
        "@P1 BRA 0x0",
        "NOP",
        "@P2 BRA 0x60",
        "EXIT",
        "BRA 0x20",
    )
    assert matmul_loops(listing) == [MatmulLoop(0x10, 0x30, ("HGMMA", "LDGSTS", "BRA"))]
    assert matmul_loops(_listing("FADD R3, R3, R4", "EXIT")) == []
