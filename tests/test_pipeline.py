"""Preparation ahead of the step: the prefetcher's order, bound, errors and stop, and a
pipelined Trainer that trains exactly as the serial one, bit for bit."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from betty.engine import PartitionPlan, Trainer
from betty.memory.meter import MemoryMeter
from betty.models import build_model
from betty.pipeline import Inline, Prefetcher
from distributed_cases import CLASSES, FEATS, assert_same_training, dataset
from graphs import backend_params

pytestmark = pytest.mark.usefixtures("one_thread")  # bit-for-bit comparisons


def _prepare_threads(within_s: float = 5.0) -> list[threading.Thread]:
    """The preparation threads still alive ``within_s`` seconds from now at the latest
    (a thread left on an error ends on its own once its item is done)."""
    deadline = time.monotonic() + within_s
    while True:
        alive = [t for t in threading.enumerate() if t.name == "betty-prepare"]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.01)


# -- the prefetcher ------------------------------------------------------------------

def test_results_come_in_order_and_at_most_depth_ahead():
    made, taken, ahead = [], [], []

    def prepare(i):
        made.append(i)
        ahead.append(len(made) - len(taken))  # made but not yet released by the consumer
        return i * i

    with Prefetcher(range(12), prepare, depth=2, size=lambda r: 10) as source:
        for item, result in source:
            assert result == item * item
            time.sleep(0.01)  # let the thread run as far ahead as it may
            taken.append(item)
        peak = source.peak_bytes
    assert taken == list(range(12))
    # the consumer holds one result and releases it on asking for the next: with it,
    # at most depth + 1 are alive
    assert max(ahead) <= 3
    assert max(ahead) == 3  # and the thread does run ahead
    assert peak == 30


def test_an_error_in_prepare_reaches_the_consumer_after_the_items_before_it():
    def prepare(i):
        if i == 3:
            raise KeyError("no such batch")
        return i

    got = []
    with pytest.raises(KeyError, match="no such batch"):
        for item, _ in Prefetcher(range(6), prepare, depth=2):
            got.append(item)
    assert got == [0, 1, 2]
    assert not _prepare_threads()


@pytest.mark.parametrize("source", [Prefetcher, Inline])
def test_a_stop_iteration_in_prepare_is_an_error_not_the_end(source):
    """Raised where the consumer iterates, a StopIteration would end its loop as if the
    items were done, silently dropping the rest."""
    def prepare(i):
        if i == 2:
            next(iter([]))
        return i

    got = []
    with pytest.raises(RuntimeError, match="prepare raised StopIteration"):
        for item, _ in source(range(5), prepare):
            got.append(item)
    assert got == [0, 1]
    assert not _prepare_threads()


def test_a_prefetcher_dropped_without_close_is_collected_and_its_thread_stops():
    """Its thread holds the preparation state only, so dropping the last reference (a
    loop left early without ``with``) stops the thread instead of leaving it polling with
    depth + 1 results alive."""
    import gc
    import weakref

    source = Prefetcher(range(100), lambda i: i, depth=2)
    for item, _ in source:
        if item == 1:
            break
    gone = weakref.ref(source)
    del source
    gc.collect()
    assert gone() is None
    assert not _prepare_threads()


def test_leaving_early_stops_the_thread_and_prepares_nothing_more():
    made = []
    source = Prefetcher(range(1000), lambda i: made.append(i) or i, depth=1)
    for item, _ in source:
        if item == 2:
            break
    source.close()
    count = len(made)
    assert not _prepare_threads(within_s=0)  # close() waited for it
    assert count <= 4  # items 0-2, and at most the one ahead
    time.sleep(0.05)
    assert len(made) == count


@pytest.mark.parametrize("depth", [1, 3])
def test_closing_with_finish_allowed_prepares_exactly_what_the_consumer_allowed(depth):
    """``finish_allowed``: after the consumer took items 0-2 and closed, the thread has
    prepared items 0 to 2 + depth, however slow each one is (each would be a
    collective call on a data-parallel rank: every rank must make as many)."""
    made = []

    def slow(i):
        time.sleep(0.02)  # the consumer closes while the thread is still behind
        made.append(i)
        return i

    source = Prefetcher(range(1000), slow, depth=depth, finish_allowed=True)
    for item, _ in source:
        if item == 2:
            break
    source.close()
    assert made == list(range(3 + depth)) and not _prepare_threads(within_s=0)


def test_an_error_in_the_consumer_leaves_no_thread_behind():
    with pytest.raises(RuntimeError):
        with Prefetcher(range(100), lambda i: i, depth=3) as source:
            for item, _ in source:
                if item == 1:
                    raise RuntimeError("the step failed")
    assert not _prepare_threads()


@pytest.mark.parametrize("depth", [0, -1, 1.5, True])
def test_depth_must_be_a_positive_integer(depth):
    with pytest.raises(ValueError, match="depth"):
        Prefetcher([1], lambda i: i, depth=depth)


def test_an_interrupt_stops_after_the_item_being_prepared_and_leaves_no_thread():
    """Ctrl-C while the thread is in a long preparation: the KeyboardInterrupt reaches
    the consumer, the stop waits for that one item (the thread drops it) and no thread
    is left running when the interrupt propagates."""
    import os
    import signal

    release = threading.Event()
    made = []

    def prepare(i):
        if i == 1:
            release.wait(30)  # a long partitioner call
        made.append(i)
        return i

    # Python's own handler: another test's launcher (torch elastic) may have left its own
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    got = []
    try:
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        threading.Timer(1.0, release.set).start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            with Prefetcher(range(5), prepare, depth=1) as source:
                for item, _ in source:
                    got.append(item)
                    time.sleep(0.01)
        assert time.monotonic() - start < 5
        assert not _prepare_threads(within_s=0)  # stopped before the interrupt went on
    finally:
        signal.signal(signal.SIGINT, previous)
        release.set()
    assert got == [0] and made == [0, 1]  # item 1 finished, dropped, nothing after it


def test_inline_prepares_in_the_callers_thread_and_times_it():
    threads = []

    def prepare(i):
        threads.append(threading.current_thread())
        time.sleep(0.02)
        return i

    source = Inline(range(3), prepare)
    assert [r for _, r in source] == [0, 1, 2]
    assert threads == [threading.current_thread()] * 3
    assert source.wait_s >= 0.06 and source.peak_bytes == 0


# -- the pipelined trainer -----------------------------------------------------------


def trainer_case(prefetch: int, backend: str = "auto", batch_size=None, plan=None, meter=False,
                 arch: str = "sage", aggregator: str = "mean", gather_ahead=None, sample_device=None):
    """A seeded 2-layer model (dropout 0.5) and its Trainer on the test graph (``reg``
    K = 3 reused for 2 epochs unless ``plan``), with the CPU meter when ``meter``."""
    torch.manual_seed(0)
    model = build_model(arch, FEATS, CLASSES, hidden=8, layers=2, aggregator=aggregator, heads=2,
                        dropout=0.5, backend=backend)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    m = None
    if meter:
        m = MemoryMeter("cpu")
        m.track(model, opt)
    trainer = Trainer(model, opt, dataset(), [4, 6], plan or PartitionPlan("reg", 3, reuse=2), seed=1,
                      batch_size=batch_size, prefetch=prefetch, meter=m, gather_ahead=gather_ahead,
                      sample_device=sample_device)
    return trainer, model


def _run(prefetch: int, epochs: int = 4, **kwargs):
    trainer, model = trainer_case(prefetch, **kwargs)
    records = list(trainer.epochs(range(epochs)))
    return {n: p.detach().clone() for n, p in model.named_parameters()}, records


@pytest.fixture
def prep_workers(request):
    """``betty.workers``' preparation threads for the test (the parameter), reset after."""
    from betty import workers

    workers.set_prep_workers(request.param)
    yield request.param
    workers.set_prep_workers("auto")


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("batch_size", [None, 50])
@pytest.mark.parametrize("arch,aggregator", [("sage", "mean"), ("gat", None)])
@pytest.mark.parametrize("prep_workers", [1, 3], indirect=True)
def test_pipelined_training_equals_serial_bit_for_bit(backend, batch_size, arch, aggregator, prep_workers):
    """Serial on one preparation thread against pipelined on ``prep_workers`` (the
    membership product and the carving split over threads)."""
    from betty import workers

    workers.set_prep_workers(1)
    serial, serial_records = _run(0, backend=backend, batch_size=batch_size, arch=arch,
                                  aggregator=aggregator or "mean")
    workers.set_prep_workers(prep_workers)
    piped, piped_records = _run(2, backend=backend, batch_size=batch_size, arch=arch,
                                aggregator=aggregator or "mean")
    assert_same_training(serial, serial_records, piped, piped_records)
    for a, b in zip(serial_records, piped_records):
        assert [x.repartitioned for x in a.batches] == [x.repartitioned for x in b.batches]
        assert a.prefetch_bytes == 0 and b.prefetch_bytes > 0


