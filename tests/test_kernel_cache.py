"""The compiled-kernel cache: a hit skips cuTile's compile, a miss fills it, keys tell configs apart.

Runs on a machine without a GPU: the kernels are compiled for sm_90 ahead of time.
"""

import os

import cuda.tile as ct
import pytest
from cuda.tile._cext import default_tile_context
from cuda.tile.compilation import CallingConvention, KernelSignature

from tests.ops import aot
from tilegym import kernel_cache
from tilegym.kernel_cache import CachedKernel

SM_90 = (9, 0)


@CachedKernel
def _doubling_kernel(X, Y, block: ct.Constant[int]):
    tile = ct.load(X, index=(ct.bid(0),), shape=(block,))
    ct.store(Y, index=(ct.bid(0),), tile=tile * 2)


def _signature(block: int = 64, dtype=ct.float32) -> KernelSignature:
    array = aot._array(dtype, 1)
    return KernelSignature((array, array, block), CallingConvention.cutile_python_v2())


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEGYM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TILEGYM_KERNEL_CACHE", raising=False)
    return tmp_path / "kernels"


@pytest.fixture
def cutile_compiles(monkeypatch):
    """Counts the compiles that reach cuTile (cache misses)."""
    calls = []
    compile_in_cutile = ct.kernel._compile

    def counting(self, *args, **kwargs):
        calls.append(args[0])
        return compile_in_cutile(self, *args, **kwargs)

    monkeypatch.setattr(ct.kernel, "_compile", counting)
    return calls


def _compile(kernel, signature):
    return kernel._compile(signature, default_tile_context, SM_90)


def test_hit_returns_the_stored_kernel_without_compiling(cache_dir, cutile_compiles):
    first = _compile(_doubling_kernel, _signature())
    assert len(cutile_compiles) == 1 and len(list(cache_dir.glob("*.cubin"))) == 1
    again = _compile(_doubling_kernel, _signature())
    assert len(cutile_compiles) == 1, "a cache hit still compiled"
    assert again[:2] == first[:2]  # cubin and symbol
    assert first[0][:4] == b"\x7fELF"


def test_signature_and_hints_have_their_own_entries(cache_dir, cutile_compiles):
    variants = [
        (_doubling_kernel, _signature(64)),
        (_doubling_kernel, _signature(128)),
        (_doubling_kernel, _signature(64, ct.float16)),
        (_doubling_kernel.replace_hints(occupancy=2), _signature(64)),
    ]
    cubins = {_compile(kernel, signature)[0] for kernel, signature in variants}
    assert isinstance(variants[-1][0], CachedKernel)
    assert len(cutile_compiles) == len(variants)
    assert len(list(cache_dir.glob("*.cubin"))) == len(variants)
    assert len(cubins) == len(variants)


def test_turned_off_by_the_environment(cache_dir, cutile_compiles, monkeypatch):
    monkeypatch.setenv("TILEGYM_KERNEL_CACHE", "0")
    for _ in range(2):
        _compile(_doubling_kernel, _signature())
    assert len(cutile_compiles) == 2
    assert not cache_dir.exists()


def test_a_damaged_entry_is_compiled_again(cache_dir, cutile_compiles):
    compiled = _compile(_doubling_kernel, _signature())
    [entry] = cache_dir.glob("*.cubin")
    entry.write_bytes(b"no symbol line")
    assert _compile(_doubling_kernel, _signature())[:2] == compiled[:2]
    assert len(cutile_compiles) == 2
    assert entry.read_bytes().endswith(compiled[0])


def test_least_recently_used_entries_are_evicted(cache_dir, cutile_compiles, monkeypatch):
    monkeypatch.setattr(kernel_cache, "_MAX_ENTRIES", 2)
    for age, block in enumerate((16, 32, 64)):
        before = set(cache_dir.glob("*.cubin"))
        _compile(_doubling_kernel, _signature(block))
        for entry in set(cache_dir.glob("*.cubin")) - before:  # distinct use times, oldest first
            os.utime(entry, (1e9 + age, 1e9 + age))
    assert len(list(cache_dir.glob("*.cubin"))) == 2
    _compile(_doubling_kernel, _signature(16))  # the evicted one compiles again
    assert len(cutile_compiles) == 4
