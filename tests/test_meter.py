"""Tests for betty.memory.meter: exact live-byte accounting of code regions."""

from __future__ import annotations

import threading

import pytest
import torch

from betty.memory.meter import (
    MemoryMeter,
    MemoryReading,
    module_bytes,
    optimizer_state_bytes,
    tensor_bytes,
)

MB = 2**20


def _bytes(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


# --------------------------------------------------------------------------- scripted sequences


def test_scripted_sequence_peak_is_exact():
    meter = MemoryMeter("cpu")
    with meter.measure() as reading:
        a = _bytes(4 * MB)
        b = _bytes(4 * MB)
        del a  # live 4 MB
        c = _bytes(8 * MB)  # live 12 MB: the peak
    assert reading.backend == "dispatch"
    assert reading.baseline_bytes == 0
    assert reading.peak_bytes == 12 * MB
    assert reading.end_bytes == 12 * MB  # b and c alive at exit
    del b, c


def test_freed_tensors_leave_end_bytes_and_alive_ones_stay():
    meter = MemoryMeter()
    with meter.measure() as reading:
        kept = _bytes(3 * MB)
        tmp = _bytes(5 * MB)
        del tmp
    assert reading.peak_bytes == 8 * MB
    assert reading.end_bytes == 3 * MB
    assert kept.numel() == 3 * MB


def test_views_count_once():
    before = torch.zeros(MB)  # 4 MB, untracked, made before the region
    meter = MemoryMeter()
    with meter.measure() as reading:
        a = torch.zeros(MB)  # 4 MB
        views = [a.view(1024, 1024), a[10:20], a.view(1024, 1024).t(), a.unsqueeze(0)]
        outside_views = [before[5:], before.view(2, -1), before.view(2, -1)[1]]
    assert reading.peak_bytes == 4 * MB
    assert reading.end_bytes == 4 * MB
    assert tensor_bytes(a, *views) == 4 * MB
    assert len(outside_views) == 3


def test_in_place_ops_add_nothing():
    meter = MemoryMeter()
    with meter.measure() as reading:
        a = torch.ones(MB)
        a.add_(1)
        a.mul_(2).relu_()
        torch.add(a, 1, out=a)
        a[::2].fill_(0.0)  # (``a[::2] = 0.0`` would lift the scalar into a 4-byte tensor)
        a.clamp_(max=3.0)
    assert reading.peak_bytes == 4 * MB
    assert reading.end_bytes == 4 * MB


def test_untracked_tensor_freed_inside_is_not_subtracted():
    old = _bytes(6 * MB)  # allocated before the region and not tracked: never added
    meter = MemoryMeter()
    with meter.measure() as reading:
        del old
        new = _bytes(MB)
    assert reading.baseline_bytes == 0
    assert reading.peak_bytes == MB
    assert reading.end_bytes == MB
    del new


def test_tracked_tensor_freed_inside_is_subtracted():
    holder = {"t": _bytes(6 * MB)}
    meter = MemoryMeter()
    meter.track(holder["t"])
    with meter.measure() as reading:
        holder.clear()  # frees the tracked storage
        new = _bytes(MB)
    assert reading.baseline_bytes == 6 * MB
    assert reading.peak_bytes == 6 * MB
    assert reading.end_bytes == MB
    del new


def test_counted_tensor_made_before_the_region_is_added_until_freed():
    """``count``: a tensor made before the region (a micro-batch's inputs copied ahead)
    joins the innermost region's live bytes from there, is subtracted when freed, and
    the meter keeps no reference to it; outside a region it does nothing."""
    held = {"t": _bytes(6 * MB)}
    meter = MemoryMeter()
    meter.count([held["t"]])  # no region open
    with meter.measure() as outer:
        with meter.measure() as reading:
            meter.count([held["t"], held["t"]])  # one storage, counted once
            held.clear()  # its last holder: freed
            new = _bytes(MB)
    assert reading.baseline_bytes == 0
    assert reading.peak_bytes == 6 * MB
    assert reading.end_bytes == MB
    assert outer.peak_bytes == MB  # the outer region never counted it
    del new


def test_zero_size_storage_growth_via_resize_and_out():
    meter = MemoryMeter()
    with meter.measure() as reading:
        z = torch.empty(0)
        w = torch.empty(0)
        z.resize_(MB)  # grows to 4 MB through aten.resize_
        torch.add(torch.ones(MB), 1, out=w)  # out= grows w to 4 MB; the ones temp is freed
    assert reading.end_bytes == 8 * MB
    assert reading.peak_bytes == 12 * MB  # z + w + the ones temporary


def test_storage_resize_outside_the_dispatcher_is_followed():
    """The reversible-GNN trick: free with ``untyped_storage().resize_(0)``, rebuild later."""
    original = torch.UntypedStorage.resize_
    meter = MemoryMeter()
    with meter.measure() as reading:
        t = _bytes(MB)
        t.untyped_storage().resize_(0)
        u = _bytes(MB)  # live 1 MB, not 2
        t.untyped_storage().resize_(3 * MB)  # live 4 MB
    assert reading.peak_bytes == 4 * MB
    assert reading.end_bytes == 4 * MB
    assert torch.UntypedStorage.resize_ is original  # the hook is removed on exit
    del u


def test_storages_on_other_devices_are_ignored():
    """A host gather followed by a copy to the meter's device counts only the copy
    (``meta`` stands in for an accelerator here)."""
    feat = torch.randn(1000, 64)
    meter = MemoryMeter("meta")
    with meter.measure() as reading:
        host = feat[torch.arange(500)]  # 128 000 bytes on the CPU: not counted
        dev = host.to("meta")  # 128 000 bytes on the meter's device
        del host
    assert reading.peak_bytes == 500 * 64 * 4
    assert reading.end_bytes == 500 * 64 * 4
    assert dev.device.type == "meta"


def test_cpu_0_is_the_host():
    """``cpu:0`` names the one host memory: it measures what ``cpu`` measures (it matched
    no storage, host storages having no index)."""
    for device in ("cpu", "cpu:0"):
        meter = MemoryMeter(device)
        with meter.measure() as reading:
            x = torch.empty(1000, 2)
        assert reading.peak_bytes == 8000, device
        del x


def test_regions_closing_while_another_thread_resizes_a_storage():
    """The resize hook calls the saved original even when the last region closes while a
    thread is inside it (it called ``None`` then)."""
    import sys

    errors, stop = [], threading.Event()

    def resizer():
        storage = torch.empty(16).untyped_storage()
        while not stop.is_set():
            try:
                storage.resize_(64)
                storage.resize_(32)
            except Exception as err:  # noqa: BLE001
                errors.append(repr(err))
                return

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=resizer)
    thread.start()
    try:
        meter = MemoryMeter("cpu")
        for _ in range(20000):
            if errors:
                break
            with meter.measure():
                pass
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert errors == []


