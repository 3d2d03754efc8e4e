"""Pick a tile config per kernel and shape, once, and remember it.

One mechanism for every kernel: given the kernel's candidate configs (first one the
default), a launch either takes the default (DISABLE_AUTOTUNE), or a config already chosen
for this shape key (memory, then a JSON file under the user's cache dir), or times the
candidates (median of a few launches each, after the compiling one) and stores the winner.

Tuning never raises: a candidate that fails to compile, or that runs past the compile
timeout, is skipped with one warning, and if none works the default is used.

The cache dir is used only when it is private to the user (usable_cache_dir): both this
JSON file and the compiled kernels of kernel_cache live there, and a kernel is code the GPU runs.
"""

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import stat
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tilegym import env

try:
    import fcntl
except ImportError:  # Windows: puts stay atomic, but processes tuning side by side may lose an entry
    fcntl = None


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of the message."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


# Tuning progress: one line per kernel tuned, on stderr. Silence it with
# TILEGYM_AUTOTUNE_QUIET=1 or logging.getLogger("tilegym.autotune").setLevel(logging.WARNING).
logger = logging.getLogger("tilegym.autotune")
logger.setLevel(logging.INFO)
logger.propagate = False
_handler = _CurrentStderr()
_handler.setFormatter(logging.Formatter("tilegym: %(message)s"))
logger.addHandler(_handler)


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes of one kernel launch and the cuTile compiler hints that go with them."""

    block_m: int
    block_n: int | None = None
    num_worker_warps: int | None = None
    occupancy: int | None = None
    num_ctas: int | None = None

    def hints(self) -> dict:
        names = ("num_worker_warps", "occupancy", "num_ctas")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def to_json(self) -> dict:
        return {key: value for key, value in dataclasses.asdict(self).items() if value is not None}


_DISABLE_USAGE = f"use one of {env.TRUE_WORDS} to disable autotuning or one of {env.FALSE_WORDS} (or unset) to keep it"


def autotune_disabled() -> bool:
    """DISABLE_AUTOTUNE: 1/true/yes/on disables tuning, 0/false/no/off or unset keeps it."""
    return env.flag("DISABLE_AUTOTUNE", False, _DISABLE_USAGE)


def cache_dir() -> Path:
    """TILEGYM_CACHE_DIR, else $XDG_CACHE_HOME/tilegym, else ~/.cache/tilegym (~ expanded)."""
    explicit = env.path("TILEGYM_CACHE_DIR")
    if explicit is not None:
        return explicit
    return (env.path("XDG_CACHE_HOME") or Path(os.path.expanduser("~")) / ".cache") / "tilegym"


_usable_dirs: dict[Path, bool] = {}


def usable_cache_dir() -> Path | None:
    """cache_dir(), made private (mode 0700) where it is missing; None, after one warning, where
    it belongs to another user or group or others may write to it: another user could then
    swap a cached kernel for theirs. Without it the caches keep to memory."""
    directory = cache_dir()
    usable = _usable_dirs.get(directory)
    if usable is None:
        problem = _cache_dir_problem(directory)
        if problem is not None:
            warnings.warn(
                f"tilegym: not using the cache dir {directory}: {problem}; caching in memory only", stacklevel=2
            )
        usable = _usable_dirs[directory] = problem is None
    return directory if usable else None


def _cache_dir_problem(directory: Path) -> str | None:
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        status = os.stat(directory)
    except OSError as error:
        return f"it cannot be made ({error})"
    getuid = getattr(os, "getuid", None)  # not on Windows, where modes say little
    if getuid is not None and status.st_uid != getuid():
        return f"it belongs to user {status.st_uid}"
    if getuid is not None and status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"group or others may write to it (mode {stat.S_IMODE(status.st_mode):o}; chmod 700 makes it usable)"
    return None


def write_file(path: Path, data: bytes) -> None:
    """Replaces path by a file holding data: readers see the old file or the new one, never a
    part. The temporary file gets a fresh name, made exclusively (a link planted under a name
    we would have guessed is not followed), and goes away if the write fails (a full disk)."""
    descriptor, temporary = tempfile.mkstemp(prefix=f"{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


class TuneCache:
    """Chosen configs by shape key, in memory and in one JSON file per (GPU, cuda-tile version),
    or in memory only (on_disk False: no usable cache dir).

    Processes share the file: a put merges its entry into what the file holds at that moment,
    under a file lock, so that processes tuning side by side keep each other's entries, and
    entries this version cannot read (a field of a later one) are kept as they are.
    """

    def __init__(self, path: Path, on_disk: bool = True):
        self.path = path
        self.on_disk = on_disk
        self._entries: dict[str, TileConfig] | None = None
        self._lock = threading.Lock()

    def _load(self) -> dict[str, TileConfig]:
        if self._entries is None:
            stored, problem = _read_entries(self.path) if self.on_disk else ({}, None)
            self._entries, skipped = _configs(stored)
            if problem is not None:
                warnings.warn(
                    f"tilegym: ignored the tune cache {self.path}: {problem}; shapes tune again", stacklevel=4
                )
            if skipped:
                warnings.warn(
                    f"tilegym: skipped {skipped} entries of the tune cache {self.path} that are not tile configs",
                    stacklevel=4,
                )
        return self._entries

    def get(self, key: str) -> TileConfig | None:
        with self._lock:
            return self._load().get(key)

    def put(self, key: str, config: TileConfig) -> None:
        with self._lock:
            entries = self._load()
            entries[key] = config
            if not self.on_disk:
                return
            try:
                self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                with _locked(self.path):
                    stored, _ = _read_entries(self.path)  # what other processes wrote meanwhile
                    stored[key] = config.to_json()
                    write_file(self.path, json.dumps(stored, indent=1, sort_keys=True).encode())
            except (OSError, ValueError, RecursionError) as error:
                warnings.warn(f"tilegym: could not write the tune cache {self.path}: {error}", stacklevel=3)
                return
            entries.update(_configs(stored)[0])


def _read_entries(path: Path) -> tuple[dict, str | None]:
    """The JSON object a tune cache file holds (empty if there is none yet) and, where the file
    holds something else, what: a torn or hand-edited file must not fail a launch."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}, None
    except (OSError, ValueError) as error:  # ValueError: not UTF-8
        return {}, f"it cannot be read ({error})"
    try:
        stored = json.loads(text)
    except (ValueError, RecursionError) as error:  # RecursionError: nested past the parser's depth
        return {}, f"it is not JSON ({type(error).__name__})"
    if not isinstance(stored, dict):
        return {}, f"it holds a JSON {type(stored).__name__}, not an object"
    return stored, None


