"""Pieces that both symbolic replays model alike: :mod:`betty.memory.replay` (one
sampled micro-batch) and :mod:`betty.rev.replay` (one RevGNN part).

Each function records, on a :class:`~betty.memory.timeline.Timeline`, the tensors one
stretch of PyTorch / PyG / DGL ops allocates and frees, in the order they do. Sizes are
bytes, scalars or ``(P,)`` per-piece vectors (every piece of a split is replayed at
once). A function here is written once and called by both replayers; where the two
replays model different op sequences they keep their own code (see their modules).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from betty.memory.spec import OptimizerSpec
from betty.memory.timeline import Timeline

__all__ = ["StepConfig", "numel", "step_baseline", "param_grads", "INDEX_BYTES",
           "PARAMS", "GRADS", "OPT", "FEATS", "LABELS", "DROP", "ACT", "ATT", "LOSS", "BWD"]

INDEX_BYTES = 8  # int64 indices, node IDs, degrees, class labels

# components of the breakdown both replays report
PARAMS, GRADS, OPT = "parameters", "gradients", "optimizer_state"
FEATS, LABELS, DROP = "features", "labels", "dropout"
ACT, ATT, LOSS, BWD = "activations", "attention", "loss", "activation_gradients"


@dataclass(kw_only=True)
class StepConfig:
    """What a replayed training step needs besides the model and the sizes (keyword
    arguments of both replays' configs).

    Attributes:
        optimizer: which optimizer state exists (it is assumed to exist: the steady
            state after the first step).
        elt: bytes per element of the compute dtype (features after the cast,
            activations, parameters of a RevGNN).
        feat_elt: bytes per element of the host feature matrix.
        fresh_grads: ``(P,)`` bools: the piece starts with no ``.grad`` (the first piece
            after ``zero_grad(set_to_none=True)``), so its backward creates them.
        label_columns: T for multi-label targets (0: single-label int64 classes).
        label_elt: bytes per element of multi-label targets.
        host: the measured device is the host: Adam's 0-d ``step`` tensors are counted,
            Adam runs single-tensor, standard dropout keeps a float noise tensor. On CUDA
            the steps stay on the host unless capturable/fused, Adam runs foreach and
            dropout keeps a bool mask.
    """

    optimizer: OptimizerSpec
    elt: int
    feat_elt: int
    fresh_grads: np.ndarray
    label_columns: int = 0
    label_elt: int = 4
    host: bool = True


def numel(shape: Iterable[int]) -> int:
    """Number of elements of a tensor of ``shape`` (``1`` for ``()``)."""
    n = 1
    for s in shape:
        n *= int(s)
    return n


def step_baseline(tl: Timeline, cfg: StepConfig, param_bytes, num_params: int,
                  buffers=None) -> None:
    """What lives through the whole step: the parameters (``param_bytes`` in all, in
    ``num_params`` tensors) and the model's ``buffers`` (bytes, e.g. batch-norm running
    statistics; None: none), the optimizer state (``n_state · param_bytes``, plus a
    4-byte ``step`` per parameter where it is counted: on the host or on the device
    with capturable/fused Adam) and, in the pieces that do not start fresh, the
    existing ``.grad`` (``param_bytes``)."""
    tl.add_baseline(param_bytes, PARAMS)
    if buffers is not None:
        tl.add_baseline(buffers, PARAMS)
    n_state, has_step = cfg.optimizer.state_tensors()
    state = n_state * param_bytes
    if has_step and (cfg.host or cfg.optimizer.step_on_device):
        state += 4 * num_params
    tl.add_baseline(state, OPT)
    tl.add_baseline(np.where(np.asarray(cfg.fresh_grads, dtype=bool), 0.0, param_bytes), GRADS)


def param_grads(tl: Timeline, nbytes, keep, name: str, accumulated_name: str) -> None:
    """Parameter gradients (``nbytes``) one backward node produces, through
    ``AccumulateGrad``: where ``keep`` (``(P,)`` bools: the piece has no ``.grad`` yet)
    the new gradient becomes ``.grad`` and stays; elsewhere it is added in place into
    the existing ``.grad`` and freed (a transient)."""
    tl.alloc(np.where(keep, nbytes, 0.0), GRADS, name)
    tl.temp(np.where(keep, 0.0, nbytes), GRADS, accumulated_name)