def test_a_last_batch_smaller_than_k_gets_one_micro_batch_per_output():
    """A fixed K above the epoch's last, smaller batch: that batch is split into one
    micro-batch per output node, and every step is still the full-batch (K = 1) step."""
    from betty.train import max_relative_difference

    last = 3  # outputs in the last batch, below K = 4
    size = dataset().train_idx.numel() - last

    def run(k: int):
        trainer, model = trainer_case(0, batch_size=size, plan=PartitionPlan("random", k))
        model.double()
        trainer.dtype = torch.float64
        records = list(trainer.epochs(range(2)))
        return {n: p.detach().clone() for n, p in model.named_parameters()}, records

    split, records = run(4)
    assert [sorted(len(b.micro) for b in r.batches) for r in records] == [[last, 4]] * 2  # batch order shuffles
    whole, _ = run(1)
    assert max_relative_difference(split, whole) < 1e-10


def test_sampling_on_the_cpu_device_path_trains_as_the_host_sampler_bit_for_bit(monkeypatch):
    """``sample_device="cpu"``: the torch-op sampler, whose CPU batch is the host
    sampler's, gives the same updates and records."""
    import betty.engine

    host, host_records = _run(0, epochs=2)
    devices = []
    sampler = betty.engine.sample_full_batch

    def recording(*args, device=None, **kwargs):
        devices.append(device)
        return sampler(*args, device=device, **kwargs)

    monkeypatch.setattr(betty.engine, "sample_full_batch", recording)
    trainer, model = trainer_case(0)
    trainer.sample_device = torch.device("cpu")
    records = list(trainer.epochs(range(2)))
    assert devices and set(devices) == {torch.device("cpu")}
    for name, value in model.named_parameters():
        assert torch.equal(value.detach(), host[name]), name
    for a, b in zip(host_records, records):
        assert a.loss == b.loss and a.train_acc == b.train_acc