_CONFIG_FIELDS = frozenset(field.name for field in dataclasses.fields(TileConfig))
_REQUIRED_FIELDS = frozenset(
    field.name for field in dataclasses.fields(TileConfig) if field.default is dataclasses.MISSING
)


def _config(value) -> TileConfig | None:
    """The TileConfig a stored entry describes, or None: sizes must be ints (128.0 or true would
    reach the kernel as a constant of the wrong type), fields must be TileConfig's."""
    if not isinstance(value, dict) or not _REQUIRED_FIELDS <= value.keys() <= _CONFIG_FIELDS:
        return None
    for name, size in value.items():
        if type(size) is not int and not (size is None and name not in _REQUIRED_FIELDS):
            return None
    return TileConfig(**value)


def _configs(stored: dict) -> tuple[dict[str, TileConfig], int]:
    """The entries that are TileConfigs, and how many were skipped."""
    configs = {key: _config(value) for key, value in stored.items()}
    valid = {key: config for key, config in configs.items() if config is not None}
    return valid, len(configs) - len(valid)


@contextlib.contextmanager
def _locked(path: Path):
    """Holds an exclusive lock on path's sibling .lock file for the block; goes on without one
    where the platform or the file system has none (the write is still atomic)."""
    descriptor = None
    if fcntl is not None:
        try:
            descriptor = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
            fcntl.flock(descriptor, fcntl.LOCK_EX)
        except OSError:
            pass
    try:
        yield
    finally:
        if descriptor is not None:
            os.close(descriptor)  # releases the lock


CACHE_DIR_VARIABLES = ("TILEGYM_CACHE_DIR", "XDG_CACHE_HOME", "HOME")
_caches: dict[tuple, TuneCache] = {}
_caches_by_path: dict[Path, TuneCache] = {}  # one object per file, however its dir was named


def tune_cache(device_name: str, cutile_version: str) -> TuneCache:
    """The cache of one GPU and cuda-tile version under the current cache dir.

    Every launch asks for it, so it is found by the environment values that decide the
    cache dir rather than by building the path again (a fifth of a launch's host time).
    """
    key = (device_name, cutile_version, *(os.environ.get(name) for name in CACHE_DIR_VARIABLES))
    cache = _caches.get(key)
    if cache is None:
        directory = usable_cache_dir()
        # v2: entries are checked field by field; files of the older format are not read.
        path = (directory or cache_dir()) / f"autotune-v2-{_slug(device_name)}-cuda-tile-{_slug(cutile_version)}.json"
        cache = _caches[key] = _caches_by_path.setdefault(path, TuneCache(path, on_disk=directory is not None))
    return cache


