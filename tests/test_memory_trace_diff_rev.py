"""The RevGNN replay's event sequence against the allocation recorder, op by op.

One training step of a RevGNN on one whole-graph part (:func:`betty.rev.engine.train_step_parts`:
forward, loss, backward, the correct count, the optimizer step: SGD, Adam for GAT; class or
multi-label targets) runs under
:class:`betty.memory.trace.AllocationTrace` after a first step, and the same part is
replayed (:func:`betty.rev.replay.replay_rev`). The three checks of
:func:`test_memory_trace_diff.diff` must hold (every floating-point allocation of the
trace is, in order, one of the replay's with the same bytes; every allocation of the
replay is, in order, one of the trace's; each paired allocation is freed between the
same two paired allocations on both sides), for GCN, SAGE-mean and GAT couplings, the
reversible, residual and checkpointed networks, layer norm and none, the masks of
:class:`betty.rev.engine.SharedHashMasks` (the trainer's deterministic dropout) and the
model's own Bernoulli masks, on both backends; at hidden 64 too, where the parameters'
gradients are at least ``MIN_BYTES`` and so take part, each at the op that makes it.
A reversible block frees its input's storage with ``UntypedStorage.resize_(0)``, which
the recorder reports as a resize to 0 bytes: the free the third check compares.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from betty.memory.trace import AllocationTrace
from betty.rev.engine import SharedHashMasks, train_step_parts
from betty.rev.memory import rev_replay_config
from betty.rev.model import RevGNN
from betty.rev.replay import replay_rev
from betty.rev.training import cluster_partition
from graphs import backend_params, power_law_graph
from test_memory_trace_diff import MIN_BYTES, traced_rows, diff, replayed_rows

CASES = list(itertools.product(("gcn", "sage", "gat"), ("reversible", "residual", "checkpoint"),
                               ("layer", "none"), (True, False)))
DROPOUT, LAYERS = 0.2, 3


def _events(backend: str, conv: str, mode: str, norm: str, held: bool, tasks: int = 0,
            groups: int = 2, hidden: int = 16):
    """``(traced, replayed)`` allocations of one step on one 300-node part (``tasks > 0``:
    multi-label targets with that many tasks; ``groups`` of ``hidden / groups``
    channels)."""
    from betty.backends import get_backend

    g, feat, label, train_idx = power_law_graph(num_nodes=300, avg_degree=6, num_feats=12,
                                                num_classes=5, seed=300)
    if tasks:
        label = (torch.rand(300, tasks, generator=torch.Generator().manual_seed(1)) < 0.3).float()
    mask = torch.zeros(300, dtype=torch.bool)
    mask[train_idx] = True
    graph = get_backend(backend).full_graph(g)
    torch.manual_seed(0)
    model = RevGNN(12, hidden, tasks or 5, num_layers=LAYERS, num_groups=groups, conv=conv, dropout=DROPOUT, heads=3,
                   reversible=mode == "reversible", checkpoint=mode == "checkpoint", norm=norm,
                   backend=backend)
    opt = (torch.optim.Adam if conv == "gat" else torch.optim.SGD)(model.parameters(), lr=1e-3)
    parts = cluster_partition(graph, 1)
    kwargs = {"mask_factory": lambda: SharedHashMasks(DROPOUT, 7, LAYERS)} if held else {}
    kwargs["multilabel"] = bool(tasks)
    train_step_parts(model, opt, parts, feat, label, mask, **kwargs)  # .grad and the state exist
    with AllocationTrace("cpu") as trace:
        train_step_parts(model, opt, parts, feat, label, mask, **kwargs)
    cfg, _ = rev_replay_config(model, optimizer=opt, masks_held=held, fresh_grads=True, label_columns=tasks)
    part = parts[0].graph
    replayed = replayed_rows(lambda: replay_rev([part.num_nodes()], [part.num_edges()], [int(mask.sum())], cfg), 0)
    return traced_rows(trace), replayed


@pytest.mark.parametrize("backend", backend_params())
def test_rev_replay_follows_the_trace(backend):
    failed = []
    for case in CASES:
        problems = diff(*_events(backend, *case))
        if problems:
            failed.append(f"{case}: {problems[0]}")
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("backend", backend_params())
def test_rev_replay_of_multilabel_targets_follows_the_trace(backend):
    """The BCE loss over 7 tasks and the correct count of multi-label targets."""
    failed = []
    for conv, mode in (("gcn", "reversible"), ("sage", "residual")):
        problems = diff(*_events(backend, conv, mode, "layer", True, tasks=7))
        if problems:
            failed.append(f"{conv}, {mode}: {problems[0]}")
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("backend", backend_params())
def test_rev_replay_of_more_than_two_groups_follows_the_trace(backend):
    """With C > 2 groups the gradient wrt ``X'_0`` is added out of place into every
    group's slot, not only the one that is a view of the output's gradient (hidden 18:
    every parameter gradient stays below ``MIN_BYTES``)."""
    failed = []
    for conv, mode in (("gcn", "reversible"), ("sage", "residual"), ("gcn", "checkpoint")):
        problems = diff(*_events(backend, conv, mode, "layer", True, groups=3, hidden=18))
        if problems:
            failed.append(f"{conv}, {mode}: {problems[0]}")
    assert not failed, "\n".join(failed)


OPTIMIZER_VARIANTS = {
    "adam-maximize": (torch.optim.Adam, {"maximize": True}),
    "adam-maximize-decay": (torch.optim.Adam, {"maximize": True, "weight_decay": 1e-4}),
    "adam-decay": (torch.optim.Adam, {"weight_decay": 1e-4}),
    "sgd-decay": (torch.optim.SGD, {"weight_decay": 1e-4}),
    "sgd-momentum-decay": (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 1e-4}),
    "sgd-nesterov": (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
    "sgd-maximize": (torch.optim.SGD, {"maximize": True}),
    "sgd-nesterov-maximize-decay": (torch.optim.SGD, {"momentum": 0.9, "nesterov": True, "maximize": True,
                                                      "weight_decay": 1e-4}),
}
STEP_EVENTS = ("adam ", "sgd ")  # the replay's labels of the step's temporaries and SGD's new buffers


def _step_events(backend: str, name: str, first_step: bool):
    """``(traced, replayed)`` allocations of ``optimizer.step()`` alone (hidden 64: every
    parameter is at least ``MIN_BYTES``), after the gradients of one whole-graph part;
    ``first_step``: the optimizer has no state yet."""
    from betty.backends import get_backend
    from betty.rev.engine import backward_parts

    g, feat, label, train_idx = power_law_graph(num_nodes=300, avg_degree=6, num_feats=32,
                                                num_classes=5, seed=300)
    mask = torch.zeros(300, dtype=torch.bool)
    mask[train_idx] = True
    graph = get_backend(backend).full_graph(g)
    torch.manual_seed(0)
    model = RevGNN(32, 64, 5, num_layers=LAYERS, num_groups=2, conv="gcn", backend=backend)
    make, options = OPTIMIZER_VARIANTS[name]
    opt = make(model.parameters(), lr=1e-3, **options)
    parts = cluster_partition(graph, 1)
    if not first_step:
        train_step_parts(model, opt, parts, feat, label, mask)  # the state exists
    opt.zero_grad(set_to_none=True)
    backward_parts(model, parts, feat, label, mask)
    with AllocationTrace("cpu") as trace:
        opt.step()
    cfg, _ = rev_replay_config(model, optimizer=opt, fresh_grads=True, first_step=first_step)
    part = parts[0].graph
    tl = replay_rev([part.num_nodes()], [part.num_edges()], [int(mask.sum())], cfg, record=True)
    traced = [(e.op_name, e.nbytes, e.dtype) for e in trace.allocations(MIN_BYTES)]
    replayed = [(label, int(size[0]), comp) for kind, label, comp, size in tl.log
                if kind == "alloc" and size[0] >= MIN_BYTES and label.startswith(STEP_EVENTS)]
    return traced, replayed


@pytest.mark.parametrize("backend", backend_params())
def test_rev_replay_of_the_optimizer_step_follows_the_trace(backend):
    """The single-tensor step op by op: Adam's negated (maximize) and decayed gradients
    beside its square roots and denominators; SGD's gradient copies (decay, Nesterov,
    maximize); on SGD's first step with momentum, each momentum buffer cloned inside
    the loop. Every case holds a step allocation to compare."""
    failed = []
    cases = [(name, False) for name in OPTIMIZER_VARIANTS]
    cases += [("sgd-momentum-decay", True), ("sgd-nesterov-maximize-decay", True)]
    for name, first_step in cases:
        traced, replayed = _step_events(backend, name, first_step)
        assert traced and replayed, (name, first_step)
        problems = diff(traced, replayed)
        if problems:
            failed.append(f"{name}{' (first step)' if first_step else ''}: {problems[0]}")
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("backend", backend_params())
def test_rev_replay_of_parameter_gradients_follows_the_trace(backend):
    """Hidden 64 (32 channels a group): every weight's gradient is an event of both
    sides, at the op that makes it, in the three modes and the three couplings."""
    failed = []
    for conv, mode in itertools.product(("gcn", "sage", "gat"), ("reversible", "residual", "checkpoint")):
        problems = diff(*_events(backend, conv, mode, "layer", True, hidden=64))
        if problems:
            failed.append(f"{conv}, {mode}: {problems[0]}")
    assert not failed, "\n".join(failed)
