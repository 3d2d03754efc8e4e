"""Compiled kernels: found on disk before cuTile rebuilds their bytecode, and compiled ahead.

On disk: cuTile keys its own disk cache by a kernel's bytecode, so a new process that finds
its cubin there has already lowered the kernel's Python to bytecode (about 0.6 s per attention
kernel) and started the compiler to learn its version. This cache is keyed by what decides
that bytecode instead: the source files of the kernel's package, the signature cuTile
specializes a launch on (dtypes, constants, alignment facts), the compiler hints, the GPU
arch, the cuda-tile version, the compiler binary and the CUDA_TILE* environment. So a kernel
must call only code of its own package and of cuda.tile.

Entries live in <autotune.usable_cache_dir()>/kernels, at most _MAX_ENTRIES of them (the least
recently used go first). TILEGYM_KERNEL_CACHE=0 turns the cache off. Any failure to build a
key, read or write falls back to cuTile's own path. An entry's header holds a digest of the
rest: the driver loads a cubin unchecked, and half a cubin crashes the process, so an entry
that fails the check is deleted (one warning) and compiled again.

Ahead: CachedKernel.compile_ahead starts compiling a kernel for the arguments of a launch to
come, in a background thread; that launch then waits for the result instead of compiling. A
compile takes seconds, nearly all of it in the tileiras process, which cuTile runs under
one lock per process; here the lock is held only while the kernel is lowered to bytecode
(tenths of a second), so that kernels compile side by side. At exit, compiles still queued
are cancelled, and the one running is bounded by _AHEAD_TIMEOUT_SEC: exit waits for no more.
"""

import ast
import contextlib
import dataclasses
import hashlib
import importlib.util
import logging
import os
import tempfile
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache
from pathlib import Path

import cuda.tile as ct

from tilegym import autotune, env, requirements

logger = logging.getLogger("tilegym.kernel_cache")
_MAX_ENTRIES = 256
# v2: a header with a digest; entries of the older format (".cubin" alone) are never read,
# and age out as the least recently used.
_FORMAT = b"tilegym-kernel-v2"
_SUFFIX = ".v2.cubin"
_ANY_FORMAT = "*.cubin"
# A compile started ahead gives up after this long, as tuning does with a candidate (a
# compile takes about 4 s): exit waits for the running one, and it must end.
_AHEAD_TIMEOUT_SEC = 120.0


def enabled() -> bool:
    """TILEGYM_KERNEL_CACHE: on unless 0/false/no/off."""
    return env.flag("TILEGYM_KERNEL_CACHE", True)


class CachedKernel(ct.kernel):
    """A cuda.tile kernel whose compiled code is looked up in this cache first."""

    def _compile(self, signature, context, compute_capability=None):
        ahead = _ahead_compiles.get(_ahead_key(self, signature, compute_capability)) if _ahead_compiles else None
        if ahead is not None:
            try:
                return ahead.result(timeout=context.config.compiler_timeout_sec)
            except Exception:  # failed, late or cancelled at exit: compiled again below, so that
                pass  # the launch raises the error
        return self._compile_now(signature, context, compute_capability)

    def compile_ahead(self, args, compute_capability=None) -> None:
        """Starts compiling the kernel for a launch with these arguments, in a background thread;
        nothing when no signature can be made of them (the launch compiles as usual)."""
        try:
            from cuda.tile.compilation import CallingConvention, KernelSignature

            # The convention and the absent symbol of cuTile's own launches (cuda-tile 1.7).
            convention = CallingConvention.cutile_python_v2()
            signature = KernelSignature.from_kernel_args(self, args, convention).with_symbol(None)
            self.start_compile(signature, compute_capability)
        except Exception as error:
            logger.debug("no compile ahead: %s", error)

    def start_compile(self, signature, compute_capability=None) -> Future:
        """The background compile of one signature, started now unless it already was."""
        from cuda.tile._cext import default_tile_context

        key = _ahead_key(self, signature, compute_capability)
        with _ahead_lock:
            if key not in _ahead_compiles:
                work = _compile_pool().submit(
                    self._compile_now, signature, default_tile_context, compute_capability, _AHEAD_TIMEOUT_SEC
                )
                _ahead_compiles[key] = work
            return _ahead_compiles[key]

    def _compile_now(self, signature, context, compute_capability, timeout_sec: float | None = None):
        """Compiled code from the cache, else compiled now; timeout_sec bounds the compiler
        beyond the context's timeout (where it has one at all)."""
        if not enabled():
            return super()._compile(signature, context, compute_capability)
        path = _entry_path(self, signature, compute_capability)
        found = None if path is None else _read(path)
        if found is not None:
            symbol, cubin = found
            return cubin, symbol, None, ()
        limit = _shorter(timeout_sec, context.config.compiler_timeout_sec)
        compiled = _compile_outside_lock(self, signature, context, compute_capability, limit)
        if compiled is None:
            compiled = super()._compile(signature, context, compute_capability)
        cubin, symbol, _, library_providers = compiled
        if path is not None and not library_providers:  # kernels that need a library set-up are not kept
            _write(path, symbol, cubin)
        return compiled

    def replace_hints(self, **hints):
        options = dataclasses.replace(self._compiler_options, **hints)
        return CachedKernel(self._pyfunc, **dataclasses.asdict(options))


