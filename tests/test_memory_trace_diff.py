"""The replays' event sequences against the allocation recorder, op by op.

For each model and backend, one training micro-batch runs under
:class:`betty.memory.trace.AllocationTrace` and the same micro-batch is replayed
(:func:`betty.memory.replay.replay`, configured by
:func:`betty.memory.estimator.replay_config` as the estimator does). Normalized form: the
allocations of at least ``MIN_BYTES`` (tiny 0-d and per-bucket tensors are below it),
as ``(op or label, bytes)`` in order, each with the position of its free. Three checks,
each naming the first op that breaks it, so that a library upgrade that adds, drops,
resizes or keeps an op longer shows up by name:

* every floating-point allocation of the trace is, in order, an allocation of the
  replay with the same bytes (a replay that leaves an op out fails here);
* every allocation of the replay, except the block structures and dropout IDs built
  before the model runs (the replay keeps them as one buffer per layer), is, in order,
  an allocation of the trace with the same bytes (a replay that invents an op or gets
  its size wrong fails here);
* each floating-point allocation paired by the first check is freed, in the replay as
  in the trace, before the same next paired allocation (or lives to the end in both):
  a replay that frees a tensor late or early fails here, which the first two checks
  cannot see (a layer's dropped input kept past the node that last saved it).

The same checks hold under bf16-mixed (the step's forward pass and loss under
``torch.autocast(cpu, bfloat16)``: ``accumulate_gradients(precision=...)``; the replay
with ``autocast_elt=2``) for every model the replay covers under autocast
(:data:`test_memory_precision.MODELS`), at depth 2 and 3: autocast's weight and input
copies, the ops that promote back to float32 and the casts' backward are each an event;
for SAGE-LSTM also ``AutocastLSTM``'s float32 copies of a bfloat16 mailbox and of the
initial states, and the cast of the input's gradient back to bfloat16. With host
features in bfloat16 or float16 (bf16-mixed on both backends; 16-mixed on PyG, whose CPU
kernels take float16): features in the compute dtype reach the first layer as they are
(its degrees, sums and norms in that dtype, the ops meeting a float32 parameter
promoting to float32), features in the other 16-bit dtype are first cast to float32
(:func:`betty.precision.input_dtype`). With input dropout, on the second micro-batch of
a split, in float32 and bf16-mixed.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable

import numpy as np
import pytest
import torch

from betty.memory.constants import load_constants
from betty.memory.estimator import replay_config
from betty.memory.replay import replay
from betty.memory.sizes import split_sizes
from betty.memory.timeline import Buffer, Timeline
from betty.memory.trace import AllocationTrace
from betty.models import build_model
from betty.partition import partition_batch
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
            precision: str = "32", label_columns: int = 0,
            feat_dtype: torch.dtype = torch.float32, dropout: float = 0.0, k: int = 1,
            attn_dropout: float = 0.0, heads: int = 3, dtype: torch.dtype | None = None,
            edgeless: bool = False):
    """``(traced, replayed)`` allocations of one micro-batch; ``label_columns`` T > 0:
    multi-label ``(N, T)`` float32 0/1 targets and the BCE loss, else 5 classes. The host
    features are ``feat_dtype``; the step runs in ``precision`` (the trainer's own path:
    :func:`betty.precision.input_dtype` decides the features' cast, autocast covers each
    forward and loss). ``k`` > 1: a random K-way split, and the micro-batch traced is the
    last one (it starts with ``.grad`` from the others, where the one of ``k = 1`` starts
    with that of a previous step); with ``edgeless`` the outputs without in-edges are that
    micro-batch, whose blocks then have no edges. GAT runs 3 heads: an ``(E, H)`` float32
    tensor then has another size than an ``(E,)`` int64 one (the diff pairs events by
    bytes)."""
    if backend == "pyg":
        pytest.importorskip("torch_geometric")
    g, feat, label, train = power_law_graph(num_nodes=300, avg_degree=8, num_feats=40,
                                            num_classes=5, seed=300)
    feat = feat.to(feat_dtype)
    multilabel = label_columns > 0
    if multilabel:
        gen = torch.Generator().manual_seed(300)
        label = (torch.rand(feat.shape[0], label_columns, generator=gen) > 0.5).float()
    batch = sample_full_batch(g, train, [4, 6, 3][:layers], seed=1)
    torch.manual_seed(0)
    model = build_model(arch, 40, label_columns or 5, hidden=hidden, layers=layers,
                        aggregator=agg, heads=heads, dropout=dropout, backend=backend,
                        **({"attn_dropout": attn_dropout} if attn_dropout else {})).train()
    step = {"dtype": dtype} if dtype is not None else {}  # precision "64": the model in float64
    if dtype is not None:
        model = model.to(dtype)
    opt = build_optimizer("adam", model.parameters(), 1e-3)
    groups = torch.zeros(batch.num_outputs, dtype=torch.int64)
    train_step(model, opt, batch, groups, feat, label, dropout_key=1,  # .grad and Adam state
               multilabel=multilabel, **step)
    if k > 1:
        groups = partition_batch(batch, k, "random", seed=3).groups
        if edgeless:
            groups = torch.where(batch.layers[-1].in_degrees() == 0, k - 1, groups % (k - 1))
        opt.zero_grad(set_to_none=True)
        accumulate_gradients(model, batch, groups, feat, label, k=k, indices=range(k - 1),
                             dropout_key=2, multilabel=multilabel, precision=precision, **step)
    with AllocationTrace("cpu") as trace:
        accumulate_gradients(model, batch, groups, feat, label, k=k, indices=[k - 1],
                             dropout_key=2, multilabel=multilabel, precision=precision, **step)
    sizes = split_sizes(batch, groups, k)
    assert not edgeless or all(e[k - 1] == 0 for e in sizes.num_edges), "tests nothing"
    cfg = replay_config(model, opt, dtype=dtype, precision=precision, feature_dtype=feat_dtype,
                        fresh_grads=np.zeros(k, dtype=bool), num_micro_batches=k,
                        label_columns=label_columns, constants=load_constants("cpu"))
    return traced_rows(trace), _replayed(sizes, cfg, k - 1)


def traced_rows(trace: AllocationTrace) -> list[tuple]:
    """The trace's allocations of at least MIN_BYTES, ``(op, bytes, dtype, position,
    position of its free)`` (positions in ``trace.events``; None: alive at the end; the
    free is the first event that leaves the storage no bytes: a free or a resize to 0)."""
    freed: dict[int, int] = {}
    for t, e in enumerate(trace.events):
        if e.kind == "free" or (e.kind == "resize" and e.nbytes == 0):
            freed.setdefault(e.storage, t)
    return [(e.op_name, e.nbytes, e.dtype, t, freed.get(e.storage))
            for t, e in enumerate(trace.events) if e.kind == "alloc" and e.nbytes >= MIN_BYTES]


def _replayed(sizes, cfg, col: int) -> list[tuple]:
    """:func:`replayed_rows` of the sampled-block replay of ``sizes`` under ``cfg``."""
    return replayed_rows(lambda: replay(sizes, cfg), col)


def replayed_rows(run: Callable[[], object], col: int) -> list[tuple]:
    """The allocations of at least MIN_BYTES in micro-batch ``col`` of the replay ``run``
    runs, ``(name, bytes, component, position, position of its free)`` (positions in the
    replay's sequence of allocations and frees; None: alive at the end). A buffer is
    freed when its last holder lets go (:meth:`Timeline.release`) or where
    ``release_where`` / ``free_where`` free it in micro-batch ``col``; a merged buffer
    stands for its parts."""
    rows: list[list] = []
    parts: dict[int, tuple[Buffer, list[int]]] = {}  # id(buffer) -> (buffer, its rows)
    clock = itertools.count()
    original = {name: getattr(Timeline, name)
                for name in ("alloc", "release", "release_where", "free_where", "merge")}

    def freed(buf: Buffer) -> None:
        entry = parts.get(id(buf))
        if entry is None:
            return
        t = next(clock)
        for r in entry[1]:
            if rows[r][4] is None:
                rows[r][4] = t

    def alloc(self, nbytes, component, name):
        buf = original["alloc"](self, nbytes, component, name)
        rows.append([name, int(buf.size[col]), component, next(clock), None])
        parts[id(buf)] = (buf, [len(rows) - 1])
        return buf

    def release(self, *bufs):
        original["release"](self, *bufs)
        for buf in bufs:
            if buf is not None and buf.holders == 0:
                freed(buf)

    def where(name):
        def wrapped(self, buf, mask):
            original[name](self, buf, mask)
            if np.broadcast_to(np.asarray(mask, dtype=bool), (self.num_micro_batches,))[col]:
                freed(buf)
        return wrapped

    def merge(self, *bufs):
        out = original["merge"](self, *bufs)
        parts[id(out)] = (out, [r for b in bufs for r in parts.get(id(b), (None, []))[1]])
        return out

    patched = {"alloc": alloc, "release": release, "release_where": where("release_where"),
               "free_where": where("free_where"), "merge": merge}
    try:
        for name, fn in patched.items():
            setattr(Timeline, name, fn)
        run()
    finally:
        for name, fn in original.items():
            setattr(Timeline, name, fn)
    return [tuple(r) for r in rows if r[1] >= MIN_BYTES]


def _match(needles, haystack) -> tuple[list[int], int | None]:
    """Greedy subsequence match on bytes: the ``haystack`` index of each ``needles``
    entry, in order, up to the first one not found, and that one's index (None when all
    are found)."""
    j, found = 0, []
    for i, needle in enumerate(needles):
        while j < len(haystack) and haystack[j][1] != needle[1]:
            j += 1
        if j == len(haystack):
            return found, i
        found.append(j)
        j += 1
    return found, None


def _first_unmatched(needles, haystack) -> int | None:
    """Index of the first ``needles`` entry whose bytes are not found, in order, in
    ``haystack``; None when all are."""
    return _match(needles, haystack)[1]


def _freed_before(allocs: list[int], free: int | None) -> int:
    """How many of the positions ``allocs`` (ascending) come before ``free`` (all of
    them where it is None: alive to the end)."""
    return len(allocs) if free is None else bisect.bisect_left(allocs, free)


def diff(traced, replayed) -> list[str]:
    """The three checks of the module docstring, on ``(op or label, bytes, dtype or
    component, position, position of its free)`` rows (:func:`traced_rows`,
    :func:`_replayed`; rows of three: the first two checks only); a message per failed
    check."""
    out = []
    floats = [e for e in traced if "float" in e[2]]
    pairs, i = _match(floats, replayed)
    if i is not None:
        out.append(f"traced op {floats[i][0]} ({floats[i][1]} bytes, {floats[i][2]}, float "
                   f"allocation {i}) has no replay event; replay around it: "
                   f"{[r[:2] for r in replayed[max(0, i - 3):i + 3]]}")
    own = [e for e in replayed if e[2] not in BEFORE_MODEL]
    i = _first_unmatched(own, traced)
    if i is not None:
        out.append(f"replay event {own[i][0]!r} ({own[i][1]} bytes, allocation {i}) has no "
                   f"traced op")
    if not pairs or len(floats[0]) < 5 or len(replayed[0]) < 5:
        return out  # rows without free positions (the optimizer step alone): the first two checks
    t_at = [floats[i][3] for i in range(len(pairs))]
    r_at = [replayed[j][3] for j in pairs]
    for i, j in enumerate(pairs):
        t_free = _freed_before(t_at, floats[i][4])
        r_free = _freed_before(r_at, replayed[j][4])
        if t_free != r_free:
            def when(n: int, side) -> str:
                return "at the end" if n == len(pairs) else f"before {side[n][0]!r} (float allocation {n})"
            out.append(f"traced op {floats[i][0]} ({floats[i][1]} bytes, float allocation {i}, "
                       f"replay event {replayed[j][0]!r}) is freed {when(t_free, floats)} in the "
                       f"trace but {when(r_free, [replayed[p] for p in pairs])} in the replay")
            break
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


# host features in a 16-bit dtype under a mixed precision: in the autocast dtype they reach
# the model as they are; in the other one the trainer casts them to float32 first
FEATURE_DTYPE_CASES = [
    pytest.param("dgl", torch.bfloat16, "bf16-mixed", marks=pytest.mark.dgl, id="dgl-bf16-bf16mixed"),
    pytest.param("dgl", torch.float16, "bf16-mixed", marks=pytest.mark.dgl, id="dgl-fp16-bf16mixed"),
    pytest.param("pyg", torch.bfloat16, "bf16-mixed", marks=pytest.mark.pyg, id="pyg-bf16-bf16mixed"),
    pytest.param("pyg", torch.float16, "bf16-mixed", marks=pytest.mark.pyg, id="pyg-fp16-bf16mixed"),
    pytest.param("pyg", torch.float16, "16-mixed", marks=pytest.mark.pyg, id="pyg-fp16-16mixed"),
    pytest.param("pyg", torch.bfloat16, "16-mixed", marks=pytest.mark.pyg, id="pyg-bf16-16mixed"),
]


@pytest.mark.parametrize("arch,agg", MIXED_MODELS, ids=[f"{a}-{g}" for a, g in MIXED_MODELS])
@pytest.mark.parametrize("backend,feat_dtype,precision", FEATURE_DTYPE_CASES)
def test_low_precision_features_replay_follows_the_trace(backend, feat_dtype, precision, arch, agg):
    """16-bit host features under autocast: in the compute dtype the first layer's
    non-product ops (degrees, sums, norms, dropout) run in it and the ops that meet a
    float32 parameter promote to float32; in the other 16-bit dtype the features are
    first cast to float32 on the device, and that copy is what every layer sees."""
    for layers in (2, 3):
        for hidden in (16, 64):
            traced, replayed = _events(arch, agg, backend, hidden, layers, precision,
                                       feat_dtype=feat_dtype)
            problems = diff(traced, replayed)
            assert not problems, f"L={layers} hidden {hidden}: " + "\n".join(problems)


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
@pytest.mark.parametrize("arch,agg", MODELS, ids=[f"{a}-{g}" for a, g in MODELS])
@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_replay_follows_the_trace(backend, arch, agg, precision):
    """Input dropout 0.5 on every layer, the second micro-batch of a K = 2 split (it
    starts with the first one's ``.grad``): a layer's input is then the dropout's output,
    which only the layer's own products keep (SAGE's ``fc_self`` and the sources'
    ``fc_neigh``, GAT's ``fc``; the backends' aggregations keep none), so it is freed
    by the last of those nodes, before ``AccumulateGrad`` and autocast's float32
    gradient casts run."""
    for layers in (2, 3):  # depth 3: a middle layer whose dropped input needs a gradient
        for hidden in (16, 64):
            traced, replayed = _events(arch, agg, backend, hidden, layers, precision,
                                       dropout=0.5, k=2)
            problems = diff(traced, replayed)
            assert not problems, f"L={layers} hidden {hidden}: " + "\n".join(problems)


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_gat_attention_dropout_replay_follows_the_trace(backend, precision):
    """GAT's attention dropout: the aggregation's node holds the dropped attention and
    lets go of it when it ends, before the dropout's backward runs."""
    for k in (1, 2):
        traced, replayed = _events("gat", "mean", backend, 16, 2, precision, dropout=0.5, k=k,
                                   attn_dropout=0.3)
        problems = diff(traced, replayed)
        assert not problems, f"K={k}: " + "\n".join(problems)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_lstm_replay_follows_the_trace(backend):
    """Precision 64 on the host: torch runs its native per-step LSTM (no oneDNN kernel
    for float64), which the replay follows step by step, forward and backward."""
    for layers, k in ((2, 1), (3, 2)):
        traced, replayed = _events("sage", "lstm", backend, 16, layers, "64", k=k, dtype=torch.float64)
        problems = diff(traced, replayed)
        assert not problems, f"L={layers} K={k}: " + "\n".join(problems)


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_pool_without_edges_replay_follows_the_trace(backend, precision):
    """The second micro-batch of a K = 2 split holds the outputs without in-edges, so none
    of its blocks has edges. On DGL betty's ``EdgelessPoolSAGEConv`` runs: float32
    zeros (copied to the layer input's dtype where that differs, or cast by autocast),
    ``fc_self`` then ``fc_neigh`` of the zeros, and in backward ``fc_neigh``'s weight
    gradient first, then ``fc_self``'s node and ``slice_backward``; nothing of
    ``fc_pool`` or the max. On PyG the pool aggregator's ops run on no messages."""
    for layers in (2, 3):  # depth 3: a middle layer whose input needs a gradient
        for hidden in (16, 64):
            traced, replayed = _events("sage", "pool", backend, hidden, layers, precision, k=2,
                                       edgeless=True)
            problems = diff(traced, replayed)
            assert not problems, f"L={layers} hidden {hidden}: " + "\n".join(problems)
