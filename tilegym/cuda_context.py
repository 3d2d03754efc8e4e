"""A current CUDA context on whatever thread launches a kernel.

PyTorch runs a backward on its autograd worker threads, which have no current CUDA context
until some library makes one (cuBLAS warns and sets the primary context itself). cuTile's
launch asks the driver for the stream's context first, and without a current one the driver
answers CUDA_ERROR_INVALID_CONTEXT: cuTile recovers, but compute-sanitizer reports the failed
call. So a launch from a thread without a context makes the device's primary context (the one
PyTorch uses) current first, once per thread and device.
"""

import ctypes
import threading
from functools import cache

_made_current = threading.local()


@cache
def _driver():
    driver = ctypes.CDLL("libcuda.so.1")
    for name in ("cuCtxGetCurrent", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent"):
        getattr(driver, name).restype = ctypes.c_int
    return driver


@cache
def _primary_context(device_index: int) -> int:
    """The device's primary context, retained for the life of the process (as PyTorch does)."""
    driver = _driver()
    device, context = ctypes.c_int(), ctypes.c_void_p()
    _check(driver.cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
    _check(driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    return context.value


def ensure_current(device_index: int) -> None:
    """Makes the device's primary context current on this thread if no context is."""
    done = getattr(_made_current, "devices", None)
    if done is None:
        done = _made_current.devices = set()
    if device_index in done:
        return
    driver = _driver()
    current = ctypes.c_void_p()
    _check(driver.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
    if not current.value:
        _check(driver.cuCtxSetCurrent(ctypes.c_void_p(_primary_context(device_index))), "cuCtxSetCurrent")
    done.add(device_index)


def _check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed with CUDA driver error {status}")