def test_python_data_tensors_are_counted():
    meter = MemoryMeter()
    with meter.measure() as reading:
        t = torch.tensor([1.0] * 1000)  # built outside the dispatcher, lifted by lift_fresh
    assert reading.end_bytes == 4000
    assert t.numel() == 1000


# --------------------------------------------------------------------------- backward


def test_backward_allocations_are_counted_exactly():
    """``y = relu(x @ w).sum(); y.backward()`` with x (n, d), w (d, h), float32.

    Baseline: x and w (tracked). Forward: mm makes t = x @ w (n, h); relu makes
    r (n, h) while t is alive (peak of the forward: 2nh floats); t dies, r stays (saved
    by ReluBackward); sum makes y (1 float). Backward: ``torch.autograd.backward``
    makes the seed grad ones_like(y) (1 float, held until backward returns);
    SumBackward expands it (a view); ReluBackward makes g (n, h) and then releases r;
    MmBackward computes only grad_w = x^T g (d, h), since x needs no grad; AccumulateGrad
    steals it as w.grad. Peak = baseline + y + seed + g + grad_w; with d >> n the
    backward peak exceeds the forward one. At exit: baseline + y + w.grad.
    """
    n, d, h = 4, 1024, 256
    x = torch.randn(n, d)
    w = torch.randn(d, h, requires_grad=True)
    meter = MemoryMeter()
    meter.track(x, w)
    with meter.measure() as reading:
        y = (x @ w).relu().sum()
        y.backward()
    f = 4  # bytes per float32
    baseline = f * (n * d + d * h)
    assert reading.baseline_bytes == baseline
    assert reading.peak_bytes == baseline + f + f + f * n * h + f * d * h
    assert reading.end_bytes == baseline + f + f * d * h
    assert w.grad.untyped_storage().nbytes() == f * d * h


def test_allocations_inside_a_custom_backward_are_seen():
    seen_threads = []

    class Scratch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen_threads.append(threading.get_ident())
            scratch = _bytes(8 * MB)  # only alive inside the autograd engine's call
            return grad * (1 + scratch[:1].float() * 0)

    x = torch.randn(10, requires_grad=True)
    meter = MemoryMeter()
    with meter.measure() as reading:
        Scratch.apply(x).sum().backward()
    assert seen_threads  # the backward did run
    assert reading.peak_bytes >= 8 * MB
    assert reading.end_bytes < MB  # the scratch buffer was freed and subtracted


# --------------------------------------------------------------------------- tracking


def _train_step(model, optimizer, x):
    loss = model(x).square().sum()
    loss.backward()
    optimizer.step()


