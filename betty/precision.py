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
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator

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

    def unsupported(self, backend: str, device_type: str) -> str | None:
        """Why this precision cannot train a ``backend`` (``"dgl"``/``"pyg"``) model on a
        ``device_type`` device, or ``None`` when it can: DGL's CPU sparse kernels take
        no float16."""
        if self.name == "16-mixed" and backend == "dgl" and device_type == "cpu":
            return ("train.precision 16-mixed needs CUDA with the DGL backend: DGL's CPU sparse "
                    "kernels take bfloat16, float32 or float64, not float16; on the CPU use "
                    "bf16-mixed, or model.backend pyg")
        return None

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


def parameter_dtype(model: "torch.nn.Module") -> "torch.dtype":
    """The dtype of ``model``'s floating-point parameters (float32 when it has none): what
    features are cast to when no dtype is given."""
    import torch

    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def check_parameter_dtype(model: "torch.nn.Module", dtype: "torch.dtype") -> None:
    """Refuse a ``model`` with floating-point parameters in a dtype other than ``dtype``
    (the trainer's parameter dtype): the first matrix product would fail on mismatched
    operands, and the memory model would count every parameter at the wrong size."""
    wrong = sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point() and p.dtype != dtype})
    if wrong:
        raise ValueError(f"the model's parameters are {', '.join(wrong)} but the trainer's dtype is "
                         f"{dtype}: build the model in that dtype (model.to({dtype})) or pass the "
                         f"model's dtype as dtype=")


def input_dtype(feat_dtype: "torch.dtype", precision: "Precision | str | None",
                dtype: "torch.dtype | None") -> "torch.dtype | None":
    """The dtype a micro-batch's features are cast to on the device, or ``None`` to keep
    ``feat_dtype``: under a mixed precision, features already in its ``compute_dtype``
    stay there (autocast's first matrix product takes them as they are); otherwise they
    are cast to ``dtype`` (the model's, e.g. bfloat16 host features to float32 in ``32``)."""
    prec = Precision.parse(precision if precision is not None else "32")
    if prec.mixed and feat_dtype == prec.compute_dtype:
        return None
    return dtype


class LossScaler:
    """A dynamic loss scale for ``16-mixed``, one scale per optimizer step.

    The step multiplies every micro-batch's loss by the same :attr:`scale` ``s`` before
    its backward, so ``.grad`` accumulates ``s · Σ_k ∇L_k``. After the last micro-batch
    (and, data-parallel, after the gradient all-reduce) :meth:`unscale` multiplies every
    gradient by ``1/s`` once and reports whether any entry is inf or NaN; ``found_inf``
    is then all-reduced (MAX) over the ranks, so one bad micro-batch anywhere skips the
    step everywhere. :meth:`update` runs once per step: a skipped step multiplies ``s``
    by ``backoff_factor``; ``growth_interval`` finite steps in a row multiply it by
    ``growth_factor``. The defaults are ``torch.amp.GradScaler``'s (2^16, 2, 0.5, 2000).
    ``s`` stays a power of two, so scaling and unscaling a float32 gradient are exact
    (short of overflow or underflow).

    Torch's own ``GradScaler`` is not used: torch 2.2 has only the CUDA one, and its
    ``unscale_``/``step`` decide per process, with no hook for a cross-rank decision.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        from betty.checks import is_integer, is_number

        def power_of_two(x) -> bool:  # scaling by it is exact in binary floating point
            return is_number(x) and 0 < x < float("inf") and math.frexp(x)[0] == 0.5

        if not (all(map(power_of_two, (init_scale, growth_factor, backoff_factor)))
                and growth_factor > 1 and backoff_factor < 1 and is_integer(growth_interval)
                and growth_interval >= 1):
            raise ValueError(f"LossScaler needs powers of two init_scale, growth_factor > 1 and "
                             f"backoff_factor < 1, and an integer growth_interval >= 1; got "
                             f"{init_scale!r}, {growth_factor!r}, {backoff_factor!r}, {growth_interval!r}")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.growth_tracker = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: "torch.Tensor") -> "torch.Tensor":
        """``s · loss`` (float32)."""
        return loss.float() * self.scale

    def unscale(self, params: "Iterable[torch.Tensor]", all_ranks: bool = False, group=None) -> bool:
        """Multiply every ``.grad`` by ``1/s`` in place; return ``found_inf``: whether any
        gradient entry is inf or NaN, with ``all_ranks`` on any rank of the process
        ``group`` (a MAX all-reduce of the flag; ``None``: the default group)."""
        import torch
        inv = 1.0 / self.scale
        bad = torch.zeros((), dtype=torch.float32)
        for p in params:
            if p.grad is None:
                continue
            p.grad.mul_(inv)
            bad = torch.maximum(bad, (~torch.isfinite(p.grad)).any().float().cpu())
        import torch.distributed as dist
        if all_ranks:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
        return bool(bad.item() > 0)

    def update(self, found_inf: bool) -> None:
        """Once per step: back off after a skipped step, grow after
        ``growth_interval`` finite steps in a row."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def step(self, optimizer: "torch.optim.Optimizer", params: "Iterable[torch.Tensor]",
             all_ranks: bool = False, group=None) -> bool:
        """:meth:`unscale`, then ``optimizer.step()`` unless ``found_inf``, then
        :meth:`update`. Returns whether the step was taken."""
        found_inf = self.unscale(params, all_ranks, group)
        if not found_inf:
            optimizer.step()
        self.update(found_inf)
        return not found_inf

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
