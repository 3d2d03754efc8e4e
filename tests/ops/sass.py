"""The attention kernels' SASS, compiled ahead of time and read on a machine without a GPU.

Every compiled form of the kernels is a variant named in tilegym/ops/attention/variants.py
(VARIANTS); everything here takes a variant's name and reads the rest from the registry and
the config tables (configs.py). Four parts:

- compile: a variant's launch signature, built from its kernel's parameter names and
  annotations as PyTorch tensors would fill it, and its cubin for one arch (sm_90, sm_100, ...),
  optionally with score-modifier switches on or every array indexed by int64.
- read: the cubin's SASS (cuobjdump), instruction counts, the innermost matmul loops (the
  steps a kernel repeats per tile), and whether ptxas serialized the warpgroup matmuls.
- fingerprints: hashes of every variant's plain sm_90 code, stored in sass_fingerprints.json,
  to prove the score modifiers cost plain attention nothing.
- matmul waits: how much work the compiler overlaps with each warpgroup matmul.

Command line, `python -m tests.ops.sass COMMAND`:
  list                         every variant: its pinned switches, whether it takes modifiers
  fingerprints [--update]      compare the plain code with the stored fingerprints, or rewrite them
  waits [VARIANT ...]          matmul waits at the default sm_90 configs (default: every variant)
  loops VARIANT [--packed]     instructions per matmul loop, dense or packed
  dump VARIANT                 print one variant's SASS
"""

import argparse
import hashlib
import inspect
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from collections import Counter
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import cuda.tile as ct
from cuda.tile.compilation import ArrayConstraint, CallingConvention, KernelSignature, ScalarConstraint, export_kernel

from tilegym import autotune, index_width
from tilegym.ops.attention import configs, launch, programmable
from tilegym.ops.attention.variants import ANY_SCORES, VARIANTS

# ---------------------------------------------------------------------------------------------
# Compile
# ---------------------------------------------------------------------------------------------

# The score modifiers' switches, all off: plain attention.
PLAIN = {
    "windowed": False, "capped": False, "bias_mode": 0, "alibi": False, "bias_grad": 0, "with_sinks": False,
    "lse_grad": False, "sinks_grad": False, "varlen": False, "block_sparse": False, "stats_by_sequence": False,
    "dropout": False,
}  # fmt: skip
# Per-row arrays [B, H, S] in the accumulators' dtype: statistics, the LSE's gradient, and the
# per-tile shares of the sinks' gradient ([B, H, query tiles]).
_ROW_STATS = ("Lse", "Delta", "LseBase2", "DLse", "DSinks")


@cache
def parameters(name: str) -> tuple[str, ...]:
    """The names of a variant's kernel parameters."""
    return tuple(inspect.signature(VARIANTS[name].kernel._pyfunc).parameters)


def takes(name: str, parameter: str) -> bool:
    """Whether a variant's kernel has a parameter (e.g. `causal`, `bias_grad`): a compile-time
    switch it lacks changes nothing in its code."""
    return parameter in parameters(name)


def array_constraint(dtype, ndim: int, index_dtype=ct.int32) -> ArrayConstraint:
    """An array as PyTorch hands over a contiguous, 16-byte aligned tensor."""
    return ArrayConstraint(
        dtype=dtype,
        ndim=ndim,
        index_dtype=index_dtype,
        stride_lower_bound_incl=0,
        alias_groups=(),
        may_alias_internally=False,
        stride_constant=(None,) * (ndim - 1) + (1,),
        stride_divisible_by=(8,) * (ndim - 1) + (1,),
        base_addr_divisible_by=16,
    )


