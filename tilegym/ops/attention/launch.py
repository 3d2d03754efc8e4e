"""Host side of attention: argument checks, output allocation, grids and tuned launches."""

import dataclasses
import math
import struct
from dataclasses import dataclass
from functools import cache, lru_cache

import torch

from tilegym import autotune, cuda_context, env, index_width, requirements
from tilegym.ops.attention import configs, score_mods
from tilegym.ops.attention.score_mods import BIAS_NONE, NO_TENSORS, PLAIN, ModTensors, ScoreMods

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MAX_GRID_YZ = 65535
# Kernels add sequence positions, window sides and tile counts in int32: these bounds keep every
# such sum below 2**31 (_check_index_ranges). They are far beyond what fits in GPU memory.
_MAX_SEQLEN_SUM = 2**29
LOG2E = 1.4426950408889634  # also in kernels.py, which this module imports only on launch
_FP32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class AttentionProblem:
    """Validated sizes of one attention call."""

    batch: int
    q_heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: torch.dtype
    softmax_scale: float
    causal: bool
    mods: ScoreMods = PLAIN
    # Some tensor has a size or stride beyond int32: the kernels' int64-indexed twins run.
    wide_index: bool = False

    @property
    def query_group_size(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def is_empty(self) -> bool:
        return self.batch == 0 or self.q_heads == 0 or self.seqlen_q == 0

    def shape_key(self, arch: str) -> str:
        """Calls with equal keys share a tuned config: sequence lengths are rounded up to powers of two."""
        return (
            f"{arch}|{str(self.dtype).removeprefix('torch.')}|d{self.head_dim}|g{self.query_group_size}"
            f"|{'causal' if self.causal else 'full'}|sq{_pow2_ceil(self.seqlen_q)}|sk{_pow2_ceil(self.seqlen_k)}"
            f"{self.mods.key()}{'|int64-index' if self.wide_index else ''}"
        )


@lru_cache(maxsize=4096)
def split_float(x: float) -> tuple[float, float]:
    """x as an fp32 pair (hi, lo) with hi + lo == x to about 48 bits, for fp64 kernels."""
    hi = _to_fp32(x)
    return hi, _to_fp32(x - hi)


def _to_fp32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _pow2_ceil(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must have 4 dimensions [batch, heads, seq_len, head_dim], got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"{name} has dtype {t.dtype}; supported dtypes are {names}")


# Problems of plain calls (no score modifier) that passed every check, by _plain_call_key: a
# training loop repeats a few calls, whose full checks cost the host tens of microseconds.
_checked_plain_calls: dict[tuple, AttentionProblem] = {}
_CHECKED_PLAIN_CALLS_MAX = 1024


def check_inputs(
    q, k, v, scaling, is_causal, attn_bias=None, window_size=None, softcap=None, alibi_slopes=None, bias_grad=None
) -> tuple[AttentionProblem, ModTensors]:
    """Validate everything before any launch; errors name the argument and what was expected.

    bias_grad: whether attn_bias will get a gradient; None reads attn_bias.requires_grad.
    """
    modified = attn_bias is not None or window_size is not None or softcap is not None or alibi_slopes is not None
    key = None if modified else _plain_call_key(q, k, v, scaling, is_causal)
    problem = _checked_plain_calls.get(key) if key is not None else None
    if problem is not None:
        return problem, NO_TENSORS
    problem, mod_tensors = _check_all_inputs(
        q, k, v, scaling, is_causal, attn_bias, window_size, softcap, alibi_slopes, bias_grad
    )
    # Whether a tensor spanning more than 2**31 bytes needs int64 indexing also depends on its
    # address (index_width), which the key leaves out: such calls are checked in full each time.
    if key is not None and not any(index_width.spans_past_int32(t) for t in (q, k, v)):
        if len(_checked_plain_calls) >= _CHECKED_PLAIN_CALLS_MAX:
            _checked_plain_calls.clear()
        _checked_plain_calls[key] = problem
    return problem, mod_tensors


def _plain_call_key(q, k, v, scaling, is_causal) -> tuple | None:
    """Everything the checks of a plain call read, or None where a value's type alone needs the
    full checks (a tensor subclass, a scaling that is not a float, ...)."""
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None
    if type(is_causal) is not bool or not (scaling is None or type(scaling) is float):
        return None
    return (
        q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
        q.device, k.device, v.device, scaling, is_causal,
    )  # fmt: skip


def _check_all_inputs(
    q, k, v, scaling, is_causal, attn_bias, window_size, softcap, alibi_slopes, bias_grad
) -> tuple[AttentionProblem, ModTensors]:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    batch, q_heads, seqlen_q, head_dim = q.shape
    _, kv_heads, seqlen_k, kv_head_dim = k.shape
    if k.shape[0] != batch:
        raise ValueError(f"k and v must have the batch size of q ({batch}), got {k.shape[0]}")
    if kv_head_dim != head_dim:
        raise ValueError(f"k and v must have the head dim of q ({head_dim}), got {kv_head_dim}")
    if head_dim not in configs.HEAD_DIMS:
        raise ValueError(f"head dim {head_dim} is not supported; supported head dims are {configs.HEAD_DIMS}")
    if kv_heads == 0 and q_heads != 0:
        raise ValueError(f"k and v have 0 heads but q has {q_heads}")
    if kv_heads and q_heads % kv_heads:
        raise ValueError(f"q's head count ({q_heads}) must be a multiple of k's and v's ({kv_heads}) for GQA/MQA")
    if batch > _MAX_GRID_YZ or q_heads > _MAX_GRID_YZ:
        raise ValueError(f"batch ({batch}) and heads ({q_heads}) must each be at most {_MAX_GRID_YZ}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if scaling is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
        raise TypeError(f"scaling must be a float or None, got {type(scaling).__name__}")
    else:
        softmax_scale = score_mods.as_float(scaling)
        if not math.isfinite(softmax_scale) or abs(softmax_scale) * LOG2E > _FP32_MAX:
            raise ValueError(f"scaling must be finite and within the float32 range, got {scaling}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cuda":
            raise ValueError(f"{name} must be a CUDA tensor, got a tensor on {t.device}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got q on {q.device}, k on {k.device}, v on {v.device}")
    window, causal = score_mods.check_window(window_size, is_causal, seqlen_q, seqlen_k)
    bias_mode, bias = score_mods.check_bias(attn_bias, q, seqlen_k, q_heads, bias_grad)
    slopes = score_mods.check_alibi(alibi_slopes, q, q_heads)
    mods = ScoreMods(
        bias_mode=bias_mode,
        bias_shape=None if attn_bias is None else tuple(attn_bias.shape),
        window=window,
        softcap=score_mods.check_softcap(softcap, softmax_scale),
        alibi=slopes is not None,
    )
    _check_index_ranges(q_heads, seqlen_q, seqlen_k)
    sizes = (batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim)
    wide_index = any(index_width.needs_int64(t) for t in (q, k, v, bias) if t is not None)
    bias_size = 0 if bias is None else bias.element_size()
    wide_index = wide_index or _allocations_need_int64(*sizes, q.dtype.itemsize, bias_size, bias_mode)
    problem = AttentionProblem(
        batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim, q.dtype, softmax_scale, causal, mods, wide_index
    )  # fmt: skip
    return problem, ModTensors(bias, slopes)


def _check_index_ranges(q_heads: int, seqlen_q: int, seqlen_k: int) -> None:
    """Refuses sizes whose int32 position arithmetic in the kernels could overflow: positions
    plus window reaches (up to about 2 (Sq + Sk)) and program numbers (tiles times heads)."""
    if seqlen_q + seqlen_k > _MAX_SEQLEN_SUM:
        raise ValueError(f"seqlen_q + seqlen_k is {seqlen_q + seqlen_k}; at most 2**29 are supported (int32 positions)")
    if q_heads * (seqlen_q + seqlen_k) > index_width.INT32_MAX:
        raise ValueError(
            f"heads * (seqlen_q + seqlen_k) is {q_heads * (seqlen_q + seqlen_k)}; "
            "at most 2**31 - 1 are supported (int32 program numbers)"
        )


def _allocations_need_int64(*sizes) -> bool:
    """Whether a tensor a call allocates needs the int64-indexed kernels (_allocation_shapes_need_int64).
    Cached for int sizes, since calls with score modifiers are checked in full every time;
    symbolic sizes (torch.compile's fake tensors) cannot be cached and are computed each time."""
    if all(type(size) is int for size in sizes):
        return _cached_allocations_need_int64(*sizes)
    return _allocation_shapes_need_int64(*sizes)


def _allocation_shapes_need_int64(
    batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim, itemsize, bias_size, bias_mode
):
    """Whether a tensor a call allocates needs the int64-indexed kernels (index_width): out and
    dQ, dK and dV, the row statistics, the dBias workspace (fp32 or the bias's dtype, bias_size
    bytes; 0: no bias) and the fused backward's fp32 sums over rows padded to whole tiles of any
    config."""
    stat_size = 8 if itemsize == 8 else 4
    padded = configs.MAX_BLOCK
    tile = configs.head_dim_tile(head_dim)
    shapes = [
        ((batch, q_heads, seqlen_q, head_dim), itemsize),
        ((batch, kv_heads, seqlen_k, head_dim), itemsize),
        ((batch, q_heads, seqlen_q), stat_size),
        ((batch, q_heads, seqlen_q + padded, tile), 4),
        ((batch, kv_heads, seqlen_k + padded, tile), 4),
    ]
    if bias_size:
        rows = 1 if bias_mode == score_mods.BIAS_ONE_ROW else seqlen_q
        shapes += [((batch, q_heads, rows, seqlen_k), size) for size in {bias_size, stat_size}]
    return any(index_width.contiguous_needs_int64(shape, size) for shape, size in shapes)


_cached_allocations_need_int64 = lru_cache(maxsize=1024)(_allocation_shapes_need_int64)


def addressable(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself when its head dim is unit-stride (any other strides are fine), else one copy.

    A [B, S, H, D] tensor viewed as [B, H, S, D] by transpose is used as is.
    """
    if t.stride(-1) == 1 or t.shape[-1] == 1:
        return t
    return t.contiguous()


def row_stat(problem: AttentionProblem, device) -> torch.Tensor:
    """An uninitialized [B, Hq, Sq] row statistic (the LSE, Delta): fp64 for fp64 inputs, else fp32."""
    dtype = torch.float64 if problem.dtype == torch.float64 else torch.float32
    return torch.empty((problem.batch, problem.q_heads, problem.seqlen_q), dtype=dtype, device=device)


@cache
def _device_facts(device_index: int) -> tuple[str, str, str]:
    """(GPU name, arch family, cuda-tile version), once the device passed requirements.check."""
    requirements.check(device_index)
    import cuda.tile as ct

    props = torch.cuda.get_device_properties(device_index)
    return props.name, configs.arch_family((props.major, props.minor)), ct.__version__


@lru_cache(maxsize=1024)
def _launch_facts(problem: AttentionProblem, device_index: int) -> tuple[str, str, str, str]:
    """(GPU name, arch family, cuda-tile version, shape key): once per problem and device."""
    device_name, arch, cutile_version = _device_facts(device_index)
    return device_name, arch, cutile_version, problem.shape_key(arch)


def _stream_handle_by_accelerator(device_index: int | None) -> int:
    return torch.accelerator.current_stream(device_index).native_handle


def _stream_handle_by_cuda_stream(device_index: int | None) -> int:
    return torch.cuda.current_stream(device_index).cuda_stream


# ct.launch takes a stream's handle as well as a torch stream; a torch.cuda.Stream object costs
# about 6 us of host time to make, torch.accelerator's generic one about 1.5 (torch >= 2.6).
current_stream_handle = (
    _stream_handle_by_accelerator
    if hasattr(torch, "accelerator") and hasattr(torch.Stream, "native_handle")
    else _stream_handle_by_cuda_stream
)


class _Launcher:
    """Launches one attention kernel with the config chosen for the problem's shape."""

    def __init__(self, problem: AttentionProblem, device: torch.device):
        cuda_context.ensure_current(device.index or 0)  # the autograd thread may have none
        self.problem = problem
        self.device_name, self.arch, cutile_version, self.shape_key = _launch_facts(problem, device.index or 0)
        self.cache = autotune.tune_cache(self.device_name, cutile_version)
        self.stream = current_stream_handle(device.index)

    def candidates(self, kernel_name: str):
        forced = autotune.forced_candidates(kernel_name)
        if forced is not None:
            return forced
        problem = self.problem
        modified = problem.mods != PLAIN
        return configs.candidates(kernel_name, self.arch, problem.head_dim, problem.dtype.itemsize, modified)

    def kernel(self, kernel):
        """The kernel, or its int64-indexed twin where the problem has a size or stride past int32."""
        return index_width.wide(kernel) if self.problem.wide_index else kernel

    def launch(self, launch: autotune.TunedKernel) -> None:
        autotune.launch_tuned(launch, self.candidates(launch.name), self.shape_key, self.cache, self.stream)

    def compile_ahead(self, launch: autotune.TunedKernel) -> None:
        autotune.compile_ahead(launch, self.candidates(launch.name), self.shape_key, self.cache)


def _sequence_tile_grid(rows: torch.Tensor, seqlen: int, block: str):
    """(sequence tiles, heads, batch) of a [B, H, S, ...] tensor, tiles of config.<block> rows."""
    return lambda config: (math.ceil(seqlen / getattr(config, block)), rows.shape[1], rows.shape[0])


class _ModArgs:
    """The score modifiers' kernel arguments: runtime values and compile-time switches."""

    def __init__(self, problem: AttentionProblem, tensors: ModTensors, placeholder: torch.Tensor):
        mods = problem.mods
        self.bias = placeholder if tensors.bias is None else tensors.bias
        self.slopes = _placeholder_slopes(placeholder.device) if tensors.slopes is None else tensors.slopes
        cap = mods.softcap or 1.0
        # Unbounded window sides become a reach past either end of the sequences.
        reach = problem.seqlen_q + problem.seqlen_k
        left, right = (reach if side < 0 else side for side in (mods.window or (-1, -1)))
        self.values = (*split_float(problem.softmax_scale / cap), *split_float(cap), left, right)
        self.switches = (mods.window is not None, bool(mods.softcap), mods.bias_mode, mods.alibi)
        self.kernel_causal = problem.causal and mods.window is None


@cache
def _placeholder_slopes(device: torch.device) -> torch.Tensor:
    return torch.zeros((1, 1), dtype=torch.float32, device=device)


def _positive_scale(q: torch.Tensor, problem: AttentionProblem) -> tuple[torch.Tensor, float]:
    """(q, scale) giving the same scores with scale > 0, which the plain forward kernels need
    (they scale inside exp2, kernels._forward_keeps_raw_scores): s * q.k = -s * (-q).k, and
    0 * q.k = 1 * (0 q).k. Both are exact; only a non-positive scale pays for a copy of q."""
    scale = problem.softmax_scale
    if scale > 0 or problem.mods.changes_scores:
        return q, scale
    if scale < 0:
        return -q, -scale
    return q * 0, 1.0


def forward(q, k, v, problem: AttentionProblem, with_lse: bool, out=None, lse=None, mod_tensors=NO_TENSORS):
    """out (and lse when with_lse) of validated inputs.

    out and lse may be given (contiguous, right shape and dtype) to be written in place.
    """
    from tilegym.ops.attention import kernels

    q, k, v = addressable(q), addressable(k), addressable(v)
    device = q.device
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if lse is None and with_lse:
        lse = row_stat(problem, device)
    if problem.is_empty:
        return out, lse
    if problem.seqlen_k == 0:  # no key to attend to: every row is empty
        out.zero_()
        if lse is not None:
            lse.fill_(-math.inf)
        return out, lse

    head_tile = configs.head_dim_tile(problem.head_dim)
    q, softmax_scale = _positive_scale(q, problem)
    qk_scale_log2 = split_float(softmax_scale * LOG2E)
    group = problem.query_group_size
    launcher = _Launcher(problem, device)
    fixed_max = _fixed_max_forward(problem, launcher)
    if with_lse:
        name = configs.FORWARD_LSE_FIXED_MAX if fixed_max else configs.FORWARD_LSE
        kernel = launcher.kernel(kernels.attention_forward_lse_kernel)
        outputs = (out, lse)
    else:
        name = configs.FORWARD_FIXED_MAX if fixed_max else configs.FORWARD
        kernel = launcher.kernel(kernels.attention_forward_kernel)
        outputs = (out,)

    mods = _ModArgs(problem, mod_tensors, q)

    def args(config):
        return (
            q, k, v, *outputs, *qk_scale_log2, group, mods.bias, mods.slopes, *mods.values,
            config.block_m, config.block_n, head_tile, mods.kernel_causal, *mods.switches, fixed_max,
        )  # fmt: skip

    launcher.launch(autotune.TunedKernel(name, kernel, _sequence_tile_grid(q, problem.seqlen_q, "block_m"), args))
    return out, lse


def _fixed_max_forward(problem: AttentionProblem, launcher: "_Launcher") -> bool:
    """Whether the forward keeps a fixed row max per query tile (kernels._forward_key_loops):
    plain attention with enough keys per query for it to win, where the arch has a table for it
    (16-bit inputs; fp32 and fp64 keep the running max). Not with int64 indexing: that twin of
    the fixed-max kernel compiles to a 1.7 MB cubin, where the running-max one is ordinary."""
    if problem.mods != PLAIN or problem.wide_index or not launcher.candidates(configs.FORWARD_FIXED_MAX):
        return False
    min_keys = configs.FIXED_MAX_FORWARD_MIN_MEAN_KEYS[configs.head_dim_tile(problem.head_dim)]
    return mean_keys_per_query(problem) >= min_keys


def mean_keys_per_query(problem: AttentionProblem) -> float:
    """Keys a query row attends to, on average; causal rows are aligned at the bottom right, so
    the last min(seqlen_q, seqlen_k) rows see seqlen_k - seen + 1 up to seqlen_k keys."""
    if not problem.causal:
        return problem.seqlen_k
    seen = min(problem.seqlen_q, problem.seqlen_k)
    return seen * (2 * problem.seqlen_k - seen + 1) / 2 / problem.seqlen_q


def backward(d_out, q, k, v, out, lse, problem: AttentionProblem, grads=None, mod_tensors=NO_TENSORS, bias_grad=False):
    """(dq, dk, dv, d_bias) of validated inputs, given the forward's out and lse.

    grads, a (dq, dk, dv) of contiguous tensors, may be given to be written in place.
    d_bias (with bias_grad) is the gradient of the caller's attn_bias, else None.
    """
    dq, dk, dv, d_bias = _gradients(q, k, v, problem, grads, mod_tensors, bias_grad)
    if not problem.wide_index and index_width.needs_int64(d_out):
        problem = dataclasses.replace(problem, wide_index=True)
    if _backward_is_empty(problem):
        for gradient in (dq, dk, dv, d_bias):
            if gradient is not None:
                gradient.zero_()
        return dq, dk, dv, _caller_bias_grad(d_bias, problem.mods, mod_tensors)
    launcher = _Launcher(problem, q.device)
    steps, targets = _backward_steps(launcher, d_out, q, k, v, out, lse, dq, dk, dv, d_bias, mod_tensors)
    # Everything is prepared before the first launch: host work between launches would leave
    # the GPU idle after a short one.
    for step in steps:
        launcher.launch(step)
    if targets.dq is not dq:  # the fused backward summed into fp32 targets
        targets.copy_to(dq, dk, dv, problem)
    return dq, dk, dv, _caller_bias_grad(d_bias, problem.mods, mod_tensors)


_compiled_ahead: set[tuple] = set()


def compile_backward_ahead(q, k, v, problem: AttentionProblem, mod_tensors=NO_TENSORS, bias_grad=False) -> None:
    """Starts compiling, in background threads, the kernels backward() will launch for this
    problem (autotune.compile_ahead), once per problem: the training forward calls it first, so
    that the backward's compiles run alongside its own. Its tensors are stand-ins shaped and
    laid out like the backward's (a contiguous out and d_out), dropped on return; where they do
    not fit in memory, nothing is started."""
    key = (problem, q.device, bias_grad)
    if key in _compiled_ahead or _backward_is_empty(problem):
        return
    _compiled_ahead.add(key)
    launcher = _Launcher(problem, q.device)
    try:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = row_stat(problem, q.device)
        dq, dk, dv, d_bias = _gradients(q, k, v, problem, None, mod_tensors, bias_grad)
        steps, _ = _backward_steps(launcher, out, q, k, v, out, lse, dq, dk, dv, d_bias, mod_tensors)
    except torch.cuda.OutOfMemoryError:
        return
    for step in steps:
        launcher.compile_ahead(step)


def _backward_is_empty(problem: AttentionProblem) -> bool:
    return problem.is_empty or problem.seqlen_k == 0 or problem.kv_heads == 0


def _gradients(q, k, v, problem: AttentionProblem, grads, mod_tensors: ModTensors, bias_grad: bool):
    """(dq, dk, dv, d_bias) to write: grads or new tensors; d_bias None without a bias gradient."""
    if grads is None:
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
        dtype = torch.float64 if problem.dtype == torch.float64 else torch.float32
    # Zeros where a mask or window skips tiles, which the kernel never writes.
    skips_tiles = mods.bias_mode == score_mods.BIAS_PER_ROW and (problem.causal or mods.window is not None)
    d_bias = (torch.zeros if skips_tiles else torch.empty)(shape, dtype=dtype, device=q.device)
    return (*grads, d_bias)


def _backward_steps(launcher: "_Launcher", d_out, q, k, v, out, lse, dq, dk, dv, d_bias, mod_tensors):
    """The backward's launches, in order, and where they write dQ, dK and dV."""
    from tilegym.ops.attention import kernels

    problem = launcher.problem
    mods = problem.mods
    q, k, v, out, d_out = (addressable(t) for t in (q, k, v, out, d_out))
    head_tile = configs.head_dim_tile(problem.head_dim)
    scale = split_float(problem.softmax_scale)
    qk_scale_log2 = split_float(problem.softmax_scale * LOG2E)
    group = problem.query_group_size
    device = q.device

    delta, lse_base2 = row_stat(problem, device), row_stat(problem, device)
    fused = _fused_backward(problem, launcher, d_bias is not None)
    # The fused backward sums dQ in fp32, over rows padded to whole tiles of every candidate;
    # the grouped one also dK and dV, so that a group's heads run in separate programs.
    targets = _fused_targets(problem, launcher, fused, dk, dv) if fused else GradientTargets(dq, dk, dv, False)
    mod_args = _ModArgs(problem, mod_tensors, q)
    bias_grad_mode = BIAS_NONE if d_bias is None else mods.bias_mode

    def arguments(inputs, gradients, extra_arrays=(), extra_switches=()):
        """Arguments of the dK/dV and dQ kernels, which differ in what they read and write."""
        middle = (*scale, *qk_scale_log2, group, mod_args.bias, mod_args.slopes, *extra_arrays, *mod_args.values)
        switches = (mod_args.kernel_causal, *mod_args.switches, *extra_switches)
        return lambda config: (*inputs, *gradients, *middle, config.block_m, config.block_n, head_tile, *switches)

    query_tiles = _sequence_tile_grid(q, problem.seqlen_q, "block_m")
    # A grouped fused backward runs a program per query head and key tile.
    key_tiles = _sequence_tile_grid(q if targets.grouped else k, problem.seqlen_k, "block_n")
    # Without fusion the dK/dV kernel's DQSum is an unused placeholder.
    dkdv_gradients = (targets.dk, targets.dv, targets.dq if fused else q)
    switches = (bias_grad_mode, fused is not None, targets.grouped)
    dkdv_args = arguments(
        (q, k, v, d_out, lse_base2, delta), dkdv_gradients, (q if d_bias is None else d_bias,), switches
    )
    if fused:
        # Every dK/dV program needs the row statistics of every query tile: a kernel of their own.
        preprocess = autotune.TunedKernel(
            configs.BACKWARD_PREPROCESS,
            launcher.kernel(kernels.attention_backward_preprocess_kernel),
            query_tiles,
            lambda config: (out, d_out, lse, delta, lse_base2, config.block_m, head_tile),
        )
        dkdv_dq = autotune.TunedKernel(
            fused, launcher.kernel(kernels.attention_backward_dkdv_kernel), key_tiles, dkdv_args, targets.zero
        )
        return (preprocess, dkdv_dq), targets
    # Two kernels: the dQ kernel writes the row statistics of its query tile, so it runs first.
    dq_step = autotune.TunedKernel(
        configs.BACKWARD_DQ,
        launcher.kernel(kernels.attention_backward_dq_kernel),
        query_tiles,
        arguments((q, k, v, d_out, out, lse, lse_base2, delta), (targets.dq,)),
    )
    dkdv_kernel = launcher.kernel(kernels.attention_backward_dkdv_kernel)
    dkdv = autotune.TunedKernel(configs.BACKWARD_DKDV, dkdv_kernel, key_tiles, dkdv_args)
    return (dq_step, dkdv), targets


_BACKWARD_CHOICES = ("auto", "fused", "two-kernel")


def backward_choice() -> str:
    """TILEGYM_BACKWARD: auto (default), fused or two-kernel; anything else is a ValueError."""
    return env.choice("TILEGYM_BACKWARD", _BACKWARD_CHOICES, "auto")


def _fused_backward(problem: AttentionProblem, launcher: "_Launcher", bias_grad: bool) -> str | None:
    """The fused backward's kernel name (dQ summed by the dK/dV kernel), or None for two kernels.

    Fused only for plain attention where the arch has a fused table, never under
    torch.use_deterministic_algorithms (the order of the fp32 sums varies between runs);
    "auto" also needs enough keys for it to win (configs.FUSED_BACKWARD_MIN_SEQLEN_K).
    Causal grouped-query attention takes the grouped form: a program per query head.
    """
    choice = backward_choice()
    if choice == "two-kernel" or torch.are_deterministic_algorithms_enabled():
        return None
    grouped = problem.causal and problem.query_group_size > 1
    name = configs.BACKWARD_FUSED_GROUPED if grouped else configs.BACKWARD_FUSED
    if problem.mods != PLAIN or bias_grad or not launcher.candidates(name):
        return None
    if choice == "fused" or problem.seqlen_k >= configs.FUSED_BACKWARD_MIN_SEQLEN_K:
        return name
    return None


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

    def copy_to(self, dq, dk, dv, problem: AttentionProblem) -> None:
        dq.copy_(self.dq[:, :, : problem.seqlen_q, : problem.head_dim])
        if self.grouped:
            dk.copy_(self.dk[:, :, : problem.seqlen_k, : problem.head_dim])
            dv.copy_(self.dv[:, :, : problem.seqlen_k, : problem.head_dim])


def _fused_targets(problem: AttentionProblem, launcher: "_Launcher", name: str, dk, dv) -> GradientTargets:
    candidates = launcher.candidates(name)
    head_tile = configs.head_dim_tile(problem.head_dim)

    def padded_sum(heads, seqlen, block):
        rows = max(getattr(config, block) for config in candidates)
        shape = (problem.batch, heads, math.ceil(seqlen / rows) * rows, head_tile)
        return torch.empty(shape, dtype=torch.float32, device=dk.device)

    dq_sum = padded_sum(problem.q_heads, problem.seqlen_q, "block_m")
    if name != configs.BACKWARD_FUSED_GROUPED:
        return GradientTargets(dq_sum, dk, dv, grouped=False)
    dk_sum, dv_sum = (padded_sum(problem.kv_heads, problem.seqlen_k, "block_n") for _ in range(2))
    return GradientTargets(dq_sum, dk_sum, dv_sum, grouped=True)


def _caller_bias_grad(d_bias, mods: ScoreMods, mod_tensors: ModTensors):
    if d_bias is None:
        return None
    return score_mods.reduce_bias_grad(d_bias, mods, mod_tensors.bias.dtype)