def test_pipelined_k_search_and_measured_peaks_equal_serial():
    """K from the memory model (a budget), the estimate logged beside the measurement:
    the preparation thread's allocations are not the step's, so every measured and
    estimated peak is the serial run's."""
    plan = PartitionPlan("reg", "auto", reuse=2, memory_budget=3 * 2**20)
    serial, a_records = _run(0, plan=plan, meter=True, batch_size=50)
    piped, b_records = _run(1, plan=plan, meter=True, batch_size=50)
    for name, value in serial.items():
        assert torch.equal(value, piped[name]), name
    for a, b in zip(a_records, b_records):
        assert [m.peak_bytes for x in a.batches for m in x.micro] == \
               [m.peak_bytes for x in b.batches for m in x.micro]
        assert [x.micro_estimated_bytes for x in a.batches] == [x.micro_estimated_bytes for x in b.batches]
        assert a.k == b.k


def test_the_next_batch_is_prepared_while_the_step_runs():
    trainer, _ = trainer_case(1, batch_size=50)
    overlapped = []
    real_prepare, real_step = trainer.prepare, trainer.train_prepared
    stepping = threading.Event()

    def prepare(*args, **kwargs):
        # after the first, each batch is prepared while the loop takes the one before it
        # and starts its step (which lasts at least 0.3 s): wait for that step to show
        overlapped.append(stepping.wait(timeout=10) if overlapped else stepping.is_set())
        return real_prepare(*args, **kwargs)

    def step(prepared):
        stepping.set()
        time.sleep(0.3)  # longer than a preparation
        try:
            return real_step(prepared)
        finally:
            stepping.clear()

    trainer.prepare, trainer.train_prepared = prepare, step
    records = list(trainer.epochs(range(2)))
    # the first is made before any step; every later one while a step runs, across
    # the epoch boundary too
    assert overlapped == [False] + [True] * 5
    assert all(r.time_wait_s < 0.5 * r.epoch_time_s for r in records[1:])


