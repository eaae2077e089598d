"""The sampler's torch-op path (``sample_full_batch(..., device=...)``): on the CPU the
same batch as the host (NumPy) path, bit for bit, and the same carved micro-batches; on
CUDA, where there is one, a deterministic batch that follows the sampling rule."""

from __future__ import annotations

import pytest
import torch

from betty.batch import SampledBatch
from betty.graph import Graph
from betty.microbatch import Carver
from betty.sampling import sample_full_batch, uniform_subsets, uniform_subsets_torch
from graphs import power_law_graph

LAYER_TENSORS = ("src_nid", "edge_src", "edge_dst", "edge_id", "src_out_degree")
FANOUTS = [[3, 5], [-1, 4], [2, -1, 6], [1], [40, 40], [5, 200, 2]]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _power_law() -> Graph:
    """Heavy-tailed in-degrees, some nodes without in-edges, edge IDs shuffled (so
    ascending edge ID is not ascending source ID)."""
    g = power_law_graph(num_nodes=400, avg_degree=7, seed=3)[0]
    perm = torch.randperm(g.num_edges(), generator=torch.Generator().manual_seed(0))
    return Graph(g.src[perm], g.dst[perm], g.num_nodes())


def _multigraph() -> Graph:
    """Parallel edges (up to 3 copies of a pair), self-loops, and isolated nodes (no
    in- or out-edges: nodes 60..69)."""
    gen = torch.Generator().manual_seed(4)
    src = torch.randint(0, 60, (500,), generator=gen)
    dst = torch.randint(0, 60, (500,), generator=gen)
    src = torch.cat([src, src[:120], src[:40]])
    dst = torch.cat([dst, dst[:120], dst[:40]])
    perm = torch.randperm(src.numel(), generator=gen)
    return Graph(src[perm], dst[perm], 70)


def _stored(graph: Graph) -> Graph:
    """The same graph held as a stored CSR with int32 ``indices`` and ``eid``."""
    indptr, indices, eid = graph.in_csr
    return Graph.from_csr(indptr.clone(), indices.to(torch.int32), eid.to(torch.int32),
                          graph.num_nodes())


GRAPHS = {"power_law": _power_law, "multigraph": _multigraph,
          "stored_int32": lambda: _stored(_power_law())}


@pytest.fixture(scope="module", params=sorted(GRAPHS))
def graph(request) -> Graph:
    return GRAPHS[request.param]()


def _outputs(graph: Graph) -> torch.Tensor:
    """Every third node, in a shuffled order (outputs need not be ascending)."""
    nodes = torch.arange(0, graph.num_nodes(), 3)
    return nodes[torch.randperm(nodes.numel(), generator=torch.Generator().manual_seed(1))]


def _assert_same_batch(a: SampledBatch, b: SampledBatch) -> None:
    assert a.fanouts == b.fanouts and a.num_layers == b.num_layers
    for la, lb in zip(a.layers, b.layers):
        assert la.num_dst == lb.num_dst
        for name in LAYER_TENSORS:
            ta, tb = getattr(la, name), getattr(lb, name)
            assert ta.dtype == tb.dtype and ta.device == tb.device, name
            assert torch.equal(ta, tb), name


def _assert_follows_the_rule(graph: Graph, batch: SampledBatch, fanouts: list[int]) -> None:
    """Every edge a real CSR entry of its destination, each destination's edges
    distinct, ``min(fanout, in-degree)`` of them, in canonical order; blocks chain."""
    deg = graph.in_degrees()
    src_all, dst_all = graph.edges()
    for l, (layer, fanout) in enumerate(zip(batch.layers, fanouts)):
        layer_cpu = {name: getattr(layer, name).cpu() for name in LAYER_TENSORS}
        src_nid, eid = layer_cpu["src_nid"], layer_cpu["edge_id"]
        dst_nid = src_nid[: layer.num_dst]
        if l + 1 < batch.num_layers:
            assert torch.equal(batch.layers[l + 1].src_nid.cpu(), dst_nid)
        assert torch.unique(src_nid).numel() == src_nid.numel()
        src = src_nid[layer_cpu["edge_src"]]
        dst = dst_nid[layer_cpu["edge_dst"]]
        assert torch.equal(src_all[eid], src) and torch.equal(dst_all[eid], dst)
        assert torch.unique(eid).numel() == eid.numel()  # no CSR entry picked twice
        want = deg[dst_nid] if fanout == -1 else deg[dst_nid].clamp(max=fanout)
        assert torch.equal(torch.bincount(layer_cpu["edge_dst"], minlength=layer.num_dst), want)
        key = layer_cpu["edge_dst"] * graph.num_nodes() + src
        assert bool((key[1:] >= key[:-1]).all())
        assert torch.equal(layer_cpu["src_out_degree"], graph.out_degrees()[src_nid])


@pytest.mark.parametrize("fanouts", FANOUTS, ids=str)
@pytest.mark.parametrize("seed", [0, 7, 12345])
def test_device_path_on_cpu_is_the_host_batch(graph, fanouts, seed):
    outputs = _outputs(graph)
    host = sample_full_batch(graph, outputs, fanouts, seed=seed)
    on_cpu = sample_full_batch(graph, outputs, fanouts, seed=seed, device="cpu")
    _assert_same_batch(host, on_cpu)
    _assert_follows_the_rule(graph, on_cpu, fanouts)