def signature(
    name: str,
    dtype,
    head_dim: int,
    config: autotune.TileConfig,
    causal: bool,
    switches=None,
    wide=False,
    arrays=None,
    value_dim=None,
) -> KernelSignature:
    """A variant's signature for one launch, built from its kernel's parameter names and annotations.

    The variant's pinned parameters (Variant.fixed) are constants; switches overrides entries
    of PLAIN (the score modifiers' switches); wide gives every array int64 sizes and strides
    (index_width.wide's twin of the kernel); arrays maps parameter names to (dtype, ndim) of
    other arrays than the defaults (the caller's aux tensors, say); value_dim: V's head dim (head_dim
    when None). Only the head-dim tiles enter the code: head dims with the same tiles (80 and
    128) compile to the same cubin.
    """
    index_dtype = ct.int64 if wide else ct.int32
    variant = VARIANTS[name]
    stat_dtype = ct.float64 if dtype == ct.float64 else ct.float32
    constants = {
        "block_m": config.block_m,
        "block_n": config.block_n,
        "block_d": configs.head_dim_tiles(head_dim)[0],
        "block_d_tail": configs.head_dim_tiles(head_dim)[1],
        # V's head dim as the launches tile it.
        **launch.value_tile_arguments(value_dim or head_dim, parameters(name)),
        "causal": causal,
        **PLAIN,
        **variant.fixed,
        **(switches or {}),
    }
    params = []
    for param_name, param in inspect.signature(variant.kernel._pyfunc).parameters.items():
        if arrays and param_name in arrays:
            params.append(array_constraint(*arrays[param_name], index_dtype))
        elif param_name in constants:
            params.append(constants[param_name])
        elif param.annotation is float:
            params.append(ScalarConstraint(ct.float32))
        elif param.annotation is int:
            params.append(ScalarConstraint(ct.int32))
        elif (
            param_name in _ROW_STATS
            or param_name == "DBias"
            or (param_name == "DQSum" and constants.get("sum_dq"))
            or (param_name in ("dK", "dV") and constants.get("sum_dkdv"))
        ):
            params.append(array_constraint(stat_dtype, 3 if param_name in _ROW_STATS else 4, index_dtype))
        elif param_name == "Slopes":
            params.append(array_constraint(ct.float32, 2, index_dtype))
        elif param_name in ("CuSeqlensQ", "CuSeqlensK", "DropoutSeed"):
            params.append(array_constraint(ct.int32, 1, index_dtype))
        elif param_name == "MaskCounts":
            params.append(array_constraint(ct.int32, 4, index_dtype))
        elif param_name == "MaskTiles":
            params.append(array_constraint(ct.int32, 5, index_dtype))
        elif param_name.startswith(("Aux", "MaskAux")):
            # The caller's tensors (or one-element placeholders without a function).
            params.append(array_constraint(ct.float32, 1, index_dtype))
        elif param_name == "Sinks":
            params.append(array_constraint(stat_dtype, 1, index_dtype))
        else:
            params.append(array_constraint(dtype, 4, index_dtype))
    return KernelSignature(params, CallingConvention.cutile_python_v2()).with_mangled_symbol(name)


def compile_cubin(
    name: str,
    dtype,
    head_dim: int,
    config,
    causal: bool,
    arch: str,
    path: Path,
    switches=None,
    wide=False,
    value_dim=None,
    functions=None,
    arrays=None,
) -> Path:
    """Compile a variant for one launch signature (see signature) to a cubin at path; functions:
    the caller's (programmable.user_functions), compiled into the variant's copy that calls them,
    and arrays the types of their aux arrays (signature)."""
    kernel = programmable.user_kernel(VARIANTS[name].kernel, functions)
    kernel = autotune.with_hints(index_width.wide(kernel) if wide else kernel, config)
    export_kernel(
        kernel,
        [signature(name, dtype, head_dim, config, causal, switches, wide, arrays, value_dim)],
        str(path),
        gpu_code=arch,
        output_format="cubin",
    )
    return path


def default_sass(name: str, head_dim: int, causal: bool, workdir: Path, arch: str = "sm_90") -> str:
    """The SASS of a variant's plain bf16 form at its default config (its table's first)."""
    config = configs.candidates(name, arch, head_dim, 2)[0]
    return disassemble(compile_cubin(name, ct.bfloat16, head_dim, config, causal, arch, workdir / f"{name}.cubin"))


# ---------------------------------------------------------------------------------------------
# Read
# ---------------------------------------------------------------------------------------------


def cuobjdump() -> str | None:
    """cuobjdump from PATH or from the nvidia-cuda-cuobjdump wheel."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    for root in {sysconfig.get_paths()["purelib"], *sys.path}:
        candidate = Path(root) / "nvidia" / "cu13" / "bin" / "cuobjdump"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def disassemble(cubin: Path) -> str:
    """The SASS listing of a cubin."""
    tool = cuobjdump()
    if tool is None:
        raise RuntimeError("cuobjdump not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    return subprocess.run([tool, "--dump-sass", str(cubin)], check=True, capture_output=True, text=True).stdout


def count_instructions(text: str, opcode: str) -> int:
    return len(re.findall(rf"\b{opcode}\b", text))


_ADDRESSED = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_BRANCH_TARGET = re.compile(r"\bBRA\s+0x([0-9a-f]+)")


@dataclass(frozen=True)
class MatmulLoop:
    """An innermost loop that issues warpgroup MMA: the steps a kernel repeats per tile. Its
    address range and its instructions' opcodes in order (no predicate, no modifiers)."""

    start: int
    end: int
    opcodes: tuple[str, ...]


