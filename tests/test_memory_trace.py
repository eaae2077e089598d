"""The allocation recorder (betty.memory.trace) against known op sequences and the meter."""

import torch

from betty.memory import MemoryMeter
from betty.memory.trace import AllocationTrace
from betty.precision import Precision


def test_records_allocations_and_frees_in_order():
    a = torch.ones(256, 256)  # before the region: not recorded
    with AllocationTrace() as trace:
        b = a @ a            # 256 KiB
        c = b + 1            # 256 KiB
        del b
        d = c.view(-1)       # a view: no allocation
        c.add_(1)            # in place: no allocation
        e = torch.cat([c, c])  # 512 KiB
        del c, d, e
    kinds = [(ev.kind, ev.op_name, ev.nbytes) for ev in trace.events]
    n = 256 * 256 * 4
    assert kinds == [("alloc", "mm", n), ("alloc", "add", n), ("free", "mm", n),
                     ("alloc", "cat", 2 * n), ("free", "add", n), ("free", "cat", 2 * n)]
    assert trace.live_bytes() == [n, 2 * n, n, 3 * n, 2 * n, 0]
    assert trace.peak_bytes() == 3 * n


def test_peak_equals_the_meters_region_peak():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    x = torch.randn(300, 64)
    model(x).sum().backward()  # .grad exists: the backward accumulates into it
    meter = MemoryMeter("cpu")
    meter.track(model)
    with meter.measure() as reading, AllocationTrace() as trace:
        torch.nn.functional.cross_entropy(model(x), torch.zeros(300, dtype=torch.long)).backward()
    assert trace.peak_bytes() == reading.region_peak_bytes > 0


def test_autocast_casts_are_recorded_with_their_dtype():
    lin = torch.nn.Linear(32, 16)
    x = torch.randn(100, 32)
    with AllocationTrace() as trace:
        with Precision.parse("bf16-mixed").autocast("cpu"):
            y = lin(x)
    assert y.dtype == torch.bfloat16
    allocs = [(ev.op_name, ev.dtype, ev.nbytes) for ev in trace.allocations()]
    # the input, the weight and the bias cast to bfloat16, then the bfloat16 product
    assert ("_to_copy", "torch.bfloat16", 100 * 32 * 2) in allocs
    assert ("_to_copy", "torch.bfloat16", 16 * 32 * 2) in allocs
    assert allocs[-1] == ("addmm", "torch.bfloat16", 100 * 16 * 2)


def test_storage_resize_outside_the_dispatcher_is_recorded_beside_the_meter():
    """``untyped_storage().resize_`` (how a reversible block frees its input and rebuilds
    it) is a resize event of the storage, also with a meter region open inside the
    trace (both hear it, and the original method is back once both have closed)."""
    original = torch.UntypedStorage.resize_
    n = 1 << 20
    meter = MemoryMeter("cpu")
    with AllocationTrace() as trace:
        with meter.measure() as reading:
            t = torch.empty(n, dtype=torch.uint8)
            t.untyped_storage().resize_(0)
            u = torch.empty(n, dtype=torch.uint8)
            t.untyped_storage().resize_(2 * n)
        del t, u
    assert [(e.kind, e.op, e.nbytes) for e in trace.events] == [
        ("alloc", "aten.empty.memory_format", n), ("resize", "UntypedStorage.resize_", 0),
        ("alloc", "aten.empty.memory_format", n), ("resize", "UntypedStorage.resize_", 2 * n),
        ("free", "aten.empty.memory_format", 2 * n), ("free", "aten.empty.memory_format", n)]
    assert trace.live_bytes() == [n, 0, n, 3 * n, n, 0]
    assert reading.peak_bytes == 3 * n and reading.end_bytes == 3 * n
    assert torch.UntypedStorage.resize_ is original
