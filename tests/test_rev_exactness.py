"""RevGNN's K-part training step against an independent full-graph reference.

On a graph whose K = 3 METIS parts cut no edge (six connected components, which METIS
pairs into three balanced unions: every node keeps all its neighbours), one
:class:`betty.rev.engine.RevTrainer` step (K parts, their gradients accumulated, one SGD
step) must equal the step of plain torch autograd on the whole graph:

* the reference is a ``deepcopy`` of the model before the step, run once on the whole
  graph and differentiated with ``loss.backward()``: no part, no accumulation, none of
  betty's loss helpers (``F.cross_entropy`` / ``F.binary_cross_entropy_with_logits``
  with their ``mean`` reduction over the training nodes);
* RevGNN: the reference runs the same weights with ``set_mode(reversible=False,
  checkpoint=False)``, so its backward is ordinary autograd through every block (not
  betty's reversible autograd Function, not ``torch.utils.checkpoint``): the reversible
  and checkpointed variants are checked against a backward that shares none of their
  machinery;
* DEQ: the reference unrolls the plain fixed-point iteration ``Z <- cell(Z, X)`` from 0
  under autograd (:data:`DEQ_UNROLL` steps) with the model's own encoder, cell, norm and
  decoder: no solver, no implicit-gradient hook. The unrolled gradient equals the
  implicit one only at convergence, so the DEQ's forward and backward solves are run to
  ``tol = backward_tol = 1e-13`` in float64, 1e-6 in float32 (Anderson,
  ``max_iter = 200``), and any solve that stops at its cap fails the test (its
  ``RuntimeWarning`` is an error here). With the model's default ``tol = 1e-5`` the
  float64 gradients differ from the reference by 2e-6 to 5e-6: DEQ exactness holds up
  to the solver's tolerance.
* dropout: the trainer's deterministic masks are a hash of (key, global node ID,
  column) with ``key = dropout_key(dropout_seed, epoch)``, one mask shared by the blocks
  (hash layer 0) and one before the decoder (hash layer 1), scaled by ``1 / (1 - p)``
  (:class:`betty.rev.engine.SharedHashMasks`). The reference rebuilds them from that
  definition with :func:`betty.models.dropout.hash_keep_mask` over the whole graph's
  node IDs, passed to the model's own forward as ``mask_fn``, so it sees the same masks
  with dropout on (p = 0.2); one variant per backend runs with p = 0 (no mask at all).

Tolerances: relative to the largest entry of each gradient tensor (in float32, GAT's
attention vectors excepted, below), 1e-10 in float64 and 1e-5 in float32 (the project's
rule; never loosen them). Every axis value occurs at least
once per backend (conv gcn/sage/gat; reversible, residual, residual + checkpoint; weight
tied or not; norm layer/none; 2 or 3 groups; float64/float32; single-/multi-label), not
their full product.

One float32 scale differs: GAT's destination attention vector. Its gradient is
``∂L/∂a_r = Σ_i (Σ_{j→i} σ'_ij ∂L/∂s_ij) W h_i`` over destinations i, where ``s_ij`` is
the softmax input and ``σ'_ij`` the LeakyReLU slope; the softmax's gradient sums to zero
over each destination's edges, so only the slopes' differences survive and the sum
nearly cancels (at seed 0, 35 times smaller than the source vector's gradient in the
first block). Measured against its own largest entry, float32 rounding of its terms
alone moves it by up to 1.7e-5 with or without parts (plain float32 autograd on the whole
graph: up to 6.7e-6 from float64). In float32 both attention vectors of a layer are
therefore measured against the larger of their two largest entries, the scale of the
terms they sum (the gradients of ``W`` and ``a_l`` are left as they are); float64 keeps
the per-tensor scale.

The variants, DEQ ones included, run in one process and on 2 ranks (``DataParallel``: each rank runs its
share of the parts, the gradients all-reduced). Each test runs once per installed backend
(``backend``: the DGL half is marked ``dgl``, the PyG half ``pyg``, each skipped where
its framework is missing).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from betty.backends import get_backend
from betty.data.types import GraphDataset
from betty.models import build_model
from betty.models.dropout import dropout_key, hash_keep_mask
from betty.rev.engine import RevPlan, RevTrainer
from graphs import components_graph

SIZES = (10, 13, 8, 11, 9, 12)  # METIS with K = 3 pairs them into unions of 21, 23, 19 nodes
K = 3
FEATS, CLASSES, TASKS, HIDDEN, LAYERS = 5, 4, 3, 12, 3
SEED, EPOCH, LR = 3, 2, 0.5  # the trainer's seed (dropout keys and METIS), the epoch trained
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
# DEQ: both solves run to DEQ_TOL (float32: near its rounding floor); the unrolled
# reference must have stopped moving by DEQ_SETTLED when it ends
DEQ_TOL = {torch.float64: 1e-13, torch.float32: 1e-6}
DEQ_SETTLED = {torch.float64: 1e-14, torch.float32: 1e-6}
DEQ_MAX_ITER, DEQ_UNROLL = 200, 150


def _dataset(multilabel: bool, seed: int = 0) -> GraphDataset:
    g, _ = components_graph(SIZES, edges_per_node=3, seed=seed)
    n = g.num_nodes()
    gen = torch.Generator().manual_seed(seed + 1)
    feat = torch.randn(n, FEATS, generator=gen)
    label = ((torch.rand(n, TASKS, generator=gen) < 0.4).float() if multilabel
             else torch.randint(CLASSES, (n,), generator=gen))
    perm = torch.randperm(n, generator=gen)
    return GraphDataset(name="rev-exact", graph=g, feat=feat, label=label,
                        train_idx=perm[: 3 * n // 5], valid_idx=perm[3 * n // 5: 4 * n // 5],
                        test_idx=perm[4 * n // 5:], num_classes=TASKS if multilabel else CLASSES,
                        multilabel=multilabel)


@dataclass(frozen=True)
class Variant:
    conv: str
    mode: str  # "rev" | "res" | "ckpt" (residual + gradient checkpointing)
    tied: bool
    norm: str
    groups: int
    dtype: torch.dtype
    multilabel: bool
    dropout: float = 0.2
    prefetch: int = 0  # the trainer's preparation thread (RevTrainer's default for specs is 1)

    @property
    def id(self) -> str:
        return "-".join([self.conv, self.mode, "tied" if self.tied else "untied", self.norm,
                         f"g{self.groups}", "f64" if self.dtype == torch.float64 else "f32",
                         "multi" if self.multilabel else "single", f"p{self.dropout:g}"]
                        + ([f"prefetch{self.prefetch}"] if self.prefetch else []))


F64, F32 = torch.float64, torch.float32
VARIANTS = [
    Variant("gcn", "rev", False, "layer", 2, F64, False, prefetch=1),
    Variant("sage", "res", False, "none", 3, F64, True),
    Variant("gat", "ckpt", True, "layer", 2, F64, False),
    Variant("gcn", "ckpt", False, "none", 3, F64, True),
    Variant("gat", "rev", False, "none", 2, F64, True),
    Variant("sage", "rev", True, "layer", 3, F64, True),
    Variant("gcn", "rev", False, "layer", 2, F32, False),
    Variant("sage", "ckpt", True, "none", 2, F32, True, prefetch=1),
    Variant("gcn", "res", True, "layer", 3, F32, False, dropout=0.0),
    Variant("gat", "rev", False, "layer", 2, F32, False),
    Variant("gat", "ckpt", True, "none", 3, F32, True),
    Variant("gat", "res", True, "layer", 3, F64, False),
    Variant("sage", "rev", False, "none", 2, F64, False),
]


def _train_mask(ds: GraphDataset) -> torch.Tensor:
    mask = torch.zeros(ds.num_nodes, dtype=torch.bool)
    mask[ds.train_idx] = True
    return mask


def _reference_masks(p: float, head_layer: int):
    """The trainer's masks rebuilt from their definition: hash layer 0 for the body
    (``layer < head_layer``), hash layer 1 before the decoder; bool keep-masks, which the
    model scales by ``1 / (1 - p)``. ``None`` when ``p == 0``."""
    if p == 0.0:
        return None
    key = dropout_key(SEED, EPOCH)
    return lambda shape, ids, layer: hash_keep_mask(ids, int(shape[1]), p, key, 0 if layer < head_layer else 1)


def _mean_loss(out, ds: GraphDataset, train: torch.Tensor):
    if ds.multilabel:  # the mean over training nodes of the mean over tasks
        return F.binary_cross_entropy_with_logits(out[train], ds.label[train].to(out.dtype))
    return F.cross_entropy(out[train], ds.label[train])


def _accuracy(out, ds: GraphDataset, train: torch.Tensor) -> float:
    out, target = out.detach()[train], ds.label[train]
    if ds.multilabel:
        return float(((out > 0) == (target > 0.5)).double().mean())
    return float((out.argmax(1) == target).double().mean())


def _trainer_step(model, ds: GraphDataset, dtype, parallel=None, prefetch: int = 0):
    """One RevTrainer epoch (K = 3 METIS parts, one SGD step; on ``parallel``'s ranks if
    given; ``prefetch``: parts split on the preparation thread): the record, the parameters before the step and the accumulated gradients the
    step used (all-reduced over the ranks)."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = RevTrainer(model, torch.optim.SGD(model.parameters(), lr=LR), ds, RevPlan("metis", K),
                         seed=SEED, dtype=dtype, estimate_memory=False, parallel=parallel, prefetch=prefetch)
    record = trainer.train_epoch(EPOCH)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return record, before, grads


