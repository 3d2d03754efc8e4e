"""Values worked out from a tensor, kept for the few tensors last seen (KeptPerTensor)."""

import torch


class KeptPerTensor:
    """Values worked out from a tensor and a context (the other arguments they depend on), kept
    for the last few tensors. A model passes one tensor (a mask, cumulative lengths) to all its
    layers, so the work is done once per step, not once per layer. An entry holds its tensors,
    whose ids no other tensor can take while they live; an in-place change bumps a tensor's
    version, which the entry compares."""

    def __init__(self, kept: int = 2):
        self.kept = kept
        self._entries: dict[int, tuple] = {}

    def value_for(self, tensor: torch.Tensor, context: tuple, make, tensors: tuple = ()):
        """The value kept for tensor in this context (with these other tensors unchanged), else
        make()'s, kept."""
        state = self._state(tensor, context, tensors)
        entry = self._entries.get(id(tensor))
        if entry is not None and entry[0] is tensor and entry[1] == state:
            return entry[2]
        value = make()
        if len(self._entries) >= self.kept:
            self._entries.clear()
        self._entries[id(tensor)] = (tensor, state, value, tensors)
        return value

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _state(tensor, context, tensors) -> tuple:
        return (tensor._version, context, tuple((id(t), t._version) for t in tensors))