# Compiles started ahead, by (kernel, signature, arch); kept for the life of the process, as
# cuTile keeps what it launched: a signature is compiled once.
_ahead_compiles: dict[tuple, Future] = {}
_ahead_lock = threading.Lock()


def _ahead_key(kernel: CachedKernel, signature, compute_capability) -> tuple:
    from cuda.tile._cext import get_compute_capability

    return kernel, repr(signature), tuple(compute_capability or get_compute_capability())  # kernels hash by identity


def _shorter(timeout_sec: float | None, other_sec: float | None) -> float | None:
    """The shorter of two timeouts, where None is none."""
    return other_sec if timeout_sec is None else timeout_sec if other_sec is None else min(timeout_sec, other_sec)


@cache
def _compile_pool() -> ThreadPoolExecutor:
    # Each compile is mostly a tileiras process: one thread per core, up to a handful of kernels.
    pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="tilegym-compile")
    # Python joins the pool's threads at exit, after running every queued compile (seconds
    # each): cancel those first. Hooks of threading run before that join, atexit's after it.
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(lambda: pool.shutdown(wait=False, cancel_futures=True))
    return pool


def _compile_outside_lock(kernel: CachedKernel, signature, context, compute_capability, timeout_sec: float | None):
    """(cubin, symbol, None, ()) as cuTile's compile makes them, with cuTile's compiler lock
    held only while lowering to bytecode; None where that cannot be done (a kernel that
    needs a library set-up, internals of another cuda-tile version): cuTile's own path then."""
    try:
        from cuda.tile._cext import get_compute_capability
        from cuda.tile._compile import compile_cubin, compile_tile, format_sm_arch
    except ImportError:
        return None
    arch = format_sm_arch(*(compute_capability or get_compute_capability()))
    options = kernel._compiler_options
    lowered = compile_tile(
        kernel._annotated_function, (signature,), arch, options, context, return_bytecode=True, return_cubin=False
    )  # fmt: skip
    if lowered.library_lifecycle_providers:
        return None
    with tempfile.TemporaryDirectory(prefix="tilegym-", dir=context.config.temp_dir) as scratch:
        bytecode = Path(scratch) / "kernel.bytecode"
        bytecode.write_bytes(lowered.bytecode)
        cubin = compile_cubin(str(bytecode), options, arch, timeout_sec).read_bytes()
    return cubin, lowered.kernel_signatures[0].symbol, None, ()


def _entry_path(kernel: CachedKernel, signature, compute_capability) -> Path | None:
    try:
        from cuda.tile._cext import get_compute_capability

        major, minor = compute_capability or get_compute_capability()
        described = repr(signature)
        if " at 0x" in described:  # an object's address: the key would differ in every process
            return None
        environment = sorted((name, value) for name, value in os.environ.items() if "CUDA_TILE" in name)
        parts = (
            ct.__version__,
            _compiler_fingerprint(os.environ.get("PATH", ""), os.environ.get("CUDA_HOME", "")),
            _package_digest(kernel._pyfunc.__module__),
            kernel._pyfunc.__qualname__,
            described,
            repr(kernel._compiler_options),
            f"sm_{major}{minor}",
            repr(environment),
        )
    except Exception as error:  # a cuda-tile whose internals moved: use its own path
        logger.debug("no kernel cache key: %s", error)
        return None
    directory = autotune.usable_cache_dir()
    if directory is None:
        return None
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()
    return directory / "kernels" / f"{digest}{_SUFFIX}"


