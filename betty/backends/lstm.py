"""An ``nn.LSTM`` that runs in float32 where autocast's low-precision LSTM cannot run.

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` torch sends ``nn.LSTM`` to
oneDNN's bf16 LSTM, which needs CPU support (AVX-512 BF16 or AMX); without it the call
fails ("could not create a primitive descriptor for an LSTM forward propagation
primitive"), and float16 LSTMs have no CPU kernel. :class:`AutocastLSTM` keeps
``nn.LSTM``'s parameters and names and, under CPU autocast, runs the recurrence with
autocast off on float32 inputs (the cell state is float32 under autocast anyway); on
CUDA autocast runs it in its dtype as usual.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["AutocastLSTM", "autocast_safe"]


def _cpu_autocast_enabled() -> bool:
    """Whether CPU autocast is on: ``torch.is_autocast_enabled("cpu")`` where torch takes a
    device (its older ``is_autocast_cpu_enabled`` warns as deprecated there)."""
    try:
        return torch.is_autocast_enabled("cpu")
    except TypeError:  # torch before 2.4: no device argument
        return torch.is_autocast_cpu_enabled()


class AutocastLSTM(nn.LSTM):
    """``nn.LSTM``; under CPU autocast: float32 with autocast off (see the module)."""

    def forward(self, input, hx=None):  # noqa: D102 (nn.LSTM's signature)
        if input.device.type == "cpu" and _cpu_autocast_enabled():
            with torch.autocast("cpu", enabled=False):
                if hx is not None:
                    hx = tuple(h.float() for h in hx)
                return super().forward(input.float(), hx)
        return super().forward(input, hx)


def autocast_safe(module: nn.Module) -> nn.Module:
    """Turn every ``nn.LSTM`` inside ``module`` into an :class:`AutocastLSTM` in place
    (same parameters, same state-dict names); returns ``module``."""
    for sub in module.modules():
        if type(sub) is nn.LSTM:
            sub.__class__ = AutocastLSTM
    return module
