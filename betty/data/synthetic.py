"""A seeded, vectorized generator of large co-purchase-like graphs.

Model (a degree-corrected stochastic block model sampled Chung-Lu style):

1. **Nodes and communities.** ``N = round(num_nodes * scale)`` nodes, ``C =
   max(num_classes, round(num_communities * scale))`` communities whose shares are
   drawn from a flat Dirichlet, so sizes are uneven. Every node joins a community at
   random, independently of its ID (node IDs carry no structure a range split could
   exploit). Each community belongs to one class (every class gets at least one
   community) and a node's label is its community's class.
2. **Degrees.** Each node has an expected degree (its *popularity*)
   ``w_i = min(1 + λ z_i, d_max)`` with ``z_i`` Pareto-II (Lomax) distributed,
   ``P(z > t) = (1 + t)^{-(γ - 1)}``, so the degree distribution has a power-law tail
   ``P(d) ∝ d^{-γ}`` while most nodes have small degree. ``d_max`` defaults to the
   structural cutoff ``sqrt(N · avg_degree)`` and ``λ`` is solved (bisection) so that
   ``mean(w) = avg_degree``.
3. **Edges.** ``M = round(N · avg_degree / 2)`` undirected edges. Node i gets
   ``k_i`` stubs, ``w_i`` rounded stochastically (``E[k_i] = w_i``). Each candidate edge
   picks ``u`` with probability ``k_u / Σk``; with probability ``p_in``
   (``intra_community_fraction``) its other end ``v`` is drawn ∝ ``k`` *inside u's
   community*; otherwise (a *cross-community* edge) ∝ ``k`` over all nodes or, with
   probability ``cross_community_locality``, at a scale-free distance from u (below).
   Both ends are thus drawn ∝ ``k``, so ``E[deg_i] ≈ k_i``. Self-loops and duplicate
   pairs are dropped, more candidates are drawn until ``M`` distinct pairs exist, and a
   uniform random ``M`` of them are kept.
   Both directions are stored: ``2M`` directed edges, in-degree = degree.
   *Locality.* Communities lie on a ring, those of one class next to each other (class
   order and the order inside a class are random); every stub has a position on it
   (stubs listed community by community, ``S = Σk`` positions). A local cross-community
   edge takes u's stub position ``p`` and ends at the stub at ``p ± δ`` (mod ``S``,
   random sign) with ``δ`` log-uniform on ``[S / C, S / 2]``: every scale, from a
   neighbouring community to the far side of the graph, carries the same share of
   these edges (the one-dimensional analogue of a hierarchical block model). ``p ± δ``
   is uniform when ``p`` is, so v is still drawn ∝ ``k``. A split into K contiguous
   arcs then cuts a share of them that grows linearly in ``log K`` (a global edge is
   cut with probability ``1 - 1/K`` already at small K).
4. **Features.** ``x_i = s · μ_{y_i} + ε_i`` with class centroids ``μ_k ~ N(0, I_F)``
   and noise ``ε_i ~ N(0, I_F)``; ``s`` is ``feature_snr`` (per-dimension signal to
   noise ratio of the class signal).
5. **Split** (OGB style). ``split_by="popularity"`` ranks nodes by ``w`` (as ogbn-products
   ranks products by sales): the top ``train_fraction`` train, the next
   ``valid_fraction`` validate, the rest test. ``"random"`` uses a random order.

Everything is drawn from one ``numpy.random.Generator(PCG64(seed))`` in a fixed order,
so a seed fixes the dataset. All steps are array operations; candidate edges are drawn
in fixed-size chunks to bound temporary memory.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from betty.data.graph_build import bare_graph
from betty.data.synthetic_config import SYNTHETIC_PRESETS, SyntheticConfig
from betty.data.types import GraphDataset

__all__ = [
    "SyntheticConfig",
    "SYNTHETIC_PRESETS",
    "generate_synthetic",
    "sample_degree_weights",
]

_CHUNK = 1 << 22  # candidate edges drawn per vectorized step
_MAX_ROUNDS = 40  # top-up rounds before accepting fewer than M edges (impossible density)

def sample_degree_weights(
    rng: np.random.Generator,
    num_nodes: int,
    avg_degree: float,
    exponent: float,
    max_degree: float,
) -> np.ndarray:
    """Expected degrees ``w = min(1 + λ z, max_degree)``, z ~ Lomax(γ - 1), mean(w) = avg.

    Args:
        rng: random generator (consumes ``num_nodes`` uniforms).
        num_nodes: N.
        avg_degree: target ``mean(w)``; must lie in ``[1, max_degree)``.
        exponent: γ > 2, tail ``P(w > t) ∝ t^{-(γ-1)}``.
        max_degree: cap on ``w``.

    Returns:
        ``(N,)`` float64.
    """
    if not 1 <= avg_degree < max_degree:
        raise ValueError(
            f"avg_degree={avg_degree} must lie in [1, max_degree={max_degree}) "
            "(every node expects at least one neighbour)"
        )
    u = rng.random(num_nodes)
    z = (1.0 - u) ** (-1.0 / (exponent - 1.0)) - 1.0  # Lomax, P(z > t) = (1+t)^-(γ-1)
    lo, hi = 0.0, 1.0
    while np.minimum(1.0 + hi * z, max_degree).mean() < avg_degree:
        hi *= 2.0
    for _ in range(60):  # mean(min(1 + λ z, cap)) is nondecreasing in λ
        mid = 0.5 * (lo + hi)
        if np.minimum(1.0 + mid * z, max_degree).mean() < avg_degree:
            lo = mid
        else:
            hi = mid
    return np.minimum(1.0 + hi * z, max_degree)


def _assign_communities(
    rng: np.random.Generator, num_nodes: int, num_communities: int, num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(community (N,), class_of_community (C,))``: Dirichlet(1) shares, every class
    owning at least one community."""
    shares = rng.dirichlet(np.ones(num_communities))
    cum = np.cumsum(shares)
    cum[-1] = 1.0
    community = np.searchsorted(cum, rng.random(num_nodes), side="right").astype(np.int64)
    class_of_community = np.empty(num_communities, dtype=np.int64)
    class_of_community[rng.permutation(num_communities)] = (
        np.arange(num_communities) % num_classes
    )
    return community, class_of_community


