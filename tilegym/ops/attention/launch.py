"""Launching attention: outputs and workspaces allocated, kernel arguments built by name, the
variants dispatch.py chooses launched with their tuned configs. Inputs arrive validated
(problem.check_inputs)."""

import dataclasses
import math
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from functools import cache, lru_cache
from types import MappingProxyType

import torch

from tilegym import autotune, cuda_context, index_width, launching
from tilegym.launching import (
    NamedArguments,
    TunedLauncher,
    addressable,
    current_stream_handle,
    parameter_names,
    split_arguments,
)
from tilegym.ops.attention import (
    aux_gradients,
    configs,
    dispatch,
    dropout,
    packing,
    prepared,
    programmable,
    score_mods,
)
from tilegym.ops.attention.block_mask import BlockMask, MaskRule
from tilegym.ops.attention.packing import CuSeqlens
from tilegym.ops.attention.problem import LOG2E, AttentionProblem
from tilegym.ops.attention.score_mods import BIAS_NONE, NO_TENSORS, ModTensors, ScoreMods
from tilegym.ops.attention.variants import (
    BACKWARD_DK,
    BACKWARD_DKDV,
    BACKWARD_DQ,
    BACKWARD_DV,
    BACKWARD_FUSED_GROUPED,
    BACKWARD_PREPROCESS,
    FORWARD,
    FORWARD_FIXED_MAX,
    FORWARD_LSE,
    FORWARD_LSE_FIXED_MAX,
    VARIANTS,
)


def output(q: torch.Tensor, problem: AttentionProblem) -> torch.Tensor:
    """An uninitialized, contiguous output [B, Hq, Sq, Dv] in q's dtype; packed, an uninitialized
    [total_q, Hq, Dv] as its [1, Hq, total_q, Dv] view (packing.empty_rows)."""
    if problem.packing:
        return packing.empty_rows(problem.packing.total_q, problem.q_heads, problem.value_dim, q)
    return q.new_empty((*q.shape[:3], problem.value_dim))


def row_stat(problem: AttentionProblem, device) -> torch.Tensor:
    """An uninitialized [B, Hq, Sq] LSE, packed [1, Hq, total_q]: fp64 for fp64 inputs, else fp32."""
    if problem.packing:
        return packing.row_stat(problem, device)[None]
    return torch.empty((problem.batch, problem.q_heads, problem.seqlen_q), dtype=problem.stat_dtype, device=device)


