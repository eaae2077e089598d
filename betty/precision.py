"""Training precision: the numeric formats of one training step.

A precision names where each tensor of a step lives (Lightning's names):

========== ============== ======================= =====================
name       parameters,    forward compute          gradient scaler
           gradients,
           optimizer state
========== ============== ======================= =====================
``64``     float64        float64                  no
``32``     float32        float32                  no
bf16-mixed float32        bfloat16 under autocast  no
16-mixed   float32        float16 under autocast   yes (one scale per step)
========== ============== ======================= =====================

Under a mixed precision each micro-batch's forward pass and loss run inside
``torch.autocast(device_type, dtype=compute_dtype)``; the backward pass runs outside it
and accumulates float32 gradients into the float32 master parameters, and the step
takes one optimizer update. Autocast runs matrix products in ``compute_dtype`` and keeps
reductions such as softmax, norms and the loss in float32.

The module imports no torch at load time (the spec layer uses :data:`PRECISIONS`
without it); torch dtypes are resolved on first use.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:  # pragma: no cover
    import torch

PRECISIONS: tuple[str, ...] = ("64", "32", "bf16-mixed", "16-mixed")
"""The accepted ``train.precision`` names, widest first."""

_PARAM = {"64": "float64", "32": "float32", "bf16-mixed": "float32", "16-mixed": "float32"}
_COMPUTE = {"64": "float64", "32": "float32", "bf16-mixed": "bfloat16", "16-mixed": "float16"}


@dataclass(frozen=True)
class Precision:
    """One of :data:`PRECISIONS`, with the dtypes it implies.

    Args:
        name: ``"64"``, ``"32"``, ``"bf16-mixed"`` or ``"16-mixed"``.
    """

    name: str = "32"

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ValueError(
                f"train.precision must be one of {', '.join(PRECISIONS)}; got {self.name!r}")

    @classmethod
    def parse(cls, value: "str | int | Precision") -> "Precision":
        """``Precision`` from a name, the ints 32/64, or a ``Precision``."""
        if isinstance(value, Precision):
            return value
        return cls(str(value))

    @property
    def mixed(self) -> bool:
        """Whether the forward pass runs under autocast."""
        return self.name.endswith("-mixed")

    @property
    def needs_scaler(self) -> bool:
        """Whether the step needs a gradient scaler (float16's narrow exponent)."""
        return self.name == "16-mixed"

    @property
    def param_dtype(self) -> "torch.dtype":
        """The dtype of parameters, gradients and optimizer state."""
        import torch
        return getattr(torch, _PARAM[self.name])

    @property
    def compute_dtype(self) -> "torch.dtype":
        """The dtype autocast computes matrix products in (``param_dtype`` if not mixed)."""
        import torch
        return getattr(torch, _COMPUTE[self.name])

    @property
    def param_bytes(self) -> int:
        """Bytes per element of a parameter, gradient or optimizer state."""
        return 8 if self.name == "64" else 4

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of a matrix product's output in the forward pass."""
        return {"64": 8, "32": 4, "bf16-mixed": 2, "16-mixed": 2}[self.name]

    @contextlib.contextmanager
    def autocast(self, device_type: str) -> Iterator[None]:
        """The forward context: autocast to ``compute_dtype`` when mixed, else nothing."""
        if not self.mixed:
            yield
            return
        import torch
        with torch.autocast(device_type=device_type, dtype=self.compute_dtype):
            yield

    def __str__(self) -> str:
        return self.name