def _community_ring(
    rng: np.random.Generator, class_of_community: np.ndarray, num_classes: int
) -> np.ndarray:
    """``(C,)`` communities in ring order: classes in random order, each class's
    communities next to each other in random order."""
    class_rank = rng.permutation(num_classes)
    tie = rng.random(class_of_community.shape[0])
    return np.lexsort((tie, class_rank[class_of_community]))


class _EndpointSampler:
    """Draw nodes ∝ w, globally, inside a given node's community or at a distance along
    the ring of communities, in O(1) each.

    Node i owns ``k_i`` *stubs*, ``k_i`` = ``w_i`` rounded stochastically (floor, plus
    one with probability equal to the fractional part, so ``E[k_i] = w_i``; ``k_i >= 1``
    as ``w_i >= 1``). A uniform stub is a node drawn ∝ ``k``; stubs listed community by
    community in ring order (``ring[r]`` = the community at ring position r; default
    ``0..C-1``) make each community a contiguous stub range and give every stub a
    position on the ring.
    """

    def __init__(
        self,
        rng: np.random.Generator,
        weight: np.ndarray,
        community: np.ndarray,
        num_communities: int,
        ring: np.ndarray | None = None,
    ):
        self.num_nodes = weight.shape[0]
        self.num_communities = num_communities
        base = np.floor(weight)
        stubs = (base + (rng.random(weight.shape[0]) < weight - base)).astype(np.int64)
        idtype = np.int32 if self.num_nodes < 2**31 else np.int64
        order = np.arange(num_communities) if ring is None else np.asarray(ring)
        rank = np.empty(num_communities, dtype=np.int64)
        rank[order] = np.arange(num_communities)
        by_ring = np.argsort(rank[community], kind="stable").astype(idtype)
        self.stub_node = np.repeat(by_ring, stubs[by_ring])
        self.community = community
        stubs_per_community = np.bincount(community, weights=stubs, minlength=num_communities)
        self.comm_end = np.empty(num_communities, dtype=np.int64)
        self.comm_end[order] = np.cumsum(stubs_per_community[order]).astype(np.int64)
        self.comm_size = stubs_per_community.astype(np.int64)

    def position(self, u: np.ndarray) -> np.ndarray:
        """Stub positions (uniform over the ``S`` stubs) for uniforms ``u`` in [0, 1)."""
        return np.minimum((u * self.stub_node.size).astype(np.int64), self.stub_node.size - 1)

    def node_at(self, pos: np.ndarray) -> np.ndarray:
        """The (int64) nodes owning the stubs at positions ``pos``."""
        return self.stub_node[pos].astype(np.int64)

    def global_draw(self, u: np.ndarray) -> np.ndarray:
        """Nodes ∝ stubs for uniforms ``u`` in [0, 1)."""
        return self.node_at(self.position(u))

    def community_draw(self, anchor: np.ndarray, u: np.ndarray) -> np.ndarray:
        """For each anchor node, a node of the anchor's community ∝ stubs."""
        c = self.community[anchor]
        size = self.comm_size[c]
        pos = self.comm_end[c] - size + np.minimum((u * size).astype(np.int64), size - 1)
        return self.node_at(pos)

    def ring_draw(self, pos: np.ndarray, u: np.ndarray, negative: np.ndarray) -> np.ndarray:
        """The node at stub position ``pos ± δ`` (mod S), δ log-uniform on
        ``[S / C, S / 2]`` (``u`` in [0, 1) picks δ, ``negative`` the sign)."""
        total = self.stub_node.size
        far = max(total / 2.0, 1.0)
        near = min(total / self.num_communities, far)
        delta = np.exp(np.log(near) + u * (np.log(far) - np.log(near)))
        step = np.rint(delta).astype(np.int64)
        step[negative] *= -1
        return self.node_at((pos + step) % total)


