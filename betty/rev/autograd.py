"""The memory trick of reversible blocks: an autograd Function that keeps no activations.

Forward (under ``no_grad``): ``Y = F(X)``; nothing of ``F``'s internals is kept, and the
storage of ``X`` is released (``untyped_storage().resize_(0)``), so a chain of ``L``
blocks holds O(1) activations instead of O(L).

Backward: ``X = F^{-1}(Y)`` is reconstructed from the output, ``F`` is run again with
gradients on the reconstruction, and ``dL/dX``, ``dL/dtheta`` come from one vector-Jacobian
product with ``dL/dY``.

Consecutive blocks pass activations through a :class:`Handoff` attached to each output
tensor: block ``l + 1`` takes its input over in the forward pass (frees it), and in the
backward pass hands its reconstruction down to block ``l``, which needs it as its output
``Y_l``. The last block keeps its output (it is alive anyway as the stack's result), so
``backward`` may run several times (``retain_graph=True``, ``gradcheck``).

The input of the first block of a chain is freed too, so it must be a tensor nobody else
needs until the backward pass: :func:`check_freeable_input` refuses leaves (user data,
parameters), views, tensors sharing their storage, and outputs that their producer saved
for its own backward (ReLU, sigmoid, tanh, exp ...). An encoder ``nn.Linear`` output is
the intended input.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

__all__ = [
    "Handoff",
    "MaskSource",
    "ReversibleRun",
    "apply_reversible",
    "check_freeable_input",
    "consistency_tolerance",
]

MaskSource = Callable[[int], Optional[Tensor]]
"""``layer -> dropout multiplier`` (``None``: no dropout). Called once in the forward
pass and twice in the backward pass of each block (reconstruction, recomputation), so it
must return the same values on every call (a stored tensor, or a deterministic hash of
(seed, step, layer, node ID))."""

_HANDOFF_ATTR = "_betty_rev_handoff"


class Handoff:
    """Holds one activation between two blocks (see the module docstring).

    ``value`` is the forward output (kept only while no later block consumed it) or, in
    the backward pass, the reconstruction handed down by the next block.
    """

    __slots__ = ("value", "version", "consumed", "__weakref__")

    def __init__(self) -> None:
        self.value: Optional[Tensor] = None
        self.version: Optional[int] = None
        self.consumed = False

    def keep_forward_output(self, y: Tensor) -> None:
        self.value, self.version = y.detach(), y._version

    def take(self, layer: int) -> Tensor:
        if self.value is None:
            raise RuntimeError(
                f"reversible block {layer}: its output is no longer available for the "
                "backward pass (a second backward through a consumed chain, or the chain "
                "was cut); rerun the forward pass"
            )
        if self.version is not None and self.value._version != self.version:
            raise RuntimeError(
                f"reversible block {layer}: its output was modified in place after the "
                "forward pass; the inputs cannot be reconstructed from it"
            )
        return self.value


@dataclass
class ReversibleRun:
    """Everything one block application needs in its backward pass (no activations)."""

    coupling: nn.Module  # has forward(graph, x, mask) and inverse(graph, y, mask)
    graph: Any  # a whole graph of either backend (dgl.DGLGraph or PygGraph)
    masks: MaskSource
    layer: int
    handoff_in: Optional[Handoff]
    handoff_out: Handoff
    check_consistency: bool
    consistency_tol: Optional[float]


def consistency_tolerance(dtype: torch.dtype) -> float:
    """Default bound on ``max|F(F^{-1}(Y)) - Y| / max|Y|`` for one block in ``dtype``.

    Deterministic ``f_i`` reproduce ``Y`` to a few rounding errors amplified by the
    Lipschitz constants of the group functions (measured on CPU, 64 blocks, GCN/SAGE/GAT:
    at most 1.6e-7 in float32 and 2.3e-16 in float64); a redrawn dropout mask changes
    it by O(0.1-1). Values: float64 1e-8, float32 1e-3, half precision 5e-2.
    """
    if dtype == torch.float64:
        return 1e-8
    if dtype == torch.float32:
        return 1e-3
    return 5e-2


def check_freeable_input(x: Tensor, what: str = "x") -> None:
    """Raise ``ValueError`` unless the storage of ``x`` may be freed until backward.

    ``x`` must be a non-leaf tensor (it has a ``grad_fn``), own its storage exclusively
    (no view, contiguous, offset 0, storage exactly its size), and not be saved by its
    producer for the producer's backward. A tensor without ``grad_fn`` cannot be told
    apart from user data and is refused even when fresh (e.g. the output of a frozen
    encoder): train the encoder, or run the stack with ``reversible=False``. Consumers of
    ``x`` other than the block (a skip connection to the decoder, say) cannot be seen:
    nothing else may use ``x``.
    """
    problem = _freeable_problem(x)
    if problem is not None:
        raise ValueError(
            f"{what}: the first reversible block frees its input's storage until the "
            f"backward pass, but this input {problem}. Feed the blocks the output of an "
            "encoder (e.g. nn.Linear) that nothing else uses"
        )


def _freeable_problem(x: Tensor) -> Optional[str]:
    if x.grad_fn is None:
        return (
            "is a leaf tensor (user data or a parameter"
            + ("" if x.requires_grad else ", requires_grad=False")
            + ") and would be destroyed"
        )
    if hasattr(x, _HANDOFF_ATTR):
        return None  # output of a reversible block: handled by the handoff
    if x._base is not None:
        return "is a view of another tensor whose data would be destroyed"
    storage = x.untyped_storage()
    if (
        not x.is_contiguous()
        or x.storage_offset() != 0
        or storage.nbytes() != x.numel() * x.element_size()
    ):
        return "shares its storage with other data"
    ptr = storage.data_ptr()
    for name in dir(x.grad_fn):
        if not name.startswith("_saved_"):
            continue
        try:
            saved = getattr(x.grad_fn, name)
        except RuntimeError:  # already freed by an earlier backward
            continue
        if isinstance(saved, Tensor) and saved.untyped_storage().data_ptr() == ptr:
            return (
                f"is saved by its producer {type(x.grad_fn).__name__} ({name}) for the "
                "backward pass (e.g. the output of ReLU/sigmoid/tanh/exp)"
            )
    return None


def _free(x: Tensor) -> None:
    x.untyped_storage().resize_(0)


class _ReversibleFunction(torch.autograd.Function):
    """``Y = coupling(X)`` with O(1) saved activations; see the module docstring."""

    @staticmethod
    def forward(ctx, x: Tensor, run: ReversibleRun, *params: Tensor) -> Tensor:  # type: ignore[override]
        with torch.no_grad():
            y = run.coupling(run.graph, x, run.masks(run.layer))
        ctx.run = run
        ctx.input_ref = weakref.ref(x)
        ctx.params = params
        run.handoff_out.keep_forward_output(y)
        if run.handoff_in is not None:  # we take over the previous block's output
            run.handoff_in.value, run.handoff_in.version = None, None
            run.handoff_in.consumed = True
        _free(x)
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):  # type: ignore[override]
        run: ReversibleRun = ctx.run
        y = run.handoff_out.take(run.layer)
        with torch.no_grad():
            x = run.coupling.inverse(run.graph, y, run.masks(run.layer))
        _restore_if_alive(ctx.input_ref, x)
        if run.handoff_in is not None:
            run.handoff_in.value, run.handoff_in.version = x, None
        if run.handoff_out.consumed:  # a later block owns it; drop our reference
            run.handoff_out.value = None
        params = ctx.params
        wanted = [p for p, need in zip(params, ctx.needs_input_grad[2:]) if need]
        with torch.enable_grad():
            x_in = x.detach().requires_grad_(ctx.needs_input_grad[0])
            # the mask is asked for again (not reused): a source that draws a new mask on
            # each call then fails the consistency check instead of giving wrong gradients
            y_re = run.coupling(run.graph, x_in, run.masks(run.layer))
        if run.check_consistency:
            _check_consistency(y_re.detach(), y, run)
        inputs = ([x_in] if ctx.needs_input_grad[0] else []) + wanted
        grads = list(
            torch.autograd.grad(y_re, inputs, grad_y, allow_unused=True) if inputs else []
        )
        grad_x = grads.pop(0) if ctx.needs_input_grad[0] else None
        grad_params = [grads.pop(0) if need else None for need in ctx.needs_input_grad[2:]]
        return (grad_x, None, *grad_params)


def _restore_if_alive(input_ref: "weakref.ref[Tensor]", x: Tensor) -> None:
    """Refill the freed storage of the original input if someone still holds it."""
    original = input_ref()
    if original is not None and original.untyped_storage().nbytes() == 0:
        original.untyped_storage().resize_(original.numel() * original.element_size())
        with torch.no_grad():
            original.copy_(x)


def _check_consistency(y_re: Tensor, y: Tensor, run: ReversibleRun) -> None:
    tol = run.consistency_tol
    if tol is None:
        tol = consistency_tolerance(y.dtype)
    scale = y.abs().max()
    err = (y_re - y).abs().max()
    if err > tol * torch.clamp(scale, min=torch.finfo(y.dtype).tiny):
        raise RuntimeError(
            f"reversible block {run.layer}: recomputing the block on its reconstructed input "
            f"does not reproduce its output (max error {err.item():.3e}, output scale "
            f"{scale.item():.3e}, tolerance {tol:.1e} relative). The block is not a "
            "deterministic function of (graph, input, mask): a stochastic layer such as "
            "nn.Dropout/F.dropout inside f, a mask source that returns different masks on "
            "each call, or BatchNorm in a mode whose statistics change between calls. "
            "Gradients would be wrong"
        )


def apply_reversible(
    coupling: nn.Module,
    graph,
    x: Tensor,
    masks: MaskSource,
    layer: int,
    *,
    check_consistency: bool = True,
    consistency_tol: Optional[float] = None,
) -> Tensor:
    """Run ``coupling`` on ``x`` ``(N, D)`` reversibly (frees ``x``); returns ``Y`` ``(N, D)``.

    ``x`` is either the output of a previous reversible block or a tensor accepted by
    :func:`check_freeable_input` (raises ``ValueError`` otherwise).
    """
    handoff_in: Optional[Handoff] = getattr(x, _HANDOFF_ATTR, None)
    if handoff_in is None:
        check_freeable_input(x, what=f"input of reversible block {layer}")
    elif handoff_in.consumed:
        raise ValueError(
            f"input of reversible block {layer} was already consumed by another reversible "
            "block (its storage is freed); a reversible output can feed only one block"
        )
    run = ReversibleRun(
        coupling=coupling,
        graph=graph,
        masks=masks,
        layer=layer,
        handoff_in=handoff_in,
        handoff_out=Handoff(),
        check_consistency=check_consistency,
        consistency_tol=consistency_tol,
    )
    y = _ReversibleFunction.apply(x, run, *coupling.parameters())
    setattr(y, _HANDOFF_ATTR, run.handoff_out)
    return y
