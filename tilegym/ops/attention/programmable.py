"""Programmable attention on the host: the caller's score and mask functions, checked, keyed
and compiled into copies of the kernels.

A call's functions (score_mod, score_mod_grad, aux_grad, mask_mod; kernels/user.py says what
each takes) become compile-time constants of the kernels: user_kernel copies a kernel with
globals naming them, which cuTile inlines. Copies are keyed by the functions' fingerprint:
their code, the constants they close over and the globals they read, recursively, never an
object's id. So two different functions never share a kernel, two definitions of the same
function do, and a new process finds the compiled kernels of the last one on disk (the
kernel cache keys each copy by its name, which holds the fingerprint).
"""

import contextlib
import dataclasses
import enum
import hashlib
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Tensors each of aux and mask_aux may hold: the kernels take this many arrays for each.
AUX_SLOTS = 4
_FUNCTION_ROLES = ("score_mod", "score_mod_grad", "aux_grad", "mask_mod")
# The kernels' globals that name the caller's functions (kernels/user.py).
_KERNEL_GLOBALS = {"score_mod": "SCORE_MOD", "score_mod_grad": "SCORE_MOD_GRAD", "aux_grad": "AUX_GRAD",
                   "mask_mod": "MASK_MOD"}  # fmt: skip


class UserFunctionError(ValueError):
    """A caller's function that the kernels cannot compile; the message names it and its line."""


@dataclass(frozen=True, eq=False)
class UserFunctions:
    """The caller's functions of one call (None where not given), equal and hashed by their
    fingerprint: a part of the tuning key and of the kernels' names."""

    score_mod: Callable | None = None
    score_mod_grad: Callable | None = None
    aux_grad: Callable | None = None
    mask_mod: Callable | None = None
    fingerprint: str = ""
    # score_mod declared a few elementwise operations per score (score_functions.elementwise):
    # it may run where plain attention's kernels do (dispatch.fused_backward).
    elementwise: bool = False

    def __eq__(self, other):
        return isinstance(other, UserFunctions) and self.fingerprint == other.fingerprint

    def __hash__(self):
        return hash(self.fingerprint)

    def key(self) -> str:
        parts = [role for role in ("score_mod", "mask_mod") if getattr(self, role) is not None]
        return "".join(f"|{part}" for part in parts) + f"|fn-{self.fingerprint[:16]}"

    def given(self) -> dict[str, Callable]:
        return {role: getattr(self, role) for role in _FUNCTION_ROLES if getattr(self, role) is not None}


def user_functions(score_mod=None, score_mod_grad=None, aux_grad=None, mask_mod=None) -> UserFunctions | None:
    """UserFunctions of a call, checked (None when none is given)."""
    given = {"score_mod": score_mod, "score_mod_grad": score_mod_grad, "aux_grad": aux_grad, "mask_mod": mask_mod}
    for role, function in given.items():
        if function is not None and not isinstance(function, types.FunctionType):
            raise TypeError(f"{role} must be a Python function (def or lambda), got {type(function).__name__}")
    if score_mod is None:
        for role in ("score_mod_grad", "aux_grad"):
            if given[role] is not None:
                raise ValueError(f"{role} is given without score_mod")
    if all(function is None for function in given.values()):
        return None
    elementwise = bool(getattr(score_mod, "elementwise", False))
    digest = hashlib.sha256()
    for role, function in given.items():
        digest.update(role.encode() + b"=")
        if function is not None:
            digest.update(fingerprint(function, role).encode())
        digest.update(b";")
    digest.update(b"elementwise" if elementwise else b"")
    return UserFunctions(**given, fingerprint=digest.hexdigest(), elementwise=elementwise)


# user_functions of recent calls, by the function objects themselves (held here, so an object's
# identity is never reused while it keys an entry): a training loop passes the same functions
# every step, whose fingerprints cost the host tens of microseconds.
_memo: dict[tuple, UserFunctions | None] = {}
_MEMO_MAX = 256