def _sorted_unique(runs: list[np.ndarray]) -> np.ndarray:
    """Sorted distinct values of the concatenation of sorted arrays ``runs`` (a stable
    sort merges sorted runs in about linear time)."""
    if not runs:
        return np.zeros(0, dtype=np.int64)
    keys = np.concatenate(runs)
    keys.sort(kind="stable")
    if keys.size:
        keep = np.empty(keys.size, dtype=bool)
        keep[0] = True
        np.not_equal(keys[1:], keys[:-1], out=keep[1:])
        keys = keys[keep]
    return keys


def _candidate_keys(
    rng: np.random.Generator,
    sampler: _EndpointSampler,
    count: int,
    p_intra: float,
    locality: float = 0.0,
) -> np.ndarray:
    """Sorted distinct keys ``lo * N + hi`` (lo < hi) of ``count`` candidate edges."""
    n = sampler.num_nodes
    runs = []
    for start in range(0, count, _CHUNK):  # loop over fixed-size chunks, not edges
        m = min(_CHUNK, count - start)
        pos = sampler.position(rng.random(m))
        u = sampler.node_at(pos)
        intra = rng.random(m) < p_intra
        r = rng.random(m)
        v = np.empty_like(u)
        v[intra] = sampler.community_draw(u[intra], r[intra])
        cross = ~intra
        if locality > 0:  # extra draws only then: locality 0 reproduces the flat model
            local = np.zeros(m, dtype=bool)
            local[cross] = rng.random(int(cross.sum())) < locality
            negative = rng.random(int(local.sum())) < 0.5
            v[local] = sampler.ring_draw(pos[local], r[local], negative)
            cross &= ~local
        v[cross] = sampler.global_draw(r[cross])
        lo, hi = np.minimum(u, v), np.maximum(u, v)
        key = lo[lo != hi] * n + hi[lo != hi]
        key.sort()
        runs.append(key)
    return _sorted_unique(runs)


