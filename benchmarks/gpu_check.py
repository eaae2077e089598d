"""GPU check: memory estimates, budget compliance and epoch time on one device.

One self-contained script for a short GPU loan (it also runs on the host, which is how the
test suite keeps it alive). It imports only torch, numpy, scipy, betty's core and the
graph backend (no workflow/, MLflow or pydantic); pymetis is used when importable, else
the partitioner falls back to ``random`` (recorded in the JSON as ``settings.partition``).

Sections, in order:

1. **Calibration.** :func:`betty.memory.calibrate.calibrate` on the device (not written
   to the user file): the measured backend constants, beside the shipped ones.
2. **Estimate vs measurement.** For SAGE mean, pool, lstm, GAT (sampled blocks, two
   layers) and a RevGNN (whole graph / random parts), at two graph sizes and K in {1, 4},
   every micro-batch's (part's) peak is measured with :class:`betty.memory.MemoryMeter`
   (``torch.cuda.max_memory_allocated`` on CUDA) after one warm-up step (Adam state
   exists) and estimated with the calibrated and with the shipped constants. Per model:
   ``max |estimated − measured| / measured`` over sizes, K and micro-batches.
3. **Budget.** On the larger graph, budget ``B = 0.4 · P₁`` (``P₁`` = measured K = 1
   peak); the K search picks K; on CUDA the allocator is capped at B
   (:func:`betty.memory.apply_budget`); two training steps run and every measured micro-batch
   peak above B counts as an overrun (an out-of-memory error counts as one). Then a
   budget below the fixed costs must raise the K search's error (message recorded).
4. **Timing.** One epoch (one full batch over every training node) of GraphSAGE-mean on
   a ``synthetic-products`` graph (partitioner ``--partition``), split into sampling, partitioning, carving,
   host-to-device (index and feature gather + copy) and compute (forward, backward,
   optimizer step), with ``torch.cuda.synchronize`` at every boundary on CUDA, at K = 1
   and at the K chosen for a budget of 25% of the estimated K = 1 peak.
5. **Pipeline.** :class:`betty.engine.Trainer` on the same graph at that K (partition
   reused), ``PIPELINE_EPOCHS`` epochs serially (``prefetch=0``) and again pipelined
   (``prefetch=1``: the next batch sampled, partitioned and carved on a thread while the
   current one trains; the features gathered in the step, ``gather_ahead=False``),
   pipelined with the features gathered ahead too (``gather_ahead=True``, an
   accelerator's default: into pinned host memory on the thread), serially with
   preparation on the device (``sample_device``: the sampler, carving and the feature
   gather as torch ops on the GPU, only the cut on the host), and pipelined, gathered
   ahead, with copy-ahead (``copy_ahead=True``: micro-batch k+1's inputs copied on a
   side CUDA stream while micro-batch k computes), each from the same
   initial weights. Per epoch: wall,
   compute, sampling, gather + copy (``time_h2d_s``), the wait for preparation and the
   device's idle fraction ``1 - compute / wall``; and the relative parameter difference
   of each mode from the serial run (``relative_difference``, its largest
   ``max_relative_difference``; 0 with deterministic
   kernels; multi-threaded CPU scatter and GPU atomics differ in the last bits from run
   to run, serial against serial too).

Output: one JSON (``--out``) with top-level ``estimate_error`` (per model, calibrated
constants), ``estimate_error_shipped``, ``budget_overruns`` (a count), the environment
(torch, CUDA, GPU names) and every row; a short table on stdout.

    python benchmarks/gpu_check.py --device cuda --out benchmarks/results/gpu_check.json
    python benchmarks/gpu_check.py --device cpu --quick --out /tmp/gpu_check.json

``--backend auto|dgl|pyg``: the graph backend, resolved in :func:`resolve_backend` (the
one place to wire another backend); ``auto`` takes DGL when importable, else PyG.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import betty  # noqa: E402,F401  (sets OMP_WAIT_POLICY before torch is imported)
import numpy as np  # noqa: E402
import torch  # noqa: E402

BLOCK_MODELS = {"sage-mean": ("sage", "mean"), "sage-pool": ("sage", "pool"),
                "sage-lstm": ("sage", "lstm"), "gat": ("gat", "mean")}
MODELS = (*BLOCK_MODELS, "revgnn")
KS = (1, 4)
BUDGET_FRACTION = 0.4
TIMING_BUDGET_FRACTION = 0.25
SAFETY_MARGIN = 0.05
PIPELINE_EPOCHS = 3
PIPELINE_MODES = ("serial", "pipelined", "gathered_ahead", "device_preparation", "copy_ahead")
#: partitioner of the estimate and budget sections: which split is used does not change
#: what they check (every micro-batch of the split actually used is estimated and measured),
#: and ``random`` keeps them fast; ``--partition`` applies to the timed epoch.
CHECK_PARTITION = "random"


@dataclass(frozen=True)
class Sizes:
    """Problem sizes of one run (``--quick`` or full)."""

    graph_nodes: tuple[int, int]
    avg_degree: float
    feats: int
    classes: int
    hidden: int
    fanouts: tuple[int, ...]
    rev_layers: int
    products_scale: float
    products_hidden: int
    products_fanouts: tuple[int, ...]
    lstm_grid: tuple[tuple[int, int, int], ...] | None  # None: calibrate's default grid


QUICK = Sizes(graph_nodes=(300, 700), avg_degree=6.0, feats=16, classes=5, hidden=16,
              fanouts=(4, 6), rev_layers=4, products_scale=0.004, products_hidden=32,
              products_fanouts=(5, 10),
              lstm_grid=tuple((t, b, w) for w in (16, 40) for t in (1, 4) for b in (16, 200)))
FULL = Sizes(graph_nodes=(20_000, 100_000), avg_degree=12.0, feats=100, classes=16, hidden=128,
             fanouts=(10, 25), rev_layers=16, products_scale=0.25, products_hidden=256,
             products_fanouts=(10, 25), lstm_grid=None)


# --------------------------------------------------------------------------- backend seam

def resolve_backend(name: str) -> SimpleNamespace:
    """The graph backend's callables, the only backend-specific part of the check.

    Fields: ``name``; ``graph(src, dst, n)`` -> a :class:`betty.graph.Graph`;
    ``rev_graph(graph)`` -> the backend's whole-graph object for the RevGNN; ``sample(graph,
    outputs, fanouts, seed=)`` -> :class:`betty.batch.SampledBatch`; ``build_model(arch,
    in, out, **kw)``; ``rev_model(in, hidden, out, layers)``; ``cluster_partition(graph,
    k, method, seed)``; ``to_device_blocks(mb, device, model)``; ``device_ids(model, mb,
    device)``; ``train_step_parts`` / ``estimate_parts`` (reversible steps);
    ``products(scale)`` -> ``(graph, feat, label, train_idx)``; ``products_dataset(scale)``
    -> the :class:`betty.data.GraphDataset` they come from; ``block_formats``
    (whether calibration measures device graph formats).

    Raises:
        ValueError: unknown name (allowed: auto, dgl, pyg).
        RuntimeError: the backend's framework is not installed (names the install command).
    """
    allowed = ("auto", "dgl", "pyg")
    if name not in allowed:
        raise ValueError(f"--backend must be one of {allowed}, got {name!r}")
    from betty.backends import BackendUnavailable
    from betty.backends import resolve_backend as resolve_gnn_backend

    try:
        name = resolve_gnn_backend(name)
    except BackendUnavailable as err:
        raise RuntimeError(str(err)) from err
    return _backend(name)


def _backend(name: str) -> SimpleNamespace:
    """The seam for GNN backend ``name`` (``"dgl"`` or ``"pyg"``): graphs are
    :class:`betty.graph.Graph` (betty's sampler reads them directly); the RevGNN runs on
    the backend's whole-graph object (``rev_graph``); models and blocks are built on
    ``name``; calibration measures device graph formats only for DGL (PyG blocks are a
    plain ``edge_index``)."""
    from functools import partial

    from betty.backends import get_backend
    from betty.data.synthetic import SYNTHETIC_PRESETS, generate_synthetic
    from betty.graph import Graph
    from betty.models import build_model
    from betty.rev.model import RevGNN
    from betty.rev.training import cluster_partition
    from betty.rev.engine import estimate_parts, train_step_parts
    from betty.sampling import sample_full_batch
    from betty.train import _device_ids, _to_device_blocks

    gnn = get_backend(name)

    def graph(src, dst, n):
        return Graph(src, dst, n)

    def rev_model(in_feats, hidden, out_feats, layers):
        return RevGNN(in_feats, hidden, out_feats, layers, num_groups=2, conv="sage",
                      dropout=0.1, norm="layer", backend=name)

    def products_dataset(scale):
        from dataclasses import replace

        return generate_synthetic(replace(SYNTHETIC_PRESETS["synthetic-products"], scale=scale),
                                  "synthetic-products")

    def products(scale):
        ds = products_dataset(scale)
        return ds.graph, ds.feat, ds.label, ds.train_idx

    return SimpleNamespace(name=name, graph=graph, rev_graph=gnn.full_graph,
                           sample=sample_full_batch,
                           build_model=partial(build_model, backend=name), rev_model=rev_model,
                           cluster_partition=cluster_partition,
                           to_device_blocks=_to_device_blocks, device_ids=_device_ids,
                           train_step_parts=train_step_parts, estimate_parts=estimate_parts,
                           products=products, products_dataset=products_dataset,
                           block_formats=name == "dgl")


# --------------------------------------------------------------------------- helpers

def log(message: str) -> None:
    """Progress on stderr (so a run cut short by a time limit shows how far it got)."""
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def device_bytes(device: torch.device) -> int | None:
    """Bytes allocated on a CUDA device right now (None on the host). Read before each
    model is built: it should be 0, or every measured peak after it is off by it."""
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else None


def sync(device: torch.device) -> None:
    """Wait for the device (a no-op on the host)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    """Return cached device memory between sections (CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def chung_lu_graph(be, n: int, avg_degree: float, feats: int, classes: int, seed: int):
    """A directed heavy-tailed graph (Pareto node weights, no self-loops, no duplicate
    edges): ``(graph, feat (n, F), label (n,), train_mask (n,))``; half the nodes train."""
    rng = np.random.default_rng(seed)
    w = rng.pareto(1.1, n) + 1.0
    p = w / w.sum()
    m = int(avg_degree * n)
    src, dst = rng.choice(n, m, p=p), rng.choice(n, m, p=p)
    keep = src != dst
    key = np.unique(src[keep].astype(np.int64) * n + dst[keep])
    g = be.graph(torch.from_numpy(key // n), torch.from_numpy(key % n), n)
    gen = torch.Generator().manual_seed(seed)
    label = torch.randint(0, classes, (n,), generator=gen)
    feat = torch.randn(n, feats, generator=gen)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.from_numpy(np.sort(rng.choice(n, n // 2, replace=False)))] = True
    return g, feat, label, mask


def rel_error(est: int, meas: int) -> float:
    return abs(est - meas) / max(meas, 1)


def partition_method(requested: str) -> str:
    """``auto``: ``reg`` (REG + METIS) when pymetis imports, else ``random``."""
    if requested != "auto":
        return requested
    return "reg" if importlib.util.find_spec("pymetis") is not None else "random"


# --------------------------------------------------------------------------- sections

def calibrate_section(device, sizes: Sizes, be) -> tuple[dict, Any, Any]:
    """Calibrated and shipped constants of the device's backend."""
    from betty.memory.calibrate import LSTM_GRID, calibrate
    from betty.memory.constants import BackendConstants, default_backend, load_constants

    result = calibrate(device, write=False, lstm_grid=sizes.lstm_grid or LSTM_GRID,
                       block_formats=be.block_formats)
    backend = default_backend(device)
    shipped = load_constants(backend, use_user=False)
    calibrated = BackendConstants.from_dict(result["constants"])
    result["shipped_constants"] = shipped.to_dict()
    return result, calibrated, shipped


def _block_setup(be, kind: str, sizes: Sizes, device, seed: int):
    arch, agg = BLOCK_MODELS[kind]
    torch.manual_seed(seed)
    model = be.build_model(arch, sizes.feats, sizes.classes, hidden=sizes.hidden,
                           layers=len(sizes.fanouts), aggregator=agg, heads=4, dropout=0.1,
                           attn_dropout=0.05).to(device).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt


def block_rows(be, kind, graph, feat, label, mask, sizes, device, backend, consts, method):
    """Estimate vs measure every micro-batch of K in :data:`KS` for one block model."""
    from betty.memory import MemoryMeter, estimate_micro_batches
    from betty.partition import partition_batch
    from betty.train import accumulate_gradients, train_step

    outputs = torch.nonzero(mask).flatten()
    batch = be.sample(graph, outputs, list(sizes.fanouts), seed=0)
    before = device_bytes(device)
    model, opt = _block_setup(be, kind, sizes, device, seed=0)
    zeros = torch.zeros(batch.num_outputs, dtype=torch.int64)
    train_step(model, opt, batch, zeros, feat, label, device=device, dropout_key=1)
    meter = MemoryMeter(device)
    meter.track(model, opt)
    rows = []
    for k in KS:
        groups = zeros if k == 1 else partition_batch(batch, k, method, seed=k, graph=graph).groups
        opt.zero_grad(set_to_none=True)
        res = accumulate_gradients(model, batch, groups, feat, label, k=k, device=device,
                                   meter=meter, dropout_key=2)
        est = {name: estimate_micro_batches(batch, groups, k, model, opt, backend=backend, constants=c)
               for name, c in consts.items()}
        for i, rec in enumerate(res.micro):
            rows.append({"model": kind, "nodes": graph.num_nodes(), "k": k, "index": i,
                         "measured": int(rec.peak_bytes),
                         **{f"estimated_{n}": int(e[i].peak) for n, e in est.items()},
                         "peak_at": est["calibrated"][i].peak_at,
                         "device_bytes_before": before})
    return rows


def rev_rows(be, graph, feat, label, mask, sizes, device, backend, consts):
    """Estimate vs measure every part of K in :data:`KS` for the RevGNN."""
    from betty.memory import MemoryMeter

    graph = be.rev_graph(graph)

    before = device_bytes(device)
    torch.manual_seed(0)
    model = be.rev_model(sizes.feats, sizes.hidden, sizes.classes, sizes.rev_layers).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    be.train_step_parts(model, opt, be.cluster_partition(graph, 1, "random", 0), feat, label,
                        mask, device=device)
    meter = MemoryMeter(device)
    meter.track(model, opt)
    rows = []
    for k in KS:
        parts = be.cluster_partition(graph, k, "random", k)
        step = be.train_step_parts(model, opt, parts, feat, label, mask, device=device, meter=meter)
        est = {n: be.estimate_parts(model, opt, parts, mask, backend=backend, constants=c)
               for n, c in consts.items()}
        for i, rec in enumerate(step.parts):
            if rec.skipped:
                continue
            rows.append({"model": "revgnn", "nodes": graph.num_nodes(), "k": k, "index": i,
                         "measured": int(rec.peak_bytes),
                         **{f"estimated_{n}": int(e[i]) for n, e in est.items()},
                         "device_bytes_before": before})
    return rows


def measured_peaks_step(step) -> list[int]:
    """Measured peak of every micro-batch (block step) or running part (reversible step)."""
    micro_batches = getattr(step, "micro", None)
    if micro_batches is None:
        micro_batches = [p for p in step.parts if not p.skipped]
    return [int(p.peak_bytes) for p in micro_batches]


def budget_block(be, kind, graph, feat, label, mask, sizes, device, backend, consts, method,
                 k1_peak: int) -> dict:
    """K search for 40% of the K = 1 peak, cap, two steps; overruns counted."""
    from betty.memory import KSearchError, search_k
    from betty.memory.estimator import persistent_bytes
    from betty.train import train_step

    outputs = torch.nonzero(mask).flatten()
    batch = be.sample(graph, outputs, list(sizes.fanouts), seed=0)
    model, opt = _block_setup(be, kind, sizes, device, seed=0)
    zeros = torch.zeros(batch.num_outputs, dtype=torch.int64)
    train_step(model, opt, batch, zeros, feat, label, device=device, dropout_key=1)
    budget = int(BUDGET_FRACTION * k1_peak)
    found = search_k(batch, model, opt, memory_budget=budget, safety_margin=SAFETY_MARGIN,
                     method=method, seed=0, graph=graph, backend=backend, constants=consts)
    out = {"model": kind, "budget": budget, "k1_peak": k1_peak, "k": found.k,
           "estimated_max": int(found.max_peak), "tried": found.tried}
    out.update(_capped_steps(device, budget, found.estimates, lambda meter, step: train_step(
        model, opt, batch, found.partition.groups, feat, label, k=found.k, device=device,
        meter=meter, dropout_key=10 + step), (model, opt)))
    try:
        search_k(batch, model, opt, memory_budget=max(1, persistent_bytes(model, opt, backend) // 2),
                 safety_margin=SAFETY_MARGIN, method=method, seed=0, graph=graph,
                 backend=backend, constants=consts)
        out["impossible_budget"] = {"raised": False, "error": None}
    except KSearchError as err:
        out["impossible_budget"] = {"raised": True, "type": type(err).__name__,
                                    "error": str(err)}
    return out


def budget_rev(be, graph, feat, label, mask, sizes, device, backend, consts,
               k1_peak: int) -> dict:
    """The same for the RevGNN (:func:`betty.rev.memory.search_k_rev`)."""
    from betty.rev.memory import RevKSearchError, rev_persistent_bytes, search_k_rev

    graph = be.rev_graph(graph)

    torch.manual_seed(0)
    model = be.rev_model(sizes.feats, sizes.hidden, sizes.classes, sizes.rev_layers).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    be.train_step_parts(model, opt, be.cluster_partition(graph, 1, "random", 0), feat, label,
                        mask, device=device)
    budget = int(BUDGET_FRACTION * k1_peak)
    found = search_k_rev(graph, model, budget, method="random", seed=0, train_mask=mask,
                         safety_margin=SAFETY_MARGIN, optimizer=opt, backend=backend,
                         constants=consts)
    out = {"model": "revgnn", "budget": budget, "k1_peak": k1_peak, "k": found.k,
           "estimated_max": int(max(e.peak for e in found.estimates))}
    out.update(_capped_steps(device, budget, found.estimates, lambda meter, step: be.train_step_parts(
        model, opt, list(found.parts), feat, label, mask, device=device, meter=meter),
        (model, opt)))
    floor = rev_persistent_bytes(model, opt, backend)
    try:
        search_k_rev(graph, model, max(1, floor // 2), method="random", seed=0, train_mask=mask,
                     optimizer=opt, backend=backend, constants=consts)
        out["impossible_budget"] = {"raised": False, "error": None}
    except RevKSearchError as err:
        out["impossible_budget"] = {"raised": True, "type": type(err).__name__,
                                    "error": str(err)}
    return out


def _capped_steps(device, budget: int, estimates, run_step: Callable, tracked,
                  steps: int = 2) -> dict:
    """Cap the allocator at ``budget`` (CUDA), run ``steps`` metered steps
    (``run_step(meter, step)``), lift the cap; every micro-batch peak over ``budget`` and every
    error (out of memory included) is an overrun."""
    from betty.memory import MemoryMeter, apply_budget, oom_guard

    meter = MemoryMeter(device)
    meter.track(*tracked)
    free(device)
    at_cap = device_bytes(device)  # model, gradients, optimizer state: inside the budget
    fraction = apply_budget(device, budget)
    peaks, error = [], None
    try:
        for s in range(steps):
            with oom_guard(estimates, budget):
                peaks += measured_peaks_step(run_step(meter, s))
    except Exception as err:  # noqa: BLE001 - an OOM is recorded, the check goes on
        error = f"{type(err).__name__}: {err}"
    finally:
        if device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    overruns = sum(p > budget for p in peaks) + (1 if error else 0)
    return {"cap_fraction": fraction if device.type == "cuda" else None,
            "device_bytes_at_cap": at_cap, "measured": peaks,
            "max_measured": max(peaks) if peaks else None, "overruns": int(overruns),
            "error": error}


def timed_epoch(be, model, opt, graph, feat, label, outputs, fanouts, k, method,
                device) -> tuple[dict, Any]:
    """One full-batch step timed by phase (seconds); see the module docstring."""
    from betty.microbatch import Carver
    from betty.partition import partition_batch
    from betty.train import node_loss_sum

    t = dict.fromkeys(("sampling", "partitioning", "carving", "host_to_device", "compute"), 0.0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    start = time.perf_counter()
    batch = be.sample(graph, outputs, list(fanouts), seed=0)
    t["sampling"] = time.perf_counter() - start
    start = time.perf_counter()
    groups = (torch.zeros(batch.num_outputs, dtype=torch.int64) if k == 1
              else partition_batch(batch, k, method, seed=0, graph=graph).groups)
    t["partitioning"] = time.perf_counter() - start
    model.train()
    opt.zero_grad(set_to_none=True)
    start = time.perf_counter()
    carver = Carver(batch)
    order = torch.argsort(groups, stable=True)
    t["carving"] += time.perf_counter() - start
    n_total = batch.num_outputs
    for idx in torch.split(order, torch.bincount(groups, minlength=k).tolist()):
        start = time.perf_counter()
        mb = carver.carve(idx)
        t["carving"] += time.perf_counter() - start
        start = time.perf_counter()
        blocks = be.to_device_blocks(mb, device, model)
        src_nids, edge_ids = be.device_ids(model, mb, device)
        x = feat[mb.input_nid].to(device)
        y = label[mb.output_nid].to(device)
        sync(device)
        t["host_to_device"] += time.perf_counter() - start
        start = time.perf_counter()
        logits = model(blocks, x, src_nids=src_nids, edge_ids=edge_ids, dropout_key=3)
        (node_loss_sum(logits, y) / n_total).backward()
        del blocks, src_nids, edge_ids, x, y, logits
        sync(device)
        t["compute"] += time.perf_counter() - start
    start = time.perf_counter()
    opt.step()
    sync(device)
    t["compute"] += time.perf_counter() - start
    out = {"k": int(k), "seconds": t, "epoch_s": sum(t.values()),
           "preparation_s": t["sampling"] + t["partitioning"] + t["carving"] + t["host_to_device"],
           "num_outputs": int(n_total), "num_inputs": int(batch.layers[0].num_src)}
    if device.type == "cuda":
        out["measured_peak"] = int(torch.cuda.max_memory_allocated(device))
    return out, batch


def timing_section(be, sizes: Sizes, device, backend, consts, method) -> dict:
    """Epoch split at K = 1 and at the K for 25% of the estimated K = 1 peak."""
    from betty.memory import estimate_micro_batches, search_k

    start = time.perf_counter()
    graph, feat, label, train_idx = be.products(sizes.products_scale)
    gen_s = time.perf_counter() - start
    outputs = torch.sort(torch.as_tensor(train_idx, dtype=torch.int64)).values
    torch.manual_seed(0)
    model = be.build_model("sage", feat.shape[1], int(label.max()) + 1,
                           hidden=sizes.products_hidden, layers=len(sizes.products_fanouts),
                           aggregator="mean").to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    timed_epoch(be, model, opt, graph, feat, label, outputs, sizes.products_fanouts, 1, method,
                device)  # warm-up (kernels, Adam state), not reported
    k1, batch = timed_epoch(be, model, opt, graph, feat, label, outputs, sizes.products_fanouts,
                            1, method, device)
    zeros = torch.zeros(batch.num_outputs, dtype=torch.int64)
    k1_est = estimate_micro_batches(batch, zeros, 1, model, opt, backend=backend, constants=consts)[0].peak
    budget = int(TIMING_BUDGET_FRACTION * k1_est)
    start = time.perf_counter()
    found = search_k(batch, model, opt, memory_budget=budget, safety_margin=SAFETY_MARGIN,
                     method=method, seed=0, graph=graph, backend=backend, constants=consts)
    search_s = time.perf_counter() - start
    kk, _ = timed_epoch(be, model, opt, graph, feat, label, outputs, sizes.products_fanouts,
                        found.k, method, device)
    return {"dataset": "synthetic-products", "scale": sizes.products_scale,
            "num_nodes": int(graph.num_nodes()), "num_edges": int(graph.num_edges()),
            "generate_s": gen_s, "model": "sage-mean", "hidden": sizes.products_hidden,
            "fanouts": list(sizes.products_fanouts), "partition": method,
            "k1_estimated_peak": int(k1_est), "budget": budget, "k_search_s": search_s,
            "k_chosen": found.k, "k_estimated_max": int(found.max_peak),
            "epochs": [k1, kk]}


def pipeline_section(be, sizes: Sizes, device, method: str, k: int) -> dict:
    """Serial against pipelined :class:`betty.engine.Trainer` epochs (module docstring)."""
    from betty.engine import PartitionPlan, Trainer
    from betty.train import max_relative_difference

    ds = be.products_dataset(sizes.products_scale)
    torch.manual_seed(0)
    model = be.build_model("sage", ds.num_features, ds.num_classes, hidden=sizes.products_hidden,
                           layers=len(sizes.products_fanouts), aggregator="mean", dropout=0.5).to(device)
    initial = {n: v.detach().clone() for n, v in model.state_dict().items()}
    modes, finals = {}, {}
    for name, prefetch, gather_ahead, sample_device, copy_ahead in (
            ("serial", 0, False, None, False), ("pipelined", 1, False, None, False),
            ("gathered_ahead", 1, True, None, False), ("device_preparation", 0, False, device, False),
            ("copy_ahead", 1, True, None, True)):
        model.load_state_dict(initial)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        trainer = Trainer(model, opt, ds, list(sizes.products_fanouts), PartitionPlan(method, int(k)),
                          device=device, seed=0, estimate_memory=False, prefetch=prefetch,
                          gather_ahead=gather_ahead, sample_device=sample_device,
                          copy_ahead=copy_ahead)
        epochs = []
        for record in trainer.epochs(range(PIPELINE_EPOCHS)):
            sync(device)
            epochs.append({"epoch": record.epoch, "epoch_s": record.epoch_time_s,
                           "compute_s": record.time_compute_s, "wait_s": record.time_wait_s,
                           "sample_s": record.time_sample_s, "h2d_s": record.time_h2d_s,
                           "idle_fraction": record.time_idle_s / record.epoch_time_s,
                           "prefetch_bytes": int(record.prefetch_bytes)})
        modes[name] = epochs
        finals[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
        del trainer, opt
        free(device)
    differences = {mode: max_relative_difference(finals[mode], finals["serial"])
                   for mode in PIPELINE_MODES[1:]}
    return {"k": int(k), "partition": method, "epochs_per_mode": PIPELINE_EPOCHS, **modes,
            "relative_difference": differences,
            "max_relative_difference": max(differences.values())}



def environment(device, be) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "numpy": np.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
           "device": str(device), "backend": be.name, "host": platform.node(),
           "machine": platform.machine(), "cpu_threads": torch.get_num_threads(),
           "pymetis": importlib.util.find_spec("pymetis") is not None,
           "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for mod in ("torch_geometric", "dgl", "scipy"):
        if importlib.util.find_spec(mod) is not None:
            env[mod] = getattr(__import__(mod), "__version__", "unknown")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_bytes=int(props.total_memory),
                   gpu_capability=f"{props.major}.{props.minor}")
    return env


def _table(report: dict) -> str:
    lines = [f"{'model':10s} {'err calibrated':>15s} {'err shipped':>12s} {'K@40%':>6s} "
             f"{'overruns':>8s}"]
    budget = {b["model"]: b for b in report["budget"]}
    for m in MODELS:
        b = budget.get(m, {})
        lines.append(f"{m:10s} {report['estimate_error'][m] * 100:14.2f}% "
                     f"{report['estimate_error_shipped'][m] * 100:11.2f}% {b.get('k', '-'):>6} "
                     f"{b.get('overruns', '-'):>8}")
    lines.append(f"budget_overruns: {report['budget_overruns']}")
    tm = report["timing"]
    lines.append(f"epoch on synthetic-products scale {tm['scale']} ({tm['num_nodes']} nodes), "
                 f"budget 25% of K=1 -> K={tm['k_chosen']}:")
    lines.append(f"{'K':>4s} " + " ".join(f"{p:>14s}" for p in tm["epochs"][0]["seconds"])
                 + f" {'total':>8s}")
    for e in tm["epochs"]:
        lines.append(f"{e['k']:4d} " + " ".join(f"{v:13.3f}s" for v in e["seconds"].values())
                     + f" {e['epoch_s']:7.3f}s")
    pl = report["pipeline"]
    lines.append(f"epochs at K={pl['k']} (wall / compute / wait / sampling / gather+copy / device idle), "
                 f"serial, pipelined, features gathered ahead, the sampler on the device, and copy-ahead; "
                 f"max relative parameter difference {pl['max_relative_difference']:.1e}:")
    width = max(map(len, PIPELINE_MODES))
    for mode in PIPELINE_MODES:
        lines.append(f"{mode:>{width}s} " + "  ".join(
            f"{e['epoch_s']:.2f}/{e['compute_s']:.2f}/{e['wait_s']:.2f}/{e['sample_s']:.2f}/"
            f"{e['h2d_s']:.2f}/{e['idle_fraction']:.0%}" for e in pl[mode]))
    return "\n".join(lines)


def run(args) -> dict:
    """The whole check; returns the JSON-ready report."""
    wall = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False on this machine")
    be = resolve_backend(args.backend)
    sizes = QUICK if args.quick else FULL
    method = partition_method(args.partition)
    from betty.memory.constants import default_backend

    backend = default_backend(device)
    phase = {}
    log(f"device {device}, backend {be.name}, {'quick' if args.quick else 'full'} sizes, "
        f"timed partitioner {method}")
    start = time.perf_counter()
    calib, calibrated, shipped = calibrate_section(device, sizes, be)
    phase["calibrate_s"] = time.perf_counter() - start
    consts = {"calibrated": calibrated, "shipped": shipped}

    start = time.perf_counter()
    rows, k1_peaks, graphs = [], {}, {}
    for n in sizes.graph_nodes:
        graphs[n] = chung_lu_graph(be, n, sizes.avg_degree, sizes.feats, sizes.classes, seed=n)
        g, feat, label, mask = graphs[n]
        log(f"estimates on {n} nodes ({g.num_edges()} edges)")
        for kind in BLOCK_MODELS:
            # models are dropped on return: on CUDA a live one would add to later peaks
            rows += block_rows(be, kind, g, feat, label, mask, sizes, device, backend, consts,
                               CHECK_PARTITION)
            free(device)
        rows += rev_rows(be, g, feat, label, mask, sizes, device, backend, consts)
        free(device)
    big = max(sizes.graph_nodes)
    for row in rows:
        if row["nodes"] == big and row["k"] == 1:
            k1_peaks[row["model"]] = row["measured"]
    phase["estimates_s"] = time.perf_counter() - start
    for row in rows:
        for n in consts:
            row[f"error_{n}"] = rel_error(row[f"estimated_{n}"], row["measured"])

    start = time.perf_counter()
    g, feat, label, mask = graphs[big]
    log("budget runs")
    budgets = [budget_block(be, kind, g, feat, label, mask, sizes, device, backend, calibrated,
                            CHECK_PARTITION, k1_peaks[kind]) for kind in BLOCK_MODELS]
    free(device)
    budgets.append(budget_rev(be, g, feat, label, mask, sizes, device, backend, calibrated,
                              k1_peaks["revgnn"]))
    free(device)
    phase["budget_s"] = time.perf_counter() - start

    start = time.perf_counter()
    log(f"timed epochs on synthetic-products scale {sizes.products_scale}")
    timing = timing_section(be, sizes, device, backend, calibrated, method)
    phase["timing_s"] = time.perf_counter() - start
    free(device)

    start = time.perf_counter()
    log(f"serial and pipelined epochs at K={timing['k_chosen']}")
    pipeline = pipeline_section(be, sizes, device, method, timing["k_chosen"])
    phase["pipeline_s"] = time.perf_counter() - start

    def worst(name):
        return {m: max(r[f"error_{name}"] for r in rows if r["model"] == m) for m in MODELS}

    return {
        "schema": 1,
        "estimate_error": worst("calibrated"),
        "estimate_error_shipped": worst("shipped"),
        "budget_overruns": int(sum(b["overruns"] for b in budgets)),
        "environment": environment(device, be),
        "settings": {"quick": bool(args.quick), "partition": method,
                     "partition_checks": CHECK_PARTITION, "ks": list(KS),
                     "budget_fraction": BUDGET_FRACTION, "safety_margin": SAFETY_MARGIN,
                     "timing_budget_fraction": TIMING_BUDGET_FRACTION,
                     "sizes": {k: v for k, v in sizes.__dict__.items() if k != "lstm_grid"}},
        "calibration": calib,
        "estimates": rows,
        "budget": budgets,
        "timing": timing,
        "pipeline": pipeline,
        "phase_s": phase,
        "wall_s": time.perf_counter() - wall,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="small sizes (the test suite's run)")
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--backend", default="auto", help="auto | dgl | pyg")
    parser.add_argument("--partition", default="auto",
                        help="partitioner name, or auto: reg when pymetis imports, else random")
    args = parser.parse_args(argv)
    try:
        report = run(args)
    except (ValueError, RuntimeError) as err:
        if "backend" not in str(err).lower():
            raise
        print(f"gpu_check: {err}", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1, default=float)
    print(_table(report))
    print(f"wrote {args.out} ({report['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
