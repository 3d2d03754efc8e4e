"""Autotuning without a GPU: the switches, the choice of a config, and the tune cache file as
processes and threads share it (merged puts, entries checked one by one, a private cache dir)."""

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import cuda.tile as ct
import pytest

from tilegym import autotune, env
from tilegym.autotune import TileConfig


@pytest.mark.parametrize("value", ["1", "true", "YES", " on "])
def test_op_disable_autotune_true(monkeypatch, value):
    monkeypatch.setenv("DISABLE_AUTOTUNE", value)
    assert autotune.autotune_disabled()


@pytest.mark.parametrize("value", ["0", "false", "No", "off", ""])
def test_op_disable_autotune_false(monkeypatch, value):
    monkeypatch.setenv("DISABLE_AUTOTUNE", value)
    assert not autotune.autotune_disabled()


def test_op_disable_autotune_unset(monkeypatch):
    monkeypatch.delenv("DISABLE_AUTOTUNE", raising=False)
    assert not autotune.autotune_disabled()


@pytest.mark.parametrize("value", ["2", "maybe", "enabled"])
def test_op_disable_autotune_invalid(monkeypatch, value):
    monkeypatch.setenv("DISABLE_AUTOTUNE", value)
    with pytest.raises(ValueError, match="DISABLE_AUTOTUNE"):
        autotune.autotune_disabled()


# ---- autotune cache --------------------------------------------------------------------------


def test_op_tune_cache_round_trip(monkeypatch, tmp_path):
    monkeypatch.setenv("TILEGYM_CACHE_DIR", str(tmp_path))
    cache = autotune.tune_cache("NVIDIA H100 80GB HBM3", "1.7.0")
    config = TileConfig(block_m=128, block_n=64, num_worker_warps=8)
    cache.put("attention_forward|key", config)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and "H100" in files[0].name and "1.7.0" in files[0].name
    fresh = autotune.TuneCache(files[0])  # as a new process would read it
    assert fresh.get("attention_forward|key") == config
    assert fresh.get("attention_forward|other") is None


def test_op_tune_cache_follows_the_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TILEGYM_CACHE_DIR", str(tmp_path / "a"))
    first = autotune.tune_cache("GPU", "1.7.0")
    assert autotune.tune_cache("GPU", "1.7.0") is first
    monkeypatch.setenv("TILEGYM_CACHE_DIR", str(tmp_path / "b"))
    second = autotune.tune_cache("GPU", "1.7.0")
    assert second.path.parent == tmp_path / "b" and first.path.parent == tmp_path / "a"
    monkeypatch.delenv("TILEGYM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a"))
    assert autotune.tune_cache("GPU", "1.7.0").path == tmp_path / "a" / "tilegym" / first.path.name


def test_op_tune_cache_ignores_corrupt_file(tmp_path):
    path = tmp_path / "cache.json"
    path.write_text("{not json")
    cache = autotune.TuneCache(path)
    with pytest.warns(UserWarning, match="ignored the tune cache"):
        assert cache.get("anything") is None
    cache.put("k", TileConfig(block_m=64, block_n=64))
    assert autotune.TuneCache(path).get("k") == TileConfig(block_m=64, block_n=64)


class _FakeLaunch:
    name = "fake_kernel"
    kernel = object()
    reset = None

    @staticmethod
    def grid(config):
        return (1,)

    @staticmethod
    def args(config):
        return ()


def test_op_choose_config_disabled_takes_first(monkeypatch, tmp_path):
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    candidates = [TileConfig(64, 64), TileConfig(128, 128)]
    cache = autotune.TuneCache(tmp_path / "c.json")
    cache.put(autotune._tune_key(_FakeLaunch, "shape", candidates), candidates[1])
    assert autotune.choose_config(_FakeLaunch, candidates, "shape", cache, stream=None) == candidates[0]


def test_op_choose_config_uses_cache_without_tuning(monkeypatch, tmp_path):
    monkeypatch.setenv("DISABLE_AUTOTUNE", "0")
    candidates = [TileConfig(64, 64), TileConfig(128, 128)]
    cache = autotune.TuneCache(tmp_path / "c.json")
    cache.put(autotune._tune_key(_FakeLaunch, "shape", candidates), candidates[1])

    def no_search(*args, **kwargs):
        raise AssertionError("a cached shape must not be tuned again")

    monkeypatch.setattr(autotune, "_search", no_search)
    assert autotune.choose_config(_FakeLaunch, candidates, "shape", cache, stream=None) == candidates[1]


