"""N-rank data-parallel training (gloo on CPU) equals single-process K-way training.

float64, dropout 0.5, 3 Adam steps: parameters on every rank equal the single-process
run's to 1e-10 relative, for SAGE mean and lstm, GAT and RevGNN parts, K in {3, 4, 7},
N in {2, 3}, on the DGL backend; SAGE mean and lstm and GAT on the PyG backend too (that
half needs no DGL and runs in ``.venv-pyg``). One launch per (backend, N) runs every case;
the 2-rank launches prepare each batch ahead of its step, its features gathered ahead
(``Trainer(prefetch=1, gather_ahead=True)``), the 3-rank ones serially, against the serial single-process reference.
"""

from __future__ import annotations

import os

import pytest
import torch

from betty.distributed.launch import launch
from betty.distributed.shared import share_dataset
from betty.train import max_relative_difference
from distributed_cases import CASES, PYG_CASES, case_name, dataset, rank_all_cases, train_case

TOL = 1e-10
BACKEND_CASES = {"dgl": CASES, "pyg": PYG_CASES}
_REFERENCE: dict[str, dict] = {}


def reference(backend: str) -> dict[str, dict[str, torch.Tensor]]:
    """Single-process K-way results of ``backend``'s cases (computed once per session)."""
    if backend not in _REFERENCE:
        ds = dataset()
        _REFERENCE[backend] = {case_name(*c): train_case(ds, *c) for c in BACKEND_CASES[backend]}
    return _REFERENCE[backend]


@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.parametrize("backend", [pytest.param("dgl", marks=pytest.mark.dgl),
                                     pytest.param("pyg", marks=pytest.mark.pyg)])
def test_ranks_equal_single_process(backend, nproc):
    if backend == "pyg":
        pytest.importorskip("torch_geometric")
    cases = BACKEND_CASES[backend]
    prefetch = 1 if nproc == 2 else 0
    if backend == "dgl":  # every rank builds its own dataset
        results = launch(rank_all_cases, (cases, None, prefetch), nproc=nproc)
    else:  # the ranks map one shared copy (betty.distributed.shared): same results
        with share_dataset(dataset()) as shared:
            results = launch(rank_all_cases, (cases, shared, prefetch), nproc=nproc)
        for rank in range(nproc):
            mapped = results[rank].pop("_files")  # the rank reads the launcher's copy
            assert mapped == sorted(t.path for t in shared.tensors.values()), mapped
        assert not os.path.exists(shared.folder)
    assert sorted(results) == list(range(nproc))
    assert sorted(results[0]) == sorted(case_name(*c) for c in cases)
    for name, ref in reference(backend).items():
        ref_params = {n: t for n, t in ref.items() if not n.startswith("_")}
        covered = []
        for rank in range(nproc):
            got = results[rank][name]
            covered += got["_indices"].tolist()
            err = max_relative_difference({n: got[n] for n in ref_params}, ref_params)
            assert err < TOL, f"{name} rank {rank}/{nproc}: relative parameter error {err:.3e}"
            assert torch.allclose(got["_losses"], ref["_losses"], rtol=TOL, atol=0), name
        k = _parse(name)[2]
        assert sorted(covered) == list(range(k)), f"{name}: micro-batches {covered} do not cover K={k} once"
        # the parameters moved: the comparison is not between two untouched models
        assert any(float((ref_params[n] - t).abs().max()) > 0 for n, t in
                   train_case(dataset(), *_parse(name), steps=0).items() if not n.startswith("_"))


@pytest.mark.parametrize("prefetch", [0, 1])
def test_ranks_take_rank_0s_split_when_processes_split_differently(prefetch):
    """A partitioner that splits differently in each process (Mt-KaHyPar's default preset,
    KaMinPar on several threads, a time limit that falls back on one rank): every rank
    runs its micro-batches of rank 0's split, so the update is still the single process's
    with rank 0's split, also when the split is made ahead in the preparation thread."""
    from distributed_cases import PER_PROCESS, rank_per_process_split, registered_per_process

    with registered_per_process():
        ref = train_case(dataset(), "sage", "mean", 4, method=PER_PROCESS)
    results = launch(rank_per_process_split, (4, prefetch), nproc=2)
    for rank in range(2):
        got = results[rank]
        err = max_relative_difference({n: got[n] for n in ref if not n.startswith("_")},
                                      {n: t for n, t in ref.items() if not n.startswith("_")})
        assert err < TOL, f"rank {rank}: relative parameter error {err:.3e}"


def test_a_split_agreed_ahead_while_the_ranks_agree_to_stop():
    """The preparation thread agrees on the next epoch's split while rank 0 validates and
    the training threads agree whether to stop: the two agreements never pair across
    ranks (a split sent where a stop flag is expected aborts the job), and the ranks
    train what one process trains."""
    from distributed_cases import fit_while_splitting, rank_fit_while_splitting

    results = launch(rank_fit_while_splitting, nproc=2)
    assert results[1] is None
    assert results[0] == pytest.approx(fit_while_splitting(), rel=TOL, abs=0)


@pytest.mark.parametrize("arch", ["sage", "revgnn"])
def test_best_valid_weights_are_kept_on_every_rank(arch):
    """``fit`` with ``best_valid`` on 2 ranks: every rank ends with the best epoch's
    weights (rank 0's scores reach every rank's selector), not only rank 0; ranks that
    kept the last epoch's would fail the next step's parameter check."""
    from distributed_cases import rank_fit_best_valid

    results = launch(rank_fit_best_valid, (arch,), nproc=2)
    (final0, best0), (final1, best1) = results[0], results[1]
    assert final0 == best0 and final1 == best1 and final0 == final1


def _parse(name):
    for c in CASES + PYG_CASES:
        if case_name(*c) == name:
            return c
    raise KeyError(name)


@pytest.mark.dgl
def test_revgnn_k_auto_on_ranks_learns_what_one_process_learns():
    """K is part of the RevGNN model (edges between parts are dropped): the ranks search K
    from 1 as one process does, so a budget the whole graph fits gives K = 1 on two ranks
    too (the second rank, warned, has no part) and the same losses."""
    from distributed_cases import rank_rev_auto, rev_auto_case

    k, losses, warned = rev_auto_case()
    assert k == 1 and not warned
    ranks = launch(rank_rev_auto, nproc=2)
    for rank in (0, 1):
        assert ranks[rank][0] == 1 and ranks[rank][2]
        assert max(abs(a - b) for a, b in zip(ranks[rank][1], losses)) < 1e-12
