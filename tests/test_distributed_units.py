"""The building blocks of betty.distributed: LPT assignment, gradient all-reduce with presence
flags, parameter checksums, several-machine launch (two launchers on 127.0.0.1)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from betty.distributed import lpt_assign, micro_batches_of_rank, parameter_checksum
from betty.distributed.launch import RankFailed, free_port, launch
from betty.train import max_relative_difference
from distributed_cases import case_name, dataset, rank_collective_checks, rank_raise_on, train_case

TESTS = Path(__file__).resolve().parent


def test_lpt_longest_first_to_least_loaded():
    assert lpt_assign([5, 4, 3, 3, 3], 2) == [[0, 3], [1, 2, 4]]
    assert lpt_assign([1, 1, 1], 3) == [[0], [1], [2]]
    assert lpt_assign([2.0], 3) == [[0], [], []]
    assert micro_batches_of_rank([5, 4, 3, 3, 3], 2, 1) == [1, 2, 4]
    gen = torch.Generator().manual_seed(0)
    costs = torch.rand(50, generator=gen).tolist()
    owned = lpt_assign(costs, 4)
    assert sorted(k for o in owned for k in o) == list(range(50))
    loads = [sum(costs[k] for k in o) for o in owned]
    assert max(loads) <= 4 / 3 * max(sum(costs) / 4, max(costs)) + 1e-12  # Graham's bound
    with pytest.raises(ValueError, match="world_size"):
        lpt_assign([1.0], 0)
    with pytest.raises(ValueError, match="rank must be in"):
        micro_batches_of_rank([1.0], 2, 2)


def test_default_backend_reduces_cpu_tensors_with_gloo_also_beside_cuda(monkeypatch):
    """NCCL reduces CUDA tensors only; the ranks also reduce CPU tensors (loss sums,
    checksums, gradients of a CPU run on a GPU machine), so CUDA adds NCCL beside gloo."""
    from betty.distributed import launch as launch_module

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert launch_module.default_backend() == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    backend = launch_module.default_backend()
    assert dict(part.split(":") for part in backend.split(",")) == {"cpu": "gloo", "cuda": "nccl"}
    assert backend in launch_module.BACKENDS  # what launch() accepts
    with pytest.raises(ValueError, match="backend must be one of 'gloo', 'nccl', 'cpu:gloo,cuda:nccl'"):
        launch(print, nproc=1, backend="mpi")


def test_a_data_parallel_subgroup_agrees_without_the_other_ranks():
    """A DataParallel over a subgroup: its ranks agree on the subgroup's first rank's
    value; a rank outside it takes no part (and is not waited for)."""
    from distributed_cases import rank_subgroup_agree

    assert launch(rank_subgroup_agree, nproc=3) == {0: None, 1: "from rank 1", 2: "from rank 1"}


def test_fit_on_a_data_parallel_subgroup_gathers_and_agrees_within_it():
    """The epoch's per-rank figures are gathered and the early-stopping decision agreed
    over the trainer's subgroup, not the default group (whose third rank is elsewhere)."""
    from distributed_cases import rank_subgroup_fit

    assert launch(rank_subgroup_fit, nproc=3) == {0: None, 1: ([2.0, 2.0], [0, 1]), 2: None}


