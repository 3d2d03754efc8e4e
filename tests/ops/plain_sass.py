"""Fingerprints of the plain attention kernels' sm_90 SASS, to prove the score modifiers cost
plain attention nothing: with every switch off, the code must stay instruction for instruction
what it was before the modifiers existed.

A fingerprint hashes the instructions with their hex immediates blanked out: kernel
parameters added for the modifiers shift the constant-bank offsets of the others, which is
not a change of code. `python -m tests.ops.plain_sass --update` rewrites the stored ones
(do it only for a deliberate change of the plain kernels, or a new pinned compiler).
"""

import hashlib
import json
import re
import sys
import tempfile
from pathlib import Path

import cuda.tile as ct

from tests.ops import aot
from tilegym.ops.attention import configs

STORED = Path(__file__).with_name("plain_sass_fingerprints.json")
MATRIX_KERNELS = (configs.FORWARD, configs.FORWARD_LSE, configs.BACKWARD_DKDV, configs.BACKWARD_DQ)
VARIANTS = [
    (kernel, head_dim, causal) for kernel in MATRIX_KERNELS for head_dim in (64, 128) for causal in (False, True)
]


def variant_name(kernel: str, head_dim: int, causal: bool) -> str:
    return f"{kernel}-bfloat16-{head_dim}-{causal}"


def normalized_instructions(sass_text: str) -> list[str]:
    lines = [re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).strip() for line in sass_text.splitlines()]
    lines = [line for line in lines if ";" in line]
    return [re.sub(r"\s+", " ", re.sub(r"0x[0-9a-f]+", "HEX", line)) for line in lines]


def fingerprint(sass_text: str) -> str:
    return hashlib.sha256("\n".join(normalized_instructions(sass_text)).encode()).hexdigest()


def current_fingerprint(kernel: str, head_dim: int, causal: bool, workdir: Path) -> str:
    config = configs.candidates(kernel, "sm_90", head_dim, 2)[0]
    cubin = aot.compile_cubin(kernel, ct.bfloat16, head_dim, config, causal, "sm_90", workdir / "plain.cubin")
    return fingerprint(aot.sass(cubin))


def stored() -> dict[str, str]:
    return json.loads(STORED.read_text())


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: python -m tests.ops.plain_sass --update")
    with tempfile.TemporaryDirectory() as tmp:
        prints = {variant_name(*v): current_fingerprint(*v, Path(tmp)) for v in VARIANTS}
    STORED.write_text(json.dumps(prints, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(prints)} fingerprints to {STORED}")