@dataclass(frozen=True)
class TunedKernel:
    """What the tuner needs of one kernel launch, independent of the config."""

    name: str
    kernel: object  # a cuda.tile kernel
    grid: Callable[[TileConfig], tuple[int, ...]]
    args: Callable[[TileConfig], tuple]
    # For a kernel that accumulates into its outputs: called right before the launch that
    # counts, after any tuning runs, to set them back to their starting values.
    reset: Callable[[], None] | None = None


_hinted: dict[tuple, object] = {}


def with_hints(kernel, config: TileConfig):
    """The kernel compiled with the config's hints; one object per hint set, so its JIT cache lives."""
    hints = config.hints()
    if not hints:
        return kernel
    key = (id(kernel), tuple(sorted(hints.items())))
    if key not in _hinted:
        _hinted[key] = kernel.replace_hints(**hints)
    return _hinted[key]


def _known_choice(
    launch: TunedKernel, candidates: Sequence[TileConfig], shape_key: str, cache: TuneCache
) -> TileConfig | None:
    """The default (tuning disabled, a single candidate) or the cached choice; None: tune."""
    if autotune_disabled() or len(candidates) == 1:
        return candidates[0]
    cached = cache.get(_tune_key(launch, shape_key, candidates))
    return cached if cached in candidates else None


def _tune_key(launch: TunedKernel, shape_key: str, candidates: Sequence[TileConfig]) -> str:
    """The cache key of a choice: the kernel, the shape and the candidates it was chosen among,
    so that a choice made among other candidates (an older config table) is tuned again rather
    than kept because it is still one of them."""
    listed = sorted(json.dumps(config.to_json(), sort_keys=True) for config in candidates)
    tag = hashlib.sha256("\n".join(listed).encode()).hexdigest()[:12]
    return f"{launch.name}|{shape_key}|{tag}"


def choose_config(
    launch: TunedKernel,
    candidates: Sequence[TileConfig],
    shape_key: str,
    cache: TuneCache,
    stream,
    compile_timeout_sec: float = 120.0,
) -> TileConfig:
    """The config to launch with: default, cached, or freshly tuned.

    Threads that meet a new shape together (one per stream, say) tune it once: the others
    wait for that choice and take it from the cache, rather than tune again and maybe differ.
    """
    known = _known_choice(launch, candidates, shape_key, cache)
    if known is not None:
        return known
    tune_key = _tune_key(launch, shape_key, candidates)
    with _tuning_lock(cache.path, tune_key):
        known = _known_choice(launch, candidates, shape_key, cache)
        if known is not None:
            return known
        quiet = env.flag("TILEGYM_AUTOTUNE_QUIET", False)  # read first: a bad value fails before the search
        started = time.perf_counter()
        best = _search(launch, candidates, stream, compile_timeout_sec)
        elapsed = time.perf_counter() - started
        if not quiet:
            logger.info(
                f"tuned {launch.name} for {shape_key}: {len(candidates)} configs in {elapsed:.1f} s, "
                f"chose {best.to_json()}"
            )
        cache.put(tune_key, best)
    return best


_tuning_locks: dict[tuple[Path, str], threading.Lock] = {}
_tuning_locks_guard = threading.Lock()


def _tuning_lock(path: Path, tune_key: str) -> threading.Lock:
    with _tuning_locks_guard:
        return _tuning_locks.setdefault((path, tune_key), threading.Lock())


# Each candidate is timed for about this long after its first (compiling) launch: long
# enough for a stable median, short enough that a first call stays quick.
_TIMING_BUDGET_MS = 30.0
_MIN_TIMED_RUNS = 3
_MAX_TIMED_RUNS = 50


def _search(launch: TunedKernel, candidates: Sequence[TileConfig], stream, compile_timeout_sec: float) -> TileConfig:
    """The candidate with the smallest median time; failures are skipped with a warning."""
    import cuda.tile as ct

    # Side by side, while the first ones are timed: by then the compiles are mostly tileiras
    # processes. One being lowered to bytecode holds the interpreter and slowed timed launches
    # fourfold when forced to overlap them; in the first calls measured, none was (perf-notes 112).
    _compile_ahead(launch, candidates)
    medians = {}
    for config in candidates:
        try:
            with ct.compiler_timeout(compile_timeout_sec):
                medians[config] = _median_ms(launch, config, stream)
        except Exception as error:  # a config that does not compile must not fail the call
            first_line = str(error).splitlines()[0] if str(error) else ""
            warnings.warn(
                f"tilegym: skipped config {config.to_json()} of {launch.name}: {type(error).__name__}: {first_line}",
                stacklevel=4,
            )
    if not medians:
        warnings.warn(f"tilegym: no config of {launch.name} could be timed; using the default", stacklevel=4)
        return candidates[0]
    return min(medians, key=medians.get)