def test_launch_keeps_the_callers_signal_handlers_and_a_ctrl_c_is_a_keyboard_interrupt():
    """torch elastic installs its own SIGINT/SIGTERM handlers and left them: a later
    Ctrl-C was its SignalException, and one during a launch too, not the
    KeyboardInterrupt the workflow ends its runs KILLED on."""
    import signal

    from distributed_cases import rank_interrupt_launcher

    def mine(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt("the caller's handler")

    previous = {sig: signal.signal(sig, mine) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert launch(rank_raise_on, (-1,), nproc=1) == {0: 0}
        assert signal.getsignal(signal.SIGINT) is mine and signal.getsignal(signal.SIGTERM) is mine
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt, match="signal SIGINT"):
            launch(rank_interrupt_launcher, nproc=1)
        assert time.monotonic() - start < 50  # the rank was stopped, not waited for
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_checksum_sees_one_ulp():
    a = torch.tensor([1.0, 2.0], dtype=torch.float64)
    b = a.clone()
    b[1] = torch.nextafter(b[1], torch.tensor(3.0, dtype=torch.float64))
    assert parameter_checksum([a]) == parameter_checksum([a.clone()])
    assert parameter_checksum([a]) != parameter_checksum([b])


def test_allreduce_sums_keeps_absent_gradients_and_names_diverged_rank():
    out = launch(rank_collective_checks, nproc=2)
    for rank in (0, 1):
        got = out[rank]
        assert torch.equal(got["weight"], torch.full((2, 3), 3.0, dtype=torch.float64))
        assert torch.equal(got["bias"], torch.full((2,), 0.5, dtype=torch.float64))
        assert got["unused"] is None  # no rank produced one: the optimizer must skip it
        assert got["buckets"] == 2 and got["bytes"] == (6 + 1 + 6 + 2) * 8
        assert "rank(s) [1] differ from rank 0" in got["divergence"]


def test_data_parallel_state_does_not_grow_with_the_steps():
    """A long run takes millions of steps: the object keeps the latest step and running
    totals, not a record per step."""
    from distributed_cases import rank_state_after_steps

    out = launch(rank_state_after_steps, (20,), nproc=1)[0]
    assert out["held_after_all"] == out["held_after_one"]
    assert out["steps"] == 20 and out["indices"] == [0, 1]
    assert out["step_bytes"] > 0 and out["reduce_bytes"] == 20 * out["step_bytes"]


@pytest.mark.parametrize("failing", [-1, 1])
def test_launch_leaves_no_files_behind(temp_in_tmp_path, failing):
    """The launcher's per-rank files go to a folder that launch removes, whether the
    ranks succeed or one fails (its error still reaches the caller)."""
    tmp_path = temp_in_tmp_path
    if failing < 0:
        assert launch(rank_raise_on, (failing,), nproc=2) == {0: 0, 1: 1}
    else:
        with pytest.raises(RankFailed, match="rank 1 failed: RuntimeError: rank 1 gave up on purpose"):
            launch(rank_raise_on, (failing,), nproc=2)
    left = {p.name for p in tmp_path.iterdir() if not p.name.startswith("torchinductor_")}  # torch's compile cache
    if failing >= 0:  # newer torch.multiprocessing keeps a failed process's pickled error, a file of its own
        left = {name for name in left if not name.startswith("pytorch-errorfile-")}
    assert left == set()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_a_sigkilled_launchers_rank_folder_is_reclaimed_by_the_next_launch(temp_in_tmp_path):
    """A launcher killed by SIGKILL cannot remove its folder of per-rank files; it is named
    after the launcher, and the next launch removes it once that process is gone."""
    tmp_path = temp_in_tmp_path
    ready = tmp_path / "rank-started"
    code = ("import sys\n"
            f"sys.path.insert(0, {str(TESTS)!r})\n"
            "from betty.distributed.launch import launch\n"
            "from distributed_cases import rank_mark_then_wait\n"
            f"launch(rank_mark_then_wait, ({str(ready)!r},), nproc=1)\n")
    launcher = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.1)
        assert ready.exists(), "the rank did not start"
    finally:
        launcher.kill()
        launcher.wait()
    stale = [p for p in tmp_path.iterdir() if p.name.startswith(".ranks.betty-")]
    assert len(stale) == 1 and stale[0].is_dir()  # SIGKILL: nothing could remove it
    assert launch(rank_raise_on, (-1,), nproc=1) == {0: 0}
    assert not stale[0].exists()


def _machine_script(module: str, fn: str, args: tuple, port: int, join_timeout_s: int) -> str:
    """A script that runs ``launch(module.fn, args)`` as machine ``sys.argv[1]`` of two
    (one rank each, rendezvous at 127.0.0.1:``port``) and pickles its result to
    ``sys.argv[2]``."""
    return ("import pickle, sys\n"
            f"sys.path.insert(0, {str(TESTS)!r})\n"
            "from betty.distributed.launch import launch\n"
            f"from {module} import {fn}\n"
            f"res = launch({fn}, {args!r}, nproc=1, nnodes=2, node_rank=int(sys.argv[1]),\n"
            f"             rdzv_endpoint='127.0.0.1:{port}', run_id={'m-' + uuid.uuid4().hex[:8]!r},\n"
            f"             join_timeout_s={join_timeout_s})\n"
            "pickle.dump(res, open(sys.argv[2], 'wb'))\n")


def _start_machine(script: str, machine: int, folder: Path) -> subprocess.Popen:
    """:func:`_machine_script`'s ``script`` as ``machine``, its result in ``folder/node<machine>.pkl``."""
    return subprocess.Popen([sys.executable, "-c", script, str(machine), str(folder / f"node{machine}.pkl")])


