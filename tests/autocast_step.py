"""A measured training step with the forward pass and the loss under autocast (the
harness of the mixed-precision memory checks: ``accumulate_gradients`` runs each
micro-batch's forward and loss inside ``Precision.autocast``, its backward outside)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

import betty.train
from betty.precision import Precision


class AutocastForward(torch.nn.Module):
    """``model`` whose forward enters ``precision``'s autocast; the region stays open
    until the loss of that forward is computed (:func:`autocast_step`). Attributes not
    found here are the wrapped model's."""

    def __init__(self, model: torch.nn.Module, precision: Precision, device_type: str) -> None:
        super().__init__()
        self.model = model
        self.precision = precision
        self.device_type = device_type
        self.open: list = []

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["model"], name)

    def forward(self, *args, **kwargs):
        ctx = self.precision.autocast(self.device_type)
        ctx.__enter__()
        self.open.append(ctx)
        return self.model(*args, **kwargs)


@contextlib.contextmanager
def autocast_step(model: torch.nn.Module, precision: "str | Precision",
                  device_type: str = "cpu") -> Iterator[torch.nn.Module]:
    """Yield the model to pass to ``accumulate_gradients``: each micro-batch's forward
    and ``node_loss_sum`` run under autocast, the backward outside it."""
    wrapper = AutocastForward(model, Precision.parse(precision), device_type)
    original = betty.train.node_loss_sum

    def loss_then_exit(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            wrapper.open.pop().__exit__(None, None, None)

    betty.train.node_loss_sum = loss_then_exit
    try:
        yield wrapper
    finally:
        betty.train.node_loss_sum = original
