"""Attention dropout on the host: the rate's check, a call's seed, and what the kernels take.

The kernels (kernels/dropout.py) drop each probability that multiplies V where a hash of the
call's seed and its position falls below a threshold, and scale the kept ones by the inverse of
the keep probability. A call with dropout draws a new seed from PyTorch's CUDA generator (so
torch.manual_seed reproduces it, and CUDA graphs replay a fresh one each time); its backward
reuses that seed, so it sees the forward's mask without storing one.
"""

import contextlib
import dataclasses

import torch

from tilegym.ops.attention.problem import AttentionProblem
from tilegym.ops.attention.score_mods import ModTensors


def check_rate(dropout_p) -> float:
    """dropout_p as a float in [0, max_rate()], or an error naming it."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__}")
    rate = float(dropout_p)
    if not 0.0 <= rate < 1.0:
        # 1 drops every probability: the output would be 0 / 0.
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if threshold(rate) > _levels() - 2:
        # Kept probabilities are scaled by 1 / (1 - rate) in the inputs' dtype: at most 2^15,
        # so that a float16 one stays finite.
        raise ValueError(f"dropout_p must be at most {max_rate()} (1 - 2^-15), got {dropout_p!r}")
    return rate


def refuse_without_training(dropout_p, rate: float, training: bool) -> None:
    """The error of dropout (check_rate's rate) on a call that does not train."""
    if rate and not training:
        raise ValueError(f"dropout_p={dropout_p} with training=False: dropout applies to training calls only")


def _device():
    """kernels/dropout.py, the source of the hash's constants: imported on first use, so that this
    module loads without cuTile."""
    from tilegym.ops.attention.kernels import dropout as device

    return device


def _levels() -> int:
    """How many values the hash's bits that decide a probability take (KEPT_BITS)."""
    return 1 << _device().KEPT_BITS


def max_rate() -> float:
    """The largest rate check_rate takes."""
    return (_levels() - 2) / _levels()


def threshold(rate: float) -> int:
    """The kernels' threshold: a probability is dropped where its hash's deciding bits are below
    it. The rate is rounded to the nearest multiple of 1 / _levels()."""
    return round(rate * _levels())


def kept_scale(rate: float) -> float:
    """1 / (the exact keep probability of rate's threshold)."""
    return _levels() / (_levels() - threshold(rate))


def _seed_words() -> int:
    """The seed tensor's length (SEED_WORDS)."""
    return _device().SEED_WORDS


_GIVEN_SEEDS: list[torch.Tensor] = []  # drawn_as's, innermost last


def call_seed(device: torch.device) -> torch.Tensor:
    """The seed of a call with dropout: drawn_as's within it, else a new one (new_seed)."""
    if _GIVEN_SEEDS:
        return check_seed(_GIVEN_SEEDS[-1], device)
    return new_seed(device)


def new_seed(device: torch.device) -> torch.Tensor:
    """A new seed: int32 [SEED_WORDS], two words drawn on the device in [0, 2^31) (no host
    synchronisation), then the first query row 0 and a zero."""
    seed = torch.randint(0, 2**31 - 1, (_seed_words(),), dtype=torch.int32, device=device)
    seed[2:] = 0
    return seed


@contextlib.contextmanager
def drawn_as(seed: torch.Tensor):
    """Within it, every call with dropout takes seed instead of drawing one (context
    parallelism: one seed on every rank, each chunk's own first row, with_first_row)."""
    _GIVEN_SEEDS.append(seed)
    try:
        yield
    finally:
        _GIVEN_SEEDS.pop()


def with_first_row(seed: torch.Tensor, first_row: int) -> torch.Tensor:
    """seed for a call whose query row 0 is row first_row of the sequence: the kernels then draw
    that call's rows of the mask of the whole sequence (keys counted from the sequence's first)."""
    chunk = seed.clone()
    chunk[2] = first_row
    return chunk


def check_seed(seed, device: torch.device) -> torch.Tensor:
    """An operator's seed: new_seed's int32 [SEED_WORDS] on the call's device, or an error naming it."""
    if not isinstance(seed, torch.Tensor):
        raise TypeError(f"dropout_seed must be a tensor, got {type(seed).__name__}")
    if seed.dtype != torch.int32 or tuple(seed.shape) != (_seed_words(),) or seed.device != device:
        raise ValueError(
            f"dropout_seed must be an int32 tensor of shape ({_seed_words()},) on {device}, got {seed.dtype} "
            f"{tuple(seed.shape)} on {seed.device}"
        )
    return seed


def with_dropout(
    problem: AttentionProblem, mod_tensors: ModTensors, rate: float, device: torch.device, seed=None
) -> tuple[AttentionProblem, ModTensors]:
    """problem and mod_tensors with dropout at rate (checked; 0 leaves them as they are) and seed,
    a new one on device when None (the operators are given theirs, check_seed)."""
    if rate == 0.0:
        return problem, mod_tensors
    mods = dataclasses.replace(problem.mods, dropout=rate)
    seed = call_seed(device) if seed is None else check_seed(seed, device)
    return dataclasses.replace(problem, mods=mods), dataclasses.replace(mod_tensors, dropout_seed=seed)