def test_module_and_adam_state_baseline():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    params = list(model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    step_bytes = 4 * len(params)  # one float32 0-d `step` tensor per parameter
    x = torch.randn(16, 64)

    meter = MemoryMeter("cpu")
    meter.track(model, optimizer)
    with meter.measure() as first:  # grads and Adam state are born inside this region
        _train_step(model, optimizer, x)
    assert first.baseline_bytes == param_bytes
    # params + grads + exp_avg + exp_avg_sq + steps, all made in the region, stay alive
    assert first.end_bytes == 4 * param_bytes + step_bytes

    with meter.measure() as second:  # looked up again: now part of the baseline
        optimizer.zero_grad(set_to_none=True)  # frees the tracked grads
    assert second.baseline_bytes == 4 * param_bytes + step_bytes
    assert second.end_bytes == 3 * param_bytes + step_bytes

    assert module_bytes(model, grads=False) == param_bytes
    assert optimizer_state_bytes(optimizer) == 2 * param_bytes + step_bytes
    assert meter.tracked_bytes() == 3 * param_bytes + step_bytes


def test_helpers_deduplicate_storages():
    a = torch.zeros(1000)
    assert tensor_bytes(a, a[:10], a.view(10, 100), [a, {"v": a[5:]}]) == 4000
    b = torch.zeros(10, dtype=torch.float64)
    assert tensor_bytes(a, b) == 4080
    assert tensor_bytes(a, b, device="meta") == 0

    lin = torch.nn.Linear(10, 5)
    tied = torch.nn.Sequential(lin, lin)  # the same parameters twice
    assert module_bytes(tied, grads=False) == (10 * 5 + 5) * 4
    lin.weight.grad = torch.ones_like(lin.weight)
    assert module_bytes(lin) == (10 * 5 + 5 + 10 * 5) * 4
    bn = torch.nn.BatchNorm1d(3)  # buffers: running mean/var (3 floats) and a long counter
    assert module_bytes(bn, grads=False) == 4 * (3 + 3 + 3 + 3) + 8


def test_tracked_objects_are_weakly_held():
    meter = MemoryMeter()
    t = _bytes(MB)
    meter.track(t)
    assert meter.tracked_bytes() == MB
    del t
    with meter.measure() as reading:
        pass
    assert reading.baseline_bytes == 0


# --------------------------------------------------------------------------- regions


def test_sequential_regions_are_independent():
    meter = MemoryMeter()
    with meter.measure() as first:
        big = _bytes(8 * MB)
        leftover = _bytes(2 * MB)  # survives the region, untracked
        del big
    with meter.measure() as second:
        small = _bytes(MB)
    assert first.peak_bytes == 10 * MB
    assert first.end_bytes == 2 * MB
    assert second.peak_bytes == MB  # neither the freed 8 MB nor the untracked leftover
    assert second.end_bytes == MB
    del leftover, small


def test_nested_regions():
    meter = MemoryMeter()
    with meter.measure() as outer:
        a = _bytes(4 * MB)
        with meter.measure() as inner:
            b = _bytes(2 * MB)
            c = _bytes(MB)
            del c
        del b
    assert inner.peak_bytes == 3 * MB  # only its own allocations
    assert inner.end_bytes == 2 * MB
    assert outer.peak_bytes == 7 * MB  # sees the inner region's allocations too
    assert outer.end_bytes == 4 * MB
    del a


def test_reading_is_filled_when_the_block_raises():
    meter = MemoryMeter()
    with pytest.raises(KeyError):
        with meter.measure() as reading:
            a = _bytes(MB)
            raise KeyError("boom")
    assert reading.peak_bytes == MB
    assert torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_
    del a


_CTRL_C_DURING_A_METERED_LOOP = """
import os, signal, threading, time
import torch
from betty.memory.meter import MemoryMeter

def interrupt(sent):
    os.kill(os.getpid(), signal.SIGINT)
    sent.append(time.monotonic())

with MemoryMeter("cpu").measure():  # the lazy imports of a first region (torch 2.13: sympy)
    torch.randn(64) * 2
lost = 0
for i in range({tries}):
    sent = []
    try:
        threading.Timer(0.05 + 0.01 * i, interrupt, (sent,)).start()
        with MemoryMeter("cpu").measure():
            while not sent or time.monotonic() - sent[0] < 1.0:  # frees metered storages all the time
                x = torch.randn(64)
                y = x * 2 + 1
                del x, y
        lost += 1  # still running 1 s after the signal: it was dropped
    except KeyboardInterrupt:
        pass
print("lost", lost)
"""


def test_ctrl_c_during_a_metered_loop_is_never_lost():
    """Ctrl-C while a region frees metered storages raises ``KeyboardInterrupt`` every
    time: freeing a storage runs no Python code in which the signal handler could raise
    it (Python drops what a finalizer raises: with a finalizer written in Python on every
    storage, some of these Ctrl-Cs are lost)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _CTRL_C_DURING_A_METERED_LOOP.format(tries=20)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["lost", "0"], (out.stdout, out.stderr[-2000:])


def test_region_peak_property():
    assert MemoryReading(peak_bytes=10, baseline_bytes=3).region_peak_bytes == 7


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="backend must be one of"):
        MemoryMeter("cpu", backend="nvml")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        MemoryMeter("cpu", backend="cuda")
    with pytest.raises(TypeError, match="track\\(\\) takes"):
        MemoryMeter().track("weights")
    with pytest.raises(TypeError, match="cannot find tensors"):
        tensor_bytes(3)


# --------------------------------------------------------------------------- DGL


@pytest.mark.dgl
def test_dgl_sageconv_forward_backward_is_measured():
    import dgl
    from dgl.nn import SAGEConv

    torch.manual_seed(0)
    n_src, n_dst, n_edges, width, hidden = 500, 100, 2000, 32, 16
    src = torch.randint(0, n_src, (n_edges,))
    dst = torch.randint(0, n_dst, (n_edges,))
    block = dgl.create_block((src, dst), num_src_nodes=n_src, num_dst_nodes=n_dst)
    conv = SAGEConv(width, hidden, "mean")
    feat = torch.randn(n_src, width)
    meter = MemoryMeter()
    meter.track(conv)
    with meter.measure() as reading:
        out = conv(block, feat)
        out_bytes = tensor_bytes(out)
        out.sum().backward()
    assert out_bytes == n_dst * hidden * 4
    assert reading.peak_bytes - reading.baseline_bytes >= out_bytes
    # the parameter gradients were allocated by the backward and are still alive
    assert reading.end_bytes - reading.baseline_bytes == module_bytes(conv, grads=False) + out_bytes


def _k_sweep_peaks(ks, n_nodes=6000, n_edges=60000, width=256, hidden=8, fanout=10):
    """Max-over-micro-batches peak of a 1-layer SAGE step for each K (range split)."""
    import dgl
    from dgl.nn import SAGEConv

    from betty.microbatch import split
    from betty.partition import partition_batch
    from betty.sampling import sample_full_batch

    dgl.seed(0)
    torch.manual_seed(0)
    graph = dgl.rand_graph(n_nodes, n_edges)
    feat = torch.randn(n_nodes, width)
    full = sample_full_batch(graph, torch.arange(0, n_nodes, 10), [fanout], seed=0)
    conv = SAGEConv(width, hidden, "mean")
    meter = MemoryMeter("cpu")
    meter.track(conv)

    def step(mb):
        blocks = mb.to_blocks("cpu")
        h = feat[mb.input_nid]
        conv(blocks[0], h).sum().backward()

    result = {}
    for k in ks:
        micro = split(full, partition_batch(full, k, method="range").groups, k)
        readings = []
        for mb in micro:
            with meter.measure() as reading:
                step(mb)
            readings.append(reading)
            # the gathered features are saved for fc_neigh's weight gradient, so the
            # region must have held them at once
            assert reading.region_peak_bytes >= mb.input_nid.numel() * width * 4
        result[k] = max(r.peak_bytes for r in readings)
    return result


@pytest.mark.dgl
def test_peak_per_micro_batch_decreases_with_k():
    peaks = _k_sweep_peaks((1, 2, 4))
    assert peaks[1] > peaks[2] > peaks[4]


# --------------------------------------------------------------------------- CUDA (hardware)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_backend_matches_dispatch_on_a_scripted_sequence():
    device = torch.device("cuda")

    def script():
        a = torch.empty(4 * MB, dtype=torch.uint8, device=device)
        b = torch.empty(4 * MB, dtype=torch.uint8, device=device)
        del a
        c = torch.empty(8 * MB, dtype=torch.uint8, device=device)
        return b, c

    cuda_meter = MemoryMeter(device)
    assert cuda_meter.backend == "cuda"
    with cuda_meter.measure() as on_cuda:
        kept = script()
    dispatch_meter = MemoryMeter(device, backend="dispatch")
    with dispatch_meter.measure() as by_dispatch:
        kept2 = script()
    assert on_cuda.peak_bytes - on_cuda.baseline_bytes == 12 * MB
    assert by_dispatch.peak_bytes == 12 * MB
    assert on_cuda.end_bytes - on_cuda.baseline_bytes == 12 * MB
    with cuda_meter.measure() as outer:
        x = torch.empty(2 * MB, dtype=torch.uint8, device=device)
        with cuda_meter.measure() as inner:
            y = torch.empty(6 * MB, dtype=torch.uint8, device=device)
            del y
        del x
    assert inner.peak_bytes - inner.baseline_bytes == 6 * MB
    assert outer.peak_bytes - outer.baseline_bytes == 8 * MB
    del kept, kept2