def _gradient_scale(name: str, ref_grads: dict) -> float:
    """What a gradient's error is measured against: its largest entry; in float32, for a
    GAT attention vector, the larger of its layer's two (module docstring)."""
    if ref_grads[name].dtype == torch.float32 and name.endswith((".attn_l", ".attn_r")):
        return max(float(ref_grads[name[:-1] + side].abs().max()) for side in "lr")
    return float(ref_grads[name].abs().max())


def _check_step(model, record, before, grads, ref_loss, ref_acc, ref_grads, tol, ranks: bool = False):
    # the precondition: K parts that together keep every edge (each part ran; on ranks
    # each record lists this rank's parts, the test checks that they cover K)
    assert record.k == K and (ranks or len(record.parts) == K), record.parts
    assert record.edges_kept_fraction == 1.0, "the split cuts edges: K-part training is another model"
    assert all(not p.skipped for p in record.parts)
    # the accumulated gradient is the whole graph's, parameter by parameter
    assert set(grads) == set(ref_grads)
    assert any(float(g.abs().max()) > 0 for g in ref_grads.values())
    worst = {}
    for name, want in ref_grads.items():
        scale = _gradient_scale(name, ref_grads)
        err = float((grads[name] - want).abs().max())
        worst[name] = err / scale if scale > 0 else (0.0 if err == 0.0 else float("inf"))
    bad = {n: e for n, e in worst.items() if not e <= tol}
    assert not bad, f"gradients differ from the full-graph autograd ones (relative, tol {tol:g}): {bad}"
    # the step's loss and training accuracy are the whole graph's
    assert record.loss == pytest.approx(ref_loss, rel=tol, abs=0.0)
    # (hits are counted as integers, so only float64 rounding of the sums remains; one
    # changed prediction moves it by ~9e-3)
    assert record.train_acc == pytest.approx(ref_acc, rel=0.0, abs=1e-12)
    # and the optimizer stepped once, with exactly that accumulated gradient
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name].add(grads[name], alpha=-LR)), name


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.id)
def test_k_part_step_equals_plain_autograd_on_the_whole_graph(backend, variant):
    check_variant(backend, variant)


