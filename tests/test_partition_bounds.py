"""Bounded, well-formed partitioning: weighted baselines never leave a micro-batch empty,
``reg`` hands METIS the REG's counts, the single METIS wrapper's index checks."""

import numpy as np
import pytest
import torch

from betty.partition import partition_batch
from betty.partition.balance import fill_empty_micro_batches
from betty.partition.planted import planted_community_graph
from betty.sampling import sample_full_batch


@pytest.fixture(scope="module")
def batch40():
    """A 40-output two-layer batch (every K up to n_out stays cheap)."""
    graph, _ = planted_community_graph(400, 4, avg_degree=6.0, seed=5)
    outputs = torch.arange(0, 400, 10)
    return graph, sample_full_batch(graph, outputs, [3, 3], seed=2)


def _skewed_weights(n: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    spike = torch.ones(n, dtype=torch.float64)
    spike[4] = 1000.0  # the issue's example: [1, 1, 1, 1, 1000, 1, ...]
    first, last = torch.ones(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64)
    first[0], last[-1] = 1e6, 1e6
    one_nonzero = torch.zeros(n, dtype=torch.float64)
    one_nonzero[n // 2] = 1.0
    return {
        "spike": spike,
        "first_heavy": first,
        "last_heavy": last,
        "one_nonzero": one_nonzero,
        "geometric": 2.0 ** torch.arange(n, dtype=torch.float64),
        "lognormal": torch.exp(3.0 * torch.randn(n, generator=gen, dtype=torch.float64)),
    }


@pytest.mark.parametrize("method", ["range", "random"])
def test_weighted_baselines_never_leave_a_micro_batch_empty(batch40, method):
    graph, batch = batch40
    n = batch.num_outputs
    for name, w in _skewed_weights(n).items():
        for k in range(1, n + 1):
            res = partition_batch(batch, k, method, weights=w, seed=3)  # validates: raises on empty
            sizes = torch.bincount(res.groups, minlength=k)
            assert int(sizes.min()) >= 1, (name, k, sizes.tolist())
            if method == "range":  # contiguous runs in ascending global-ID order
                order = torch.argsort(batch.output_nid)
                assert bool((res.groups[order].diff() >= 0).all()), (name, k)


def test_weighted_range_matches_the_issue_example(batch40):
    _, batch = batch40
    w = _skewed_weights(batch.num_outputs)["spike"]
    order = torch.argsort(batch.output_nid)
    w_by_position = torch.empty_like(w)
    w_by_position[order] = w  # the heavy output is the 5th in global-ID order
    res = partition_batch(batch, 4, "range", weights=w_by_position)
    sizes = torch.bincount(res.groups, minlength=4).tolist()
    assert min(sizes) >= 1 and sum(sizes) == batch.num_outputs
    # the heavy output sits alone in its micro-batch, right after the first four outputs
    assert res.groups[order[4]] == 1 and sizes[1] == 1 and sizes[0] == 4


@pytest.mark.parametrize("method", ["range", "random"])
def test_weighted_baselines_still_balance_weights(batch40, method):
    """The repair does not break balance when no micro-batch would be empty."""
    _, batch = batch40
    n, k = batch.num_outputs, 4
    w = torch.linspace(1.0, 3.0, n, dtype=torch.float64)
    res = partition_batch(batch, k, method, weights=w, seed=1)
    per_micro_batch = torch.bincount(res.groups, weights=w, minlength=k)
    assert float(per_micro_batch.max()) <= float(w.sum()) / k + float(w.max())


@pytest.fixture
def metis_spy(monkeypatch):
    """Records every ``pymetis.part_graph`` call (then runs the real METIS)."""
    import pymetis

    calls, real = [], pymetis.part_graph

    def spy(nparts, adjacency=None, **kwargs):
        calls.append(dict(kwargs, nparts=nparts, adjacency=adjacency))
        return real(nparts, adjacency=adjacency, **kwargs)

    monkeypatch.setattr(pymetis, "part_graph", spy)
    return calls


def _reg_matrix(batch, seed):
    from betty.partition.incidence import output_layer_incidence
    from betty.partition.reg import redundancy_graph

    c, _ = redundancy_graph(output_layer_incidence(batch), seed=seed)
    return c


def test_reg_hands_metis_the_reg_counts_and_the_vertex_weights(batch40, metis_spy):
    from betty.partition.balance import integer_vertex_weights

    _, batch = batch40
    n = batch.num_outputs
    w = torch.linspace(1.0, 50.0, n, dtype=torch.float64)
    partition_batch(batch, 4, "reg", weights=w, seed=5)
    (call,) = metis_spy
    c = _reg_matrix(batch, seed=5)
    assert c.data.max() > 1  # the counts differ from a unit-weight graph
    adj = call["adjacency"]
    np.testing.assert_array_equal(np.asarray(adj.adj_starts), c.indptr)
    np.testing.assert_array_equal(np.asarray(adj.adjacent), c.indices)
    np.testing.assert_array_equal(np.asarray(call["eweights"]), c.data)  # C's entries, in order
    np.testing.assert_array_equal(np.asarray(call["vweights"]), integer_vertex_weights(w, n))
    assert call["nparts"] == 4


def test_reg_unweighted_hands_metis_no_edge_weights(batch40, metis_spy):
    _, batch = batch40
    partition_batch(batch, 4, "reg-unweighted", seed=5)
    (call,) = metis_spy
    assert call["eweights"] is None
    np.testing.assert_array_equal(np.asarray(call["vweights"]), np.ones(batch.num_outputs))


def test_metis_cuts_k_way_from_three_micro_batches_and_bisects_two(batch40, metis_spy):
    """pymetis alone would bisect recursively up to K = 8; betty asks for k-way from
    K = 3 on (cheaper and lower redundancy on the products-scale REG)."""
    import pymetis

    _, batch = batch40
    c = _reg_matrix(batch, seed=5)
    for k in (2, 3, 8, 16):
        groups = partition_batch(batch, k, "reg", seed=5).groups
        assert metis_spy[-1]["recursive"] is (k == 2)
        kway = pymetis.part_graph(k, adjacency=pymetis.CSRAdjacency(c.indptr, c.indices),
                                  eweights=c.data, recursive=k == 2,
                                  options=pymetis.Options(seed=5))
        expected, _ = fill_empty_micro_batches(np.asarray(kway.vertex_part, dtype=np.int64), k)
        assert torch.equal(groups, expected)


def test_metis_wrapper_keeps_64_bit_values(metis_spy):
    import scipy.sparse as sp

    from betty.partition.metis_cut import metis_cut, metis_index_dtype

    assert metis_index_dtype() == np.int64  # pymetis here is built with 64-bit idx_t
    big = 2**31 + 5  # wraps to a negative number in int32
    adj = sp.csr_matrix(np.array([[0, big, 1], [big, 0, 1], [1, 1, 0]], dtype=np.int64))
    groups, _ = metis_cut(adj, 2, vweights=np.array([1, 1, big]), use_edge_weights=True)
    (call,) = metis_spy
    assert int(np.asarray(call["eweights"]).max()) == big
    assert int(np.asarray(call["vweights"]).max()) == big
    assert groups.shape == (3,)


def test_metis_wrapper_refuses_values_its_idx_t_cannot_hold(metis_spy, monkeypatch):
    import scipy.sparse as sp

    from betty.partition import metis_cut as mc

    monkeypatch.setattr(mc, "metis_index_dtype", lambda: np.dtype(np.int32))
    big = 2**31 + 5
    adj = sp.csr_matrix(np.array([[0, big], [big, 0]], dtype=np.int64))
    with pytest.raises(ValueError, match="edge weights"):
        mc.metis_cut(adj, 2, use_edge_weights=True)
    ok = sp.csr_matrix(np.array([[0, 1], [1, 0]], dtype=np.int64))
    with pytest.raises(ValueError, match="vertex weights.*total"):
        mc.metis_cut(ok, 2, vweights=np.array([2**30, 2**30]), use_edge_weights=False)
    assert metis_spy == []  # refused before METIS ran


def test_hypergraph_defaults_to_the_default_preset(batch40):
    _, batch = batch40
    res = partition_batch(batch, 3, "hypergraph", options={"threads": 1})
    assert res.method == "hypergraph"
    assert res.info["preset"] == "DEFAULT"
    det = partition_batch(batch, 3, "hypergraph", options={"deterministic": True, "threads": 1})
    assert det.info["preset"] == "DETERMINISTIC"


def test_hypergraph_within_its_time_limit_keeps_its_split(batch40):
    _, batch = batch40
    opts = {"deterministic": True, "threads": 1}
    inline = partition_batch(batch, 4, "hypergraph", seed=2, options=opts)
    child = partition_batch(batch, 4, "hypergraph", seed=2, options=dict(opts, time_limit_s=120))
    assert child.method == "hypergraph" and "fallback_from" not in child.info
    assert torch.equal(child.groups, inline.groups)  # same split, run in the child process


def test_hypergraph_falls_back_to_reg_at_its_time_limit(batch40, caplog):
    import logging

    _, batch = batch40
    with caplog.at_level(logging.WARNING, logger="betty.partition.hypergraph"):
        res = partition_batch(batch, 4, "hypergraph", seed=2,
                              options={"time_limit_s": 1e-3, "threads": 1})
    assert res.method == "reg" and res.info["fallback_from"] == "hypergraph"
    assert torch.equal(res.groups, partition_batch(batch, 4, "reg", seed=2).groups)
    assert any("falling back to 'reg'" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="time_limit_s must be > 0"):
        partition_batch(batch, 4, "hypergraph", options={"time_limit_s": 0})
    reg_options = {"max_hub_degree": 2, "hub_links": 1, "deterministic": True}  # the fallback keeps them
    res = partition_batch(batch, 4, "hypergraph", seed=2, options={"time_limit_s": 1e-3, "threads": 1, **reg_options})
    assert res.info["fallback_from"] == "hypergraph" and res.info["max_hub_degree"] == 2
    assert torch.equal(res.groups, partition_batch(batch, 4, "reg", seed=2, options=reg_options).groups)


def test_partition_options_and_weights_are_checked_for_every_method(batch40):
    _, batch = batch40
    with pytest.raises(ValueError, match=r"unknown partition option\(s\) \['partitoner'\]; allowed: \[.*'partitioner'"):
        partition_batch(batch, 4, "range", options={"partitoner": "kaminpar"})
    capped = partition_batch(batch, 4, "reg", options={"max_hub_degree": 2})
    assert capped.info["max_hub_degree"] == 2  # a declared option reaches the method
    n = batch.num_outputs
    for method in ("range", "random", "reg"):
        for bad, what in ((torch.full((n,), -1.0), "-1.0"), (torch.full((n,), float("nan")), "nan"),
                          (torch.ones(n + 1), "shape")):
            with pytest.raises(ValueError, match=f"weights must .*{what}"):
                partition_batch(batch, 4, method, weights=bad)


def test_mtkahypar_child_is_killed_at_the_deadline(monkeypatch):
    """A child that cannot finish in time (a fresh interpreter alone takes longer than
    0.2 s to import betty) is killed: None comes back at once, no process is left. The
    child takes the parent's import path, less what import itself skips (a ``Path``)."""
    import sys
    import time
    from pathlib import Path

    import psutil

    from betty.partition.hypergraph import _run_with_deadline

    pins = np.array([0, 1, 1, 2, 2, 3], dtype=np.int32)
    args = (4, pins, np.array([0, 2, 4, 6]), np.ones(4, dtype=np.int32), 2, 0.03, "DEFAULT", 1, 0)
    start = time.perf_counter()
    assert _run_with_deadline(args, 0.2) is None
    assert time.perf_counter() - start < 10.0
    assert not [p for p in psutil.Process().children() if "_child_main" in " ".join(p.cmdline())]
    monkeypatch.setattr(sys, "path", [*sys.path, Path("/nonexistent")])
    groups, km1 = _run_with_deadline(args, 300.0)  # with time to spare it finishes
    assert groups.shape == (4,) and km1 >= 0


UNGUARDED_SCRIPT = """
import sys
import torch
from betty.partition import partition_batch
from betty.partition.planted import planted_community_graph
from betty.sampling import sample_full_batch

with open(sys.argv[1], "a") as fh:
    fh.write("ran\\n")
graph, _ = planted_community_graph(400, 4, avg_degree=6.0, seed=5)
batch = sample_full_batch(graph, torch.arange(0, 400, 10), [3, 3], seed=2)
res = partition_batch(batch, 4, "hypergraph", seed=2,
                      options={"time_limit_s": 120, "threads": 1, "deterministic": True})
print(res.method, res.info.get("fallback_from"))
"""


def test_hypergraph_time_limit_works_from_a_script_without_a_main_guard(tmp_path):
    """The time-limited child must not run the caller's script again: a script with no
    ``if __name__ == "__main__"`` guard (the README's API example is one) gets the
    hypergraph split, and its top level runs once."""
    import subprocess
    import sys
    from pathlib import Path

    script, log = tmp_path / "split.py", tmp_path / "ran.txt"
    script.write_text(UNGUARDED_SCRIPT)
    root = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, str(script), str(log)], capture_output=True, text=True,
                         timeout=300, env={**__import__("os").environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["hypergraph", "None"]
    assert log.read_text().splitlines() == ["ran"]


def test_a_time_limited_fallback_counts_its_wait_and_says_so_in_the_sweep(batch40):
    """After a fallback the hypergraph's wait is partitioning time, and a sweep row of
    ``hypergraph`` says its figures are the fallback's."""
    from betty.partition.sweep import SWEEP_COLUMNS, sweep_batch

    _, batch = batch40
    res = partition_batch(batch, 4, "hypergraph", seed=2, options={"time_limit_s": 0.3, "threads": 1})
    assert res.info["fallback_from"] == "hypergraph"
    assert res.time_partition_s >= res.info["hypergraph_time_s"] > 0
    rows, _ = sweep_batch(batch, [4], ["reg", "hypergraph"], seed=2, options={"time_limit_s": 1e-4})
    by_method = {row["method"]: row for row in rows}
    assert "fallback" not in by_method["reg"]
    assert by_method["hypergraph"]["fallback"].startswith("reg: ")
    assert "fallback" in SWEEP_COLUMNS


def test_max_hub_degree_none_reaches_reg_as_no_cap(batch40):
    _, batch = batch40
    res = partition_batch(batch, 4, "reg", options={"max_hub_degree": None})
    assert res.info["max_hub_degree"] is None and res.info["hub_sources"] == 0
    assert partition_batch(batch, 4, "reg", options={"time_limit_s": None}).method == "reg"


@pytest.mark.parametrize("k", [2.9, "3", True, 3.0])
def test_partition_batch_refuses_a_k_that_is_not_an_integer(batch40, k):
    _, batch = batch40
    with pytest.raises(ValueError, match="k must be an integer"):
        partition_batch(batch, k, "random")
    assert partition_batch(batch, np.int64(3), "random").k == 3


@pytest.mark.parametrize("method, options", [("hypergraph", {"threads": 1, "deterministic": True}),
                                             ("reg", {"partitioner": "kaminpar", "trainer_threads": 1,
                                                      "deterministic": True}),
                                             ("reg", {}), ("random", {})])
def test_every_seed_a_spec_allows_reaches_the_partitioners(batch40, method, options):
    """A spec's seed goes up to 2**32 - 1, an epoch's or a repeat's adds to it; the
    libraries whose seed is a C int take it folded, and the split stays reproducible."""
    if options.get("partitioner") == "kaminpar":
        pytest.importorskip("kaminpar")
    _, batch = batch40
    big = (1 << 32) + 5
    result = partition_batch(batch, 4, method, seed=big, options=options)
    assert sorted(set(result.groups.tolist())) == [0, 1, 2, 3]
    assert torch.equal(result.groups, partition_batch(batch, 4, method, seed=big, options=options).groups)


def test_hypergraph_reports_the_threads_of_the_pool_it_runs_on(batch40, monkeypatch):
    """Mt-KaHyPar has one thread pool per process, sized at its first use: a split that
    asks for another count reports the count it ran with."""
    from betty.partition import hypergraph

    _, batch = batch40
    first = partition_batch(batch, 3, "hypergraph", options={"threads": 1}).info["threads"]
    res = partition_batch(batch, 3, "hypergraph", options={"threads": first + 1})
    assert res.info["threads"] == first == hypergraph.pool_threads(first + 1)
    child = partition_batch(batch, 3, "hypergraph", options={"threads": first + 1, "time_limit_s": 120})
    assert child.info["threads"] == first + 1  # a fresh process: its own pool