def backward_row_stats(problem: AttentionProblem, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward's two row statistics, Delta and the base-2 LSE: uninitialized, as the LSE
    (row_stat); packed, in a layout of their own (packing.backward_row_stats)."""
    if problem.packing:
        return packing.backward_row_stats(problem, device)
    return row_stat(problem, device), row_stat(problem, device)


@lru_cache(maxsize=1024)
def _shape_key(problem: AttentionProblem, arch: str) -> str:
    return problem.shape_key(arch)


class _Launcher(TunedLauncher):
    """Launches the variants of one attention problem with the configs chosen for its shape."""

    def __init__(self, problem: AttentionProblem, device: torch.device, block_mask: BlockMask | None = None):
        super().__init__(device, lambda arch: _shape_key(problem, arch))
        self.problem = problem
        self.block_mask = block_mask
        self.device = device

    def candidates(self, kernel_name: str):
        forced = autotune.forced_candidates(kernel_name)
        if forced is not None:
            _check_forced_packed(self.problem, kernel_name, forced)
            return forced
        problem = self.problem
        return configs.call_candidates(
            kernel_name, self.arch, problem.head_dim, problem.value_dim, problem.dtype, problem.mods.switches
        )

    def tuned(self, name: str, values: dict, before_each=None, packed_as_one=False) -> autotune.TunedKernel:
        """The launch of a variant: values names every kernel argument but the variant's pinned
        switches and the config's tile sizes; the grid follows the variant's tiles and heads.
        packed_as_one: a packed problem's arrays run as one dense batch entry of all their rows:
        varlen off and the grid one entry; the cumulative lengths stay, for a kernel that places
        rows by their sequence (the preprocess's row statistics)."""
        form = _launch_form(self.problem, name, packed_as_one)
        if packed_as_one:
            dense = _dense_packing_arguments(self.device)
            values = {**values, **{key: dense[key] for key in values.keys() & dense.keys() - _CU_SEQLENS}}
        named = NamedArguments(form.kernel, {**values, **form.fixed}, late=form.late)
        problem, mask, device = self.problem, self.block_mask, self.device

        def grid(config):
            return form.grid(getattr(config, form.block))

        def arguments(config):
            if not form.takes_user:
                return named(block_m=config.block_m, block_n=config.block_n)
            lists = _tile_list_arguments(problem, mask, config, form.block == "block_n", device)
            return named(block_m=config.block_m, block_n=config.block_n, **lists)

        return autotune.TunedKernel(name, form.kernel, grid, arguments, before_each)


@dataclass(frozen=True)
class _LaunchForm:
    """What launching a variant for one problem takes that no call's tensors change, worked out
    once per problem (_launch_form): a call's host time is on the GPU's critical path in short
    steps (perf-notes#host-work-memoized)."""

    kernel: object  # the variant's kernel, the caller's functions inlined, its int64 twin if needed
    fixed: MappingProxyType  # the variant's pinned switches and V's head-dim tiles
    late: tuple[str, ...]  # the arguments each config gives
    takes_user: bool  # the kernel takes the caller's functions' arguments
    block: str  # the config's tile along grid axis 0: "block_m" (query tiles) or "block_n"
    rows: int  # rows along grid axis 0 (packed: the longest sequence's; packed as one: all rows)
    heads: int
    batch: int
    packed: bool  # tiles counted as packing.tiles does (at least one)

    def grid(self, block: int) -> tuple[int, int, int]:
        tiles = packing.tiles(self.rows, block) if self.packed else math.ceil(self.rows / block)
        return tiles, self.heads, self.batch


@lru_cache(maxsize=1024)
def _launch_form(problem: AttentionProblem, name: str, packed_as_one: bool) -> _LaunchForm:
    variant = VARIANTS[name]
    kernel = variant.kernel
    takes_user = "block_sparse" in parameter_names(kernel)
    if takes_user:
        kernel = programmable.user_kernel(kernel, problem.mods.user)
    kernel = index_width.wide(kernel) if problem.wide_index else kernel
    query_tiles = variant.tiles == "query"
    rows, batch = (problem.seqlen_q if query_tiles else problem.seqlen_k), problem.batch
    if packed_as_one:
        rows, batch = (problem.packing.total_q if query_tiles else problem.packing.total_k), 1
    late = ("block_m", "block_n", "MaskCounts", "MaskTiles") if takes_user else ("block_m", "block_n")
    return _LaunchForm(
        kernel=kernel,
        fixed=MappingProxyType({**value_tile_arguments(problem.value_dim, parameter_names(kernel)), **variant.fixed}),
        late=late,
        takes_user=takes_user,
        block="block_m" if query_tiles else "block_n",
        rows=rows,
        heads=problem.q_heads if variant.heads == "query" else problem.kv_heads,
        batch=batch,
        packed=problem.packing is not None,
    )


def _packing_arguments(problem: AttentionProblem, cu_seqlens: CuSeqlens | None, device) -> dict:
    """The kernels' arguments of a packed batch by name; placeholders for a dense one."""
    if problem.packing is None:
        return _dense_packing_arguments(device)
    return {
        "CuSeqlensQ": cu_seqlens.q, "CuSeqlensK": cu_seqlens.k,
        "max_seqlen_q": problem.seqlen_q, "max_seqlen_k": problem.seqlen_k, "varlen": True,
    }  # fmt: skip


_CU_SEQLENS = {"CuSeqlensQ", "CuSeqlensK"}


def _check_forced_packed(problem: AttentionProblem, kernel_name: str, forced) -> None:
    """A packed problem's fused backward reads its row statistics at the tile index of each
    sequence's first row (kernels/packed.py, stat_first_tile), which only query tiles dividing
    packing.STAT_ALIGN give; every table's do (a CPU test), a forced config might not."""
    if problem.packing is None or not VARIANTS[kernel_name].fixed.get("sum_dq"):
        return
    for config in forced:
        if packing.STAT_ALIGN % config.block_m:
            raise ValueError(
                f"force_config: {kernel_name} on a packed batch needs block_m dividing {packing.STAT_ALIGN}, "
                f"got {config.block_m}"
            )


@cache
def _dense_packing_arguments(device: torch.device) -> MappingProxyType:
    """_packing_arguments of every dense call on a device, made once (every launch reads them)."""
    unused = _unused(device, 1, torch.int32)
    return MappingProxyType(
        {"CuSeqlensQ": unused, "CuSeqlensK": unused, "max_seqlen_q": 0, "max_seqlen_k": 0, "varlen": False}
    )


def value_tile_arguments(value_dim: int, names: tuple[str, ...]) -> dict:
    """block_dv, and block_dv_tail, of a kernel with parameters `names` that tiles V's head dim:
    split as Q's (configs.head_dim_tiles) where the kernel takes a tail, else one tile padded to a
    power of two (the forward, kernels/forward.py says why, and the row reductions)."""
    if "block_dv_tail" in names:
        block_dv, block_dv_tail = configs.head_dim_tiles(value_dim)
        return {"block_dv": block_dv, "block_dv_tail": block_dv_tail}
    return {"block_dv": configs.head_dim_tile(value_dim)} if "block_dv" in names else {}


def _modifier_arguments(problem: AttentionProblem, tensors: ModTensors, placeholder: torch.Tensor) -> dict:
    """The score modifiers' kernel arguments by name: tensors, runtime values, compile-time switches."""
    return {
        "Bias": placeholder if tensors.bias is None else tensors.bias,
        "Slopes": _or_unused(tensors.slopes, placeholder.device, 2),
        "DropoutSeed": _or_unused(tensors.dropout_seed, placeholder.device, 1, torch.int32),
        **_modifier_values(problem),
    }


@lru_cache(maxsize=1024)
def _modifier_values(problem: AttentionProblem) -> MappingProxyType:
    """_modifier_arguments' values that are not tensors: the same for every call of a problem."""
    mods = problem.mods
    cap = mods.softcap or 1.0
    rule = mask_rule(problem)
    block_d, block_d_tail = configs.head_dim_tiles(problem.head_dim)
    return MappingProxyType({
        **split_arguments(softcap_in=problem.softmax_scale / cap, softcap=cap),
        "window_left": rule.window_left,
        "window_right": rule.window_right,
        "causal": rule.causal,
        "windowed": rule.windowed,
        "capped": bool(mods.softcap),
        "bias_mode": mods.bias_mode,
        "alibi": mods.alibi,
        "query_group_size": problem.query_group_size,
        "block_d": block_d,
        "block_d_tail": block_d_tail,
        "dropout": bool(mods.dropout),
        "dropout_threshold": dropout.threshold(mods.dropout),
        **split_arguments(dropout_scale=dropout.kept_scale(mods.dropout)),
    })  # fmt: skip


def _tile_list_arguments(problem: AttentionProblem, mask: BlockMask | None, config, key_major: bool, device):
    """A block mask's lists for a launch with this config (placeholders without a mask)."""
    if mask is None:
        return _no_user_arguments(device)["tile_lists"]
    lists = mask.tile_lists(config.block_m, config.block_n, mask_rule(problem), key_major)
    return {"MaskCounts": lists.counts, "MaskTiles": lists.tiles}


def mask_rule(problem: AttentionProblem) -> MaskRule:
    """The causal switch and window sides the kernels take (unbounded sides reach past either end
    of the sequences), which a block mask's tile lists depend on too."""
    mods = problem.mods
    reach = problem.seqlen_q + problem.seqlen_k
    left, right = (reach if side < 0 else side for side in (mods.window or (-1, -1)))
    totals = (0, 0) if problem.packing is None else (problem.packing.total_q, problem.packing.total_k)
    # A window carries its own right side: the kernels' causal mask stays off under one.
    return MaskRule(problem.causal and mods.window is None, mods.window is not None, left, right, *totals)


def _user_arguments(tensors: ModTensors, device):
    """The caller's tensors for its functions (programmable.py), placeholders in unused slots."""
    if tensors.block_mask is None and not tensors.aux:
        return _no_user_arguments(device)["tensors"]
    mask_aux = () if tensors.block_mask is None else tensors.block_mask.mask_aux
    return {"block_sparse": tensors.block_mask is not None, **_slots("Aux", tensors.aux, device),
            **_slots("MaskAux", mask_aux, device)}  # fmt: skip


def _aux_grad_arguments(d_aux: tuple | None, device):
    """The dK/dV kernel's AuxGrad slots: the aux gradients' buffers, placeholders where unused."""
    return _no_user_arguments(device)["aux_grads"] if not d_aux else _slots("AuxGrad", d_aux, device)


def _slots(prefix: str, given: tuple, device) -> dict:
    """Arguments prefix0 ... prefix{AUX_SLOTS - 1}: the given tensors, then placeholders."""
    return {f"{prefix}{slot}": given[slot] if slot < len(given) else _unused(device, 1)
            for slot in range(programmable.AUX_SLOTS)}  # fmt: skip


@cache
def _no_user_arguments(device: torch.device) -> MappingProxyType:
    """The arguments of the caller's functions for a call without any, made once per device
    (every launch reads them): its tensors, tile lists and aux gradients, each by name."""
    lists = {"MaskCounts": _unused(device, 4, torch.int32), "MaskTiles": _unused(device, 5, torch.int32)}
    tensors = {"block_sparse": False, **_slots("Aux", (), device), **_slots("MaskAux", (), device)}
    parts = {"tensors": tensors, "tile_lists": lists, "aux_grads": _slots("AuxGrad", (), device)}
    return MappingProxyType({name: MappingProxyType(part) for name, part in parts.items()})


def classify_tiles(mask: BlockMask, block_m: int, block_n: int, rule: MaskRule) -> torch.Tensor:
    """The kinds of a block mask's tiles at one tiling (kernels/block_mask.py), int8 [B, H,
    query tiles, key tiles]."""
    import cuda.tile as ct

    from tilegym.ops.attention.kernels.block_mask import block_mask_kernel

    rows, cols = math.ceil(mask.seqlen_q / block_m), math.ceil(mask.seqlen_k / block_n)
    kinds = torch.zeros((mask.batch, mask.heads, rows, cols), dtype=torch.int8, device=mask.device)
    if kinds.numel() == 0:
        return kinds
    kernel = programmable.user_kernel(block_mask_kernel, mask.functions)
    aux = [mask.mask_aux[slot] if slot < len(mask.mask_aux) else _unused(mask.device, 1)
           for slot in range(programmable.AUX_SLOTS)]  # fmt: skip
    packed = mask.cu_seqlens
    lengths = (_unused(mask.device, 1, torch.int32),) * 2 if packed is None else (packed.q, packed.k)
    arguments = (
        kinds, *aux, *lengths, mask.seqlen_q, mask.seqlen_k, rule.total_q, rule.total_k, rule.window_left,
        rule.window_right, block_m, block_n, rule.causal, rule.windowed, packed is not None,
    )  # fmt: skip
    with programmable.naming_errors(mask.functions):
        ct.launch(current_stream_handle(mask.device.index), (rows, cols, mask.batch * mask.heads), kernel, arguments)
    return kinds


# _unused's tensors by id, which a prepared launch keeps as they are (prepared.py); held here
# too, so that no other tensor can take the id of one that two threads made at once.
_PLACEHOLDERS: dict[int, torch.Tensor] = {}


@cache
def _unused(device: torch.device, ndim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An array argument a kernel does not touch under its switches (ALiBi slopes without
    ALiBi, the forward's LSE when it writes none, sinks, the sinks' and the LSE's gradients,
    the cumulative lengths of a dense batch): one zero of the argument's rank and dtype, made
    once per device (and kept: _PLACEHOLDERS holds its id)."""
    placeholder = torch.zeros((1,) * ndim, dtype=dtype, device=device)
    _PLACEHOLDERS[id(placeholder)] = placeholder
    return placeholder


def _or_unused(
    tensor: torch.Tensor | None, device: torch.device, ndim: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return _unused(device, ndim, dtype) if tensor is None else tensor


def _positive_scale(q: torch.Tensor, problem: AttentionProblem) -> tuple[torch.Tensor, float]:
    """(q, scale) giving the same scores with scale > 0, which the plain forward needs (it scales
    inside exp2, kernels/modifiers.py keeps_raw_scores): s * q.k = -s * (-q).k, and 0 * q.k =
    1 * (0 q).k. Both are exact; only a non-positive scale pays for a copy of q."""
    scale = problem.softmax_scale
    if scale > 0 or not problem.mods.keeps_raw_scores:
        return q, scale
    if scale < 0:
        return -q, -scale
    return q * 0, 1.0


def forward(
    q, k, v, problem: AttentionProblem, with_lse: bool, out=None, lse=None, mod_tensors=NO_TENSORS, cu_seqlens=None
):
    """out (and lse when with_lse) of validated inputs; packed (problem.packing), q, k and v are
    heads_major views and cu_seqlens their CuSeqlens (forward_packed gives out and lse).

    out and lse may be given (contiguous, right shape and dtype) to be written in place.
    """
    q, k, v = addressable(q), addressable(k), addressable(v)
    device = q.device
    if out is None:
        out = output(q, problem)
    if lse is None and with_lse:
        lse = row_stat(problem, device)
    if problem.is_empty:
        if problem.packing:  # no program runs to fill the rows outside every sequence
            out.zero_()
            if lse is not None:
                lse.fill_(-math.inf)
        return out, lse
    if problem.scores_nothing:  # dense, no key to attend to: every row is empty
        out.zero_()
        if lse is not None:
            if mod_tensors.sinks is None:
                lse.fill_(-math.inf)
            else:  # all of each row's mass is the sink's
                lse.copy_(mod_tensors.sinks.reshape(1, -1, 1).expand_as(lse))
        return out, lse

    optional = _optional_tensors(mod_tensors, cu_seqlens)
    roles = (q, k, v, out, lse, *optional)
    key = _plan_key("forward", problem, device, (lse, *optional)) if _preparable(problem, mod_tensors) else None
    plan = None if key is None else prepared.find(key)
    if plan is not None and _replay(plan, roles, device):
        return out, lse

    q, softmax_scale = _positive_scale(q, problem)
    launcher = _Launcher(problem, device, mod_tensors.block_mask)
    fixed_max = dispatch.fixed_max_forward(problem, launcher.candidates)
    if with_lse:
        name = FORWARD_LSE_FIXED_MAX if fixed_max else FORWARD_LSE
    else:
        name = FORWARD_FIXED_MAX if fixed_max else FORWARD
    values = {
        "Q": q,
        "K": k,
        "V": v,
        "Out": out,
        "Lse": lse if with_lse else _unused(device, 3),
        "Sinks": _or_unused(mod_tensors.sinks, device, 1),
        "with_sinks": problem.mods.sinks,
        **split_arguments(qk_scale_log2=softmax_scale * LOG2E),
        **_modifier_arguments(problem, mod_tensors, q),
        **_packing_arguments(problem, cu_seqlens, device),
    }
    values.update(_user_arguments(mod_tensors, device))
    with programmable.naming_errors(problem.mods.user):
        launched = launcher.launch(launcher.tuned(name, values))
    if key is not None:
        # Where _positive_scale copied q, the launch's Q is no role: nothing is prepared.
        plan = prepared.prepare((launched,), roles, _PLACEHOLDERS, ((),))
        if plan is not None:
            prepared.keep(key, plan)
    return out, lse


def _optional_tensors(mod_tensors: ModTensors, cu_seqlens: CuSeqlens | None) -> tuple:
    """A call's tensors of its score modifiers, packing and dropout seed, None where it has none:
    the last roles of its prepared launches (prepared.py), after the call's own tensors.

    Self-attention often passes one tensor as both cumulative lengths: it is then the query
    lengths' role alone (the key lengths' None), so that both kernel arguments take it and the
    call can be prepared, under a key of its own (roles that share a tensor prepare nothing)."""
    if cu_seqlens is None:
        packed = (None, None)
    else:
        packed = (cu_seqlens.q, None if cu_seqlens.k is cu_seqlens.q else cu_seqlens.k)
    return (mod_tensors.sinks, mod_tensors.bias, mod_tensors.slopes, *packed, mod_tensors.dropout_seed)


def _preparable(problem: AttentionProblem, mod_tensors: ModTensors) -> bool:
    """Whether a call's launches may be prepared (prepared.py): not with the caller's functions,
    whose kernels take per-call tile lists and tensors."""
    return problem.mods.user is None and mod_tensors.block_mask is None and not mod_tensors.aux


def _plan_key(step: str, problem: AttentionProblem, device, optional: tuple, *flags) -> tuple:
    """A plan's key: the step, the problem, the device, which optional tensors (the forward's
    LSE, the LSE's gradient, score modifiers, packing) the call has, what else it asks for
    (flags: the sinks' gradient), and the launcher class (a stand-in one makes and finds no
    plans)."""
    return prepared.plan_key(_Launcher, step, problem, device, tuple(t is None for t in optional), *flags)


def _replay(plan, roles: tuple, device) -> bool:
    """Launches a plan's templates (prepared.replay) on the device's current stream."""
    cuda_context.ensure_current(device.index or 0)  # the autograd thread may have no context
    return prepared.replay(plan, roles, launching.current_stream_handle(device.index))


def forward_packed(q, k, v, problem: AttentionProblem, with_lse: bool, mod_tensors, cu_seqlens: CuSeqlens):
    """(out [total_q, Hq, Dv], lse [Hq, total_q] or None) of a packed batch of [total, H, D]
    tensors: new tensors (no views), zeros and -inf in rows that no sequence covers."""
    out = torch.empty((q.shape[0], q.shape[1], problem.value_dim), dtype=q.dtype, device=q.device)
    lse = packing.row_stat(problem, q.device) if with_lse else None
    views = packing.heads_major(q), packing.heads_major(k), packing.heads_major(v)
    forward(
        *views, problem, with_lse, packing.heads_major(out), None if lse is None else lse[None], mod_tensors,
        cu_seqlens,
    )  # fmt: skip
    return out, lse


def backward_packed(d_out, q, k, v, out, lse, problem: AttentionProblem, mod_tensors, cu_seqlens, d_lse, sinks_grad):
    """backward() of a packed batch (forward_packed's tensors and their gradients): dq, dk, dv
    [total, H, D] as new tensors, zeros in rows no sequence covers."""
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    views = [packing.heads_major(t) for t in (d_out, q, k, v, out)]
    gradients = backward(
        *views, lse[None], problem, (packing.heads_major(dq), packing.heads_major(dk), packing.heads_major(dv)),
        mod_tensors, d_lse=None if d_lse is None else d_lse[None], sinks_grad=sinks_grad, cu_seqlens=cu_seqlens,
    )  # fmt: skip
    return dataclasses.replace(gradients, dq=dq, dk=dk, dv=dv)


@dataclass(frozen=True)
class Gradients:
    """What backward() returns: d_bias in the caller's bias shape (None without bias_grad),
    d_sinks in the sinks' kernel dtype (None without sinks_grad)."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    d_bias: torch.Tensor | None = None
    d_sinks: torch.Tensor | None = None
    d_aux: tuple | None = None  # fp32 (fp64) sums for each aux tensor, with the caller's aux_grad


def backward(
    d_out,
    q,
    k,
    v,
    out,
    lse,
    problem: AttentionProblem,
    grads=None,
    mod_tensors=NO_TENSORS,
    bias_grad=False,
    d_lse=None,
    sinks_grad=False,
    cu_seqlens=None,
) -> Gradients:
    """Gradients of validated inputs, given the forward's out and lse.

    grads, a (dq, dk, dv) of contiguous tensors, may be given to be written in place. d_lse, the
    gradient of the LSE output (None: none), folds into the row statistics. sinks_grad asks for
    the sinks' gradient, summed over batch and rows in a fixed order (deterministic). Packed
    (cu_seqlens, as forward), the gradients cover every row: zeros where no sequence is.
    """
    dq, dk, dv, d_bias = _gradients(q, k, v, problem, grads, mod_tensors, bias_grad)
    sinks_grad = sinks_grad and problem.mods.sinks
    if not problem.wide_index and any(index_width.needs_int64(t) for t in (d_out, d_lse) if t is not None):
        problem = dataclasses.replace(problem, wide_index=True)
    if _backward_is_empty(problem):
        for gradient in (dq, dk, dv, d_bias):
            if gradient is not None:
                gradient.zero_()
        d_sinks = _sinks_grad_without_keys(problem, mod_tensors, d_lse) if sinks_grad else None
        d_bias = _caller_bias_grad(d_bias, problem.mods, mod_tensors)
        return Gradients(dq, dk, dv, d_bias, d_sinks, _aux_gradients_without_scores(problem, mod_tensors))
    d_out, q, k, v, out = (addressable(t) for t in (d_out, q, k, v, out))
    device = q.device
    key, optional = None, _optional_tensors(mod_tensors, cu_seqlens)
    # Prepared (prepared.py), the LSE's and the sinks' gradients included, but not dBias (summed
    # into the bias's shape afterwards).
    if d_bias is None and _preparable(problem, mod_tensors):
        key = _plan_key("backward", problem, device, (d_lse, *optional), sinks_grad)
        plan = prepared.find(key)
        if plan is not None:
            workspaces = plan.workspaces(problem, dq, dk, dv)
            row_grads = plan.row_gradients(problem, d_lse, device)
            roles = _backward_roles(d_out, q, k, v, out, lse, workspaces, row_grads, optional)
            if _replay(plan.launches, roles, device):
                workspaces.targets.copy_to(dq, dk, dv)
                return Gradients(dq, dk, dv, None, row_grads.d_sinks())
    launcher = _Launcher(problem, device, mod_tensors.block_mask)
    row_grads = _row_gradients(launcher, d_lse, sinks_grad, device)
    d_aux = _aux_gradients(problem, mod_tensors, alert=True)
    steps, workspaces = _backward_steps(
        launcher, d_out, q, k, v, out, lse, dq, dk, dv, d_bias, mod_tensors, row_grads, cu_seqlens, d_aux
    )
    # Everything is prepared before the first launch: host work between launches would leave
    # the GPU idle after a short one.
    with programmable.naming_errors(problem.mods.user):
        launched = [launcher.launch(step) for step in steps]
    targets = workspaces.targets
    if key is not None:
        roles = _backward_roles(d_out, q, k, v, out, lse, workspaces, row_grads, optional)
        plan = _BackwardPlan.of(launched, steps, roles, workspaces, row_grads, dq)
        if plan is not None:
            prepared.keep(key, plan)
    targets.copy_to(dq, dk, dv)
    d_aux = None if d_aux is None else tuple(aux_gradients.sums(buffer) for buffer in d_aux)
    d_bias = _caller_bias_grad(d_bias, problem.mods, mod_tensors)
    return Gradients(dq, dk, dv, d_bias, row_grads.d_sinks(), d_aux)


def _aux_gradients(problem: AttentionProblem, mod_tensors: ModTensors, alert: bool = False) -> tuple | None:
    """Where the caller's aux_grad adds each aux tensor's gradient (aux_gradients.buffers), zeroed
    right before the launch that counts (tuning runs add too); None without an aux_grad.
    alert: raise (or warn) where torch.use_deterministic_algorithms(True) is set and the sums
    cannot be repeatable."""
    user = problem.mods.user
    if user is None or user.aux_grad is None:
        return None
    return aux_gradients.buffers(mod_tensors.aux, problem.stat_dtype, _fixed_point_aux_sums(problem, alert))


def _aux_gradients_without_scores(problem: AttentionProblem, mod_tensors: ModTensors) -> tuple | None:
    """The aux gradients of a backward with no work: zeros (None without an aux_grad)."""
    d_aux = _aux_gradients(problem, mod_tensors)
    if d_aux is None:
        return None
    for buffer in d_aux:
        buffer.zero_()
    return tuple(aux_gradients.sums(buffer) for buffer in d_aux)


def _fixed_point_aux_sums(problem: AttentionProblem, alert: bool) -> bool:
    """Whether the aux gradients are summed in fixed point, repeatably: under
    torch.use_deterministic_algorithms(True), where aux_grad adds only by add_to_aux_grad and the
    inputs are not float64 (whose sums fixed point would round to 2^-32)."""
    if not torch.are_deterministic_algorithms_enabled():
        return False
    if problem.dtype == torch.float64:
        reason = "float64 inputs' aux gradients (aux_grad) are summed by atomic adds"
    elif aux_gradients.adds_atomically(problem.mods.user.aux_grad):
        reason = "aux_grad adds with ct.atomic_add (add_to_aux_grad sums repeatably)"
    else:
        return True
    if alert:
        _alert_not_deterministic(reason)
    return False


def _alert_not_deterministic(what: str) -> None:
    """Under torch.use_deterministic_algorithms(True), a RuntimeError before a launch whose sums
    vary from run to run (a warning with warn_only=True), as PyTorch's own operators do."""
    message = (
        f"{what}, whose last bits vary from run to run, but torch.use_deterministic_algorithms(True) is set: "
        "give the aux tensors no gradient (requires_grad=False), or turn it off for this call"
    )
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(message, stacklevel=5)
        return
    raise RuntimeError(message)


def _sinks_grad_without_keys(problem: AttentionProblem, mod_tensors: ModTensors, d_lse) -> torch.Tensor:
    """dSink where no row sees a key (or there is no row): each row's LSE is its head's sink
    (P_sink 1, output 0, Delta -dLSE), so dSink_h is the sum of dLSE over the head's rows; a -inf
    sink leaves LSE -inf and takes no gradient."""
    sinks = mod_tensors.sinks
    if d_lse is None or problem.is_empty:  # packed, only is_empty gets here: no row is covered
        return torch.zeros_like(sinks)
    return torch.where(sinks == -math.inf, 0.0, d_lse.to(sinks.dtype).sum(dim=(0, 2)))


@dataclass(frozen=True)
class RowGradients:
    """The backward's per-row extras: the LSE's gradient it folds into Delta (d_lse, None
    without one), and where the dQ kernel writes each query tile's share of the sinks'
    gradient ([B, Hq, query tiles of the smallest candidate]; None without), zeroed by reset
    right before the launch that writes it: a config with larger tiles writes fewer shares."""

    d_lse: torch.Tensor | None
    d_sinks_partial: torch.Tensor | None

    @property
    def reset(self):
        """The reset of the launch that writes the sinks' shares, None where there are none."""
        return None if self.d_sinks_partial is None else self.d_sinks_partial.zero_

    def d_sinks(self) -> torch.Tensor | None:
        """The sinks' gradient [Hq] from the shares, once the launches are issued."""
        return None if self.d_sinks_partial is None else self.d_sinks_partial.sum(dim=(0, 2))


def _row_gradients(launcher: _Launcher, d_lse, sinks_grad: bool, device) -> RowGradients:
    problem = launcher.problem
    partial = None
    if sinks_grad:
        # Shares of whichever kernel writes the row statistics, at its smallest query tile.
        names = (BACKWARD_DQ, BACKWARD_PREPROCESS)
        block_m = min(config.block_m for name in names for config in launcher.candidates(name))
        tiles = math.ceil(problem.seqlen_q / block_m)
        # Zeroed right before the launch that counts (RowGradients.zero): tuning runs of other
        # configs write other tiles' shares.
        partial = torch.empty((problem.batch, problem.q_heads, tiles), dtype=problem.stat_dtype, device=device)
    return RowGradients(_lse_grad_stat(problem, d_lse), partial)


def _lse_grad_stat(problem: AttentionProblem, d_lse):
    """The LSE's gradient as the kernels read it (None: none)."""
    return None if d_lse is None else d_lse.to(problem.stat_dtype).contiguous()


# Problems whose backward was compiled ahead, least recently seen first: bounded, so that a
# process seeing ever new shapes does not grow it without end.
_compiled_ahead: OrderedDict[tuple, None] = OrderedDict()
_COMPILED_AHEAD_MAX = 256


def compile_backward_ahead(
    q, k, v, problem: AttentionProblem, mod_tensors=NO_TENSORS, bias_grad=False, sinks_grad=False, cu_seqlens=None
) -> None:
    """Starts compiling, in background threads, the kernels backward() will launch for this
    problem (autotune.compile_ahead), once per problem: the training forward calls it first, so
    that the backward's compiles run alongside its own. Its tensors are stand-ins shaped and
    laid out like the backward's (a contiguous out and d_out), dropped on return; where they do
    not fit in memory, nothing is started. Whether the LSE will get a gradient is not known
    yet: the kernels without one are compiled. Packed (cu_seqlens given), q, k and v are the
    caller's [total, H, D] tensors, viewed only when something is compiled."""
    sinks_grad = sinks_grad and problem.mods.sinks
    key = (problem, q.device, bias_grad, sinks_grad)
    if key in _compiled_ahead:
        _compiled_ahead.move_to_end(key)
        return
    if _backward_is_empty(problem):
        return
    if cu_seqlens is not None:
        q, k, v = packing.heads_major(q), packing.heads_major(k), packing.heads_major(v)
    _compiled_ahead[key] = None
    if len(_compiled_ahead) > _COMPILED_AHEAD_MAX:
        _compiled_ahead.popitem(last=False)
    launcher = _Launcher(problem, q.device, mod_tensors.block_mask)
    try:
        out = output(q, problem)
        lse = row_stat(problem, q.device)
        dq, dk, dv, d_bias = _gradients(q, k, v, problem, None, mod_tensors, bias_grad)
        row_grads = _row_gradients(launcher, None, sinks_grad, q.device)
        # The aux gradients' buffers too: their shapes are part of the dK/dV kernel's signature.
        d_aux = _aux_gradients(problem, mod_tensors)
        steps, _ = _backward_steps(
            launcher, out, q, k, v, out, lse, dq, dk, dv, d_bias, mod_tensors, row_grads, cu_seqlens, d_aux
        )
    except torch.cuda.OutOfMemoryError:
        return
    for step in steps:
        launcher.compile_ahead(step)


def _backward_is_empty(problem: AttentionProblem) -> bool:
    """Whether no program has work. A packed batch whose sequences have no keys still runs: its
    rows' statistics (and the sinks' gradient) come from the dQ kernel."""
    return problem.scores_nothing or problem.kv_heads == 0


def _gradients(q, k, v, problem: AttentionProblem, grads, mod_tensors: ModTensors, bias_grad: bool):
    """(dq, dk, dv, d_bias) to write: grads or new tensors; d_bias None without a bias gradient.
    Packed, new gradients are uninitialized too: the kernels that write them zero the rows
    outside every sequence (kernels/packed.py), and those cast from the fused backward's fp32
    sums get every row from the cast."""
    if grads is None and problem.packing:
        grads = tuple([packing.empty_rows(t.shape[2], t.shape[1], t.shape[3], t) for t in (q, k, v)])
    elif grads is None:
        grads = tuple([torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)])
    mods = problem.mods
    if not bias_grad or mods.bias_mode == BIAS_NONE:
        return (*grads, None)
    rows = 1 if mods.bias_mode == score_mods.BIAS_ONE_ROW else problem.seqlen_q
    shape = (problem.batch, problem.q_heads, rows, problem.seqlen_k)
    # A bias of that very shape takes the kernel's output as is, in its own dtype; a
    # broadcast one is summed afterwards, from fp32 (fp64) partial sums.
    if score_mods.padded_shape(mods.bias_shape) == shape:
        dtype = mod_tensors.bias.dtype
    else:
        dtype = problem.stat_dtype
    # Zeros where a mask, window or mask function skips tiles, which the kernel never writes.
    skips_tiles = mods.bias_mode == score_mods.BIAS_PER_ROW and (
        problem.causal or mods.window is not None or "masks" in mods.switches
    )
    d_bias = (torch.zeros if skips_tiles else torch.empty)(shape, dtype=dtype, device=q.device)
    return (*grads, d_bias)


def _backward_steps(
    launcher: _Launcher,
    d_out,
    q,
    k,
    v,
    out,
    lse,
    dq,
    dk,
    dv,
    d_bias,
    mod_tensors,
    row_grads,
    cu_seqlens=None,
    d_aux=None,
):
    """The backward's launches, in order, and its workspaces (where they write dQ, dK and dV)."""
    problem = launcher.problem
    if d_aux is not None:
        mod_tensors = dataclasses.replace(mod_tensors, aux=aux_gradients.read_wide(mod_tensors.aux))
    q, k, v, out, d_out = (addressable(t) for t in (q, k, v, out, d_out))
    device = q.device

    delta, lse_base2 = backward_row_stats(problem, device)
    fused = dispatch.fused_backward(problem, launcher.candidates, d_bias is not None)
    d_lse, partial = row_grads.d_lse, row_grads.d_sinks_partial
    lse_grad = {"DLse": _or_unused(d_lse, device, 3), "lse_grad": d_lse is not None}
    # Whichever kernel writes the row statistics (the dQ kernel, or the fused backward's
    # preprocess) writes each query tile's share of the sinks' gradient.
    sinks_grad = {
        "Sinks": _or_unused(mod_tensors.sinks, device, 1),
        "DSinks": _or_unused(partial, device, 3),
        "sinks_grad": partial is not None,
    }
    # The fused backward sums dQ in fp32, over rows padded to whole tiles of every candidate;
    # the grouped one also dK and dV, so that a group's heads run in separate programs.
    targets = _fused_targets(launcher, fused, dq, dk, dv) if fused else GradientTargets(dq, dk, dv, False)
    shared = {
        "Q": q,
        "K": k,
        "V": v,
        "dOut": d_out,
        "LseBase2": lse_base2,
        "Delta": delta,
        **split_arguments(softmax_scale=problem.softmax_scale, qk_scale_log2=problem.softmax_scale * LOG2E),
        **_modifier_arguments(problem, mod_tensors, q),
        **_packing_arguments(problem, cu_seqlens, device),
        **_user_arguments(mod_tensors, device),
    }
    dkdv_values = {
        **shared,
        "dK": targets.dk,
        "dV": targets.dv,
        "DQSum": targets.dq if fused else q,  # an unused placeholder without fusion
        "DBias": q if d_bias is None else d_bias,
        "bias_grad": BIAS_NONE if d_bias is None else problem.mods.bias_mode,
        **_aux_grad_arguments(d_aux, device),
    }
    if fused:
        # Every dK/dV program needs the row statistics of every query tile: a kernel of their own.
        # A row's statistics do not depend on its sequence, so a packed batch's run over all its
        # rows as one dense batch entry: sliced per sequence, each program loaded its tiles
        # without bulk copies, 3x slower (perf-notes#packed-preprocess). The sinks' gradient
        # keeps the slices: its shares are per tile of a sequence.
        packed_as_one = problem.packing is not None and partial is None
        packed = {name: shared[name] for name in ("CuSeqlensQ", "max_seqlen_q", "varlen")}
        # Run as one, it finds each row's place in the statistics' layout from CuSeqlensQ.
        by_sequence = {
            "stats_by_sequence": packed_as_one,
            "search_steps": packing.search_steps(problem.batch) if packed_as_one else 0,
        }
        preprocess = launcher.tuned(
            BACKWARD_PREPROCESS,
            {"Out": out, "dOut": d_out, "Lse": lse, "Delta": delta, "LseBase2": lse_base2,
             **lse_grad, **sinks_grad, **packed, **by_sequence},
            row_grads.reset,
            packed_as_one,
        )  # fmt: skip
        return (preprocess, launcher.tuned(fused, dkdv_values, targets.zero)), _Workspaces(delta, lse_base2, targets)
    # Two kernels: the dQ kernel writes the row statistics of its query tile, so it runs first.
    dq_values = {**shared, "Out": out, "Lse": lse, "dQ": targets.dq, **lse_grad, **sinks_grad}
    dq_step = launcher.tuned(BACKWARD_DQ, dq_values, row_grads.reset)
    reset_aux = (lambda: [d.zero_() for d in d_aux]) if d_aux else None
    if dispatch.split_dkdv(problem, launcher.candidates):
        dkdv_steps = (launcher.tuned(BACKWARD_DV, dkdv_values), launcher.tuned(BACKWARD_DK, dkdv_values, reset_aux))
    else:
        dkdv_steps = (launcher.tuned(BACKWARD_DKDV, dkdv_values, reset_aux),)
    return (dq_step, *dkdv_steps), _Workspaces(delta, lse_base2, targets)


@dataclass(frozen=True)
class GradientTargets:
    """Where the backward kernels write dQ, dK and dV: the gradients themselves (two kernels),
    or for the fused backward a zeroed fp32 sum of dQ and, grouped, of dK and dV, over rows
    padded to whole tiles, cast into the gradients afterwards (copy_to)."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    grouped: bool  # dk and dv are sums too: the kernel's sum_dkdv

    def zero(self) -> None:
        for total in (self.dq, self.dk, self.dv) if self.grouped else (self.dq,):
            total.zero_()

    def copy_to(self, dq, dk, dv) -> None:
        """Casts the sums into the gradients [B, H, S, D] (packed: [1, H, total, D]); nothing
        where the kernels wrote the gradients themselves."""
        if self.dq is dq:
            return
        pairs = ((dq, self.dq), (dk, self.dk), (dv, self.dv)) if self.grouped else ((dq, self.dq),)
        for gradient, total in pairs:
            gradient.copy_(total[:, :, : gradient.shape[2], : gradient.shape[3]])


def _fused_targets(launcher: _Launcher, name: str, dq, dk, dv) -> GradientTargets:
    """Sums shaped as the gradients ([B, H, S, D]; packed [1, H, total, D], each sequence adding
    into its own rows), rows padded to whole tiles of every candidate, D to its tile."""
    candidates = launcher.candidates(name)

    def padded_sum(gradient, block):
        rows = max(getattr(config, block) for config in candidates)
        batch, heads, length, head_dim = gradient.shape
        padded, tile = math.ceil(length / rows) * rows, configs.head_dim_tile(head_dim)
        where = {"dtype": torch.float32, "device": gradient.device}
        if gradient.stride(2) > gradient.stride(1):
            # Rows outside heads as in the gradient (packed, [total, H, D]), so that the cast in
            # copy_to is one contiguous pass, not a transposing one (16384 x 2048: 98 us).
            return torch.empty((batch, padded, heads, tile), **where).transpose(1, 2)
        return torch.empty((batch, heads, padded, tile), **where)

    dq_sum = padded_sum(dq, "block_m")
    if name != BACKWARD_FUSED_GROUPED:
        return GradientTargets(dq_sum, dk, dv, grouped=False)
    return GradientTargets(dq_sum, padded_sum(dk, "block_n"), padded_sum(dv, "block_n"), grouped=True)


@dataclass(frozen=True)
class _Workspaces:
    """A backward call's row statistics (Delta, the base-2 LSE) and where its kernels write the
    gradients."""

    delta: torch.Tensor
    lse_base2: torch.Tensor
    targets: GradientTargets


def _backward_roles(d_out, q, k, v, out, lse, workspaces: _Workspaces, row_grads: RowGradients, optional) -> tuple:
    """A backward's tensors in the order its prepared launches name them (prepared.py), the
    optional ones (_optional_tensors) last. The kernels see the gradients only as the targets
    (the gradients themselves, or sums)."""
    targets = workspaces.targets
    return (
        d_out, q, k, v, out, lse, workspaces.delta, workspaces.lse_base2, targets.dq, targets.dk, targets.dv,
        row_grads.d_lse, row_grads.d_sinks_partial, *optional,
    )  # fmt: skip


@dataclass(frozen=True)
class _BackwardPlan:
    """A backward's prepared launches (prepared.py) and the layouts (_layout) of its workspaces
    that are made afresh for each call: the fused backward's sums (none for two kernels) and the
    shares of the sinks' gradient (None without it)."""

    launches: tuple[prepared.PreparedLaunch, ...]
    sums: tuple[tuple, ...]
    sinks_shares: tuple | None

    @classmethod
    def of(cls, launched, steps, roles: tuple, workspaces: _Workspaces, row_grads: RowGradients, dq):
        """The plan of a backward that launched steps (launched: what each launch returned);
        None where it cannot be replayed (prepared.prepare, or a reset other than the sums' or
        the sinks' shares')."""
        targets = workspaces.targets
        sums = () if targets.dq is dq else (targets.dq, targets.dk, targets.dv)[: 3 if targets.grouped else 1]
        shares = row_grads.d_sinks_partial
        zeroed = []
        for step in steps:
            if step.reset is None:
                cleared = ()
            elif step.reset == targets.zero:
                cleared = sums
            elif step.reset == row_grads.reset:
                cleared = (shares,)
            else:
                return None
            # The roles of the tensors the reset zeros (a role holds one tensor of the call).
            zeroed.append(tuple(next(i for i, role in enumerate(roles) if role is t) for t in cleared))
        launches = prepared.prepare(launched, roles, _PLACEHOLDERS, zeroed)
        if launches is None:
            return None
        layouts = tuple(_layout(t) for t in sums)
        return cls(launches, layouts, None if shares is None else _layout(shares))

    def row_gradients(self, problem: AttentionProblem, d_lse, device) -> RowGradients:
        """A call's RowGradients: its LSE's gradient, and new shares of the sinks' gradient."""
        shares = None if self.sinks_shares is None else _made(self.sinks_shares, device)
        return RowGradients(_lse_grad_stat(problem, d_lse), shares)

    def workspaces(self, problem: AttentionProblem, dq, dk, dv) -> _Workspaces:
        device = dq.device
        sums = [_made(layout, device) for layout in self.sums]
        if not sums:
            targets = GradientTargets(dq, dk, dv, grouped=False)
        elif len(sums) == 1:
            targets = GradientTargets(sums[0], dk, dv, grouped=False)
        else:
            targets = GradientTargets(*sums, grouped=True)
        return _Workspaces(*backward_row_stats(problem, device), targets)


def _layout(tensor: torch.Tensor) -> tuple:
    """What a plan keeps of a workspace: its size, stride and dtype."""
    return tuple(tensor.shape), tensor.stride(), tensor.dtype


def _made(layout: tuple, device) -> torch.Tensor:
    """A new, uninitialized workspace of a layout (_layout)."""
    size, stride, dtype = layout
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


def _caller_bias_grad(d_bias, mods: ScoreMods, mod_tensors: ModTensors):
    if d_bias is None:
        return None
    return score_mods.reduce_bias_grad(d_bias, mods, mod_tensors.bias.dtype)
