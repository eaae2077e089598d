"""betty.fit.fit: the epoch loop with validation, selection and early stopping, for both
trainers, against the same trainer driven epoch by epoch."""

from __future__ import annotations

import pytest
import torch

from betty.engine import PartitionPlan, Trainer
from betty.fit import FitResult, fit
from betty.models import build_model
from betty.selection import BestValidation
from distributed_cases import CLASSES, FEATS, dataset

# validation scores by epoch: best at epoch 2, then no improvement
CURVE = [0.5, 0.6, 0.9, 0.7, 0.9, 0.8, 0.85, 0.6]


def _trainer(arch: str = "sage"):
    torch.manual_seed(0)
    model = build_model(arch, FEATS, CLASSES, hidden=8, layers=2, dropout=0.5)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    if arch == "revgnn":
        from betty.rev.engine import RevPlan, RevTrainer

        return RevTrainer(model, opt, dataset(), RevPlan("random", 2), seed=1)
    return Trainer(model, opt, dataset(), [4, 6], PartitionPlan("reg", 3), seed=1)


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("arch", ["sage", "revgnn"])
def test_fit_trains_as_the_epoch_loop_and_keeps_the_best_weights(arch):
    reference = _trainer(arch)
    losses, states, kinds = [], [], set()
    for epoch in range(5):
        record = reference.train_epoch(epoch)
        losses.append(record.metrics()["loss"])
        states.append(_state(reference.model))
        kinds.add(type(record))

    trainer = _trainer(arch)
    seen = []
    result = fit(trainer, 5, validate=lambda epoch, k: {"valid_acc": CURVE[epoch], "k_seen": k},
                 selector=BestValidation("best_valid"), on_epoch=lambda entry, last: seen.append(last),
                 row_labels={"repeat": 7})
    assert isinstance(result, FitResult)
    assert [h["loss"] for h in result.history] == losses  # bit for bit the plain loop
    assert [h["epoch"] for h in result.history] == list(range(5))
    assert all(h["k_seen"] == h["k"] for h in result.history)
    assert seen == [False] * 4 + [True]
    assert result.selection == {"best_valid_acc": 0.9, "best_epoch": 2.0}
    best = _state(trainer.model)  # the best epoch's weights were loaded back
    assert all(torch.equal(best[k], states[2][k]) for k in best)
    assert result.rows and all(next(iter(row)) == "repeat" and row["repeat"] == 7 for row in result.rows)
    assert {result.record} == kinds


def test_fit_stops_early_and_scores_every_n_epochs():
    scored = []

    def validate(epoch, k):
        scored.append(epoch)
        return {"valid_acc": CURVE[epoch]}

    result = fit(_trainer(), 8, validate=validate, every=1, selector=BestValidation("last", patience=2))
    # best 0.9 at epoch 2; epochs 3 and 4 (a tie) do not improve: stop after epoch 4
    assert scored == [0, 1, 2, 3, 4] and len(result.history) == 5
    assert result.selection == {"best_valid_acc": 0.9, "best_epoch": 2.0, "stopped_epoch": 4.0}

    scored.clear()
    result = fit(_trainer(), 6, validate=validate, every=3)
    assert scored == [2, 5] and len(result.history) == 6
    assert ["valid_acc" in h for h in result.history] == [False, False, True, False, False, True]


@pytest.mark.parametrize("kwargs, words", [({"epochs": 0}, "epochs"), ({"epochs": 2, "every": -1}, "every"),
                                           ({"epochs": True}, "epochs")])
def test_fit_refuses_bad_arguments(kwargs, words):
    with pytest.raises(ValueError, match=words):
        fit(_trainer(), **kwargs)


@pytest.mark.parametrize("arch", ["sage", "revgnn"])
def test_both_trainers_and_their_records_share_one_interface(arch):
    from betty.records import EpochRecordProtocol, TrainerProtocol

    trainer = _trainer(arch)
    record = trainer.train_epoch(0)
    assert isinstance(trainer, TrainerProtocol) and isinstance(record, EpochRecordProtocol)
    assert set(record.rows()[0]) == set(record.ROW_COLUMNS)
    assert record.MICRO_BATCH_KEY in record.ROW_COLUMNS
    assert {"loss", "k", "epoch_time_s"} <= set(record.metrics())
    assert not isinstance(object(), TrainerProtocol)


