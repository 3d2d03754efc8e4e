"""cuda_context without a GPU: a fake driver stands in for libcuda."""

import ctypes

import pytest

from tilegym import cuda_context


class _FakeDriver:
    """Records calls; a context is current once cuCtxSetCurrent set one."""

    def __init__(self, current=0):
        self.current = current
        self.calls = []

    def cuCtxGetCurrent(self, pointer):
        self.calls.append("get")
        pointer._obj.value = self.current or None
        return 0

    def cuDeviceGet(self, pointer, index):
        pointer._obj.value = index
        return 0

    def cuDevicePrimaryCtxRetain(self, pointer, device):
        self.calls.append(f"retain {device.value}")
        pointer._obj.value = 0x1000 + device.value
        return 0

    def cuCtxSetCurrent(self, context):
        self.calls.append(f"set {context.value:#x}")
        self.current = context.value
        return 0


@pytest.fixture
def driver(monkeypatch):
    fake = _FakeDriver()
    monkeypatch.setattr(cuda_context, "_driver", lambda: fake)
    monkeypatch.setattr(cuda_context, "_made_current", __import__("threading").local())
    cuda_context._primary_context.cache_clear()
    yield fake
    cuda_context._primary_context.cache_clear()


def test_a_thread_without_a_context_gets_the_primary_one_once(driver):
    cuda_context.ensure_current(1)
    cuda_context.ensure_current(1)
    assert driver.calls == ["get", "retain 1", "set 0x1001"]


def test_a_current_context_is_left_alone(driver):
    driver.current = 0x2000
    cuda_context.ensure_current(0)
    assert driver.calls == ["get"] and driver.current == 0x2000


def test_each_thread_checks_its_own(driver):
    import threading

    cuda_context.ensure_current(0)
    driver.current = 0  # a new thread starts without a context
    worker = threading.Thread(target=cuda_context.ensure_current, args=(0,))
    worker.start()
    worker.join()
    assert driver.calls.count("get") == 2 and driver.calls.count("retain 0") == 1


def test_a_failed_driver_call_names_it(driver, monkeypatch):
    monkeypatch.setattr(driver, "cuCtxGetCurrent", lambda pointer: 201)
    with pytest.raises(RuntimeError, match="cuCtxGetCurrent failed with CUDA driver error 201"):
        cuda_context.ensure_current(0)


def test_byref_fakes_match_ctypes():
    value = ctypes.c_void_p()
    ctypes.byref(value)._obj.value = 5
    assert value.value == 5
