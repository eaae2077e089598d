"""The :class:`betty.engine.Trainer` (what ``betty run`` trains with: fixed batches,
sampling, partitioning or the K search, carving, the optimizer step) against the
independent full-batch reference, on both backends (the PyG half runs in ``.venv-pyg``).

``tests/test_exactness.py`` checks :func:`betty.train.accumulate_gradients` on batches
it samples and splits itself; here everything between the dataset and the updated
parameters is the Trainer's. For every case the Trainer trains a model for its epochs,
while a deep copy (the twin) is updated with the same optimizer from the gradients of
:func:`betty.reference.full_batch_reference` (the model run once on the sampler's own
blocks: no partition, no carving, its own loss normalisation), one reference step per
batch, in the Trainer's batch order, with the step's dropout key. The parameter updates
(after - before) must agree to 1e-10 relative in float64 (dropout 0.5, GAT attention
dropout 0.25, deterministic dropout), 1e-5 in float32 and the bounds of
``tests/test_precision.py`` under bf16-mixed and 16-mixed (the reference under the same
autocast), and each batch's loss with the reference's.

The cases are not a cross product: every model, partition method, optimizer and
weight-decay setting, activation, ``balance="memory"``, partition ``reuse``, mini-batches
(several steps per epoch, the last batch smaller than K), ``k="auto"``, multi-label
targets and the
preparation paths (``prefetch``, ``sample_device="cpu"``, ``copy_ahead``) appear at least
once, on each backend (:func:`test_cases_cover_every_axis` keeps it so when a catalog grows).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
import torch

from betty import catalog
from betty.engine import PartitionPlan, Trainer
from betty.memory.ksearch import DEFAULT_SAFETY_MARGIN
from betty.models import DEFAULT_ACTIVATION, build_model
from betty.models.dropout import dropout_key
from betty.partition import PARTITIONERS
from betty.reference import full_batch_reference
from betty.train import build_optimizer, max_relative_difference, parameter_groups
from distributed_cases import CLASSES, FEATS, dataset

TOL = {"64": 1e-10, "32": 1e-5, "bf16-mixed": 3e-2, "16-mixed": 4e-3}
"""Per precision, as tests/test_exactness.py (64, 32) and tests/test_precision.py (mixed)."""
FANOUTS = [4, 6]
LR, WD, MOMENTUM = 0.01, 5e-4, 0.9
DROPOUT, ATTN_DROPOUT = 0.5, 0.25
BACKENDS = [pytest.param("dgl", marks=pytest.mark.dgl), pytest.param("pyg", marks=pytest.mark.pyg)]


@dataclass(frozen=True)
class Case:
    """One Trainer run. ``variant``: the SAGE aggregator, or ``"1head"`` (GAT with
    ``output_heads=1``); ``optimizer``: ``adam``, ``sgd`` or ``sgd-momentum``
    (``torch.optim.SGD`` with momentum: :func:`betty.train.build_optimizer` has none);
    ``budget``: ``k="auto"`` with a memory budget a fraction of the whole batch's estimate."""

    name: str
    arch: str
    variant: str | None = None
    method: str = "random"
    k: int | str = 3
    optimizer: str = "adam"
    weight_decay: float = 0.0
    first_layer_only: bool = False
    activation: str | None = None
    balance: str = "nodes"
    reuse: int | None = None
    batch_size: int | None = None
    epochs: int = 1
    options: tuple = ()
    budget: float | None = None
    expect_repartitioned: tuple = field(default=())
    prefetch: int = 0
    sample_device: str | None = None
    copy_ahead: bool = False
    precision: str = "64"
    multilabel: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return torch.float64 if self.precision == "64" else torch.float32