def _opcode(instruction: str) -> str:
    words = instruction.split() or [""]
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def matmul_loops(text: str) -> list[MatmulLoop]:
    """The innermost loops of a listing that issue warpgroup MMA. Loops are the ranges of
    backward branches before the kernel's last EXIT; the slow paths placed after it (barrier
    waits) jump back from there and are no loops."""
    instructions = [(int(address, 16), body) for address, body in _ADDRESSED.findall(text)]
    last_exit = max((address for address, body in instructions if re.search(r"\bEXIT\b", body)), default=0)
    loops = []
    for address, body in instructions:
        target = _BRANCH_TARGET.search(body)
        if target and address < last_exit and int(target.group(1), 16) < address:
            loops.append((int(target.group(1), 16), address))
    innermost = [
        (start, end)
        for start, end in loops
        if not any(start <= s and e <= end and (s, e) != (start, end) for s, e in loops)
    ]
    found = []
    for start, end in innermost:
        opcodes = tuple(_opcode(body) for address, body in instructions if start <= address <= end)
        if "HGMMA" in opcodes:
            found.append(MatmulLoop(start, end, opcodes))
    return found


def spills_in_matmul_loops(text: str) -> int:
    """Local-memory instructions (LDL/STL) inside the innermost matmul loops (matmul_loops). A
    spill around them (a loop bound kept across a loop) costs once per loop."""
    return sum(opcode in ("LDL", "STL") for loop in matmul_loops(text) for opcode in loop.opcodes)


def matmuls_serialized(text: str) -> bool:
    """Whether every warpgroup MMA (HGMMA) of a listing closes a group of its own (`gsb0`), so
    each is waited for alone: what ptxas does to a whole kernel when it finds too few registers
    to pipeline them (its advisory C7511, which cuTile's compile does not show)."""
    matmuls = re.findall(r"\bHGMMA\.[^;]*;", text)
    return bool(matmuls) and all(matmul.rstrip(" ;").endswith("gsb0") for matmul in matmuls)


# ---------------------------------------------------------------------------------------------
# Fingerprints
# ---------------------------------------------------------------------------------------------
# With every score-modifier switch off, a variant's code must stay instruction for instruction
# what it was before the modifiers existed. A fingerprint hashes the instructions with their hex
# immediates blanked out: kernel parameters added for the modifiers shift the constant-bank
# offsets of the others, which is not a change of code. `python -m tests.ops.sass fingerprints
# --update` rewrites the stored ones: only for a deliberate change of the plain kernels, a new
# variant, or a new pinned compiler.

STORED = Path(__file__).with_name("sass_fingerprints.json")
FINGERPRINT_HEAD_DIMS = (64, 128)


def fingerprint_cases() -> list[tuple[str, int, bool]]:
    """(variant, head dim, causal): every variant's plain sm_90 bf16 form at its default config,
    at head dims 64 and 128 where it has a table, causal and not where its kernel has the switch."""
    return [
        (name, head_dim, causal)
        for name in VARIANTS
        for head_dim in FINGERPRINT_HEAD_DIMS
        if configs.candidates(name, "sm_90", head_dim, 2)
        for causal in ((False, True) if takes(name, "causal") else (False,))
    ]


def fingerprint_name(name: str, head_dim: int, causal: bool) -> str:
    return f"{name}-bfloat16-{head_dim}-{causal}"


def normalized_instructions(sass_text: str) -> list[str]:
    lines = [re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).strip() for line in sass_text.splitlines()]
    lines = [line for line in lines if ";" in line]
    return [re.sub(r"\s+", " ", re.sub(r"0x[0-9a-f]+", "HEX", line)) for line in lines]


def fingerprint(sass_text: str) -> str:
    return hashlib.sha256("\n".join(normalized_instructions(sass_text)).encode()).hexdigest()


def current_fingerprint(name: str, head_dim: int, causal: bool, workdir: Path) -> str:
    return fingerprint(default_sass(name, head_dim, causal, workdir))


def stored() -> dict[str, str]:
    return json.loads(STORED.read_text())


