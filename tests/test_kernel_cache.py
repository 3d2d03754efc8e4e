"""The compiled-kernel cache: a hit skips cuTile's compile, a miss fills it, keys tell configs
apart, a damaged entry is compiled again; a compile started ahead is what the launch gets,
compiles run side by side, and exit does not wait for the queued ones.

Runs on a machine without a GPU: the kernels are compiled for sm_90 ahead of time.
"""

import os
import subprocess
import sys
import threading
import time

import cuda.tile as ct
import cuda.tile._compile as cutile_compile
import pytest
from cuda.tile._cext import default_tile_context
from cuda.tile.compilation import CallingConvention, KernelSignature

from tests.ops import sass
from tilegym import kernel_cache
from tilegym.kernel_cache import CachedKernel

SM_90 = (9, 0)


@CachedKernel
def _doubling_kernel(X, Y, block: ct.Constant[int]):
    tile = ct.load(X, index=(ct.bid(0),), shape=(block,))
    ct.store(Y, index=(ct.bid(0),), tile=tile * 2)


def _signature(block: int = 64, dtype=ct.float32) -> KernelSignature:
    array = sass.array_constraint(dtype, 1)
    return KernelSignature((array, array, block), CallingConvention.cutile_python_v2())


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEGYM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TILEGYM_KERNEL_CACHE", raising=False)
    return tmp_path / "kernels"


@pytest.fixture
def cutile_compiles(monkeypatch):
    """Counts the compiles that reach cuTile (cache misses): each lowers the kernel once."""
    calls = []
    lower = cutile_compile.compile_tile

    def counting(*args, **kwargs):
        calls.append(args[1])
        return lower(*args, **kwargs)

    monkeypatch.setattr(cutile_compile, "compile_tile", counting)
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


@pytest.mark.parametrize("value", ["0", "off", " NO "])
def test_turned_off_by_the_environment(cache_dir, cutile_compiles, monkeypatch, value):
    monkeypatch.setenv("TILEGYM_KERNEL_CACHE", value)
    for _ in range(2):
        _compile(_doubling_kernel, _signature())
    assert len(cutile_compiles) == 2
    assert not cache_dir.exists()


def test_the_switch_rejects_other_words(cache_dir, monkeypatch):
    monkeypatch.setenv("TILEGYM_KERNEL_CACHE", "disable")
    with pytest.raises(ValueError, match="TILEGYM_KERNEL_CACHE='disable'"):
        kernel_cache.enabled()
    for value in ("", "1", "On"):
        monkeypatch.setenv("TILEGYM_KERNEL_CACHE", value)
        assert kernel_cache.enabled()