CASES = [
    Case("sage-mean-range-adam", "sage", "mean", method="range"),
    Case("sage-gcn-random-sgd-wd-gelu", "sage", "gcn", method="random", optimizer="sgd", weight_decay=WD,
         activation="gelu"),
    Case("sage-pool-reg-adam-wd1st-leaky", "sage", "pool", method="reg", weight_decay=WD, first_layer_only=True,
         activation="leaky_relu"),
    Case("sage-lstm-reg_unweighted-kaminpar-sgdmom-elu-minibatch", "sage", "lstm", method="reg-unweighted",
         k=4, optimizer="sgd-momentum", weight_decay=WD, activation="elu", batch_size=60,
         options=(("partitioner", "kaminpar"),), prefetch=2),  # 60, 60, 3 outputs: the last batch gets K=3
    Case("gat-hypergraph-adam-wd", "gat", method="hypergraph", weight_decay=WD),
    Case("gat1head-reg_all-sgd-wd1st-relu", "gat", "1head", method="reg-all", optimizer="sgd",
         weight_decay=WD, first_layer_only=True, activation="relu"),
    Case("gcn-metis-adam-wd1st", "gcn", method="metis", k=4, weight_decay=WD, first_layer_only=True),
    Case("sage-mean-reg-balance_memory-adam-wd-leaky", "sage", "mean", method="reg", balance="memory",
         weight_decay=WD, activation="leaky_relu"),
    Case("gat-range-reuse2-sgdmom-3epochs", "gat", method="range", optimizer="sgd-momentum", weight_decay=WD,
         reuse=2, epochs=3, expect_repartitioned=(True, False, True), prefetch=1),
    Case("gcn-random-adam-wd-minibatch-2epochs-torchops-copyahead", "gcn", method="random", weight_decay=WD,
         batch_size=50, epochs=2, activation="elu", sample_device="cpu", copy_ahead=True),
    Case("gcn-kauto-reg-adam", "gcn", method="reg", k="auto", budget=0.7),
    Case("gat1head-kauto-hypergraph-sgd", "gat", "1head", method="hypergraph", k="auto", optimizer="sgd",
         budget=0.7, activation="gelu"),
    # SGD: an update proportional to the gradient (Adam's first step is about lr * sign(g),
    # whose relative difference is not bounded by the gradient's)
    Case("sage-lstm-reg-sgd-f32", "sage", "lstm", method="reg", optimizer="sgd", precision="32"),
    Case("gat-random-sgd-wd-bf16", "gat", method="random", optimizer="sgd", weight_decay=WD,
         precision="bf16-mixed"),
    Case("gcn-reg-sgd-fp16", "gcn", method="reg", optimizer="sgd", precision="16-mixed"),
    # multi-label targets (binary cross-entropy over T tasks)
    Case("gat-reg-adam-multilabel", "gat", method="reg", multilabel=True),
    Case("sage-lstm-random-sgd-bf16-multilabel", "sage", "lstm", method="random", optimizer="sgd",
         precision="bf16-mixed", multilabel=True),
    # the preparation switches with other precisions, models and targets
    Case("sage-pool-random-sgd-f32-prefetch-multilabel", "sage", "pool", method="random", optimizer="sgd",
         precision="32", prefetch=1, multilabel=True),
    Case("sage-gcn-reg-sgd-bf16-torchops-copyahead-multilabel", "sage", "gcn", method="reg", optimizer="sgd",
         precision="bf16-mixed", sample_device="cpu", copy_ahead=True, multilabel=True),
    Case("sage-mean-kauto-reg-sgd-f32-multilabel", "sage", "mean", method="reg", k="auto", budget=0.7,
         optimizer="sgd", precision="32", multilabel=True),
    Case("gcn-random-sgd-fp16-prefetch-torchops-multilabel", "gcn", method="random", optimizer="sgd",
         precision="16-mixed", prefetch=1, sample_device="cpu", multilabel=True),
]
TASKS = 3


@pytest.fixture(scope="module")
def ds():
    return dataset()


def _labelled(ds, case: Case):
    """``ds`` itself, or for a multi-label case the same graph with ``TASKS`` random
    binary targets per node."""
    if not case.multilabel:
        return ds
    import dataclasses

    gen = torch.Generator().manual_seed(5)
    targets = (torch.rand(ds.num_nodes, TASKS, generator=gen) < 0.4).float()
    return dataclasses.replace(ds, label=targets, num_classes=TASKS, multilabel=True)


def _model(case: Case, backend: str):
    torch.manual_seed(0)
    model = build_model(case.arch, FEATS, TASKS if case.multilabel else CLASSES, hidden=8, layers=len(FANOUTS),
                        aggregator=case.variant if case.arch == "sage" else "mean", heads=2,
                        output_heads=1 if case.variant == "1head" else None, dropout=DROPOUT,
                        attn_dropout=ATTN_DROPOUT if case.arch == "gat" else 0.0,
                        dropout_mode="deterministic", backend=backend, activation=case.activation)
    assert model.backend_name == backend
    return model.to(case.dtype).train()