def _sample_edge_keys(
    rng: np.random.Generator,
    sampler: _EndpointSampler,
    target: int,
    p_intra: float,
    locality: float = 0.0,
) -> np.ndarray:
    """Exactly ``target`` distinct undirected edge keys (fewer only if the density is
    unreachable within the round budget), sorted."""
    keys = _candidate_keys(rng, sampler, int(math.ceil(target * 1.05)), p_intra, locality)
    for _ in range(_MAX_ROUNDS):
        deficit = target - keys.size
        if deficit <= 0:
            break
        fresh = _candidate_keys(
            rng, sampler, int(math.ceil(deficit * 1.25)) + 16, p_intra, locality
        )
        keys = _sorted_unique([keys, fresh])
    if keys.size > target:
        drop = rng.choice(keys.size, size=keys.size - target, replace=False, shuffle=False)
        keep = np.ones(keys.size, dtype=bool)
        keep[drop] = False
        keys = keys[keep]
    return keys


def _split(
    rng: np.random.Generator, weight: np.ndarray, config: SyntheticConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = weight.shape[0]
    n_train = config.scaled_num_train
    n_valid = int(round(config.valid_fraction * n))
    n_valid = min(n_valid, n - n_train - 1)
    if config.split_by == "popularity":
        order = np.argsort(-weight, kind="stable")
    else:
        order = rng.permutation(n)
    parts = np.split(order, [n_train, n_train + n_valid])
    return tuple(torch.from_numpy(np.sort(p).astype(np.int64)) for p in parts)  # type: ignore[return-value]


def _warn_if_short(made: int, config: SyntheticConfig) -> None:
    """Warn when the graph has fewer than 99% of its target edges: the options ask for
    a density the communities cannot hold (each draw inside a community is one of its
    few pairs, drawn again and again)."""
    target = config.target_num_undirected_edges
    if made < 0.99 * target:
        warnings.warn(
            f"the synthetic graph has {made:,} undirected edges, {made / target:.0%} of the "
            f"{target:,} that avg_degree={config.avg_degree} asks for: that density is out of "
            f"reach with intra_community_fraction={config.intra_community_fraction} and "
            f"{config.scaled_num_communities:,} communities of about "
            f"{config.scaled_num_nodes // config.scaled_num_communities:,} nodes; lower "
            "avg_degree, intra_community_fraction or num_communities", stacklevel=3)


def generate_synthetic(config: SyntheticConfig, name: str = "synthetic") -> GraphDataset:
    """Generate the dataset described in the module docstring.

    Returns:
        A :class:`GraphDataset` with ``2M`` directed edges (both directions of ``M``
        undirected ones), ``(N, F)`` float32 features, ``(N,)`` int64 labels.
    """
    n = config.scaled_num_nodes
    c = config.scaled_num_communities
    rng = np.random.Generator(np.random.PCG64(config.seed))

    community, class_of_community = _assign_communities(rng, n, c, config.num_classes)
    label = class_of_community[community]

    cap = math.sqrt(n * config.avg_degree) if config.max_degree is None else config.max_degree
    cap = min(float(cap), float(n - 1))
    weight = sample_degree_weights(rng, n, config.avg_degree, config.degree_exponent, cap)

    locality = float(config.cross_community_locality)
    ring = _community_ring(rng, class_of_community, config.num_classes) if locality > 0 else None
    sampler = _EndpointSampler(rng, weight, community, c, ring)
    keys = _sample_edge_keys(
        rng, sampler, config.target_num_undirected_edges, config.intra_community_fraction,
        locality,
    )
    del sampler
    _warn_if_short(keys.size, config)
    lo = torch.from_numpy(keys // n)
    hi = torch.from_numpy(keys % n)
    del keys
    graph = bare_graph(torch.cat([lo, hi]), torch.cat([hi, lo]), n)
    del lo, hi

    centroids = rng.standard_normal((config.num_classes, config.num_features), dtype=np.float32)
    feat = rng.standard_normal((n, config.num_features), dtype=np.float32)
    feat += np.float32(config.feature_snr) * centroids[label]

    train_idx, valid_idx, test_idx = _split(rng, weight, config)
    return GraphDataset(
        name=name,
        graph=graph,
        feat=torch.from_numpy(feat),
        label=torch.from_numpy(label),
        train_idx=train_idx,
        valid_idx=valid_idx,
        test_idx=test_idx,
        num_classes=config.num_classes,
    )
