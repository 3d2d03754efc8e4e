"""What launching a tuned cuTile kernel from PyTorch takes, whatever the operator: arguments
built by parameter name (NamedArguments), float arguments split for fp64 kernels, the current
stream's handle, tensors the kernels can address, the GPU's facts, and a launcher that tunes on
first use.
"""

import inspect
import operator
import struct
from functools import cache, lru_cache

import torch

from tilegym import autotune, cuda_context, requirements


@lru_cache(maxsize=4096)
def split_float(x: float) -> tuple[float, float]:
    """x as an fp32 pair (hi, lo) with hi + lo == x to about 48 bits: float kernel arguments
    arrive as fp32, and fp64 kernels rebuild x from both (a kernel's `name` and `name_lo`)."""
    hi = _to_fp32(x)
    return hi, _to_fp32(x - hi)


def _to_fp32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def split_arguments(**values: float) -> dict[str, float]:
    """{name: hi, name_lo: lo} for each float (split_float)."""
    split = {}
    for name, value in values.items():
        split[name], split[f"{name}_lo"] = split_float(value)
    return split


def pow2_ceil(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@cache
def parameter_names(kernel) -> tuple[str, ...]:
    """A kernel's parameters in order (its Python function's, for the int64 twin too)."""
    return tuple(inspect.signature(kernel._pyfunc).parameters)


class NamedArguments:
    """A kernel's arguments by name, checked and put in parameter order once; the parameters
    named in `late` (a launch's tile sizes, say) are given at each call. A name the kernel
    lacks, or one of its parameters left out, is a TypeError."""

    def __init__(self, kernel, values: dict, late: tuple[str, ...] = ()):
        getter, late_positions, count = _layout(kernel, late)
        try:
            if len(values) != count:
                raise KeyError
            self._base = list(getter(values))
        except KeyError:
            names = parameter_names(kernel)
            missing = [name for name in names if name not in values and name not in late]
            unknown = [name for name in values if name not in names]
            raise TypeError(
                f"{kernel._pyfunc.__name__}: missing arguments {missing}, unknown arguments {unknown}"
            ) from None
        self._late = late_positions

    def __call__(self, **late_values) -> tuple:
        arguments = self._base.copy()
        for position, name in self._late:
            arguments.insert(position, late_values[name])
        return tuple(arguments)


@cache
def _layout(kernel, late: tuple[str, ...]):
    """(a getter of the early arguments in order, (position, name) of each late one in
    ascending order, how many early ones there are): built once per kernel; the launch path
    asks for it at every call."""
    names = parameter_names(kernel)
    early = [name for name in names if name not in late]
    late_positions = tuple((position, name) for position, name in enumerate(names) if name in late)
    if len(early) == 1:
        only = early[0]
        return (lambda values: (values[only],)), late_positions, 1
    return operator.itemgetter(*early), late_positions, len(early)


def addressable(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself when its last dim is unit-stride (any other strides are fine), else one copy.

    A [B, S, H, D] tensor viewed as [B, H, S, D] by transpose is used as is.
    """
    if t.stride(-1) == 1 or t.shape[-1] == 1:
        return t
    return t.contiguous()


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


def arch_family(compute_capability: tuple[int, int]) -> str:
    """The config tables a GPU uses: its own arch, or the closest older one that has tables."""
    major, _ = compute_capability
    if major >= 12:
        return "sm_120"
    if major >= 10:
        return "sm_100"
    if major == 9:
        return "sm_90"
    return "sm_80"


@cache
def device_facts(device_index: int) -> tuple[str, str, str]:
    """(GPU name, arch family, cuda-tile version), once the device passed requirements.check."""
    requirements.check(device_index)
    import cuda.tile as ct

    props = torch.cuda.get_device_properties(device_index)
    return props.name, arch_family((props.major, props.minor)), ct.__version__


class TunedLauncher:
    """Launches kernels of one call on the current stream with the config tuned for its shape
    key; subclasses say which configs a kernel may take (candidates)."""

    def __init__(self, device: torch.device, shape_key_of_arch):
        index = device.index or 0
        cuda_context.ensure_current(index)  # the autograd thread may have none
        self.device_name, self.arch, cutile_version = device_facts(index)
        self.shape_key = shape_key_of_arch(self.arch)
        self.cache = autotune.tune_cache(self.device_name, cutile_version)
        self.stream = current_stream_handle(device.index)

    def candidates(self, kernel_name: str) -> tuple[autotune.TileConfig, ...]:
        raise NotImplementedError

    def launch(self, launch: autotune.TunedKernel) -> autotune.Launched:
        return autotune.launch_tuned(launch, self.candidates(launch.name), self.shape_key, self.cache, self.stream)

    def compile_ahead(self, launch: autotune.TunedKernel) -> None:
        autotune.compile_ahead(launch, self.candidates(launch.name), self.shape_key, self.cache)