def _optimizer(case: Case, model):
    params = parameter_groups(model, case.weight_decay, first_layer_only=case.first_layer_only)
    if case.first_layer_only:
        assert len(params) == 2 and params[0]["weight_decay"] == WD and params[1]["weight_decay"] == 0.0
    if case.optimizer == "sgd-momentum":
        return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=case.weight_decay)
    return build_optimizer(case.optimizer, params, lr=LR, weight_decay=case.weight_decay)


def _memory_budget(case: Case, ds, backend: str) -> int:
    """A budget whose usable part is ``case.budget`` of the whole batch's estimate (K=1),
    so the K search must split."""
    model = _model(case, backend)
    probe = Trainer(model, _optimizer(case, model), ds, FANOUTS, PartitionPlan(case.method, 1), seed=1,
                    dtype=case.dtype, estimate_memory=True)
    whole = max(probe.prepare(0, 0).estimates)
    return int(case.budget * whole / (1 - DEFAULT_SAFETY_MARGIN))


def _params(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_trainer_update_equals_reference(ds, backend, case):
    pytest.importorskip("dgl" if backend == "dgl" else "torch_geometric")
    if not runs_on(backend, case):
        pytest.skip("DGL's CPU sparse kernels take no float16 (16-mixed needs CUDA with DGL)")
    check_case(ds, backend, case)


def runs_on(backend: str, case: Case) -> bool:
    """Whether ``case`` runs on ``backend`` on this host (the Trainer refuses 16-mixed
    on DGL on the CPU)."""
    return not (backend == "dgl" and case.precision == "16-mixed")


@pytest.mark.parametrize("backend", BACKENDS)
def test_trainer_update_on_two_ranks_equals_reference(backend):
    """Every case on 2 ranks (``DataParallel``: each rank runs its share of the K
    micro-batches, the gradients all-reduced): every rank's update is the reference's."""
    pytest.importorskip("dgl" if backend == "dgl" else "torch_geometric")
    from betty.distributed.launch import launch

    results = launch(rank_check_cases, (backend,), nproc=2)
    names = [c.name for c in CASES if runs_on(backend, c)]
    assert results == {0: names, 1: names}


def rank_check_cases(backend: str) -> list[str]:
    """On one rank: :func:`check_case` of every case with a ``DataParallel`` over the
    launched ranks (without ``copy_ahead``, a single-process path); the names of the
    cases checked."""
    import dataclasses

    from betty.distributed import DataParallel

    ds = dataset()
    cases = [c for c in CASES if runs_on(backend, c)]
    for case in cases:
        check_case(ds, backend, dataclasses.replace(case, copy_ahead=False), DataParallel(check_every=1))
    return [c.name for c in cases]


def check_case(ds, backend: str, case: Case, parallel=None) -> None:
    """Train ``case`` with the Trainer (on ``parallel``'s ranks if given) and a twin with
    the reference's gradients; assert that they agree."""
    ds = _labelled(ds, case)
    model = _model(case, backend)
    twin = copy.deepcopy(model)
    plan = PartitionPlan(case.method, case.k, reuse=case.reuse, balance=case.balance,
                         options=dict(case.options),
                         memory_budget=None if case.budget is None else _memory_budget(case, ds, backend))
    trainer = Trainer(model, _optimizer(case, model), ds, FANOUTS, plan, batch_size=case.batch_size, seed=1,
                      dtype=case.dtype, precision=case.precision,
                      estimate_memory=case.balance == "memory" or case.k == "auto",
                      prefetch=case.prefetch, sample_device=case.sample_device, copy_ahead=case.copy_ahead,
                      parallel=parallel)
    assert trainer.dropout_seed == 1  # the documented default: the Trainer's seed
    before = _params(model)
    assert max_relative_difference(_params(twin), before) == 0.0

    # the reference: one step per batch, in the Trainer's order, on the Trainer's samples
    twin_opt = _optimizer(case, twin)
    ref_losses = []
    for epoch in range(case.epochs):
        order = trainer.batch_order(epoch)
        outputs = torch.cat([trainer.batches[b] for b in order])
        assert torch.equal(torch.sort(outputs).values, torch.sort(ds.train_idx).values), \
            "an epoch's batches must hold every training node once"
        for b in order:
            batch = trainer.sample(epoch, b)
            assert torch.equal(batch.output_nid, trainer.batches[b])
            ref = full_batch_reference(twin, batch, ds.feat, ds.label, multilabel=ds.multilabel,
                                       dropout_key=dropout_key(trainer.dropout_seed, epoch, b), dtype=case.dtype,
                                       precision=case.precision)
            zero = [name for name, g in ref.grads.items() if not bool((g != 0).any())]
            assert not zero, f"epoch {epoch} batch {b}: reference gradients all zero for {zero}"
            for name, p in twin.named_parameters():
                p.grad = ref.grads[name]
            twin_opt.step()
            twin_opt.zero_grad(set_to_none=True)
            ref_losses.append((epoch, b, ref.loss))

    records = list(trainer.epochs(range(case.epochs)))
    steps = [(r.epoch, br) for r in records for br in r.batches]
    assert [(e, br.index) for e, br in steps] == [(e, b) for e, b, _ in ref_losses]
    if case.batch_size is not None:
        assert len(trainer.batches) >= 3, "mini-batches: several optimizer steps per epoch"
        assert min(br.num_outputs for _, br in steps) < case.batch_size  # the last batch is smaller
    for (epoch, br), (_, b, ref_loss) in zip(steps, ref_losses):
        assert br.k >= 2, f"epoch {epoch} batch {b}: a single micro-batch tests no accumulation"
        if isinstance(case.k, int):  # the last, smaller mini-batch gets one micro-batch per output
            assert br.k == min(case.k, br.num_outputs)
        assert abs(br.loss - ref_loss) <= TOL[case.precision] * abs(ref_loss), \
            f"epoch {epoch} batch {b}: loss {br.loss!r}, reference {ref_loss!r}"
    if case.expect_repartitioned:
        assert tuple(br.repartitioned for _, br in steps) == case.expect_repartitioned
    if case.k == "auto":
        assert trainer.search_result is not None and trainer.search_result.k >= 2

    after, after_ref = _params(model), _params(twin)
    update = {name: after[name] - before[name] for name in before}
    update_ref = {name: after_ref[name] - before[name] for name in before}
    frozen = [name for name, u in update_ref.items() if not bool((u != 0).any())]
    assert not frozen, f"reference steps left parameters unchanged: {frozen}"
    frozen = [name for name, u in update.items() if not bool((u != 0).any())]
    assert not frozen, f"the Trainer left parameters unchanged: {frozen}"
    err = max_relative_difference(update, update_ref)
    worst = max(update_ref, key=lambda n: float((update[n] - update_ref[n]).norm())
                / max(float(update_ref[n].norm()), 1e-300))
    assert err < TOL[case.precision], f"Trainer update differs from the reference's by {err:.3e} (worst: {worst})"


def test_cases_cover_every_axis():
    """Every catalogued model, aggregator, partition method, optimizer and activation, and
    every Trainer setting the module docstring names, has a case (each runs on both backends)."""
    models = {(c.arch, c.variant if c.arch != "gat" else c.variant or "heads") for c in CASES}
    assert {("sage", a) for a in catalog.SAGE_AGGREGATORS} | {("gat", "heads"), ("gat", "1head"),
                                                              ("gcn", None)} <= models
    assert {a for a in catalog.ARCHS if a != "revgnn"} == {c.arch for c in CASES}  # RevGNN: its own trainer
    assert set(catalog.PARTITION_METHODS) == set(PARTITIONERS) <= {c.method for c in CASES}
    assert set(catalog.OPTIMIZERS) | {"sgd-momentum"} <= {c.optimizer for c in CASES}
    assert set(catalog.ACTIVATIONS) <= {c.activation or DEFAULT_ACTIVATION[c.arch] for c in CASES}
    assert {c.activation for c in CASES} - {None}  # activations other than the defaults
    assert any(c.weight_decay and not c.first_layer_only for c in CASES)
    assert any(c.weight_decay and c.first_layer_only for c in CASES)
    assert any(not c.weight_decay for c in CASES)
    assert {"nodes", "memory"} == {c.balance for c in CASES}
    assert any(c.reuse for c in CASES) and any(c.batch_size for c in CASES)
    assert any(c.k == "auto" for c in CASES)
    assert any(dict(c.options).get("partitioner") == "kaminpar" for c in CASES)
    assert any(c.prefetch for c in CASES) and any(c.sample_device for c in CASES)
    assert any(c.copy_ahead for c in CASES)
    assert set(TOL) == {c.precision for c in CASES}
    assert any(c.multilabel for c in CASES)
