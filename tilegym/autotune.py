"""Pick a tile config per kernel and shape, once, and remember it.

One mechanism for every kernel: given the kernel's candidate configs (first one the
default), a launch either takes the default (DISABLE_AUTOTUNE), or a config already chosen
for this shape key (memory, then a JSON file under the user's cache dir), or times the
candidates (median of a few launches each, after the compiling one) and stores the winner.

Tuning never raises: a candidate that fails to compile, or that runs past the compile
timeout, is skipped with one warning, and if none works the default is used.
"""

import dataclasses
import json
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


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


def autotune_disabled() -> bool:
    """DISABLE_AUTOTUNE: 1/true/yes/on disables tuning, 0/false/no/off or unset keeps it."""
    value = os.environ.get("DISABLE_AUTOTUNE", "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"DISABLE_AUTOTUNE={os.environ['DISABLE_AUTOTUNE']!r} is not understood: "
        f"use one of {_TRUE} to disable autotuning or one of {_FALSE[1:]} (or unset) to keep it"
    )


def cache_dir() -> Path:
    """TILEGYM_CACHE_DIR, else $XDG_CACHE_HOME/tilegym, else ~/.cache/tilegym."""
    explicit = os.environ.get("TILEGYM_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tilegym"


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


class TuneCache:
    """Chosen configs by shape key, in memory and in one JSON file per (GPU, cuda-tile version)."""

    def __init__(self, path: Path):
        self.path = path
        self._entries: dict[str, TileConfig] | None = None
        self._lock = threading.Lock()

    def _load(self) -> dict[str, TileConfig]:
        if self._entries is None:
            self._entries = {}
            try:
                raw = json.loads(self.path.read_text())
                self._entries = {key: TileConfig(**value) for key, value in raw.items()}
            except (OSError, ValueError, TypeError):
                pass  # no cache yet, or an unreadable one: tune again
        return self._entries

    def get(self, key: str) -> TileConfig | None:
        with self._lock:
            return self._load().get(key)

    def put(self, key: str, config: TileConfig) -> None:
        with self._lock:
            entries = self._load()
            entries[key] = config
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps({k: v.to_json() for k, v in entries.items()}, indent=1, sort_keys=True))
                tmp.replace(self.path)
            except OSError as error:
                warnings.warn(f"tilegym: could not write the tune cache {self.path}: {error}", stacklevel=3)


_CACHE_DIR_VARIABLES = ("TILEGYM_CACHE_DIR", "XDG_CACHE_HOME", "HOME")
_caches: dict[tuple, TuneCache] = {}
_caches_by_path: dict[Path, TuneCache] = {}  # one object per file, however its dir was named


def tune_cache(device_name: str, cutile_version: str) -> TuneCache:
    """The cache of one GPU and cuda-tile version under the current cache dir.

    Every launch asks for it, so it is found by the environment values that decide the
    cache dir rather than by building the path again (a fifth of a launch's host time).
    """
    key = (device_name, cutile_version, *(os.environ.get(name) for name in _CACHE_DIR_VARIABLES))
    cache = _caches.get(key)
    if cache is None:
        path = cache_dir() / f"autotune-{_slug(device_name)}-cuda-tile-{_slug(cutile_version)}.json"
        cache = _caches[key] = _caches_by_path.setdefault(path, TuneCache(path))
    return cache


def _progress(message: str) -> None:
    if os.environ.get("TILEGYM_AUTOTUNE_QUIET", "").strip().lower() not in _TRUE:
        logger.info(message)


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
    cached = cache.get(_tune_key(launch, shape_key))
    return cached if cached in candidates else None


def _tune_key(launch: TunedKernel, shape_key: str) -> str:
    return f"{launch.name}|{shape_key}"


def choose_config(
    launch: TunedKernel,
    candidates: Sequence[TileConfig],
    shape_key: str,
    cache: TuneCache,
    stream,
    compile_timeout_sec: float = 120.0,
) -> TileConfig:
    """The config to launch with: default, cached, or freshly tuned."""
    known = _known_choice(launch, candidates, shape_key, cache)
    if known is not None:
        return known
    started = time.perf_counter()
    best = _search(launch, candidates, stream, compile_timeout_sec)
    elapsed = time.perf_counter() - started
    _progress(
        f"tuned {launch.name} for {shape_key}: {len(candidates)} configs in {elapsed:.1f} s, chose {best.to_json()}"
    )
    cache.put(_tune_key(launch, shape_key), best)
    return best


# Each candidate is timed for about this long after its first (compiling) launch: long
# enough for a stable median, short enough that a first call stays quick.
_TIMING_BUDGET_MS = 30.0
_MIN_TIMED_RUNS = 3
_MAX_TIMED_RUNS = 50


def _search(launch: TunedKernel, candidates: Sequence[TileConfig], stream, compile_timeout_sec: float) -> TileConfig:
    """The candidate with the smallest median time; failures are skipped with a warning."""
    import cuda.tile as ct

    _compile_ahead(launch, candidates)  # side by side, while the first ones are timed
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


def launch_tuned(launch: TunedKernel, candidates: Sequence[TileConfig], shape_key: str, cache: TuneCache, stream: int):
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
    ct.launch(stream, launch.grid(config), kernel, launch.args(config))
    return config