def test_op_choose_config_tunes_again_among_other_candidates(monkeypatch, tmp_path):
    """A choice made among other candidates (an older table) is not kept: the shape tunes again,
    and both choices stay in the cache under their own keys."""
    monkeypatch.setenv("DISABLE_AUTOTUNE", "0")
    old = [TileConfig(64, 64), TileConfig(128, 128)]
    new = [*old, TileConfig(64, 64, occupancy=2)]
    cache = autotune.TuneCache(tmp_path / "c.json")
    cache.put(autotune._tune_key(_FakeLaunch, "shape", old), old[1])
    monkeypatch.setattr(autotune, "_search", lambda launch, cands, stream, timeout: cands[2])
    assert autotune.choose_config(_FakeLaunch, new, "shape", cache, stream=None) == new[2]
    assert autotune.choose_config(_FakeLaunch, list(reversed(old)), "shape", cache, stream=None) == old[1]
    assert autotune._tune_key(_FakeLaunch, "shape", old) != autotune._tune_key(_FakeLaunch, "shape", new)


def test_op_choose_config_tunes_once_and_stores(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("DISABLE_AUTOTUNE", "off")
    monkeypatch.delenv("TILEGYM_AUTOTUNE_QUIET", raising=False)
    candidates = [TileConfig(64, 64), TileConfig(128, 128)]
    calls = []

    def fake_search(launch, cands, stream, timeout):
        calls.append(cands)
        return cands[1]

    monkeypatch.setattr(autotune, "_search", fake_search)
    cache = autotune.TuneCache(tmp_path / "c.json")
    for _ in range(3):
        assert autotune.choose_config(_FakeLaunch, candidates, "shape", cache, stream=None) == candidates[1]
    assert len(calls) == 1
    assert (
        autotune.TuneCache(tmp_path / "c.json").get(autotune._tune_key(_FakeLaunch, "shape", candidates))
        == candidates[1]
    )
    progress = capsys.readouterr().err.strip().splitlines()
    assert len(progress) == 1 and "tuned fake_kernel" in progress[0]


def test_op_tuning_progress_can_be_silenced(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("DISABLE_AUTOTUNE", "0")
    monkeypatch.setenv("TILEGYM_AUTOTUNE_QUIET", "1")
    monkeypatch.setattr(autotune, "_search", lambda launch, cands, stream, timeout: cands[0])
    autotune.choose_config(
        _FakeLaunch, [TileConfig(64, 64), TileConfig(32, 32)], "s", autotune.TuneCache(tmp_path / "c"), None
    )
    assert capsys.readouterr().err == ""


def test_op_search_falls_back_when_every_candidate_fails(monkeypatch):
    def failing(launch, config, stream):
        raise RuntimeError("tileiras: out of registers")

    monkeypatch.setattr(autotune, "_median_ms", failing)
    candidates = [TileConfig(64, 64), TileConfig(128, 128)]
    with pytest.warns(UserWarning) as record:
        assert autotune._search(_FakeLaunch, candidates, stream=None, compile_timeout_sec=1) == candidates[0]
    assert len(record) == 3 and "using the default" in str(record[-1].message)


def test_op_search_warns_once_per_failed_candidate_and_picks_the_fastest(monkeypatch):
    candidates = [TileConfig(64, 64), TileConfig(128, 128), TileConfig(32, 32), TileConfig(16, 16)]
    times = {candidates[2]: 2.0, candidates[3]: 1.5}

    def fake_median(launch, config, stream):
        if config == candidates[0]:
            raise RuntimeError("ptxas out of registers\nmore")
        if config == candidates[1]:
            raise TimeoutError()
        return times[config]

    monkeypatch.setattr(autotune, "_median_ms", fake_median)
    with pytest.warns(UserWarning) as record:
        assert autotune._search(_FakeLaunch, candidates, stream=None, compile_timeout_sec=1) == candidates[3]
    assert len(record) == 2 and "ptxas out of registers" in str(record[0].message)
    assert "TimeoutError" in str(record[1].message)


# ---- environment variables -------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [("1", True), (" ON ", True), ("yes", True), ("off", False), ("No", False)])
def test_env_flag_words(monkeypatch, value, expected):
    monkeypatch.setenv("TILEGYM_SOME_FLAG", value)
    assert env.flag("TILEGYM_SOME_FLAG", not expected) is expected


@pytest.mark.parametrize("default", [True, False])
def test_env_flag_empty_or_unset_is_the_default(monkeypatch, default):
    monkeypatch.delenv("TILEGYM_SOME_FLAG", raising=False)
    assert env.flag("TILEGYM_SOME_FLAG", default) is default
    monkeypatch.setenv("TILEGYM_SOME_FLAG", " ")
    assert env.flag("TILEGYM_SOME_FLAG", default) is default


def test_env_flag_rejects_other_words(monkeypatch):
    monkeypatch.setenv("TILEGYM_SOME_FLAG", "disable")
    with pytest.raises(ValueError, match="TILEGYM_SOME_FLAG='disable' is not understood"):
        env.flag("TILEGYM_SOME_FLAG", True)


def test_env_choice(monkeypatch):
    choices = ("auto", "fused", "two-kernel")
    monkeypatch.delenv("TILEGYM_BACKWARD", raising=False)
    assert env.choice("TILEGYM_BACKWARD", choices, "auto") == "auto"
    monkeypatch.setenv("TILEGYM_BACKWARD", " Fused ")
    assert env.choice("TILEGYM_BACKWARD", choices, "auto") == "fused"
    monkeypatch.setenv("TILEGYM_BACKWARD", "x")
    message = "TILEGYM_BACKWARD='x' is not understood: use one of ('auto', 'fused', 'two-kernel')"
    with pytest.raises(ValueError) as raised:
        env.choice("TILEGYM_BACKWARD", choices, "auto")
    assert str(raised.value) == message


def test_env_imports_nothing_heavy():
    """Loaded alone, past the package's __init__ (which imports torch for the ops)."""
    code = (
        "import importlib.util, sys; spec = importlib.util.spec_from_file_location('env', sys.argv[1]); "
        "spec.loader.exec_module(importlib.util.module_from_spec(spec)); "
        "assert not {'torch', 'cuda', 'tilegym'} & set(sys.modules), sys.modules.keys(); print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code, env.__file__], capture_output=True, text=True, check=False)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


def test_autotune_quiet_rejects_other_words_before_tuning(monkeypatch, tmp_path):
    monkeypatch.setenv("DISABLE_AUTOTUNE", "0")
    monkeypatch.setenv("TILEGYM_AUTOTUNE_QUIET", "silent")

    def no_search(*args):
        raise AssertionError("tuned before reading TILEGYM_AUTOTUNE_QUIET")

    monkeypatch.setattr(autotune, "_search", no_search)
    cache = autotune.TuneCache(tmp_path / "c.json")
    with pytest.raises(ValueError, match="TILEGYM_AUTOTUNE_QUIET"):
        autotune.choose_config(_FakeLaunch, [TileConfig(64, 64), TileConfig(32, 32)], "s", cache, None)


def test_cache_dir_expands_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TILEGYM_CACHE_DIR", "~/tilegym-cache")
    assert autotune.cache_dir() == tmp_path / "tilegym-cache"


# ---- tune cache entries ----------------------------------------------------------------------


def _write_json(path, stored) -> None:
    path.write_text(json.dumps(stored))


def test_tune_cache_skips_entries_that_are_not_tile_configs(tmp_path):
    path = tmp_path / "c.json"
    _write_json(
        path,
        {
            "good": {"block_m": 64, "block_n": 64},
            "float": {"block_m": 128.0, "block_n": 64},
            "bool": {"block_m": True},
            "unknown field": {"block_m": 64, "stages": 3},
            "missing block_m": {"block_n": 64},
            "null block_m": {"block_m": None},
            "not a dict": 64,
        },
    )
    with pytest.warns(UserWarning, match="skipped 6 entries") as record:
        cache = autotune.TuneCache(path)
        assert cache.get("good") == TileConfig(64, 64)
        assert cache.get("float") is None and cache.get("unknown field") is None
    assert len(record) == 1


@pytest.mark.parametrize("text", ["[]", "null", "1", '"text"', "[" * 100_000 + "]" * 100_000, '{"k": ' + "[" * 100_000])
def test_tune_cache_ignores_a_file_that_is_not_an_object(tmp_path, text):
    path = tmp_path / "c.json"
    path.write_text(text)
    cache = autotune.TuneCache(path)
    with pytest.warns(UserWarning, match="ignored the tune cache") as record:
        assert cache.get("k") is None
    assert len(record) == 1
    cache.put("k", TileConfig(64, 64))
    assert autotune.TuneCache(path).get("k") == TileConfig(64, 64)


def test_a_float_tile_size_in_the_file_is_tuned_again(monkeypatch, tmp_path):
    """128.0 equals 128, so it would pass for a candidate and reach the kernel as a float."""
    monkeypatch.setenv("DISABLE_AUTOTUNE", "0")
    monkeypatch.setenv("TILEGYM_AUTOTUNE_QUIET", "1")
    candidates = [TileConfig(64, 64), TileConfig(128, 128)]
    path = tmp_path / "c.json"
    key = autotune._tune_key(_FakeLaunch, "shape", candidates)
    _write_json(path, {key: {"block_m": 128.0, "block_n": 128}})
    searched = []
    monkeypatch.setattr(autotune, "_search", lambda launch, cands, stream, timeout: searched.append(1) or cands[1])
    with pytest.warns(UserWarning, match="skipped 1 entries"):
        chosen = autotune.choose_config(_FakeLaunch, candidates, "shape", autotune.TuneCache(path), None)
    assert searched == [1] and type(chosen.block_m) is int
    assert json.loads(path.read_text()) == {key: {"block_m": 128, "block_n": 128}}


def test_tune_cache_keeps_entries_it_cannot_read(tmp_path):
    """An entry of another version (a field this one lacks) stays in the file for that version."""
    path = tmp_path / "c.json"
    later = {"block_m": 64, "stages": 3}
    _write_json(path, {"later": later, "good": {"block_m": 32}})
    with pytest.warns(UserWarning, match="skipped 1 entries"):
        cache = autotune.TuneCache(path)
        cache.put("new", TileConfig(16, 16))
    stored = json.loads(path.read_text())
    assert stored == {"later": later, "good": {"block_m": 32}, "new": {"block_m": 16, "block_n": 16}}


def test_tune_cache_file_name_has_a_format_version(monkeypatch, tmp_path):
    monkeypatch.setenv("TILEGYM_CACHE_DIR", str(tmp_path))
    _write_json(tmp_path / "autotune-GPU-cuda-tile-1.7.0.json", {"k": {"block_m": 64}})  # the first format
    cache = autotune.tune_cache("GPU", "1.7.0")
    assert cache.path.name == "autotune-v2-GPU-cuda-tile-1.7.0.json"
    assert cache.get("k") is None


# ---- sharing the tune cache ------------------------------------------------------------------


def test_two_caches_of_one_file_keep_each_others_entries(tmp_path):
    path = tmp_path / "c.json"
    first, second = autotune.TuneCache(path), autotune.TuneCache(path)
    assert first.get("a") is None and second.get("b") is None  # both have read the empty file
    first.put("a", TileConfig(64, 64))
    second.put("b", TileConfig(32, 32))
    fresh = autotune.TuneCache(path)
    assert fresh.get("a") == TileConfig(64, 64) and fresh.get("b") == TileConfig(32, 32)
    assert second.get("a") == TileConfig(64, 64)  # a put also brings in what others wrote


def _put_many(path: str, name: str, count: int, start) -> None:
    """One process of the side-by-side test: puts its own keys, and reads the file after each."""
    import warnings

    warnings.simplefilter("error")  # a torn file read by the check below would warn
    cache = autotune.TuneCache(Path(path))
    start.wait()
    for index in range(count):
        cache.put(f"{name}|{index}", TileConfig(16 + index))
        assert autotune.TuneCache(cache.path).get(f"{name}|{index}") == TileConfig(16 + index)


def test_processes_tuning_side_by_side_keep_every_entry(tmp_path):
    # fork: a spawned process would import torch again (seconds), and the file is what is shared
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    start = context.Barrier(3)
    path, count = tmp_path / "c.json", 40
    workers = [context.Process(target=_put_many, args=(str(path), name, count, start)) for name in ("p", "q", "r")]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert [worker.exitcode for worker in workers] == [0, 0, 0]
    stored = autotune.TuneCache(path)
    assert all(stored.get(f"{name}|{index}") == TileConfig(16 + index) for name in "pqr" for index in range(count))


def test_threads_on_a_new_shape_tune_it_once(monkeypatch, tmp_path):
    """Threads, one per stream, meeting a new shape together: one tunes, the others take its choice."""
    monkeypatch.setenv("DISABLE_AUTOTUNE", "0")
    monkeypatch.setenv("TILEGYM_AUTOTUNE_QUIET", "1")
    monkeypatch.setattr(autotune, "_chosen", {})
    candidates = [TileConfig(64, 64), TileConfig(128, 128), TileConfig(32, 32)]
    searches, launched = [], []

    def slow_search(launch, cands, stream, timeout):
        searches.append(stream)
        time.sleep(0.05)  # the others arrive meanwhile
        return cands[len(searches)]  # a tie broken differently each time

    monkeypatch.setattr(autotune, "_search", slow_search)
    monkeypatch.setattr(ct, "launch", lambda stream, grid, kernel, args: launched.append(stream))
    cache = autotune.TuneCache(tmp_path / "c.json")
    start = threading.Barrier(4)
    chosen = {}

    def launch_on(stream):
        start.wait()
        chosen[stream] = autotune.launch_tuned(_FakeLaunch, candidates, "shape", cache, stream).config

    threads = [threading.Thread(target=launch_on, args=(stream,)) for stream in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(searches) == 1
    assert set(chosen.values()) == {candidates[1]} and sorted(launched) == [0, 1, 2, 3]


# ---- the cache dir ---------------------------------------------------------------------------


def test_cache_dir_and_files_are_private(monkeypatch, tmp_path):
    monkeypatch.setenv("TILEGYM_CACHE_DIR", str(tmp_path / "made" / "here"))
    umask = os.umask(0o022)
    try:
        cache = autotune.tune_cache("GPU", "1.7.0")
        cache.put("k", TileConfig(64))
    finally:
        os.umask(umask)
    assert os.stat(tmp_path / "made" / "here").st_mode & 0o777 == 0o700
    assert os.stat(cache.path).st_mode & 0o777 == 0o600


def test_cache_dir_open_to_others_is_not_used(monkeypatch, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("TILEGYM_CACHE_DIR", str(shared))
    with pytest.warns(UserWarning, match="group or others may write to it") as record:
        cache = autotune.tune_cache("GPU", "1.7.0")
        cache.put("k", TileConfig(64))
        assert autotune.usable_cache_dir() is None
    assert len(record) == 1
    assert cache.get("k") == TileConfig(64)  # kept in memory
    assert list(shared.iterdir()) == []


def test_cache_dir_of_another_user_is_not_used(monkeypatch, tmp_path):
    monkeypatch.setenv("TILEGYM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    with pytest.warns(UserWarning, match="belongs to user"):
        autotune.tune_cache("GPU", "1.7.0").put("k", TileConfig(64))
    assert list(tmp_path.iterdir()) == []


def test_temporary_names_are_fresh_and_links_there_are_not_followed(tmp_path):
    """The first format wrote through <name>.<pid>.tmp: a link planted there redirected the write."""
    path, victim = tmp_path / "c.json", tmp_path / "victim"
    victim.write_text("untouched")
    path.with_suffix(f".{os.getpid()}.tmp").symlink_to(victim)
    replaced = []
    replace = os.replace

    def recording(source, target):
        replaced.append(source)
        replace(source, target)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "replace", recording)
        autotune.TuneCache(path).put("a", TileConfig(64))
        autotune.TuneCache(path).put("b", TileConfig(32))
    assert victim.read_text() == "untouched"
    assert len(set(replaced)) == 2
    assert autotune.TuneCache(path).get("a") == TileConfig(64)


_FULL_DISK = """
import resource, signal, sys, warnings
from pathlib import Path
from tilegym import autotune

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
warnings.simplefilter("always")
autotune.TuneCache(Path(sys.argv[1])).put("new", autotune.TileConfig(16))
"""


def test_a_full_disk_leaves_no_temporary_files(tmp_path):
    """A write that fails part way (a file size limit here, as a full disk would) leaves the
    file as it was and nothing beside it."""
    pytest.importorskip("resource")
    path = tmp_path / "c.json"
    _write_json(path, {f"shape {index}": {"block_m": 64, "block_n": 64} for index in range(200)})
    before = path.read_bytes()
    result = subprocess.run([sys.executable, "-c", _FULL_DISK, str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "could not write the tune cache" in result.stderr
    assert path.read_bytes() == before
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["c.json", "c.json.lock"]


def test_force_config_holds_one_config_for_one_kernel_within_its_block():
    forced, outer = autotune.TileConfig(32, 32), autotune.TileConfig(64, 64)
    autotune._chosen[("k", "shape", None, False)] = (outer, None)
    with autotune.force_config("k", outer):
        with autotune.force_config("k", forced):
            assert autotune.forced_candidates("k") == (forced,) and autotune.forced_candidates("other") is None
            assert not autotune._chosen  # a choice made before the block does not outlive it
        assert autotune.forced_candidates("k") == (outer,)
    assert autotune.forced_candidates("k") is None


def test_a_launcher_takes_the_forced_config_as_its_only_candidate():
    import torch

    from tilegym.ops.attention import configs, launch
    from tilegym.ops.attention import problem as problem_mod

    problem = problem_mod.AttentionProblem(1, 2, 2, 64, 64, 128, torch.bfloat16, 0.1, False)
    launcher = launch._Launcher.__new__(launch._Launcher)
    launcher.problem, launcher.arch = problem, "sm_90"
    forced = autotune.TileConfig(16, 16)
    with autotune.force_config(configs.BACKWARD_DQ, forced):
        assert launcher.candidates(configs.BACKWARD_DQ) == (forced,)
        assert forced not in launcher.candidates(configs.BACKWARD_DKDV)
