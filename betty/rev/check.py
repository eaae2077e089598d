"""Check that a reversible model's gradients equal those of the same weights run as a
plain residual network (ordinary autograd).

Any randomness drawn inside a block during the forward pass (``nn.Dropout``,
``F.dropout``, a mask source that samples on each call) is drawn again, differently,
when the reversible backward pass reconstructs and recomputes the block, so the
reversible gradients stop matching. :func:`gradient_parity` measures the mismatch and
:func:`assert_gradient_parity` fails loudly. Both runs start from the same RNG state, so
stochastic layers draw the same numbers in both forward passes: a mismatch comes from
the reversible backward pass only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn

__all__ = ["GradientMismatchError", "ParityReport", "assert_gradient_parity", "gradient_parity"]


class GradientMismatchError(AssertionError):
    """Reversible and residual gradients differ beyond the tolerance."""


@dataclass(frozen=True)
class ParityReport:
    """Relative gradient differences per parameter ``p``:

        ||g_rev_p - g_res_p|| / max(||g_res_p||, floor * ||g_res||)

    where ``||g_res||`` is the norm of the whole residual gradient; the floor keeps
    parameters whose exact gradient is zero (a bias followed by a normalisation) from
    comparing rounding noise with rounding noise.
    """

    max_rel_error: float
    worst_parameter: str
    rel_errors: dict[str, float] = field(repr=False)


def _grads(model: nn.Module, loss_closure: Callable[[nn.Module], Tensor], seed: int) -> dict[str, Tensor]:
    model.zero_grad(set_to_none=True)
    devices = [p.device for p in model.parameters() if p.device.type == "cuda"]
    with torch.random.fork_rng(devices=sorted({d.index or 0 for d in devices})):
        torch.manual_seed(seed)
        loss_closure(model).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def gradient_parity(
    model: nn.Module,
    loss_closure: Callable[[nn.Module], Tensor],
    *,
    seed: int = 0,
    floor: float = 1e-6,
) -> ParityReport:
    """Gradients of ``loss_closure(model)`` reversible vs residual, same weights.

    Args:
        model: has ``set_mode(reversible=..., checkpoint=...)`` and ``reversible``
            (e.g. :class:`betty.rev.model.RevGNN`); its mode is restored afterwards.
        loss_closure: runs a forward pass and returns a scalar loss.
        seed: RNG seed set before each of the two runs.
        floor: see :class:`ParityReport`.
    """
    was_reversible, was_checkpoint = model.reversible, bool(getattr(model, "checkpoint", False))
    try:
        model.set_mode(reversible=True)
        rev = _grads(model, loss_closure, seed)
        model.set_mode(reversible=False)
        res = _grads(model, loss_closure, seed)
    finally:
        model.set_mode(reversible=was_reversible, checkpoint=was_checkpoint)
    total = torch.stack([g.norm() for g in res.values()]).norm() if res else torch.tensor(0.0)
    errors: dict[str, float] = {}
    for name in sorted(set(rev) | set(res)):
        if name not in rev or name not in res:
            errors[name] = float("inf")
            continue
        ref = torch.maximum(res[name].norm(), floor * total)
        diff = (rev[name] - res[name]).norm()
        errors[name] = float(diff / ref) if ref > 0 else float(diff)
    worst = max(errors, key=errors.get) if errors else ""
    return ParityReport(errors.get(worst, 0.0), worst, errors)


def assert_gradient_parity(
    model: nn.Module,
    loss_closure: Callable[[nn.Module], Tensor],
    *,
    rtol: float = 1e-6,
    seed: int = 0,
) -> ParityReport:
    """:func:`gradient_parity`, raising :class:`GradientMismatchError` above ``rtol``."""
    report = gradient_parity(model, loss_closure, seed=seed)
    if not report.max_rel_error <= rtol:
        raise GradientMismatchError(
            f"reversible gradients differ from the residual ones: relative error "
            f"{report.max_rel_error:.3e} > rtol={rtol:.1e} at parameter "
            f"{report.worst_parameter!r}. A block is not deterministic (stochastic dropout "
            "inside f?) or its inverse is wrong"
        )
    return report