@contextmanager
def _reaped(procs: list[subprocess.Popen]):
    """Kill whatever of ``procs`` still runs when the block ends."""
    try:
        yield
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_two_machines_on_localhost_equal_single_process(tmp_path):
    """Two launchers with nnodes=2 (one rank each) meet through the rendezvous; machine
    i holds global rank i even when machine 1 joins first. A second launch runs every
    trainer exactness case (``test_exactness_trainer``: each rank's update against the
    full-batch reference) across the two machines."""
    case = ("sage", "mean", 4)
    script = _machine_script("test_distributed_units", "rank_case_and_exactness", (case,), free_port(), 60)
    procs = []
    with _reaped(procs):
        for i in (1, 0):  # machine 1 first: the rank order must not follow who came first
            procs.append(_start_machine(script, i, tmp_path))
            time.sleep(3)
        codes = [p.wait(timeout=240) for p in procs]
    assert codes == [0, 0]
    results, checked = {}, {}
    for i in (0, 1):
        mine = pickle.loads((tmp_path / f"node{i}.pkl").read_bytes())
        assert sorted(mine) == [i]
        results[i], checked[i] = mine[i]
    from betty.backends import resolve_backend
    from test_exactness_trainer import CASES, runs_on

    names = [c.name for c in CASES if runs_on(resolve_backend("auto"), c)]
    assert names and checked == {0: names, 1: names}
    assert sorted(results) == [0, 1]
    ref = train_case(dataset(), *case)
    name = case_name(*case)
    for rank in (0, 1):
        got = results[rank][name]
        params = {n: t for n, t in ref.items() if not n.startswith("_")}
        assert max_relative_difference({n: got[n] for n in params}, params) < 1e-10
    assert sorted(results[0][name]["_indices"].tolist() + results[1][name]["_indices"].tolist()) == [0, 1, 2, 3]


def test_a_machine_that_meets_a_closing_store_joins_the_next_one(tmp_path):
    """Machine 1 reaches the endpoint while a store of an earlier launch still listens
    there and is closed under it (node 0 ending the previous repeat): it joins node 0's
    new store instead of failing with ``DistNetworkError``, and both machines run."""
    import datetime

    import torch.distributed as dist

    port = free_port()
    script = _machine_script("distributed_cases", "rank_raise_on", (-1,), port, 30)
    earlier = dist.TCPStore("127.0.0.1", port, 2, True, datetime.timedelta(seconds=60), wait_for_workers=False)
    keys = earlier.num_keys()
    procs = []
    with _reaped(procs):
        node1 = _start_machine(script, 1, tmp_path)
        procs.append(node1)
        deadline = time.monotonic() + 120
        while earlier.num_keys() <= keys and time.monotonic() < deadline and node1.poll() is None:
            time.sleep(0.1)  # machine 1 has written its part of the rendezvous there
        assert earlier.num_keys() > keys, "machine 1 never reached the earlier store"
        del earlier  # closed: machine 1's connection breaks
        procs.append(_start_machine(script, 0, tmp_path))
        codes = [p.wait(timeout=240) for p in procs]
    assert codes == [0, 0]
    for i in (0, 1):
        assert pickle.loads((tmp_path / f"node{i}.pkl").read_bytes()) == {i: i}


def rank_case_and_exactness(case: tuple) -> tuple[dict, list[str]]:
    """On one rank: :func:`distributed_cases.rank_all_cases` of ``case``, then every
    trainer exactness case (:func:`test_exactness_trainer.rank_check_cases`) on the
    ``auto`` backend."""
    from betty.backends import resolve_backend
    from distributed_cases import rank_all_cases
    from test_exactness_trainer import rank_check_cases

    return rank_all_cases([case]), rank_check_cases(resolve_backend("auto"))


def _listening_addresses(process) -> set[str]:
    """The local addresses ``process`` and its descendants listen on (TCP)."""
    import psutil

    out = set()
    for p in [process, *process.children(recursive=True)]:
        try:
            conns = p.net_connections(kind="inet") if hasattr(p, "net_connections") else p.connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out.update(c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN)
    return out


def test_one_machine_job_listens_on_loopback_only():
    """The rendezvous store, the ranks' group store and gloo's sockets of a one-machine
    launch all listen on 127.0.0.1, never on every interface."""
    import threading

    import psutil

    from distributed_cases import rank_sum_then_wait

    seen: set[str] = set()
    done = threading.Event()

    def watch() -> None:
        me = psutil.Process()
        while not done.is_set():
            seen.update(_listening_addresses(me))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out = launch(rank_sum_then_wait, (2.0,), nproc=2)
    finally:
        done.set()
        watcher.join(5)
    assert out == {0: [3.0] * 3, 1: [3.0] * 3}
    assert seen and seen <= {"127.0.0.1", "::1"}, seen
