"""The examples on a machine without a GPU: what they need, a non-zero exit, no traceback."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.name)
def test_examples_without_a_gpu_say_what_they_need(example):
    result = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "NVIDIA GPU" in result.stderr and "CUDA build of PyTorch" in result.stderr


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.name)
def test_examples_have_help(example):
    result = subprocess.run([sys.executable, str(example), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "usage:" in result.stdout
