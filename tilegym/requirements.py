"""What a machine needs to run the kernels, checked once per device at first use.

A missing piece otherwise surfaces deep inside PyTorch, cuTile or the driver (an assertion that
torch was not compiled with CUDA, a compiler that is not found, a launch that fails). Here each
gives one error that says what to install.
"""

import importlib.util
import os
import shutil
from functools import cache

# cuTile needs the CUDA 13 driver API, which drivers from r580 on provide.
MIN_DRIVER_VERSION = 13000
MIN_DRIVER_NAME = "r580"
# The oldest architecture with config tables (ops/attention/configs.py); measured on Hopper.
MIN_COMPUTE_CAPABILITY = (8, 0)
_INSTALL = 'pip install -e ".[tileiras]" from the project root (see the README)'


class RequirementError(RuntimeError):
    """This machine lacks something the kernels need; the message says what to install."""


def tileiras_paths(search_path: str | None = None, cuda_home: str | None = None) -> list[str]:
    """Every tileiras (cuTile's compiler) cuTile may run: its pip package's, PATH's, CUDA_HOME's.

    Found without importing cuTile's compiler module, whose import alone costs a first call a
    few tenths of a second.
    """
    search_path = os.environ.get("PATH", "") if search_path is None else search_path
    cuda_home = os.environ.get("CUDA_HOME", "") if cuda_home is None else cuda_home
    try:
        package = importlib.util.find_spec("nvidia.cu13")
        roots = list(package.submodule_search_locations or ()) if package else []
    except ImportError:
        roots = []
    candidates = [os.path.join(root, "bin", "tileiras") for root in roots]
    candidates += [shutil.which("tileiras", path=search_path) or "", os.path.join(cuda_home, "bin", "tileiras")]
    return [path for path in candidates if os.path.isfile(path)]


@cache
def check(device_index: int) -> None:
    """Raises RequirementError unless device_index is a usable GPU with a recent enough driver
    and the compiler is installed; once per device."""
    import torch

    if not torch.cuda.is_available():
        built = "a CPU-only build of PyTorch" if torch.version.cuda is None else "no visible CUDA GPU"
        raise RequirementError(
            f"tilegym runs on an NVIDIA GPU (compute capability {_capability(MIN_COMPUTE_CAPABILITY)} or later, "
            f"driver {MIN_DRIVER_NAME} or later) with a CUDA build of PyTorch; this machine has {built}"
        )
    capability = torch.cuda.get_device_capability(device_index)
    if capability < MIN_COMPUTE_CAPABILITY:
        name = torch.cuda.get_device_name(device_index)
        raise RequirementError(
            f"{name} has compute capability {_capability(capability)}; tilegym needs "
            f"{_capability(MIN_COMPUTE_CAPABILITY)} or later (Ampere, Hopper, Blackwell)"
        )
    version = driver_version()
    if version < MIN_DRIVER_VERSION:
        raise RequirementError(
            f"the NVIDIA driver supports CUDA {version // 1000}.{version % 1000 // 10}; cuTile needs CUDA 13.0, "
            f"a driver {MIN_DRIVER_NAME} or later: update the driver"
        )
    if not tileiras_paths():
        raise RequirementError(f"cuTile's compiler (tileiras) is not installed: {_INSTALL}")


def driver_version() -> int:
    """The CUDA version the installed driver supports, as 1000 * major + 10 * minor."""
    from cuda.bindings import driver

    error, version = driver.cuDriverGetVersion()
    if error != driver.CUresult.CUDA_SUCCESS:
        raise RequirementError(f"the CUDA driver could not be queried ({error.name}): is an NVIDIA driver installed?")
    return version


def _capability(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"
