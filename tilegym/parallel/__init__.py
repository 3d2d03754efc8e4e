"""Multi-GPU attention on torch.distributed: context parallelism, one sequence's positions
split over the ranks of a process group (context.py), or every sequence of a packed batch
(packed.py), in the layouts of sharding.py."""

from tilegym.parallel.context import (
    context_parallel_attention,
    sequence_positions,
    shard_sequence,
    unshard_sequence,
)
from tilegym.parallel.packed import context_parallel_attention_varlen, packed_positions, shard_packed, unshard_packed
from tilegym.parallel.sharding import LAYOUTS, PackedSharding, SequenceSharding, Span

__all__ = [
    "LAYOUTS",
    "PackedSharding",
    "SequenceSharding",
    "Span",
    "context_parallel_attention",
    "context_parallel_attention_varlen",
    "packed_positions",
    "sequence_positions",
    "shard_packed",
    "shard_sequence",
    "unshard_packed",
    "unshard_sequence",
]