def test_a_failing_preparation_fails_the_run_and_leaves_no_thread():
    trainer, _ = trainer_case(1, batch_size=50)
    real = trainer.sample

    def sample(epoch, batch_index=0, **kwargs):
        if epoch == 1 and batch_index == trainer.batch_order(1)[1]:
            raise OSError("feature file vanished")
        return real(epoch, batch_index, **kwargs)

    trainer.sample = sample
    done = []
    with pytest.raises(OSError, match="feature file vanished"):
        for record in trainer.epochs(range(3)):
            done.append(record.epoch)
    assert done == [0]
    assert not _prepare_threads()


def test_breaking_out_of_the_epochs_stops_the_preparation():
    trainer, _ = trainer_case(1, batch_size=50)
    for record in trainer.epochs(range(50)):
        break
    assert record.epoch == 0
    assert not _prepare_threads()


@pytest.mark.parametrize("prefetch", [-1, 1.0, True])
def test_prefetch_must_be_a_non_negative_integer(prefetch):
    with pytest.raises(ValueError, match="prefetch"):
        trainer_case(prefetch)


# -- RevGNN's cluster parts ------------------------------------------------------------

def _rev_run(prefetch: int, backend: str, plan, epochs: int = 4, meter: bool = True):
    from betty.rev.engine import RevTrainer

    torch.manual_seed(0)
    model = build_model("revgnn", FEATS, CLASSES, hidden=8, layers=3, dropout=0.3, backend=backend)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    m = None
    if meter:
        m = MemoryMeter("cpu")
        m.track(model, opt)
    trainer = RevTrainer(model, opt, dataset(), plan, seed=1, meter=m, prefetch=prefetch)
    records = list(trainer.epochs(range(epochs)))
    return {n: p.detach().clone() for n, p in model.named_parameters()}, records


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("method", ["random", "auto"])
def test_pipelined_revgnn_parts_train_as_serial_bit_for_bit(backend, method):
    """Random clusters (a fresh split drawn each epoch, on the preparation thread) and
    the K search: the same parts, updates and measured peaks as serially."""
    from betty.rev.engine import RevPlan

    plan = RevPlan("random", 3) if method == "random" else RevPlan("random", "auto", memory_budget=100_000)
    serial, a_records = _rev_run(0, backend, plan)
    piped, b_records = _rev_run(1, backend, plan)
    for name, value in serial.items():
        assert torch.equal(value, piped[name]), name
    for a, b in zip(a_records, b_records):
        assert a.loss == b.loss and a.k == b.k and a.repartitioned == b.repartitioned
        assert [p.peak_bytes for p in a.parts] == [p.peak_bytes for p in b.parts]
        assert [p.estimated_bytes for p in a.parts] == [p.estimated_bytes for p in b.parts]
    assert all(r.k > 1 for r in b_records)  # the search split the graph
    assert "time_wait_s" in b_records[-1].metrics()
    assert not _prepare_threads()