def test_k_parts_on_two_ranks_equal_plain_autograd_on_the_whole_graph(backend):
    """Every variant on 2 ranks (``DataParallel``: each rank runs its share of the K
    parts, the gradients all-reduced): every rank's step is plain autograd's, and the
    ranks' parts cover the K parts once."""
    from betty.distributed.launch import launch

    results = launch(rank_check_variants, (backend,), nproc=2)
    for v in VARIANTS:
        ran = results[0][v.id] + results[1][v.id]
        assert sorted(ran) == list(range(K)), f"{v.id}: parts {ran} do not cover K={K} once"


def rank_check_variants(backend: str) -> dict[str, list[int]]:
    """On one rank: :func:`check_variant` of every variant on a ``DataParallel``; the
    parts each ran here."""
    from betty.distributed import DataParallel

    return {v.id: check_variant(backend, v, DataParallel(check_every=1)) for v in VARIANTS}


def check_variant(backend: str, v: Variant, parallel=None) -> list[int]:
    """One RevTrainer step of variant ``v`` (on ``parallel``'s ranks if given) against
    plain autograd on the whole graph; the indices of the parts this process ran."""
    ds = _dataset(v.multilabel)
    torch.manual_seed(0)
    model = build_model("revgnn", FEATS, ds.num_classes, hidden=HIDDEN, layers=LAYERS, conv=v.conv,
                        heads=2, dropout=v.dropout, norm=v.norm, groups=v.groups,
                        reversible=v.mode == "rev", checkpoint=v.mode == "ckpt",
                        weight_tied=v.tied, backend=backend).to(v.dtype)
    assert (model.reversible, model.checkpoint, model.stack.weight_tied) == (
        v.mode == "rev", v.mode == "ckpt", v.tied)
    reference = copy.deepcopy(model)

    record, before, grads = _trainer_step(model, ds, v.dtype, parallel, v.prefetch)

    # the reference: the same weights as a plain residual network (ordinary autograd),
    # one forward over the whole graph, the mean loss over the training nodes, .backward()
    reference.set_mode(reversible=False, checkpoint=False)
    reference.train()
    train = _train_mask(ds)
    whole = get_backend(backend).full_graph(ds.graph)
    out = reference(whole, ds.feat.to(v.dtype), node_ids=torch.arange(ds.num_nodes),
                    mask_fn=_reference_masks(v.dropout, reference.num_layers))
    loss = _mean_loss(out, ds, train)
    loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    _check_step(model, record, before, grads, loss.item(), _accuracy(out, ds, train), ref_grads,
                TOL[v.dtype], ranks=parallel is not None)
    return [p.index for p in record.parts]