def test_summarize_repeats_gives_mean_and_population_std_of_common_metrics():
    from betty.fit import summarize_repeats

    out = summarize_repeats([{"test_acc": 0.5, "loss": 1.0, "k": 4}, {"test_acc": 0.7, "k": 4},
                             {"test_acc": 0.9, "k": 4}])
    assert out.keys() == {"test_acc", "test_acc_mean", "test_acc_std", "k", "k_mean", "k_std"}
    assert out["test_acc"] == out["test_acc_mean"] == pytest.approx(0.7, abs=1e-15)
    assert out["test_acc_std"] == pytest.approx((0.08 / 3) ** 0.5, rel=1e-12)  # population: / R
    assert out["k_std"] == 0.0
    assert summarize_repeats([{"a": 2}]) == {"a": 2.0, "a_mean": 2.0, "a_std": 0.0}
    with pytest.raises(ValueError, match="at least one repeat"):
        summarize_repeats([])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_diverged_repeat_shows_in_the_summary(bad):
    """A NaN or infinite final metric of one repeat (a diverged run) gives a NaN std and
    a non-finite mean, not a crash after every repeat has trained; the others' metrics
    are summarized as usual."""
    import math

    from betty.fit import summarize_repeats

    out = summarize_repeats([{"valid_rocauc": bad, "k": 4}, {"valid_rocauc": 0.7, "k": 4}])
    assert not math.isfinite(out["valid_rocauc_mean"]) and math.isnan(out["valid_rocauc_std"])
    assert (out["k_mean"], out["k_std"]) == (4.0, 0.0)


@pytest.mark.parametrize("selector", [BestValidation("best_valid"), BestValidation("last", patience=2)])
def test_fit_refuses_validation_scores_without_the_score_key_the_selector_needs(selector):
    trainer = _trainer("sage")
    with pytest.raises(ValueError, match=r"validate returned \['valid_rocauc'\] without score_key 'valid_acc'"):
        fit(trainer, 2, validate=lambda epoch, k: {"valid_rocauc": 0.5}, selector=selector)
    result = fit(trainer, 1, validate=lambda epoch, k: {"valid_rocauc": 0.5})  # "last": nothing needs it
    assert result.selection == {} and result.history[0]["valid_rocauc"] == 0.5


@pytest.mark.parametrize("fanouts, plan, words", [
    ([4, 0], PartitionPlan("reg", 3), "each fanout must be a positive int or -1"),
    ([4, 2.5], PartitionPlan("reg", 3), "each fanout must be a positive int or -1"),
    ([4, 6], PartitionPlan("nope", 3), "unknown partition method 'nope'; allowed: \\["),
    ([4, 6], PartitionPlan("reg", "Auto"), "k must be an integer >= 1 or 'auto', got 'Auto'"),
    ([4, 6], PartitionPlan("reg", 2.5), "k must be an integer >= 1 or 'auto', got 2.5"),
    ([4, 6], PartitionPlan("reg", 0), "k must be an integer >= 1"),
    ([4, 6], PartitionPlan("reg", "auto"), "k='auto' needs a memory_budget"),
    ([4, 6], PartitionPlan("reg", 3, reuse=0), "reuse must be an integer >= 1"),
    ([4, 6], PartitionPlan("reg", 3, min_k=0), "min_k must be an integer >= 1"),
    ([4, 6], PartitionPlan("reg", 3, balance="edges"), "balance must be 'nodes' or 'memory'"),
    ([4, 6], PartitionPlan("reg", 3, safety_margin=1.0), "safety_margin must be a number in \\[0, 1\\)"),
    ([4, 6], PartitionPlan("reg", 3, safety_margin="0.1"), "safety_margin must be a number in \\[0, 1\\)"),
    ([4, 6], PartitionPlan("reg", "auto", memory_budget=float("inf")), "memory_budget must be a finite number"),
    ([4, 6], PartitionPlan("reg", 3, options={"partitoner": "metis"}), "unknown partition option"),
    ([4, 6], PartitionPlan("reg", 3, options={"partitioner": "kahip"}),
     "partition option partitioner must be one of \\['metis', 'kaminpar'\\], got 'kahip'"),
    ([4, 6], PartitionPlan("hypergraph", 3, options={"time_limit_s": "10"}),
     "partition option time_limit_s must be > 0 seconds or None .*, got '10'"),
    ([4, 6], PartitionPlan("hypergraph", 3, options={"time_limit_s": 0}), "time_limit_s must be > 0 seconds or None .*, got 0"),
    ([4, 6], PartitionPlan("hypergraph", 3, options={"threads": 0}), "threads must be >= 1 or None .*, got 0"),
    ([4, 6], PartitionPlan("reg", 3, options={"deterministic": "yes"}), "deterministic must be True or False, got 'yes'"),
    ([4, 6], PartitionPlan("reg", 3, options={"max_hub_degree": 0}), "max_hub_degree must be >= 1 or None .*, got 0"),
    ([4, 6], PartitionPlan("reg", 3, options={"hub_links": 0}), "hub_links must be >= 1 \\(an integer\\), got 0"),
])
def test_the_trainer_refuses_what_would_fail_on_the_preparation_thread(fanouts, plan, words):
    model = build_model("sage", FEATS, CLASSES, hidden=8, layers=2)
    with pytest.raises(ValueError, match=words):
        Trainer(model, torch.optim.Adam(model.parameters()), dataset(), fanouts, plan)


