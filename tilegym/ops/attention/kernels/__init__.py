"""Device code of attention, split by concept: tiles (loads, stores, numerics), state (named
values passed between functions), ranges (tiles visited, masks), scheduling (program order),
modifiers (bias, softcap, ALiBi), forward and backward (the kernels). Pure device code: host
logic lives in launch.py, and variants.py names each compiled form of these kernels.
"""

from tilegym.ops.attention.kernels.backward import (
    attention_backward_dkdv_kernel,
    attention_backward_dq_kernel,
    attention_backward_preprocess_kernel,
)
from tilegym.ops.attention.kernels.forward import attention_forward_kernel

__all__ = [
    "attention_forward_kernel",
    "attention_backward_preprocess_kernel",
    "attention_backward_dkdv_kernel",
    "attention_backward_dq_kernel",
]