def memo_user_functions(score_mod=None, score_mod_grad=None, aux_grad=None, mask_mod=None) -> UserFunctions | None:
    """user_functions, remembered for the same function objects (a function's fingerprint
    is read once: rebinding a global it reads later is not seen)."""
    key = (score_mod, score_mod_grad, aux_grad, mask_mod)
    try:
        return _memo[key]
    except KeyError:
        pass
    found = user_functions(score_mod, score_mod_grad, aux_grad, mask_mod)
    if len(_memo) >= _MEMO_MAX:
        _memo.clear()
    _memo[key] = found
    return found


def fingerprint(function: types.FunctionType, role: str = "function") -> str:
    """A digest of what a function computes in a kernel: its code (constants and nested code
    included), the values it closes over and the globals its code names, recursively for
    functions among them. A value a kernel cannot use (a tensor, say) is a TypeError naming
    the function: tensors reach the kernels through aux."""
    digest = hashlib.sha256()
    _feed_function(digest, function, role, set())
    return digest.hexdigest()


def _feed_function(digest, function: types.FunctionType, role: str, seen: set) -> None:
    if function in seen:
        digest.update(b"<recursion>")
        return
    seen.add(function)
    code = function.__code__
    digest.update(f"{function.__module__}.{function.__qualname__}".encode())
    _feed_code(digest, code)
    closure = function.__closure__ or ()
    for name, cell in zip(code.co_freevars, closure, strict=True):
        digest.update(name.encode())
        _feed_value(digest, cell.cell_contents, role, function, name, seen)
    for name in code_names(code):
        if name in function.__globals__:
            digest.update(name.encode())
            _feed_value(digest, function.__globals__[name], role, function, name, seen)
    for default in function.__defaults__ or ():
        _feed_value(digest, default, role, function, "a default", seen)


