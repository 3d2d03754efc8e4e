"""The collectives of context parallelism: the all-gather of every rank's keys and values, the
reduce-scatter of their gradients (each rank's share, summed over the ranks that used it), and
the broadcast of a call's dropout seed."""

import torch
import torch.distributed as dist

# PyTorch 2.13 renamed the single-tensor collectives; older releases have only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def world_of(group) -> tuple[int, int]:
    """(rank, world size) of this process in group (None: the default group)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("group: torch.distributed is not initialised; call torch.distributed.init_process_group first")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of it")
    return rank, dist.get_world_size(group)


def all_gather(local: torch.Tensor, group) -> torch.Tensor:
    """[world x n, ...]: every rank's local [n, ...], rank after rank."""
    local = local.contiguous()
    world = dist.get_world_size(group)
    gathered = local.new_empty((world * local.shape[0], *local.shape[1:]))
    if world == 1:
        return gathered.copy_(local)
    if local.numel():  # every rank's share has one shape: all skip an empty one alike
        _all_gather_single(gathered, local, group=group)
    return gathered


def broadcast(tensor: torch.Tensor, group) -> torch.Tensor:
    """tensor, filled with the group's rank 0's values (in place)."""
    if dist.get_world_size(group) > 1:
        dist.broadcast(tensor, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return tensor


def reduce_scatter(gathered: torch.Tensor, group) -> torch.Tensor:
    """[n, ...]: the sum over ranks of their rows of this rank's share of gathered [world x n, ...]."""
    gathered = gathered.contiguous()
    world = dist.get_world_size(group)
    if world == 1:
        return gathered
    local = gathered.new_empty((gathered.shape[0] // world, *gathered.shape[1:]))
    if local.numel():
        _reduce_scatter_single(local, gathered, group=group)
    return local


def gradient_buffer(like: torch.Tensor, local_shape: tuple, group) -> torch.Tensor:
    """Zeros laid out as an all-gather of local_shape shares ([world x n, ...]), in float32 or
    like's wider dtype: where a rank adds the gradients of what it read of every share, before
    reduce_scatter sums them into each share's own (no partial sum rounded to 16 bits)."""
    wide = torch.promote_types(like.dtype, torch.float32)
    return like.new_zeros((dist.get_world_size(group) * local_shape[0], *local_shape[1:]), dtype=wide)