def test_a_float_memory_budget_is_a_number_of_bytes():
    model = build_model("sage", FEATS, CLASSES, hidden=8, layers=2)
    for plan in (PartitionPlan("reg", "auto", memory_budget=float(2**30)), PartitionPlan("reg", 3, memory_budget=1e9)):
        Trainer(model, torch.optim.Adam(model.parameters()), dataset(), [4, 6], plan)
    with pytest.raises(ValueError, match="memory_budget must be a finite number of bytes >= 1"):
        Trainer(model, torch.optim.Adam(model.parameters()), dataset(), [4, 6],
                PartitionPlan("reg", 3, memory_budget=float("nan")))


def test_a_model_in_another_dtype_than_the_trainers_is_refused_when_built():
    """Not at the first matrix product, with torch's operand message."""
    model = build_model("sage", FEATS, CLASSES, hidden=8, layers=2).double()
    with pytest.raises(ValueError, match="parameters are torch.float64 but the trainer's dtype is torch.float32"):
        Trainer(model, torch.optim.Adam(model.parameters()), dataset(), [4, 6], PartitionPlan("random", 2))
    Trainer(model, torch.optim.Adam(model.parameters()), dataset(), [4, 6], PartitionPlan("random", 2),
            dtype=torch.float64)


def test_an_early_stop_reports_the_k_searches_of_the_batches_trained_only():
    """With the pipeline the next epoch's batch is split (its K searched) while the
    current one is validated; when the run stops there that batch never trains, and its
    search is not reported: the same searches as the serial loop."""
    reported = {}
    for prefetch in (0, 1):
        torch.manual_seed(0)
        ds = dataset()
        model = build_model("sage", FEATS, CLASSES, hidden=8, layers=2, dropout=0.5)
        searches = []
        trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), ds, [4, 6],
                          PartitionPlan("reg", "auto", reuse=1, memory_budget=3 * 2**20), seed=1,
                          prefetch=prefetch, on_search=searches.append)
        scores = iter([0.5, 0.4, 0.4, 0.9, 0.9])
        result = fit(trainer, 5, validate=lambda epoch, k: {"valid_acc": next(scores)}, every=1,
                     selector=BestValidation("last", patience=2))
        assert len(result.history) == 3  # stopped after epoch 2
        assert trainer.search_result is searches[-1]
        reported[prefetch] = [s.to_dict() for s in searches]
    assert len(reported[0]) == 3, "one search per epoch (the split is re-made every epoch)"
    assert reported[1] == reported[0]


def test_revgnn_early_stop_reports_the_k_searches_of_the_epochs_trained_only():
    """RevGNN with ``k: auto`` and random parts searches K again for an epoch whose split
    is estimated over the budget; with the pipeline that epoch is split while the one
    before is validated. When the run stops there, its search is not reported: the same
    searches as the serial loop."""
    from betty.rev.engine import RevPlan, RevTrainer, cluster_seed, estimate_parts
    from betty.rev.training import backend_graph, cluster_partition

    ds = dataset(600)

    def trainer(plan, prefetch=0, searches=None):
        torch.manual_seed(0)
        model = build_model("revgnn", FEATS, CLASSES, hidden=16, layers=3, conv="gat", heads=4, dropout=0.1)
        return RevTrainer(model, torch.optim.Adam(model.parameters(), lr=0.01), ds, plan, prefetch=prefetch,
                          on_search=None if searches is None else searches.append)

    probe = trainer(RevPlan("random", 3))
    graph = backend_graph(probe.model, ds.graph)
    peaks = [max(estimate_parts(probe.model, probe.optimizer, cluster_partition(graph, 3, "random",
                                                                             cluster_seed(probe.seed, e)),
                                probe.train_mask, **probe.memory_kwargs)) for e in range(2)]
    plan = RevPlan("random", "auto", memory_budget=int(max(peaks) / (1 - RevPlan().safety_margin)) + 1)
    searches, searched_at = [], []
    serial = trainer(plan, searches=searches)
    for epoch in range(10):
        serial.train_epoch(epoch)
        if len(searches) > len(searched_at):
            searched_at.append(epoch)
    assert searched_at[0] == 0 and len(searched_at) > 1 and searched_at[1] >= 2, searched_at  # the precondition
    stop = searched_at[1] - 1  # the run stops after this epoch, the one before a new search
    reported = {}
    for prefetch in (0, 1):
        searches = []
        scores = iter([0.5] + [0.4] * stop)
        result = fit(trainer(plan, prefetch, searches), stop + 3, validate=lambda epoch, k: {"valid_acc": next(scores)},
                     every=1, selector=BestValidation("last", patience=stop))
        assert len(result.history) == stop + 1
        reported[prefetch] = [s.k for s in searches]
    assert len(reported[0]) == 1 and reported[1] == reported[0]