def code_names(code: types.CodeType) -> list[str]:
    """The names a code object and the code nested in it read (globals and attributes)."""
    names = list(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names.extend(code_names(constant))
    return sorted(set(names))


def _feed_code(digest, code: types.CodeType) -> None:
    digest.update(code.co_code)
    digest.update(repr(code.co_names).encode())
    digest.update(repr(code.co_varnames).encode())
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            _feed_code(digest, constant)
        else:
            digest.update(repr((type(constant).__name__, constant)).encode())


def _feed_value(digest, value, role: str, function, name: str, seen: set) -> None:
    if isinstance(value, types.FunctionType):
        _feed_function(digest, value, role, seen)
    elif isinstance(value, types.ModuleType):
        digest.update(f"module:{value.__name__}".encode())
    elif value is None or isinstance(value, (bool, int, float, str, bytes, enum.Enum)):
        digest.update(repr((type(value).__name__, value)).encode())
    elif isinstance(value, (tuple, frozenset)):
        digest.update(f"{type(value).__name__}:{len(value)}".encode())
        for item in value:
            _feed_value(digest, item, role, function, name, seen)
    elif isinstance(value, type) or isinstance(value, types.BuiltinFunctionType):
        digest.update(f"type:{value.__module__}.{value.__qualname__}".encode())
    elif dataclasses.is_dataclass(value) and value.__dataclass_params__.frozen:
        digest.update(f"dataclass:{type(value).__module__}.{type(value).__qualname__}".encode())
        for field in dataclasses.fields(value):
            _feed_value(digest, getattr(value, field.name), role, function, name, seen)
    elif isinstance(value, torch.Tensor):
        raise TypeError(
            f"{role} {_where(function)} uses the tensor {name!r} from outside it; a kernel cannot: pass tensors "
            "in aux (mask_aux for mask_mod) and read them there"
        )
    else:
        # Anything else (a dtype, an object cuTile knows) by its description; one without a
        # stable one (an address) keys the kernel to this process only.
        digest.update(f"{type(value).__module__}.{type(value).__qualname__}:{value!r}".encode())


def _where(function) -> str:
    """'name' (file:line) of a function."""
    try:
        line = inspect.getsourcelines(function)[1]
    except (OSError, TypeError):
        line = function.__code__.co_firstlineno
    return f"{function.__qualname__!r} ({function.__code__.co_filename}:{line})"


_user_kernels: dict[tuple, object] = {}


def user_kernel(kernel, functions: UserFunctions | None):
    """The kernel with the caller's functions inlined: a copy of its Python function whose
    globals name them, under a name holding their fingerprint. One copy per (kernel,
    fingerprint) for the process; the kernel itself where there are none."""
    if functions is None:
        return kernel
    key = (kernel, functions.fingerprint)
    found = _user_kernels.get(key)
    if found is not None:
        return found
    original = kernel._pyfunc
    namespace = dict(original.__globals__)
    for role in _FUNCTION_ROLES:
        namespace[_KERNEL_GLOBALS[role]] = getattr(functions, role)
    copy = types.FunctionType(
        original.__code__, namespace, original.__name__, original.__defaults__, original.__closure__
    )
    copy.__qualname__ = f"{original.__qualname__}_fn_{functions.fingerprint[:24]}"
    copy.__module__ = original.__module__
    copy.__doc__ = original.__doc__
    copy.__annotations__ = dict(original.__annotations__)
    copied = type(kernel)(copy, **dataclasses.asdict(kernel._compiler_options))
    _user_kernels[key] = copied
    return copied


def check_aux(aux, q: torch.Tensor, name: str, read: bool = True) -> tuple[torch.Tensor, ...]:
    """aux (a tuple or list of at most AUX_SLOTS tensors on q's device, or None) as a tuple.
    read: whether the kernels read them; an empty tensor is refused only then (a call that
    scores nothing, such as one without keys, may pass a per-key table of no entries)."""
    if aux is None:
        return ()
    if isinstance(aux, torch.Tensor):
        aux = (aux,)
    if not isinstance(aux, (tuple, list)):
        raise TypeError(f"{name} must be a tuple of tensors, got {type(aux).__name__}")
    if len(aux) > AUX_SLOTS:
        raise ValueError(f"{name} holds {len(aux)} tensors; at most {AUX_SLOTS} are supported")
    for index, tensor in enumerate(aux):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"{name}[{index}] must be a torch.Tensor, got {type(tensor).__name__} (numbers belong in the "
                "function's code or closure, where they are compile-time constants)"
            )
        if tensor.device != q.device:
            raise ValueError(f"{name}[{index}] must be on q's device ({q.device}), got {tensor.device}")
        if tensor.dim() == 0:
            raise ValueError(f"{name}[{index}] must have at least one dimension (a 0-d tensor: use shape [1])")
        if read and tensor.numel() == 0:
            raise ValueError(f"{name}[{index}] is empty")
        if tensor.dtype == torch.bool:
            raise TypeError(f"{name}[{index}] is a bool tensor; pass it as torch.int8 or torch.int32")
    return tuple(aux)


def describe_compile_error(functions: UserFunctions, error: Exception) -> UserFunctionError:
    """The error of a kernel that failed to compile with the caller's functions, naming each of
    them and where it is defined, and cuTile's own message (which gives the failing line). Where
    the compiler itself failed (an internal error: tileiras crashed or timed out, with no line
    to point at), it says so, since the functions may well be right."""
    from cuda.tile import TileInternalError

    names = ", ".join(f"{role} {_where(function)}" for role, function in functions.given().items())
    message = f"attention kernels could not compile with {names}: {type(error).__name__}: {error}"
    if isinstance(error, TileInternalError):
        message += (
            "\n(an internal error of cuTile's compiler, not one located in these functions: please report it with "
            "the call's dtypes, head dims and functions)"
        )
    return UserFunctionError(message)


@contextlib.contextmanager
def naming_errors(functions: UserFunctions | None):
    """Launches inside: a cuTile compile error with the caller's functions becomes a
    UserFunctionError naming them (raised before the kernel runs: cuTile compiles first)."""
    if functions is None:
        yield
        return
    from cuda.tile import TileError

    try:
        yield
    except TileError as error:
        raise describe_compile_error(functions, error) from error