@cache
def _compiler_fingerprint(search_path: str, cuda_home: str) -> str:
    """Size and time of every tileiras cuTile may run (requirements.tileiras_paths)."""
    found = []
    for binary in requirements.tileiras_paths(search_path, cuda_home):
        stat = os.stat(binary)
        found.append(f"{os.path.realpath(binary)}:{stat.st_size}:{stat.st_mtime_ns}")
    if not found:
        raise FileNotFoundError("no tileiras binary")
    return ";".join(found)


@cache
def _package_digest(module_name: str) -> str:
    """sha256 over the source of the kernel's module and of every module of its top-level
    package that it imports, transitively: a device helper or constant shared from another
    module changes the key of every kernel that uses it."""
    digest = hashlib.sha256()
    for name in sorted(package_imports(module_name)):
        digest.update(name.encode() + b"\0" + _module_source(name) + b"\0")
    return digest.hexdigest()


def package_imports(module_name: str) -> set[str]:
    """The module and the modules of its top-level package it imports, transitively (read from
    their source with ast: whatever they import, also inside functions)."""
    top = module_name.partition(".")[0]
    found: set[str] = set()
    pending = [module_name]
    while pending:
        name = pending.pop()
        if name in found:
            continue
        found.add(name)
        for imported in _imports(_module_source(name)):
            if imported.partition(".")[0] == top and imported not in found:
                pending.append(imported)
    return found


def _imports(source: bytes) -> list[str]:
    """Absolute names of the modules the source imports: for `from a import b`, a.b where b is a
    module, else a."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                names.append(submodule if _is_module(submodule) else node.module)
    return names


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError, AttributeError):  # a name inside a module, not a module
        return False


def _module_source(name: str) -> bytes:
    return Path(importlib.util.find_spec(name).origin).read_bytes()


def _read(path: Path) -> tuple[str, bytes] | None:
    """(symbol, cubin) of an entry; None if there is none or it fails its check (then it is
    deleted, with a warning, so that the compile that follows stores a sound one)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        return _discard(path, f"it cannot be read ({error})")
    with contextlib.suppress(OSError):  # a read-only cache still serves its entries
        os.utime(path)  # recently used
    header, newline, cubin = data.partition(b"\n")
    fields = header.split(b" ", 2)  # the symbol last, whatever it holds
    if not newline or len(fields) != 3 or fields[0] != _FORMAT:
        return _discard(path, "its header is not tilegym's")
    _, digest, symbol = fields
    if digest != _digest(path, symbol, cubin):
        return _discard(path, "its digest does not match (a cut or altered file)")
    try:
        return symbol.decode(), cubin
    except UnicodeDecodeError:
        return _discard(path, "its symbol is not text")


def _write(path: Path, symbol: str, cubin: bytes) -> None:
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        encoded = symbol.encode()
        autotune.write_file(path, b" ".join((_FORMAT, _digest(path, encoded, cubin), encoded)) + b"\n" + cubin)
        _evict(path)
    except OSError as error:
        logger.debug("could not keep a compiled kernel in %s: %s", path.parent, error)


def _digest(path: Path, symbol: bytes, cubin: bytes) -> bytes:
    """Covers the entry's name too: an entry copied under another key's name fails it."""
    return hashlib.sha256(path.name.encode() + b"\0" + symbol + b"\0" + cubin).hexdigest().encode()


def _discard(path: Path, problem: str) -> None:
    warnings.warn(f"tilegym: deleted the damaged compiled kernel {path}: {problem}; compiling it again", stacklevel=2)
    with contextlib.suppress(OSError):
        path.unlink()
    return None


def _evict(kept: Path) -> None:
    """Removes the least recently used entries past _MAX_ENTRIES, never the one just written."""
    used = {}
    for entry in kept.parent.glob(_ANY_FORMAT):
        with contextlib.suppress(FileNotFoundError):  # evicted by another process meanwhile
            used[entry] = entry.stat().st_mtime_ns
    used.pop(kept, None)
    others = sorted(used, key=used.get)
    for entry in others[: max(0, len(others) + 1 - _MAX_ENTRIES)]:
        entry.unlink(missing_ok=True)
