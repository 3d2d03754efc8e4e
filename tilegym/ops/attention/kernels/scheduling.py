"""Which tile, head and batch a program works on: the order the GPU starts programs in."""

import cuda.tile as ct

from tilegym.ops.attention.kernels.tiles import ConstBool

# The fused causal backward hands out its programs heaviest first across about this many
# programs at a time; see heaviest_first.
HEAVIEST_FIRST_PROGRAMS = 256


@ct.function
def query_program(query_group_size, causal: ConstBool):
    """(query tile, query head, batch, K/V head) of a program on a (query tiles, heads, batch) grid."""
    q_tile = ct.bid(0)
    if causal:
        # Causal tiles near the end of the sequence do the most work: start them first.
        q_tile = ct.num_blocks(0) - 1 - q_tile
    q_head = ct.bid(1)
    return q_tile, q_head, ct.bid(2), q_head // query_group_size


@ct.function
def heaviest_first():
    """(tile, head, batch) of this program on a (tiles, heads, batch) grid whose tile 0 is the
    heaviest of each head and whose programs grow lighter with the tile.

    The GPU starts programs in grid order, so in (tile, head, batch) order the last heads' tile
    0 starts last and runs on while other SMs idle. Here programs go by tile across a group of
    heads (every head's tile 0, then every head's tile 1, ...) so the programs started last are
    the lightest. A group spans about HEAVIEST_FIRST_PROGRAMS programs, so as many heads are in
    flight at once (their Q and dO shared in L2) as in grid order. Groups hold heads of one
    batch index. Measured in the fused causal backward (one CTA per SM): +1-4% at 4096-8192
    keys. At two CTAs per SM (the forward, the two-kernel backward) it lost up to 6% at 1024
    keys, where the integer divisions below weigh on short programs and a CTA left alone on an
    SM runs faster (perf-notes#heaviest-first-order).
    """
    tiles = ct.num_blocks(0)
    group = ct.cdiv(HEAVIEST_FIRST_PROGRAMS, tiles)  # at least 1
    program = ct.bid(0) + tiles * ct.bid(1)
    first = program // (group * tiles) * group  # the group's first head
    members = min(group, ct.num_blocks(1) - first)
    within = program - first * tiles
    tile = within // members
    return tile, first + within - tile * members, ct.bid(2)
