"""Launches prepared once per problem and replayed (perf-notes#prepared-launches).

The launch path works out the same kernels, configs, grids and scalar arguments for every call
of a problem, and in short training steps that host work, not the GPU, sets the pace. So once a
call has launched its kernels, each launch is kept as a template whose tensor arguments are
named by their role in the call (q, out, a workspace), and a later call of the same problem
under the same settings fills in its own tensors and launches at once.

A template is kept only where it can be replayed exactly: every tensor argument is one of the
call's tensors (by identity) or a placeholder made once per device, no two of the call's roles
share a tensor (a later call could tell them apart), and every other argument is a number. It is
found by the settings that steer the launch path (the environment variables it reads, torch's
deterministic switch), read at every call, and it is not replayed once the tuner's choice it
launched is forgotten (autotune.force_config, a cleared memo).
"""

from collections.abc import Container, Sequence
from dataclasses import dataclass

import torch

from tilegym import autotune, env

# What the launch path reads to choose kernels and configs (autotune.py, dispatch.py).
_SETTINGS_VARIABLES = ("DISABLE_AUTOTUNE", "TILEGYM_BACKWARD", *autotune.CACHE_DIR_VARIABLES)
_MAX_PLANS = 512
_NUMBERS = (bool, int, float)

# Plans by key (plan_key): launch.py's forward and backward plans.
_plans: dict[tuple, object] = {}


def settings() -> tuple:
    """What besides its problem decides a call's launches."""
    return env.raw_values(_SETTINGS_VARIABLES), torch.are_deterministic_algorithms_enabled()


def plan_key(*parts) -> tuple:
    """parts (what decides the launches from the caller's side: launcher, problem, device, which
    roles have tensors) and the settings."""
    return (*parts, settings())


def find(key: tuple):
    return _plans.get(key)


def keep(key: tuple, plan) -> None:
    if len(_plans) >= _MAX_PLANS:
        del _plans[next(iter(_plans))]  # the oldest
    _plans[key] = plan


@dataclass(frozen=True)
class PreparedLaunch:
    """One launch as a template: its arguments with the call's tensors left out (None), and
    where each goes (slots: argument position, role)."""

    launched: autotune.Launched  # its arguments dropped: a template keeps no call's tensors
    template: tuple
    slots: tuple[tuple[int, int], ...]
    zeroed: tuple[int, ...]  # roles set to zero right before the launch (sums it adds into)

    def arguments(self, tensors: Sequence[torch.Tensor | None]) -> tuple:
        arguments = list(self.template)
        for position, role in self.slots:
            arguments[position] = tensors[role]
        return tuple(arguments)


def prepare(
    launches: Sequence[autotune.Launched | None],
    roles: Sequence[torch.Tensor | None],
    placeholders: Container[int],
    zeroed: Sequence[tuple[int, ...]],
) -> tuple[PreparedLaunch, ...] | None:
    """The launches as templates over roles (the call's tensors by role, None where it has
    none; zeroed: the roles each launch set to zero first), or None where they cannot be
    replayed: a launch not made (a stand-in launcher returns None), an argument neither a
    role's tensor, a placeholder (placeholders: their ids) nor a number, or roles sharing a tensor."""
    role_of = {}
    for role, tensor in enumerate(roles):
        if tensor is not None:
            if id(tensor) in role_of:
                return None
            role_of[id(tensor)] = role
    prepared = []
    for launched, zero in zip(launches, zeroed, strict=True):
        if not isinstance(launched, autotune.Launched):
            return None
        template, slots = list(launched.arguments), []
        for position, argument in enumerate(template):
            # By id and exact type: isinstance on a tensor costs a Python-level check.
            role = role_of.get(id(argument))
            if role is not None:
                template[position] = None
                slots.append((position, role))
            elif id(argument) not in placeholders and type(argument) not in _NUMBERS:
                return None
        kept = autotune.Launched(
            launched.config, launched.kernel, launched.grid, (), launched.memo_key, launched.chosen
        )  # fmt: skip
        prepared.append(PreparedLaunch(kept, tuple(template), tuple(slots), zero))
    return tuple(prepared)


def replay(launches: Sequence[PreparedLaunch], roles: Sequence[torch.Tensor | None], stream: int) -> bool:
    """Launches the templates with these tensors on the stream with this handle, in order; False,
    launching nothing, where a choice they launched is forgotten."""
    import cuda.tile as ct  # here: importing tilegym touches no GPU

    if not all(prepared.launched.still_chosen() for prepared in launches):
        return False
    for prepared in launches:
        for role in prepared.zeroed:
            roles[role].zero_()
        launched = prepared.launched
        ct.launch(stream, launched.grid, launched.kernel, prepared.arguments(roles))
    return True