DEQ_VARIANTS = [("gcn", "layer", False, F64), ("gat", "none", True, F64), ("sage", "none", False, F32)]


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a solve stopping at its cap fails
@pytest.mark.parametrize("conv,norm,multilabel,dtype", DEQ_VARIANTS,
                         ids=[f"{c}-{n}-{'multi' if m else 'single'}-{'f64' if d == F64 else 'f32'}"
                              for c, n, m, d in DEQ_VARIANTS])
def test_deq_k_part_step_equals_unrolled_autograd_on_the_whole_graph(backend, conv, norm, multilabel, dtype):
    """The DEQ's implicit gradient, accumulated over the parts, against plain autograd
    through the unrolled fixed-point iteration on the whole graph (both solves converged
    to :data:`DEQ_TOL`)."""
    check_deq(backend, conv, norm, multilabel, dtype)


def test_deq_k_parts_on_two_ranks_equal_unrolled_autograd_on_the_whole_graph(backend):
    """Every DEQ variant on 2 ranks: each rank's step (its parts' implicit gradients,
    all-reduced) is the unrolled whole-graph one, and the ranks' parts cover the K parts
    once."""
    from betty.distributed.launch import launch

    results = launch(rank_check_deq, (backend,), nproc=2)
    for variant in DEQ_VARIANTS:
        ran = results[0][str(variant)] + results[1][str(variant)]
        assert sorted(ran) == list(range(K)), f"{variant}: parts {ran} do not cover K={K} once"


def rank_check_deq(backend: str) -> dict[str, list[int]]:
    """On one rank: :func:`check_deq` of every DEQ variant on a ``DataParallel``, a solve
    stopping at its cap an error; the parts each ran here."""
    import warnings

    from betty.distributed import DataParallel

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        return {str(v): check_deq(backend, *v, DataParallel(check_every=1)) for v in DEQ_VARIANTS}


def check_deq(backend: str, conv: str, norm: str, multilabel: bool, dtype, parallel=None) -> list[int]:
    """One RevTrainer step of a DEQ (on ``parallel``'s ranks if given), both solves run to
    :data:`DEQ_TOL`, against autograd through the unrolled iteration on the whole graph;
    the indices of the parts this process ran."""
    p = 0.2
    ds = _dataset(multilabel)
    torch.manual_seed(0)
    model = build_model("revgnn", FEATS, ds.num_classes, hidden=HIDDEN, conv=conv, heads=2, dropout=p,
                        norm=norm, deq=True, deq_max_iter=DEQ_MAX_ITER, deq_tol=DEQ_TOL[dtype],
                        backend=backend).to(dtype)
    reference = copy.deepcopy(model)

    record, before, grads = _trainer_step(model, ds, dtype, parallel)
    assert model.last_forward_stats.converged and model.last_backward_stats.converged

    reference.train()
    train = _train_mask(ds)
    whole = get_backend(backend).full_graph(ds.graph)
    masks = _reference_masks(p, head_layer=1)
    ids = torch.arange(ds.num_nodes)

    def multiplier(layer):
        return masks((ds.num_nodes, HIDDEN), ids, layer).to(dtype) * (1.0 / (1.0 - p))

    x = reference.encoder(ds.feat.to(dtype))
    z = torch.zeros_like(x)
    for _ in range(DEQ_UNROLL):
        z_next = reference.cell(whole, z, x, multiplier(0))
        change = float((z_next - z).detach().norm() / z_next.detach().norm())
        z = z_next
    assert change < DEQ_SETTLED[dtype], f"the unrolled iteration has not converged: relative step {change:.1e}"
    out = reference.decoder(torch.relu(reference.norm(z)) * multiplier(1))
    loss = _mean_loss(out, ds, train)
    loss.backward()
    ref_grads = {n: q.grad for n, q in reference.named_parameters()}
    _check_step(model, record, before, grads, loss.item(), _accuracy(out, ds, train), ref_grads,
                TOL[dtype], ranks=parallel is not None)
    return [part.index for part in record.parts]