def _median_ms(launch: TunedKernel, config: TileConfig, stream) -> float:
    """Median time of one launch in ms, on the CUDA stream with this handle."""
    import cuda.tile as ct
    import torch

    grid, kernel, args = launch.grid(config), with_hints(launch.kernel, config), launch.args(config)
    # Timing events record on torch streams; the launch's tensors name the stream's device.
    device = next(arg.device for arg in args if isinstance(arg, torch.Tensor))
    stream = torch.cuda.ExternalStream(stream, device=device)

    def timed_runs(count: int) -> list[float]:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(count)]
        for start, end in events:
            start.record(stream)
            ct.launch(stream, grid, kernel, args)
            end.record(stream)
        end.synchronize()
        return sorted(start.elapsed_time(end) for start, end in events)

    ct.launch(stream, grid, kernel, args)  # compiles
    first = timed_runs(1)[0]
    count = int(min(max(_TIMING_BUDGET_MS / max(first, 1e-3), _MIN_TIMED_RUNS), _MAX_TIMED_RUNS))
    times = timed_runs(count)
    return times[len(times) // 2]


# (kernel, shape key, cache file, tuning disabled) -> (config, hinted kernel): after the first
# call for a shape, a launch skips the tune cache and the hint lookup.
_chosen: dict[tuple, tuple[TileConfig, object]] = {}


# Kernel name -> the one config its launches use, while force_config holds.
_forced: dict[str, tuple[TileConfig, ...]] = {}


@contextlib.contextmanager
def force_config(kernel_name: str, config: TileConfig):
    """Within the block, launches of kernel_name take config as their only candidate, tuning
    aside (tests of every config, comparisons of configs): an op's launcher asks
    forced_candidates before its table, so what it sizes from the candidates (buffers padded to
    whole tiles) follows too. Configs chosen before and within the block are forgotten."""
    previous = _forced.get(kernel_name)
    _forced[kernel_name] = (config,)
    _chosen.clear()
    try:
        yield
    finally:
        if previous is None:
            del _forced[kernel_name]
        else:
            _forced[kernel_name] = previous
        _chosen.clear()


def forced_candidates(kernel_name: str) -> tuple[TileConfig, ...] | None:
    """The config force_config holds for kernel_name, as a candidate list; None when none."""
    return _forced.get(kernel_name) if _forced else None


def _memo_key(launch: TunedKernel, shape_key: str, cache: TuneCache) -> tuple:
    return launch.name, shape_key, cache.path, autotune_disabled()


def compile_ahead(launch: TunedKernel, candidates: Sequence[TileConfig], shape_key: str, cache: TuneCache) -> None:
    """Starts compiling, in the background, what launch_tuned will compile for this shape: the
    chosen config if one is known, else every candidate it will time; nothing once launched."""
    if _memo_key(launch, shape_key, cache) in _chosen:
        return
    known = _known_choice(launch, candidates, shape_key, cache)
    _compile_ahead(launch, candidates if known is None else [known])


def _compile_ahead(launch: TunedKernel, configs: Sequence[TileConfig]) -> None:
    for config in configs:
        kernel = with_hints(launch.kernel, config)
        start = getattr(kernel, "compile_ahead", None)  # kernel_cache.CachedKernel
        if start is not None:
            start(launch.args(config))


@dataclass(frozen=True)
class Launched:
    """One launch as launch_tuned made it: the config, the kernel with its hints, the grid and the
    arguments, and the memo entry of the choice (still_chosen)."""

    config: TileConfig
    kernel: object
    grid: tuple[int, ...]
    arguments: tuple
    memo_key: tuple
    chosen: tuple

    def still_chosen(self) -> bool:
        """Whether launch_tuned would still launch this config and kernel: a choice is forgotten
        by force_config and by clearing the memo."""
        return _chosen.get(self.memo_key) is self.chosen


def launch_tuned(
    launch: TunedKernel, candidates: Sequence[TileConfig], shape_key: str, cache: TuneCache, stream: int
) -> Launched:
    """Choose the config (see choose_config), once per shape key, and launch the kernel with it
    on the CUDA stream with this handle (an int, as ct.launch takes it)."""
    import cuda.tile as ct

    memo_key = _memo_key(launch, shape_key, cache)
    chosen = _chosen.get(memo_key)
    if chosen is None:
        config = choose_config(launch, candidates, shape_key, cache, stream)
        chosen = _chosen[memo_key] = (config, with_hints(launch.kernel, config))
    config, kernel = chosen
    if launch.reset is not None:
        launch.reset()
    grid, arguments = launch.grid(config), launch.args(config)
    ct.launch(stream, grid, kernel, arguments)
    return Launched(config, kernel, grid, arguments, memo_key, chosen)
