"""The first-use checks without a GPU: each missing piece gives one error saying what to install."""

import pytest
import torch

from tilegym import requirements
from tilegym.requirements import RequirementError


@pytest.fixture
def gpu(monkeypatch):
    """A machine that passes every check, for each test to take one piece away."""
    requirements.check.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(requirements, "driver_version", lambda: 13000)
    monkeypatch.setattr(requirements, "tileiras_paths", lambda: ["/opt/tileiras"])
    yield monkeypatch
    requirements.check.cache_clear()


def test_a_complete_machine_passes(gpu):
    requirements.check(0)


def test_no_gpu_says_what_is_needed(gpu):
    gpu.setattr(torch.cuda, "is_available", lambda: False)
    gpu.setattr(torch.version, "cuda", None)
    with pytest.raises(
        RequirementError, match="NVIDIA GPU .* CUDA build of PyTorch; this machine has a CPU-only build"
    ):
        requirements.check(0)


def test_an_old_gpu_is_named(gpu):
    gpu.setattr(torch.cuda, "get_device_capability", lambda index: (7, 5))
    gpu.setattr(torch.cuda, "get_device_name", lambda index: "Tesla T4")
    with pytest.raises(RequirementError, match="Tesla T4 has compute capability 7.5; tilegym needs 8.0"):
        requirements.check(0)


def test_an_old_driver_asks_for_r580(gpu):
    gpu.setattr(requirements, "driver_version", lambda: 12080)
    with pytest.raises(RequirementError, match="supports CUDA 12.8; cuTile needs CUDA 13.0, a driver r580"):
        requirements.check(0)


def test_a_missing_compiler_names_the_install_command(gpu):
    gpu.setattr(requirements, "tileiras_paths", lambda: [])
    with pytest.raises(RequirementError, match=r"tileiras\) is not installed: pip install -e \"\.\[tileiras\]\""):
        requirements.check(0)


def test_tileiras_found_on_path(tmp_path):
    binary = tmp_path / "tileiras"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert str(binary) in requirements.tileiras_paths(search_path=str(tmp_path), cuda_home="/nonexistent")
