"""Multi-GPU attention on torch.distributed: context parallelism, one sequence's positions
split over the ranks of a process group (context.py), in one of the layouts of sharding.py."""

from tilegym.parallel.context import (
    context_parallel_attention,
    sequence_positions,
    shard_sequence,
    unshard_sequence,
)
from tilegym.parallel.sharding import LAYOUTS, SequenceSharding, Span

__all__ = [
    "LAYOUTS",
    "SequenceSharding",
    "Span",
    "context_parallel_attention",
    "sequence_positions",
    "shard_sequence",
    "unshard_sequence",
]