def test_a_batch_carved_ahead_estimates_from_its_micro_batches_not_the_membership(monkeypatch):
    """Carving ahead in one process, a batch's memory estimate and redundancy are read
    off the carved micro-batches, fresh (fixed K) and reused alike: no membership product, and
    the same estimates, redundancy and micro-batches as the membership path."""
    import betty.partition.membership as membership

    built = []
    original = membership.micro_batch_membership
    monkeypatch.setattr(membership, "micro_batch_membership",
                        lambda *a, **kw: built.append(a[2]) or original(*a, **kw))
    ahead, _ = trainer_case(1)
    behind, _ = trainer_case(1)
    for epoch in range(3):  # fresh, reused, reused (reuse=2: epoch 2 is fresh again)
        carved = ahead.prepare(epoch, 0, carve=True)
        assert built == []
        plain = behind.prepare(epoch, 0, carve=False)
        assert len(built) == 1
        built.clear()
        assert carved.fresh == plain.fresh == (epoch != 1)
        assert carved.estimates == plain.estimates and carved.estimates
        assert carved.redundancy == plain.redundancy
        assert torch.equal(carved.partition.groups, plain.partition.groups)
        assert [p for p, _, _ in carved.micro_batches] == list(range(carved.partition.k))


@pytest.mark.parametrize("backend", backend_params())
def test_features_gathered_ahead_train_as_serial_bit_for_bit(backend):
    """``gather_ahead`` (an accelerator's default, forced here on the CPU): each prepared
    micro-batch carries ``feat[input_nid]``, the step copies those rows instead of
    gathering, releases them, and the updates are the serial run's, with dropout."""
    serial, serial_records = _run(0, backend=backend, batch_size=50)
    trainer, model = trainer_case(1, backend=backend, batch_size=50, gather_ahead=True)
    assert trainer.gather_ahead
    prepared = trainer.prepare(0, 0, carve=True)
    feat = trainer.dataset.feat
    assert prepared.micro_batches
    for _, mb, _ in prepared.micro_batches:
        assert torch.equal(mb.input_features, feat[mb.input_nid])
    mbs = [mb for _, mb, _ in prepared.micro_batches]
    bare = trainer_case(1, backend=backend, batch_size=50)[0].prepare(0, 0, carve=True).nbytes
    assert prepared.nbytes == bare + sum(mb.input_features.nbytes for mb in mbs)  # counted
    assert prepared.time_gather_s > 0
    trainer.train_prepared(prepared)
    assert all(mb.input_features is None for mb in mbs)  # released by the step
    trainer, model = trainer_case(1, backend=backend, batch_size=50, gather_ahead=True)
    records = list(trainer.epochs(range(4)))
    for name, value in serial.items():
        assert torch.equal(value, model.state_dict()[name]), name
    for a, b in zip(serial_records, records):
        assert a.loss == b.loss and a.train_acc == b.train_acc
        assert b.prefetch_bytes > bare


def test_gather_ahead_is_the_default_only_for_an_accelerator_and_needs_prefetch():
    assert not trainer_case(1)[0].gather_ahead  # the CPU: the step gathers, the memory model counts it
    assert not trainer_case(0)[0].gather_ahead
    with pytest.raises(ValueError, match="gather_ahead=True .* prefetch >= 1"):
        trainer_case(0, gather_ahead=True)


@pytest.mark.parametrize("method", ["reg", "reg-all", "hypergraph", "metis"])
def test_a_prepared_batch_keeps_nothing_its_split_was_cut_from(method):
    """The REG and the incidences (the size of an edge list per output pair) are dropped
    once the split is made, not held while the batch waits and trains."""
    from betty.partition.base import CUT_STRUCTURES

    def trainer():
        torch.manual_seed(0)
        model = build_model("sage", FEATS, CLASSES, hidden=8, layers=2)
        return Trainer(model, torch.optim.Adam(model.parameters()), dataset(), [4, 6],
                       PartitionPlan(method, "auto", memory_budget=1 << 30), seed=1)

    cut = trainer()
    batch = cut.sample(0, 0)
    cut.partition(batch, 0, 0)  # the cut (a K search with reg, then the method) leaves its structures ...
    assert {key[0] for key in batch._derived} & set(CUT_STRUCTURES)
    trainer = trainer()
    prepared = trainer.prepare(0, 0, carve=True)  # ... which a prepared batch does not keep
    assert {key[0] for key in prepared.batch._derived}.isdisjoint(CUT_STRUCTURES)
    assert prepared.batch._derived and set(prepared.batch._slots.values()) <= set(prepared.batch._derived)
    trainer.train_prepared(prepared)