def test_fanouts_exercise_both_branches(graph):
    """The fanouts above sample some destinations (degree > fanout) and keep all the
    in-edges of others (degree <= fanout), so both code paths are compared."""
    deg = graph.in_degrees()[_outputs(graph)]
    assert bool((deg > 3).any()) and bool((deg <= 3).any()) and bool((deg == 0).any())


def test_uniform_subsets_torch_on_cpu_equals_numpy():
    """From generators in the same state, including rows with degree == k."""
    degree = torch.tensor([5, 9, 5, 30, 6, 1000, 5], dtype=torch.int64)
    for k in (1, 2, 5):
        a = uniform_subsets(degree, k, torch.Generator().manual_seed(k))
        b = uniform_subsets_torch(degree, k, torch.Generator().manual_seed(k))
        assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b)


def test_carving_the_device_path_batch_gives_the_same_micro_batches(graph):
    fanouts = [3, -1, 4]
    outputs = _outputs(graph)
    host = sample_full_batch(graph, outputs, fanouts, seed=3)
    on_cpu = sample_full_batch(graph, outputs, fanouts, seed=3, device="cpu")
    groups = torch.randint(0, 4, (outputs.numel(),), generator=torch.Generator().manual_seed(2))
    carvers = Carver(host), Carver(on_cpu)
    for k in range(4):
        index = torch.nonzero(groups == k).view(-1)
        a, b = (carver.carve(index) for carver in carvers)
        assert torch.equal(a.output_index, b.output_index)
        assert all(torch.equal(x, y) for x, y in zip(a.full_src_index, b.full_src_index))
        _assert_same_batch(SampledBatch(layers=a.layers, fanouts=fanouts),
                           SampledBatch(layers=b.layers, fanouts=fanouts))


def test_device_csr_is_cached_once_per_graph():
    graph = _power_law()
    csr = graph.in_csr_on("cpu")
    assert graph.in_csr_on(torch.device("cpu")) is csr
    assert all(a is b for a, b in zip(csr, graph.in_csr))  # no copy on the CPU
    assert graph.out_degrees_on("cpu") is graph.out_degrees_on("cpu")
    assert torch.equal(graph.out_degrees_on("cpu"), graph.out_degrees())


def test_device_path_rejects_bad_arguments():
    graph = _power_law()
    with pytest.raises(ValueError, match="distinct"):
        sample_full_batch(graph, torch.tensor([1, 1]), [2], device="cpu")
    with pytest.raises(ValueError, match=r"\[0, 400\)"):
        sample_full_batch(graph, torch.tensor([400]), [2], device="cpu")


@CUDA
@pytest.mark.parametrize("fanouts", FANOUTS, ids=str)
def test_cuda_path_is_deterministic_and_follows_the_rule(graph, fanouts):
    outputs = _outputs(graph)
    a = sample_full_batch(graph, outputs, fanouts, seed=5, device="cuda")
    b = sample_full_batch(graph, outputs, fanouts, seed=5, device="cuda")
    for layer in a.layers:
        assert all(getattr(layer, name).is_cuda for name in LAYER_TENSORS)
    _assert_same_batch(a, b)
    _assert_follows_the_rule(graph, a, fanouts)
    # the CSR was copied to the device once and is reused
    assert graph.in_csr_on("cuda") is graph.in_csr_on(torch.device("cuda", torch.cuda.current_device()))


@CUDA
def test_uniform_subsets_torch_on_cuda_are_distinct_and_in_range():
    degree = torch.randint(6, 40, (5000,), generator=torch.Generator().manual_seed(0)).cuda()
    for k in (1, 3, 6):
        rows = uniform_subsets_torch(degree, k, torch.Generator(device="cuda").manual_seed(k))
        again = uniform_subsets_torch(degree, k, torch.Generator(device="cuda").manual_seed(k))
        assert rows.is_cuda and rows.shape == (5000, k) and torch.equal(rows, again)
        rows = rows.cpu()
        assert bool((rows[:, 1:] > rows[:, :-1]).all()) and int(rows.min()) >= 0
        assert bool((rows < degree.cpu()[:, None]).all())


@CUDA
def test_a_cuda_batch_carves_on_the_device(graph):
    """Carving (``betty.microbatch.Carver``, its ID sort included) runs on the batch's
    device, and its micro-batches stay there."""
    outputs = _outputs(graph)
    on_cuda = sample_full_batch(graph, outputs, [3, 4], seed=2, device="cuda")
    index = torch.arange(0, outputs.numel(), 3)
    micro_batch = Carver(on_cuda).carve(index.cuda())
    for layer in micro_batch.layers:
        assert layer.src_nid.is_cuda and layer.edge_src.is_cuda
    assert micro_batch.layers[-1].num_dst == index.numel()


def test_a_batch_moves_between_devices_whole(graph):
    batch = sample_full_batch(graph, _outputs(graph), [3, 4], seed=1)
    assert batch.to("cpu") is batch
    moved = batch.to("meta")
    assert moved is not batch and moved.fanouts == batch.fanouts
    for a, b in zip(moved.layers, batch.layers):
        assert a.num_dst == b.num_dst
        for name in LAYER_TENSORS:
            assert getattr(a, name).device.type == "meta"
            assert getattr(a, name).shape == getattr(b, name).shape
