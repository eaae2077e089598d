"""The K search knows the world size: on N ranks, K >= N and every rank's largest micro-batch fits.

``search_k(..., min_k=N)`` starts at K = N (never tries a smaller K); a data-parallel
:class:`betty.engine.Trainer` passes its world size as ``min_k``; a spec with a fixed
``partition.k`` below ``train.world_size`` is rejected. No process is launched here.
"""

from __future__ import annotations

import pytest
import torch

from betty.distributed import lpt_assign
from betty.memory import ModelSpec, estimate_micro_batch, search_k
from betty.sampling import sample_full_batch
from graphs import power_law_graph


@pytest.fixture(scope="module")
def setup():
    g, _, _, train = power_law_graph(num_nodes=500, avg_degree=6, num_feats=12, seed=4)
    batch = sample_full_batch(g, train, [4, 6], seed=0)
    spec = ModelSpec.from_config("sage", 12, 5, hidden=16, layers=2, aggregator="mean")
    full = estimate_micro_batch(batch, spec, "adam", fresh_grads=True).peak
    return batch, spec, full


def _search(setup, budget, min_k=1):
    batch, spec, _ = setup
    return search_k(batch, spec, "adam", memory_budget=budget, safety_margin=0.0,
                    method="random", seed=1, min_k=min_k)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_budget_that_fits_one_micro_batch_still_gives_every_rank_one(setup, world):
    big = 4 * setup[2]
    assert _search(setup, big).k == 1  # one process: K = 1 fits
    res = _search(setup, big, min_k=world)
    assert res.k == world
    assert min(k for k, _ in res.tried) == world  # no K < N was even tried
    owned = lpt_assign([e.peak for e in res.estimates], world)
    assert all(owned), f"a rank got no micro-batch: {owned}"


@pytest.mark.parametrize("world", [2, 3, 6])
def test_tight_budget_k_at_least_world_and_each_rank_fits(setup, world):
    budget = setup[2] // 3
    single = _search(setup, budget)
    assert single.k > 1
    res = _search(setup, budget, min_k=world)
    assert res.k >= max(world, 1)
    if world <= single.k:
        assert res.k == single.k  # N does not change a search that already ends above N
    peaks = [e.peak for e in res.estimates]
    for r, mine in enumerate(lpt_assign(peaks, world)):
        assert mine, f"rank {r} got no micro-batch"
        # a rank runs its micro-batches one after the other: its peak is its largest micro-batch's
        assert max(peaks[k] for k in mine) <= res.usable_budget


def test_min_k_capped_at_outputs_and_validated(setup):
    batch = setup[0]
    assert _search(setup, 4 * setup[2], min_k=10 * batch.num_outputs).k == batch.num_outputs
    with pytest.raises(ValueError, match="min_k must be >= 1"):
        _search(setup, 4 * setup[2], min_k=0)


class _Ranks:
    """Stands in for a DataParallel: the trainer reads ``world_size`` to choose K, then
    takes rank 0's split (here: its own, ``agree``)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def agree(self, value):
        return value


def test_data_parallel_trainer_searches_from_world_size(setup):
    from betty.data.types import GraphDataset
    from betty.engine import PartitionPlan, Trainer
    from betty.models import build_model

    g, feat, label, train = power_law_graph(num_nodes=300, avg_degree=6, num_feats=12, seed=4)
    ds = GraphDataset(name="ks-world", graph=g, feat=feat, label=label, train_idx=train,
                      valid_idx=train[:5], test_idx=train[5:10], num_classes=5)
    model = build_model("sage", 12, 5, hidden=8, layers=2)  # backend "auto": dgl, else pyg
    opt = torch.optim.Adam(model.parameters())
    plan = PartitionPlan("random", "auto", memory_budget=2**40, safety_margin=0.0)
    seen = []
    trainer = Trainer(model, opt, ds, [4, 6], plan, seed=0, estimate_memory=False,
                      k_chooser=_recording_chooser(model, opt, seen))
    batch = trainer.sample(0, 0)
    assert trainer.partition(batch, 0, 0)[0].k == 1 and seen == [1]
    trainer.parallel = _Ranks(4)
    trainer._partitions.clear()
    assert trainer.partition(batch, 0, 0)[0].k == 4 and seen == [1, 4]
    assert plan.min_k == 1  # the trainer's own plan is left alone


def _recording_chooser(model, opt, seen):
    from betty.memory import make_k_chooser

    choose = make_k_chooser(model, opt, dtype=torch.float32)

    def wrapped(batch, plan, seed):
        seen.append(plan.min_k)
        return choose(batch, plan, seed)

    return wrapped


def test_spec_rejects_fixed_k_below_world_size():
    from workflow.spec import SpecError
    from workflow.specfile import apply_overrides, resolve_spec

    base = {"name": "t", "dataset": {"name": "synthetic", "num_nodes": 300},
            "sampling": {"fanouts": [3, 4]}, "model": {"arch": "sage", "hidden": 8, "layers": 2},
            "partition": {"method": "random", "k": 2}, "train": {"epochs": 1}}
    with pytest.raises(SpecError, match=r"partition\.k.*below train\.world_size 3"):
        resolve_spec(apply_overrides(base, ["train.world_size=3"]))
    resolve_spec(apply_overrides(base, ["train.world_size=2"]))  # K = N is fine
    resolve_spec(apply_overrides(base, ["train.world_size=3", "partition.k=auto",
                                        "partition.memory_budget=1GiB"]))


def test_spec_world_size_sets_the_plans_smallest_k():
    """The partition stage and the ranks build the plan from the spec: both search from N."""
    from workflow.components import partition_plan
    from workflow.specfile import load_spec

    assert partition_plan(load_spec("synthetic_products", ["train.world_size=3"])).min_k == 3
    assert partition_plan(load_spec("synthetic_products", [])).min_k == 1
