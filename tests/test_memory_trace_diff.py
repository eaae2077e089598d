"""The replays' event sequences against the allocation recorder, op by op.

For each model and backend, one float32 training micro-batch runs under
:class:`betty.memory.trace.AllocationTrace` and the same micro-batch is replayed
(:func:`betty.memory.replay.replay` with ``record=True``). Normalized form: the
allocations of at least ``MIN_BYTES`` (tiny 0-d and per-bucket tensors are below it),
as ``(op or label, bytes)`` in order. Two checks, each naming the first op that breaks
it, so that a library upgrade that adds, drops or resizes an op shows up by name:

* every floating-point allocation of the trace is, in order, an allocation of the
  replay with the same bytes (a replay that leaves an op out fails here);
* every allocation of the replay, except the block structures and dropout IDs built
  before the model runs (the replay keeps them as one buffer per layer), is, in order,
  an allocation of the trace with the same bytes (a replay that invents an op or gets
  its size wrong fails here).

The same two checks hold under bf16-mixed (the forward pass and the loss under
``torch.autocast(cpu, bfloat16)``, :func:`autocast_step.autocast_step`; the replay with
``autocast_elt=2``) for every model the replay covers under autocast
(:data:`test_memory_precision.MODELS`), at depth 2 and 3: autocast's weight and input
copies, the ops that promote back to float32 and the casts' backward are each an event;
for SAGE-LSTM also ``AutocastLSTM``'s float32 copies of a bfloat16 mailbox and of the
initial states, and the cast of the input's gradient back to bfloat16.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from autocast_step import autocast_step
from betty.memory.constants import load_constants
from betty.memory.replay import ReplayConfig, replay
from betty.memory.sizes import split_sizes
from betty.memory.spec import as_model_spec, as_optimizer_spec
from betty.memory.trace import AllocationTrace
from betty.models import build_model
from betty.sampling import sample_full_batch
from betty.train import accumulate_gradients, build_optimizer, train_step
from graphs import power_law_graph
from test_memory_precision import MODELS as MIXED_MODELS

MIN_BYTES = 1024
BACKENDS = [pytest.param("dgl", marks=pytest.mark.dgl), pytest.param("pyg", marks=pytest.mark.pyg)]
MODELS = [("sage", "mean"), ("sage", "gcn"), ("sage", "pool"), ("sage", "lstm"), ("gat", "mean"),
          ("gcn", "mean")]
BEFORE_MODEL = ("blocks", "global_ids")
# multi-label: SAGE-mean's logits stay in autocast's compute dtype, GAT's are float32;
# T = 7 tasks make the (n_out, T) bool tensors of the metrics at least MIN_BYTES
MULTILABEL_MODELS = [("sage", "mean"), ("gat", "mean")]
LABEL_COLUMNS = 7


def _events(arch: str, agg: str, backend: str, hidden: int, layers: int = 2,
            precision: str = "32", label_columns: int = 0):
    """``(traced, replayed)`` allocations of one micro-batch; ``label_columns`` T > 0:
    multi-label ``(N, T)`` float32 0/1 targets and the BCE loss, else 5 classes."""
    if backend == "pyg":
        pytest.importorskip("torch_geometric")
    g, feat, label, train = power_law_graph(num_nodes=300, avg_degree=8, num_feats=40,
                                            num_classes=5, seed=300)
    multilabel = label_columns > 0
    if multilabel:
        gen = torch.Generator().manual_seed(300)
        label = (torch.rand(feat.shape[0], label_columns, generator=gen) > 0.5).float()
    batch = sample_full_batch(g, train, [4, 6, 3][:layers], seed=1)
    torch.manual_seed(0)
    model = build_model(arch, 40, label_columns or 5, hidden=hidden, layers=layers,
                        aggregator=agg, heads=2, backend=backend).train()
    opt = build_optimizer("adam", model.parameters(), 1e-3)
    groups = torch.zeros(batch.num_outputs, dtype=torch.int64)
    train_step(model, opt, batch, groups, feat, label, dropout_key=1,  # .grad and Adam state
               multilabel=multilabel)
    with autocast_step(model, precision) as stepped, AllocationTrace("cpu") as trace:
        accumulate_gradients(stepped, batch, groups, feat, label, k=1, dropout_key=2,
                             multilabel=multilabel)
    cfg = ReplayConfig(model=as_model_spec(model), optimizer=as_optimizer_spec(opt), elt=4,
                       feat_elt=4, constants=load_constants("cpu"), fresh_grads=np.array([False]),
                       label_columns=label_columns,
                       autocast_elt=2 if precision == "bf16-mixed" else 0)
    tl = replay(split_sizes(batch, groups, 1), cfg, record=True)
    traced = [(e.op_name, e.nbytes, e.dtype) for e in trace.allocations(MIN_BYTES)]
    replayed = [(name, int(size[0]), comp) for kind, name, comp, size in tl.log
                if kind == "alloc" and size[0] >= MIN_BYTES]
    return traced, replayed


def _first_unmatched(needles, haystack) -> int | None:
    """Index of the first ``needles`` entry whose bytes are not found, in order, in
    ``haystack`` (greedy subsequence match on bytes); None when all are."""
    j = 0
    for i, (_, nbytes, _) in enumerate(needles):
        while j < len(haystack) and haystack[j][1] != nbytes:
            j += 1
        if j == len(haystack):
            return i
        j += 1
    return None


def diff(traced, replayed) -> list[str]:
    """The two checks of the module docstring; a message per failed check."""
    out = []
    floats = [e for e in traced if "float" in e[2]]
    i = _first_unmatched(floats, replayed)
    if i is not None:
        out.append(f"traced op {floats[i][0]} ({floats[i][1]} bytes, {floats[i][2]}, float "
                   f"allocation {i}) has no replay event; replay around it: "
                   f"{[r[:2] for r in replayed[max(0, i - 3):i + 3]]}")
    own = [e for e in replayed if e[2] not in BEFORE_MODEL]
    i = _first_unmatched(own, traced)
    if i is not None:
        out.append(f"replay event {own[i][0]!r} ({own[i][1]} bytes, allocation {i}) has no "
                   f"traced op")
    return out


@pytest.mark.parametrize("arch,agg", MODELS, ids=[f"{a}-{g}" for a, g in MODELS])
@pytest.mark.parametrize("backend", BACKENDS)
def test_replay_follows_the_trace(backend, arch, agg):
    for hidden in (16, 64):  # 40 -> 16: lin_before_mp; 40 -> 64: aggregate first
        traced, replayed = _events(arch, agg, backend, hidden)
        problems = diff(traced, replayed)
        assert not problems, f"hidden {hidden}: " + "\n".join(problems)


@pytest.mark.parametrize("arch,agg", MULTILABEL_MODELS, ids=[f"{a}-{g}" for a, g in MULTILABEL_MODELS])
@pytest.mark.parametrize("backend", BACKENDS)
def test_multilabel_replay_follows_the_trace(backend, arch, agg):
    for hidden in (16, 64):
        traced, replayed = _events(arch, agg, backend, hidden, label_columns=LABEL_COLUMNS)
        problems = diff(traced, replayed)
        assert not problems, f"hidden {hidden}: " + "\n".join(problems)


@pytest.mark.parametrize("arch,agg", MIXED_MODELS, ids=[f"{a}-{g}" for a, g in MIXED_MODELS])
@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_precision_replay_follows_the_trace(backend, arch, agg):
    for layers in (2, 3):  # depth 3: a middle layer whose input needs a gradient
        for hidden in (16, 64):
            traced, replayed = _events(arch, agg, backend, hidden, layers, "bf16-mixed")
            problems = diff(traced, replayed)
            assert not problems, f"L={layers} hidden {hidden}: " + "\n".join(problems)


@pytest.mark.parametrize("arch,agg", MULTILABEL_MODELS, ids=[f"{a}-{g}" for a, g in MULTILABEL_MODELS])
@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_precision_multilabel_replay_follows_the_trace(backend, arch, agg):
    for hidden in (16, 64):
        traced, replayed = _events(arch, agg, backend, hidden, precision="bf16-mixed",
                                   label_columns=LABEL_COLUMNS)
        problems = diff(traced, replayed)
        assert not problems, f"hidden {hidden}: " + "\n".join(problems)