def _fingerprints(update: bool) -> int:
    """Compare (or with update, rewrite) the stored fingerprints; the exit status."""
    old = stored() if STORED.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        new = {fingerprint_name(*case): current_fingerprint(*case, Path(tmp)) for case in fingerprint_cases()}
    differ = 0
    for name in sorted(old.keys() | new.keys()):
        if old.get(name) == new.get(name):
            state = "same"
        else:
            state = "new" if name not in old else "gone" if name not in new else "CHANGED"
            differ += 1
        print(f"{state:8} {name}")
    if update:
        STORED.write_text(json.dumps(new, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(new)} fingerprints to {STORED}")
        return 0
    print(f"{differ} of {len(old.keys() | new.keys())} differ from {STORED.name}" if differ else "all match")
    return 1 if differ else 0


# ---------------------------------------------------------------------------------------------
# Matmul waits
# ---------------------------------------------------------------------------------------------
# A warpgroup issues a matmul as a group of `HGMMA` instructions, the last marked `gsb0`, and
# waits for it with `WARPGROUP.DEPBAR.LE gsb0, N` (N groups may still be in flight). Whatever the
# warpgroup issues between a group's last `HGMMA` and that wait runs under the matmul; with
# cuda-tile 1.7 that is next to nothing in every hot kernel (perf-notes sections 23 and 41),
# which is what bounds our ratios to cuDNN. `python -m tests.ops.sass waits` prints the counts at
# the default sm_90 configs, no mask, so a new compiler can be judged in minutes.

_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_WAIT = re.compile(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)")


@dataclass(frozen=True)
class Wait:
    in_flight: int  # groups the wait lets run on
    inside: int  # instructions issued between the group's first and last HGMMA
    after: int  # instructions issued between the group's last HGMMA and the wait


def matmul_waits(sass_text: str) -> list[Wait]:
    """The matmul waits of a SASS listing, each with the group before it on the fall-through path.

    Predicated branches (loop back edges, retries of barrier waits) may fall through, so they
    do not end a path; an unconditional branch, EXIT or RET does.
    """
    waits = []
    inside = None  # instructions since the open group's first HGMMA; None outside a group
    group = None  # (inside, after) of the last closed group; None before any or after a branch
    for line in sass_text.splitlines():
        found = _INSTRUCTION.search(line)
        if not found or found.group(1).startswith("NOP"):
            continue
        instruction = found.group(1)
        wait = _WAIT.search(instruction)
        if wait:
            if group is not None:
                waits.append(Wait(int(wait.group(1), 16), *group))
                # Past a wait for all groups, a further wait has nothing to wait for.
                group = group if waits[-1].in_flight else None
        elif "HGMMA" in instruction:
            inside = inside or 0
            if instruction.endswith("gsb0"):
                group, inside = (inside, 0), None
        elif re.match(r"(BRA|EXIT|RET)\b", instruction):
            # The next address is not reached from here: count along fall-through paths only.
            inside = group = None
        else:
            inside = None if inside is None else inside + 1
            group = None if group is None else (group[0], group[1] + 1)
    return waits


def summary(waits: list[Wait]) -> str:
    if not waits:
        return "no matmul wait follows its group on a fall-through path"
    after = [wait.after for wait in waits]
    inside = [wait.inside for wait in waits]
    return (
        f"{len(waits)} waits, {sum(wait.in_flight > 0 for wait in waits)} letting a group run on; "
        f"instructions between a group's last HGMMA and its wait: median {statistics.median(after):g}, "
        f"max {max(after)}; among its own HGMMAs: median {statistics.median(inside):g}, max {max(inside)}"
    )


def _waits(names, head_dims, causal: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            for head_dim in head_dims:
                choices = configs.candidates(name, "sm_90", head_dim, 2)
                if not choices:
                    continue
                text = default_sass(name, head_dim, causal, Path(tmp))
                found = summary(matmul_waits(text)) if count_instructions(text, "HGMMA") else "no HGMMA"
                tile = "x".join(str(block) for block in (choices[0].block_m, choices[0].block_n) if block)
                print(f"{name}, D={head_dim} ({tile}): {found}", flush=True)


def _table_config(name: str, arch: str, head_dim: int, tiles=None):
    """A variant's table's first config, or its first with these (block_m, block_n); None if none."""
    choices = configs.candidates(name, arch, head_dim, 2)
    if tiles:
        choices = [config for config in choices if (config.block_m, config.block_n) == tuple(tiles)]
    return choices[0] if choices else None


def _loops(name: str, head_dim: int, causal: bool, packed: bool, config, arch: str) -> None:
    """Instructions of each innermost matmul loop (matmul_loops) of a variant's plain bf16 form at
    one config, dense or packed."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = compile_cubin(
            name, ct.bfloat16, head_dim, config, causal, arch, Path(tmp) / "k.cubin", {"varlen": packed}
        )  # fmt: skip
        loops = matmul_loops(disassemble(cubin))
    form = "packed" if packed else "dense"
    tile = "x".join(str(block) for block in (config.block_m, config.block_n) if block)
    print(f"{name}, D={head_dim} ({tile}), {form}: {len(loops)} matmul loops")
    for loop in loops:
        counts = Counter(loop.opcodes).most_common()
        print(
            f"  {loop.start:#07x}-{loop.end:#07x}: {len(loop.opcodes)} instructions; "
            + " ".join(f"{op} {n}" for op, n in counts)
        )


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _list() -> None:
    width = max(map(len, VARIANTS))
    for name, variant in VARIANTS.items():
        fixed = " ".join(f"{key}={value}" for key, value in variant.fixed.items()) or "-"
        form = (
            "modifiable"
            if variant.modifiers == ANY_SCORES
            else " or ".join("+".join(sorted(allowed)) for allowed in variant.modifiers if allowed) or "plain only"
        )
        print(f"{name:{width}}  {form:10}  {'default' if variant.default else 'sm_90 only':10}  fixed: {fixed}")
        print(f"{'':{width}}  {variant.about}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.ops.sass", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="every variant, its pinned switches, whether it takes score modifiers")
    prints = commands.add_parser("fingerprints", help=f"compare the plain sm_90 code with {STORED.name}")
    prints.add_argument("--update", action="store_true", help=f"rewrite {STORED.name}")
    waits = commands.add_parser("waits", help="work overlapping each warpgroup matmul, default sm_90 configs")
    waits.add_argument("variants", nargs="*", metavar="VARIANT", help="default: every variant")
    waits.add_argument("--head-dims", type=int, nargs="+", default=list(FINGERPRINT_HEAD_DIMS))
    waits.add_argument("--causal", action="store_true")
    loops = commands.add_parser("loops", help="instructions per matmul loop of a variant, dense or packed")
    loops.add_argument("variant", metavar="VARIANT")
    loops.add_argument("--head-dim", type=int, default=128)
    loops.add_argument("--causal", action="store_true")
    loops.add_argument("--packed", action="store_true", help="the packed variable-length form (varlen)")
    loops.add_argument("--tiles", type=int, nargs=2, metavar=("BLOCK_M", "BLOCK_N"), help="a config of the table")
    loops.add_argument("--arch", default="sm_90", choices=configs.ARCHS)
    dump = commands.add_parser("dump", help="print a variant's plain bf16 SASS at its default config")
    dump.add_argument("variant", metavar="VARIANT")
    dump.add_argument("--head-dim", type=int, default=128)
    dump.add_argument("--causal", action="store_true")
    dump.add_argument("--arch", default="sm_90", choices=configs.ARCHS)
    args = parser.parse_args(argv)
    if args.command == "list":
        _list()
        return 0
    if args.command == "fingerprints":
        return _fingerprints(args.update)
    names = (args.variants or list(VARIANTS)) if args.command == "waits" else [args.variant]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant {', '.join(unknown)}; `list` names them")
    if args.command == "loops":
        config = _table_config(args.variant, args.arch, args.head_dim, args.tiles)
        if config is None:
            tiles = f" with tiles {args.tiles[0]}x{args.tiles[1]}" if args.tiles else ""
            parser.error(f"{args.variant} has no {args.arch} config at head dim {args.head_dim}{tiles}")
        if args.packed and not takes(args.variant, "varlen"):
            parser.error(f"{args.variant} has no packed form")
        _loops(args.variant, args.head_dim, args.causal, args.packed, config, args.arch)
    elif args.command == "waits":
        _waits(names, args.head_dims, args.causal)
    elif not configs.candidates(args.variant, args.arch, args.head_dim, 2):
        parser.error(f"{args.variant} has no {args.arch} config at head dim {args.head_dim}")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            print(default_sass(args.variant, args.head_dim, args.causal, Path(tmp), args.arch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
