"""Preparation threads: the parallel map, and the steps that use it giving the
one-thread result bit for bit."""

from __future__ import annotations

import threading

import pytest
import torch

from betty import workers
from betty.partition.membership import micro_batch_membership
from betty.sampling import sample_full_batch
from betty.train import carve_all, carve_micro_batches
from graphs import power_law_graph


@pytest.fixture
def restore_workers():
    yield
    workers.set_prep_workers("auto")


def _batch(seed: int = 0):
    g, *_, train = power_law_graph(num_nodes=4000, avg_degree=8, num_feats=4, num_classes=3, seed=seed)
    return sample_full_batch(g, train, [5, 4, 6], seed=seed)


def test_parallel_map_keeps_the_order_and_uses_the_threads(restore_workers):
    barrier = threading.Barrier(3, timeout=10)  # passes only if 3 parts run at once

    def part(i: int) -> tuple[int, str]:
        barrier.wait()
        return i * i, threading.current_thread().name

    out = workers.parallel_map(part, [1, 2, 3], workers=3)
    assert [v for v, _ in out] == [1, 4, 9]
    assert all(name.startswith(workers.POOL_THREAD_PREFIX) for _, name in out)
    assert workers.parallel_map(lambda i: threading.current_thread().name, [1, 2], workers=1) == \
        [threading.current_thread().name] * 2


def test_parallel_map_raises_a_part_error_after_every_part(restore_workers):
    done = []

    def part(i: int) -> int:
        if i == 1:
            raise KeyError("part one")
        done.append(i)
        return i

    with pytest.raises(KeyError, match="part one"):
        workers.parallel_map(part, [0, 1, 2, 3], workers=2)
    assert sorted(done) == [0, 2, 3]


def test_an_interrupt_while_waiting_drops_the_parts_not_started(restore_workers):
    """Ctrl-C in the caller: the queued parts are cancelled, not run to the end."""
    import _thread
    import time

    ran = []

    def part(i: int) -> int:
        time.sleep(0.1)
        ran.append(i)
        return i

    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # not another test's handler
    try:
        timer = threading.Timer(0.15, _thread.interrupt_main)
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            workers.parallel_map(part, list(range(40)), workers=2)
    finally:
        signal.signal(signal.SIGINT, previous)
    time.sleep(0.4)  # the parts running at the interrupt finish; no others start
    assert len(ran) <= 8


def test_a_nested_map_runs_in_its_part_thread(restore_workers):
    def outer(i: int) -> list[str]:
        return workers.parallel_map(lambda j: threading.current_thread().name, [0, 1], workers=2)

    for names in workers.parallel_map(outer, [0, 1], workers=2):
        assert len(set(names)) == 1 and names[0].startswith(workers.POOL_THREAD_PREFIX)


def test_the_preparation_thread_maps_on_the_pool(restore_workers):
    """A map called from the trainer's preparation thread (prefetch >= 1,
    :mod:`betty.pipeline`) runs its parts on the pool, not serially in that thread."""
    from betty.pipeline import preparation

    barrier = threading.Barrier(3, timeout=10)  # passes only if the 3 parts run at once

    def part(j: int) -> str:
        barrier.wait()
        return threading.current_thread().name

    def prepare(i: int) -> list[str]:
        return workers.parallel_map(part, [0, 1, 2], workers=3)

    with preparation([0], prepare, 1) as source:
        names = [item for _, item in source][0]
    assert len(set(names)) == 3 and all(name.startswith(workers.POOL_THREAD_PREFIX) for name in names), names


@pytest.mark.parametrize("count", [0, -1, 1.5, "two", True])
def test_set_prep_workers_rejects(count):
    with pytest.raises(ValueError, match="prep_workers"):
        workers.set_prep_workers(count)


def test_spare_cores_is_what_the_trainer_leaves(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert workers.spare_cores(2, cores=8) == 6
    assert workers.spare_cores(8, cores=8) == 1
    # shared among this machine's ranks: 3 ranks of 2 threads on 8 cores leave 2, not enough for 3
    assert workers.spare_cores(2, cores=12, ranks=3) == 2 and workers.spare_cores(2, cores=8, ranks=3) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert workers.spare_cores(2, cores=8) == 2


@pytest.mark.parametrize("k", [3, 8])
def test_membership_on_several_threads_is_the_one_thread_membership(k, restore_workers):
    groups = torch.arange(_batch().num_outputs) % k
    workers.set_prep_workers(1)
    serial = micro_batch_membership(_batch(), groups, k)
    workers.set_prep_workers(3)
    threaded = micro_batch_membership(_batch(), groups, k)
    for a, b in zip(serial, threaded):
        assert a.shape == b.shape
        assert (a.indptr == b.indptr).all() and (a.indices == b.indices).all() and (a.data == b.data).all()


def _same_layers(a, b) -> None:
    for x, y in zip(a.layers, b.layers):
        assert x.num_dst == y.num_dst
        for name in ("src_nid", "edge_src", "edge_dst", "edge_id", "src_out_degree"):
            assert torch.equal(getattr(x, name), getattr(y, name)), name
    for x, y in zip(a.full_src_index, b.full_src_index):
        assert torch.equal(x, y)


def test_carving_on_several_threads_is_the_serial_carve(restore_workers):
    batch = _batch(seed=1)
    k = 6
    groups = torch.randint(0, k, (batch.num_outputs,), generator=torch.Generator().manual_seed(0))
    groups[:k] = torch.arange(k)
    serial = list(carve_micro_batches(batch, groups, k, indices={0, 2, 3, 5}))
    workers.set_prep_workers(4)
    for _ in range(5):  # micro-batches carved at once on 4 threads, several times
        threaded = carve_all(batch, groups, k, indices={0, 2, 3, 5})
        assert [p for p, _, _ in threaded] == [p for p, _, _ in serial] == [0, 2, 3, 5]
        for (_, a, _), (_, b, _) in zip(serial, threaded):
            _same_layers(a, b)


def test_configure_threads_sizes_torch_and_the_preparation_threads(monkeypatch):
    import torch

    from betty import workers

    before_threads, before_count = torch.get_num_threads(), workers._count
    monkeypatch.setattr("betty.threads.available_cores", lambda *a: 6)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    try:
        assert workers.configure_threads(2, 3) == 2
        assert torch.get_num_threads() == 2 and workers.prep_workers() == 3
        assert workers.configure_threads(None, "auto") is None  # torch's pool left alone
        assert torch.get_num_threads() == 2 and workers.prep_workers() == 4  # 6 cores - 2 threads
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        workers.configure_threads(1, "auto")  # two ranks of 1 thread on 6 cores: 2 each
        assert workers.prep_workers() == 2
        torch.set_num_threads(2)  # read at each use: two ranks of 2 threads on 6 cores leave 1 each
        assert workers.prep_workers() == 1
    finally:
        torch.set_num_threads(before_threads)
        workers.set_prep_workers(before_count)