def _cut_in_half(entry: bytes) -> bytes:
    return entry[: len(entry) // 2]


def _one_byte_changed(entry: bytes) -> bytes:
    return entry[:-1] + bytes([entry[-1] ^ 1])


def _header_not_text(entry: bytes) -> bytes:
    return b"\xff\xfe" + entry


def _no_header(entry: bytes) -> bytes:
    return b"no symbol line"


@pytest.mark.parametrize("damage", [_cut_in_half, _one_byte_changed, _header_not_text, _no_header])
def test_a_damaged_entry_is_compiled_again(cache_dir, cutile_compiles, damage):
    """Half a cubin handed to the driver crashes the process: an entry is checked before use."""
    compiled = _compile(_doubling_kernel, _signature())
    [entry] = cache_dir.glob("*.cubin")
    entry.write_bytes(damage(entry.read_bytes()))
    with pytest.warns(UserWarning, match="damaged compiled kernel") as record:
        assert _compile(_doubling_kernel, _signature())[:2] == compiled[:2]
    assert len(record) == 1 and len(cutile_compiles) == 2
    assert _compile(_doubling_kernel, _signature())[:2] == compiled[:2]  # stored again, sound
    assert len(cutile_compiles) == 2


def test_entries_of_the_first_format_are_not_read(cache_dir, cutile_compiles):
    """The first format (a symbol line, then the cubin, in <key>.cubin) had no check."""
    _compile(_doubling_kernel, _signature())
    [entry] = cache_dir.glob("*.cubin")
    entry.unlink()
    key = entry.name.split(".")[0]
    (cache_dir / f"{key}.cubin").write_bytes(b"symbol\nnot a cubin")
    cubin, *_ = _compile(_doubling_kernel, _signature())
    assert cubin[:4] == b"\x7fELF" and len(cutile_compiles) == 2


def test_a_read_only_cache_still_hits(cache_dir, cutile_compiles, monkeypatch):
    first = _compile(_doubling_kernel, _signature())

    def read_only(*args, **kwargs):
        raise PermissionError(30, "Read-only file system")

    monkeypatch.setattr(os, "utime", read_only)
    assert _compile(_doubling_kernel, _signature())[:2] == first[:2]
    assert len(cutile_compiles) == 1


def test_a_cache_dir_open_to_others_holds_no_kernels(cache_dir, cutile_compiles):
    """Another user could put their code in place of a cached kernel."""
    cache_dir.parent.chmod(0o777)
    with pytest.warns(UserWarning, match="group or others may write to it"):
        for _ in range(2):
            assert _compile(_doubling_kernel, _signature())[0][:4] == b"\x7fELF"
    assert len(cutile_compiles) == 2 and not cache_dir.exists()


_FULL_DISK = """
import resource, signal, sys
from pathlib import Path
from tilegym import kernel_cache

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
kernel_cache._write(Path(sys.argv[1]) / f"{'0' * 64}{kernel_cache._SUFFIX}", "symbol", bytes(10_000))
"""


def test_a_full_disk_leaves_no_temporary_files(tmp_path):
    """A write that fails part way (a file size limit here, as a full disk would) leaves nothing."""
    pytest.importorskip("resource")
    result = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert list(tmp_path.iterdir()) == []


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


@pytest.fixture
def fresh_ahead(monkeypatch):
    """An empty table of compiles started ahead, so that each test starts its own."""
    monkeypatch.setattr(kernel_cache, "_ahead_compiles", {})


@pytest.mark.parametrize("cached", [True, False], ids=["cache-on", "cache-off"])
def test_a_compile_started_ahead_is_what_the_launch_gets(cache_dir, cutile_compiles, fresh_ahead, monkeypatch, cached):
    if not cached:
        monkeypatch.setenv("TILEGYM_KERNEL_CACHE", "0")
    started = _doubling_kernel.start_compile(_signature(32), SM_90)
    assert _doubling_kernel.start_compile(_signature(32), SM_90) is started  # once per signature
    assert _compile(_doubling_kernel, _signature(32))[:2] == started.result()[:2]
    assert len(cutile_compiles) == 1, "the launch compiled again"
    _compile(_doubling_kernel, _signature(16))  # another signature is not taken from it
    assert len(cutile_compiles) == 2


def test_a_failed_compile_ahead_is_raised_by_the_launch(cache_dir, fresh_ahead):
    too_wide = 1 << 30  # a tile no GPU holds
    started = _doubling_kernel.start_compile(_signature(too_wide), SM_90)
    first_error = started.exception()
    assert first_error is not None
    with pytest.raises(type(first_error)):
        _compile(_doubling_kernel, _signature(too_wide))


def test_the_compiler_lock_is_free_while_tileiras_runs(cache_dir, fresh_ahead, monkeypatch):
    """cuTile runs every compile under one lock; ours hold it only while lowering, so that
    kernels compile side by side."""
    free_while_compiling = []
    run_tileiras = cutile_compile.compile_cubin

    def checking(*args, **kwargs):
        other = threading.Thread(target=lambda: free_while_compiling.append(_try_lock()))
        other.start()
        other.join()
        return run_tileiras(*args, **kwargs)

    monkeypatch.setattr(cutile_compile, "compile_cubin", checking)
    cubin, *_ = _doubling_kernel.start_compile(_signature(8), SM_90).result()
    assert cubin[:4] == b"\x7fELF" and free_while_compiling == [True]


def _try_lock() -> bool:
    if not cutile_compile._compiler_lock.acquire(blocking=False):
        return False
    cutile_compile._compiler_lock.release()
    return True


def test_compiles_ahead_have_a_timeout(cache_dir, fresh_ahead, monkeypatch):
    """Exit waits for the compile running in the background: it must end even where the
    context sets no timeout (cuTile's default)."""
    timeouts = []
    run_tileiras = cutile_compile.compile_cubin

    def recording(bytecode, options, arch, timeout_sec, *args, **kwargs):
        timeouts.append(timeout_sec)
        return run_tileiras(bytecode, options, arch, timeout_sec, *args, **kwargs)

    monkeypatch.setattr(cutile_compile, "compile_cubin", recording)
    monkeypatch.setattr(default_tile_context.config, "compiler_timeout_sec", None)
    _doubling_kernel.start_compile(_signature(4), SM_90).result()
    [timeout] = timeouts
    assert timeout is not None and 0 < timeout <= 600


_QUEUED_AT_EXIT = """
import time
from tilegym import kernel_cache

pool = kernel_cache._compile_pool()
for _ in range(3 * pool._max_workers):  # three rounds of fake three-second compiles
    pool.submit(time.sleep, 3)
time.sleep(0.2)  # the first round runs
print(time.time(), flush=True)
"""


def test_exit_cancels_queued_compiles():
    """Python joins the compile threads at exit: it waits for the round running (about 2.8 s),
    not the rest (6 s more). The bound leaves room for a loaded machine's slow shutdown: with
    two-second rounds, 4 s, it read 4.2 s once beside other test runs."""
    result = subprocess.run([sys.executable, "-c", _QUEUED_AT_EXIT], capture_output=True, text=True)
    waited = time.time() - float(result.stdout)
    assert result.returncode == 0, result.stderr
    assert waited < 2 * 3, f"exit waited {waited:.1f} s for compiles queued behind the running ones"


def test_a_kernel_is_keyed_by_the_modules_its_package_code_comes_from():
    """The attention kernels' device helpers live in modules of their own: each is part of the key."""
    modules = kernel_cache.package_imports("tilegym.ops.attention.kernels.backward")
    helpers = {
        f"tilegym.ops.attention.kernels.{name}" for name in ("tiles", "state", "ranges", "modifiers", "scheduling")
    }
    assert helpers | {"tilegym.ops.attention.score_mods"} <= modules
    assert "tilegym.ops.attention.launch" not in modules  # host code the kernels do not import


def test_editing_a_shared_helper_changes_the_key_of_a_kernel_that_imports_it(tmp_path, monkeypatch):
    package = tmp_path / "keyed_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "helpers.py").write_text("SCALE = 2\n")
    (package / "unrelated.py").write_text("X = 1\n")
    (package / "kernel.py").write_text("from keyed_pkg.helpers import SCALE\n\n\ndef f():\n    import keyed_pkg.deep\n")
    (package / "deep.py").write_text("Y = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert kernel_cache.package_imports("keyed_pkg.kernel") == {
        "keyed_pkg.kernel",
        "keyed_pkg.helpers",
        "keyed_pkg.deep",
    }
    before = kernel_cache._package_digest("keyed_pkg.kernel")
    (package / "unrelated.py").write_text("X = 2\n")
    kernel_cache._package_digest.cache_clear()
    assert kernel_cache._package_digest("keyed_pkg.kernel") == before
    (package / "helpers.py").write_text("SCALE = 3\n")
    kernel_cache._package_digest.cache_clear()
    assert kernel_cache._package_digest("keyed_pkg.kernel") != before
    kernel_cache._package_digest.cache_clear()
