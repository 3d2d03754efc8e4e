"""Which positions of a sequence each rank of a context-parallel group holds.

Two layouts, each with equal shares:

- ``"contiguous"``: rank r holds positions ``[r L, (r + 1) L)``, L = length / world. Causal
  attention then costs rank r about 2r + 1 times what it costs rank 0.
- ``"zigzag"``: the sequence cut into 2 x world chunks of c positions; rank r holds chunk r and
  chunk 2 world - 1 - r, in that order. Under causal masking every rank then scores the same
  number of pairs, (2 world + 1) c^2 per head.

A rank's share of a tensor is these positions along its sequence dim, one chunk after the other.
"""

from dataclasses import dataclass

import torch

# Chunks each rank holds, per layout.
CHUNKS_PER_RANK = {"zigzag": 2, "contiguous": 1}
LAYOUTS = tuple(CHUNKS_PER_RANK)


@dataclass(frozen=True)
class Span:
    """Global positions [start, stop) of one chunk, held at local position local_start."""

    start: int
    stop: int
    local_start: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class SequenceSharding:
    """A sequence of length positions split over world ranks in one of LAYOUTS."""

    layout: str
    world: int
    length: int

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if isinstance(self.world, bool) or not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"world must be a positive int, got {self.world!r}")
        if isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 0:
            raise ValueError(f"length must be an int >= 0, got {self.length!r}")
        if self.length % self.chunks:
            raise ValueError(
                f"a sequence of {self.length} positions cannot be split into {self.chunks} equal chunks "
                f"({self.layout} layout over {self.world} ranks): pad it to a multiple of {self.chunks}"
            )

    @classmethod
    def of_share(cls, layout: str, world: int, local_length: int) -> "SequenceSharding":
        """The sharding whose ranks each hold local_length positions."""
        if local_length % CHUNKS_PER_RANK.get(layout, 1):
            raise ValueError(
                f"the zigzag layout holds two equal chunks per rank: a share of {local_length} positions is not even"
            )
        return cls(layout, world, local_length * world)

    @property
    def chunks(self) -> int:
        return CHUNKS_PER_RANK[self.layout] * self.world

    @property
    def chunk_length(self) -> int:
        return self.length // self.chunks

    @property
    def local_length(self) -> int:
        return self.length // self.world

    def chunk_indices(self, rank: int) -> tuple[int, ...]:
        """The chunks rank holds, in local order."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank must be in [0, {self.world}), got {rank!r}")
        if self.layout == "zigzag":
            return (rank, self.chunks - 1 - rank)
        return (rank,)

    def spans(self, rank: int) -> tuple[Span, ...]:
        """The global positions rank holds, chunk by chunk, in local order."""
        size = self.chunk_length
        return tuple(
            Span(chunk * size, (chunk + 1) * size, slot * size) for slot, chunk in enumerate(self.chunk_indices(rank))
        )

    def positions(self, rank: int, device=None) -> torch.Tensor:
        """int64 [local_length]: the global position of each of rank's positions (RoPE's
        position_ids on that rank)."""
        return torch.cat(
            [torch.arange(span.start, span.stop, device=device) for span in self.spans(rank)]
            or [torch.zeros(0, dtype=torch.int64, device=device)]
        )

    def gathered_order(self) -> tuple[int, ...]:
        """For each chunk in sequence order, its index among the chunks of all shares laid one
        rank after the other (what an all-gather of the shares returns)."""
        place = {}
        for rank in range(self.world):
            for slot, chunk in enumerate(self.chunk_indices(rank)):
                place[chunk] = rank * CHUNKS_PER_RANK[self.layout] + slot
        return tuple(place[chunk] for chunk in range(self.chunks))

    def shard(self, x: torch.Tensor, rank: int, dim: int) -> torch.Tensor:
        """rank's share of x, whose dim holds the whole sequence."""
        if x.shape[dim] != self.length:
            raise ValueError(f"x has {x.shape[dim]} positions along dim {dim}, the sequence {self.length}")
        return torch.cat([x.narrow(dim, span.start, span.length) for span in self.spans(rank)], dim=dim)

    def unshard(self, gathered: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole sequence from the shares of every rank laid one after the other along dim."""
        if gathered.shape[dim] != self.length:
            raise ValueError(
                f"gathered has {gathered.shape[dim]} positions along dim {dim}, the sequence {self.length}"
            )
        if self.layout == "contiguous":
            return gathered
        size = self.chunk_length
        return torch.cat([gathered.narrow(dim, place * size, size) for place in self.gathered_order()], dim=dim)


@dataclass(frozen=True)
class PackedSharding:
    """A packed batch (sequences one after another, cumulative lengths cu_seqlens) whose every
    sequence is split in the zigzag layout over world ranks: each sequence's length is a
    multiple of 2 world, and rank r holds chunks r and 2 world - 1 - r of each sequence, sequence
    after sequence. Every rank then scores the same causal pairs of each sequence.

    The row maps below run on the GPU from cu_seqlens without a host synchronisation; rows they
    would place outside the batch (inconsistent cumulative lengths) are clamped into it."""

    world: int

    def __post_init__(self):
        if isinstance(self.world, bool) or not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"world must be a positive int, got {self.world!r}")

    @property
    def chunks(self) -> int:
        return 2 * self.world

    def local_rows(self, cu_seqlens: torch.Tensor, rank: int, local_total: int) -> torch.Tensor:
        """int64 [local_total]: the row of the whole batch that each of rank's rows is."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank must be in [0, {self.world}), got {rank!r}")
        bounds = cu_seqlens.long()
        rows = torch.arange(local_total, device=cu_seqlens.device)
        sequence = self.sequence_of(bounds // self.world, rows)
        offset = rows - bounds[sequence] // self.world
        chunk = self._chunk_length(bounds, sequence)
        second = offset >= chunk
        chunk_index = torch.where(second, self.chunks - 1 - rank, rank)
        within = offset - second.long() * chunk
        return (bounds[sequence] + chunk_index * chunk + within).clamp(0, max(self.world * local_total - 1, 0))

    def gathered_rows(self, cu_seqlens: torch.Tensor, rows: torch.Tensor, local_total: int) -> torch.Tensor:
        """int64: where each of rows (rows of the whole batch) lies among every rank's rows laid
        one rank after the other (what an all-gather of the shares returns)."""
        bounds = cu_seqlens.long()
        sequence = self.sequence_of(bounds, rows)
        offset = rows - bounds[sequence]
        chunk = self._chunk_length(bounds, sequence)
        chunk_index = (offset // chunk).clamp(max=self.chunks - 1)
        owner = torch.where(chunk_index < self.world, chunk_index, self.chunks - 1 - chunk_index)
        slot = (chunk_index >= self.world).long()
        place = owner * local_total + bounds[sequence] // self.world + slot * chunk + offset - chunk_index * chunk
        return place.clamp(0, max(self.world * local_total - 1, 0))

    def check(self, cu_seqlens: torch.Tensor, total: int, longest: int | None = None) -> None:
        """Raises a ValueError unless cu_seqlens starts at 0, never decreases, ends at total and
        every length is a multiple of 2 world, and at most longest (one host synchronisation)."""
        values = cu_seqlens.tolist()
        if values[0] != 0 or values[-1] != total:
            raise ValueError(f"cu_seqlens must run from 0 to the batch's {total} rows, got {values[0]} to {values[-1]}")
        for index, (start, stop) in enumerate(zip(values[:-1], values[1:], strict=True)):
            if stop < start:
                raise ValueError(f"cu_seqlens must not decrease, got {start} then {stop} at sequence {index}")
            if (stop - start) % self.chunks:
                raise ValueError(
                    f"sequence {index} has {stop - start} rows: the zigzag layout over {self.world} ranks needs "
                    f"every length to be a multiple of {self.chunks} (pad each sequence)"
                )
            if longest is not None and stop - start > longest:
                raise ValueError(f"sequence {index} has {stop - start} rows, more than max_seqlen ({longest})")

    @staticmethod
    def sequence_of(bounds: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The sequence each row falls in, by the int64 cumulative bounds [N + 1] (clamped to one)."""
        last = max(bounds.numel() - 2, 0)
        return torch.searchsorted(bounds[1:].contiguous(), rows, right=True).clamp(max=last)

    def _chunk_length(self, bounds: torch.Tensor, sequence: torch.Tensor) -> torch.Tensor:
        return ((bounds[sequence + 1] - bounds[sequence]) // self.chunks).clamp(min=1)
