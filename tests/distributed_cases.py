"""Training cases run both in one process and on several ranks (importable by spawned
ranks: keep them module-level)."""

from __future__ import annotations

import time

import torch

FEATS, CLASSES, STEPS, DROPOUT = 12, 5, 3, 0.5
KS = (3, 4, 7)
CASES = [(arch, agg, k) for arch, agg in [("sage", "mean"), ("sage", "lstm"), ("gat", None), ("revgnn", None)]
         for k in KS]
"""Cases on the default backend ("auto": DGL where it imports; RevGNN runs on DGL only)."""
PYG_CASES = [(arch, agg, k, "pyg") for arch, agg in [("sage", "mean"), ("sage", "lstm"), ("gat", None)]
             for k in KS]
"""The same sampled-block cases on the PyG backend (no DGL needed)."""


def case_name(arch: str, agg: str | None, k: int, backend: str = "auto") -> str:
    return f"{arch}{'-' + agg if agg else ''}-k{k}{'' if backend == 'auto' else '-' + backend}"


def dataset(num_nodes: int = 240):
    """A small power-law graph as a GraphDataset (half the nodes train)."""
    from betty.data.types import GraphDataset
    from graphs import power_law_graph

    g, feat, label, train = power_law_graph(num_nodes=num_nodes, avg_degree=6, seed=0,
                                            num_feats=FEATS, num_classes=CLASSES)
    rest = torch.tensor(sorted(set(range(num_nodes)) - set(train.tolist())), dtype=torch.int64)
    return GraphDataset(name="dist-test", graph=g, feat=feat, label=label, train_idx=train,
                        valid_idx=rest[: len(rest) // 2], test_idx=rest[len(rest) // 2:],
                        num_classes=CLASSES)


def train_case(ds, arch: str, agg: str | None, k: int, backend: str = "auto", parallel=None,
               steps: int = STEPS, dtype: torch.dtype = torch.float64,
               prefetch: int = 0, method: str = "random") -> dict[str, torch.Tensor]:
    """Parameters after ``steps`` optimizer steps of K-way training (float64, dropout 0.5)
    with the model on ``backend`` (``"auto"``, ``"dgl"`` or ``"pyg"``); ``prefetch``:
    the sampled-batch :class:`betty.engine.Trainer`'s (RevGNN trains serially), a batch
    prepared ahead also gathering its features ahead (``gather_ahead``, an
    accelerator's path)."""
    from betty.engine import PartitionPlan, Trainer
    from betty.models import build_model

    torch.manual_seed(0)
    if arch == "revgnn":
        from betty.rev.engine import RevPlan, RevTrainer  # DGL only

        model = build_model("revgnn", FEATS, CLASSES, hidden=8, layers=3, dropout=DROPOUT).to(dtype)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        trainer = RevTrainer(model, opt, ds, RevPlan("random", k), seed=1, dtype=dtype,
                             estimate_memory=False, parallel=parallel)
    else:
        model = build_model(arch, FEATS, CLASSES, hidden=8, layers=2, aggregator=agg or "mean",
                            heads=2, dropout=DROPOUT, attn_dropout=DROPOUT / 2, backend=backend).to(dtype)
        assert backend == "auto" or model.backend_name == backend
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        trainer = Trainer(model, opt, ds, [4, 6], PartitionPlan(method, k), seed=1, dtype=dtype,
                          estimate_memory=False, parallel=parallel, prefetch=prefetch,
                          gather_ahead=bool(prefetch))
    losses = [record.loss for record in trainer.epochs(range(steps))]
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    state["_losses"] = torch.tensor(losses, dtype=torch.float64)
    return state


def rank_all_cases(cases=None, shared=None, prefetch: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """On one rank: every case with a :class:`betty.distributed.DataParallel` (checksum
    every step), plus the micro-batches this rank ran in its last step. ``shared``: a
    :class:`betty.distributed.shared.SharedDataset` to map instead of building the
    dataset (the shared files this process maps come back under ``"_files"``);
    ``prefetch``: :func:`train_case`'s."""
    from betty.distributed import DataParallel

    ds = dataset() if shared is None else shared.attach()
    out = {}
    if shared is not None:
        with open("/proc/self/maps") as fh:
            out["_files"] = sorted({line.split()[-1] for line in fh if shared.folder in line})
    for case in cases or CASES:
        dp = DataParallel(check_every=1)
        out[case_name(*case)] = train_case(ds, *case, parallel=dp, prefetch=prefetch)
        out[case_name(*case)]["_indices"] = torch.tensor(dp.last_step.indices)
    return out


PER_PROCESS = "per-process"


def per_process_partition(batch, k: int, *, seed: int = 0, weights=None, graph=None):
    """A split that differs between processes, as a multi-threaded or time-limited
    partitioner's may: rank r > 0 draws with another seed than rank 0 (one process: rank 0's)."""
    import torch.distributed as dist

    from betty.partition.baselines import random_partition

    rank = dist.get_rank() if dist.is_initialized() else 0
    return random_partition(batch, k, seed=seed + 7919 * rank)


def registered_per_process():
    """A context manager: :func:`per_process_partition` registered as :data:`PER_PROCESS`."""
    import contextlib

    from betty.partition.base import PARTITION_OPTIONS, PARTITIONERS, register

    @contextlib.contextmanager
    def registered():
        register(PER_PROCESS)(per_process_partition)
        try:
            yield
        finally:
            PARTITIONERS.pop(PER_PROCESS, None)
            PARTITION_OPTIONS.pop(PER_PROCESS, None)

    return registered()


def rank_per_process_split(k: int, prefetch: int) -> dict[str, torch.Tensor]:
    """On one rank: the sage-mean case split by :func:`per_process_partition`."""
    from betty.distributed import DataParallel

    with registered_per_process():
        return train_case(dataset(), "sage", "mean", k, parallel=DataParallel(check_every=1),
                          prefetch=prefetch, method=PER_PROCESS)


SLOW = "slow-random"
SLOW_SPLIT_S, SLOW_VALIDATE_S = 0.3, 0.6


def slow_partition(batch, k: int, *, seed: int = 0, weights=None, graph=None):
    """A random split that takes :data:`SLOW_SPLIT_S` (a partitioner slower than a step)."""
    from betty.partition.baselines import random_partition

    time.sleep(SLOW_SPLIT_S)
    return random_partition(batch, k, seed=seed)


def fit_while_splitting(parallel=None, prefetch: int = 0, epochs: int = 2) -> list[float] | None:
    """:func:`betty.fit.fit` of the sage-mean case (K=2) re-split every epoch by
    :func:`slow_partition` while rank 0 validates for :data:`SLOW_VALIDATE_S` after every
    epoch: with ``prefetch`` the next epoch's split is agreed on a preparation thread
    while the ranks agree whether to stop. Returns rank 0's epoch losses (``None`` elsewhere)."""
    from betty.engine import PartitionPlan, Trainer
    from betty.fit import fit
    from betty.models import build_model
    from betty.partition.base import PARTITION_OPTIONS, PARTITIONERS, register
    from betty.selection import BestValidation

    def validate(epoch: int, k: int) -> dict[str, float]:
        time.sleep(SLOW_VALIDATE_S)
        return {"valid_acc": 0.5}

    register(SLOW)(slow_partition)
    try:
        torch.manual_seed(0)
        model = build_model("sage", FEATS, CLASSES, hidden=8, layers=2).double()
        trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), dataset(), [4, 6],
                          PartitionPlan(SLOW, 2, reuse=1), seed=1, dtype=torch.float64,
                          estimate_memory=False, parallel=parallel, prefetch=prefetch)
        result = fit(trainer, epochs, validate=validate, every=1, selector=BestValidation("last", 5),
                     score_key="valid_acc")
    finally:
        PARTITIONERS.pop(SLOW, None)
        PARTITION_OPTIONS.pop(SLOW, None)
    return None if result is None else [entry["loss"] for entry in result.history]


def rank_fit_while_splitting() -> list[float] | None:
    """On one rank: :func:`fit_while_splitting` with the split prepared ahead; a rank
    still at it after a minute (agreements paired across ranks deadlock) exits with its
    stack on stderr, and the launch fails instead of hanging."""
    import faulthandler

    from betty.distributed import DataParallel

    faulthandler.dump_traceback_later(60, exit=True)
    try:
        return fit_while_splitting(DataParallel(), prefetch=1)
    finally:
        faulthandler.cancel_dump_traceback_later()


def rank_fit_best_valid(arch: str) -> tuple[int, int]:
    """On one rank: :func:`betty.fit.fit` with ``best_valid`` and patience 1, rank 0's
    validation scores falling after epoch 0 (so epoch 0's weights are the best and epoch
    1 stops). Returns ``(checksum of the weights after fit, checksum of epoch 0's)``."""
    from betty.distributed import DataParallel
    from betty.distributed.collective import parameter_checksum
    from betty.engine import PartitionPlan, Trainer
    from betty.fit import fit
    from betty.models import build_model
    from betty.rev.engine import RevPlan, RevTrainer
    from betty.selection import BestValidation

    torch.manual_seed(0)
    model = build_model(arch, FEATS, CLASSES, hidden=8, layers=2).double()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    common = dict(seed=1, dtype=torch.float64, estimate_memory=False, parallel=DataParallel())
    trainer = (Trainer(model, optimizer, dataset(), [4, 6], PartitionPlan("random", 2), **common)
               if arch == "sage" else RevTrainer(model, optimizer, dataset(), RevPlan("random", 2), **common))
    before = {}  # the weights each epoch starts from: those after the epoch before

    def remember(epoch: int) -> None:
        before[epoch] = parameter_checksum(model.parameters())

    fit(trainer, 5, validate=lambda epoch, k: {"valid_acc": 0.9 - 0.1 * epoch}, every=1,
        selector=BestValidation("best_valid", 1), score_key="valid_acc", before_epoch=remember)
    return parameter_checksum(model.parameters()), before[1]


def scaled_gradient_trainer(scale: float):
    """``(trainer, model)`` of the sage-mean case (Adam, float64, K from the caller) whose
    all-reduced gradients are multiplied by ``scale`` on the ranks (in a process with
    ``torch.distributed`` initialised; elsewhere untouched): a fault that Adam's first
    update, about ``lr · sign(g)``, all but hides."""
    import torch.distributed as dist

    import betty.distributed.parallel as parallel_module
    from betty.engine import PartitionPlan, Trainer
    from betty.models import build_model

    if dist.is_initialized() and not hasattr(parallel_module.allreduce_gradients, "scale"):
        real = parallel_module.allreduce_gradients

        def scaled(params, *args, **kwargs):
            stats = real(params, *args, **kwargs)
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
            return stats

        scaled.scale = scale
        parallel_module.allreduce_gradients = scaled
    torch.manual_seed(0)
    model = build_model("sage", FEATS, CLASSES, hidden=8, layers=2, dropout=DROPOUT).double()
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), dataset(), [4, 6],
                      PartitionPlan("random", 1), seed=1, dtype=torch.float64, estimate_memory=False)
    return trainer, model


def rank_subgroup_agree() -> object:
    """On one of 3 ranks: ranks 1 and 2 form a subgroup with a DataParallel of their own
    (rank 0 takes no part in it) and agree on rank 1's value."""
    import torch.distributed as dist

    from betty.distributed import DataParallel

    sub = dist.new_group(ranks=[1, 2])  # every rank of the default group, as new_group requires
    if dist.get_rank() == 0:
        return None
    return DataParallel(group=sub).agree(f"from rank {dist.get_rank()}")


def rank_subgroup_fit() -> object:
    """On one of 3 ranks: ranks 1 and 2 train two epochs through :func:`betty.fit.fit` on a
    DataParallel over their subgroup (per-rank figures gathered, validation every epoch,
    early stopping agreed), rank 0 takes no part. Returns the subgroup's rank-0 epoch
    metrics' ``world_size`` and the ranks in its rows; ``None`` on the other ranks."""
    import torch.distributed as dist

    from betty.distributed import DataParallel
    from betty.engine import PartitionPlan, Trainer
    from betty.fit import fit
    from betty.models import build_model
    from betty.selection import BestValidation

    sub = dist.new_group(ranks=[1, 2])
    if dist.get_rank() == 0:
        return None
    torch.manual_seed(0)
    model = build_model("sage", FEATS, CLASSES, hidden=8, layers=2).double()
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), dataset(), [4, 6],
                      PartitionPlan("random", 2), seed=1, dtype=torch.float64, estimate_memory=False,
                      parallel=DataParallel(group=sub))
    result = fit(trainer, 2, validate=lambda epoch, k: {"valid_acc": 0.5}, every=1,
                 selector=BestValidation("last", 5), score_key="valid_acc")
    if result is None:
        return None
    return [entry["world_size"] for entry in result.history], sorted({row["rank"] for row in result.rows})


def rev_auto_case(parallel=None) -> tuple[int, list[float], bool]:
    """RevGNN with ``k: auto`` and a budget the whole graph fits, two epochs (one process
    with ``parallel=None``): ``(K, losses, whether a rank was warned to have no part)``."""
    import warnings

    from betty.models import build_model
    from betty.rev.engine import RevPlan, RevTrainer

    torch.manual_seed(0)
    model = build_model("revgnn", FEATS, CLASSES, hidden=8, layers=3, dropout=DROPOUT).double()
    trainer = RevTrainer(model, torch.optim.Adam(model.parameters(), lr=0.01), dataset(),
                         RevPlan("random", "auto", memory_budget=2**30), seed=1, dtype=torch.float64,
                         parallel=parallel)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [record.loss for record in trainer.epochs(range(2))]
    return trainer.k, losses, any("have no part" in str(w.message) for w in caught)


def rank_rev_auto() -> tuple[int, list[float], bool]:
    """:func:`rev_auto_case` on this rank of a :class:`betty.distributed.DataParallel`."""
    from betty.distributed import DataParallel

    return rev_auto_case(DataParallel())


def rank_distdgl_cases(folder: str, cases, pipelined=()) -> dict[str, dict[str, torch.Tensor]]:
    """On one DistDGL trainer: join the graph servers of the partitioning at ``folder``
    and train every case of ``cases`` with a :class:`betty.distributed.DataParallel` on
    the partitioned dataset, and those of ``pipelined`` with ``prefetch=1`` too (named
    ``<case>-pipelined``), then leave the servers."""
    from betty.backends.distdgl import connect, read_layout
    from betty.distributed import DataParallel

    ds = connect(read_layout(folder))
    out = {case_name(*case): train_case(ds, *case, parallel=DataParallel()) for case in cases}
    for case in pipelined:
        out[case_name(*case) + "-pipelined"] = train_case(ds, *case, parallel=DataParallel(), prefetch=1)
    ds.close()
    return out


def graph_server_pids(marker: str) -> list[int]:
    """PIDs of the live DistDGL graph server processes whose command line holds
    ``marker`` (a test's own IP configuration path)."""
    import os
    from pathlib import Path

    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "betty.backends.distdgl.server" in cmd and marker in cmd:
            found.append(int(pid))
    return found


def rank_join_and_wait(folder: str, seconds: float) -> None:
    """Join the servers, then wait ``seconds`` before leaving: a trainer that waits for an
    answer that does not come (a server is killed meanwhile)."""
    from betty.backends.distdgl import connect, read_layout

    ds = connect(read_layout(folder))
    time.sleep(seconds)
    ds.close()


def rank_fail_on_one(folder: str) -> None:
    """Join the servers; rank 1 then raises, the others sample and wait for it."""
    import torch.distributed as dist

    from betty.backends.distdgl import connect, read_layout
    from betty.sampling import sample_full_batch

    ds = connect(read_layout(folder))
    if dist.get_rank() == 1:
        raise ValueError("trainer 1 gave up")
    sample_full_batch(ds.graph, ds.train_idx, [4, 6], seed=0)
    dist.barrier()  # rank 1 never gets here
    ds.close()


def rank_raise_on(failing: int) -> int:
    """This rank's number; rank ``failing`` raises instead (-1: none does)."""
    import torch.distributed as dist

    if dist.get_rank() == failing:
        raise RuntimeError(f"rank {failing} gave up on purpose")
    return dist.get_rank()


def rank_mark_then_wait(path: str) -> None:
    """Create ``path`` (the rank is running), then wait to be stopped."""
    open(path, "w").close()
    time.sleep(300)


def rank_interrupt_launcher() -> None:
    """Send SIGINT to the launching process (this rank's parent), as a Ctrl-C in its
    terminal would, then wait to be stopped."""
    import os
    import signal

    os.kill(os.getppid(), signal.SIGINT)
    time.sleep(60)


def rank_collective_checks() -> dict:
    """On one rank: gradient sum with presence flags, then a forced divergence."""
    import torch.distributed as dist

    from betty.distributed import ParameterDivergence, allreduce_gradients, check_parameters_in_sync

    rank = dist.get_rank()
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2).double()
    unused = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    params = [layer.weight, layer.bias, unused]
    layer.weight.grad = torch.full_like(layer.weight, float(rank + 1))
    if rank == 1:
        layer.bias.grad = torch.full_like(layer.bias, 0.5)
    stats = allreduce_gradients(params, bucket_bytes=48)  # weight alone, then bias + unused
    out = {"weight": layer.weight.grad.clone(), "bias": None if layer.bias.grad is None else layer.bias.grad.clone(),
           "unused": unused.grad, "buckets": stats.buckets, "bytes": stats.bytes}
    check_parameters_in_sync(params, step=1)  # still identical
    if rank == 1:
        with torch.no_grad():
            layer.weight[0, 0] += 1e-12
    try:
        check_parameters_in_sync(params, step=2)
        out["divergence"] = None
    except ParameterDivergence as exc:
        out["divergence"] = str(exc)
    return out


def rank_state_after_steps(steps: int = 20) -> dict:
    """On one rank: a :class:`betty.distributed.DataParallel`'s state after 1 step and
    after ``steps`` (the sizes of its containers, its running all-reduce totals) and the
    bytes of one step's all-reduce."""
    from betty.distributed import DataParallel

    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2).double()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    dp = DataParallel(check_every=1)

    def run(mine):
        for _ in mine:
            layer(torch.ones(4, 3, dtype=torch.float64)).sum().backward()

    def held() -> int:  # entries in the containers the object holds
        return sum(len(v) for v in vars(dp).values() if isinstance(v, (list, dict, tuple, set)))

    out = {}
    for step in range(steps):
        dp.step(layer, opt, [1.0, 1.0], run)
        if step == 0:
            out["held_after_one"] = held()
    out.update(held_after_all=held(), steps=dp.steps, reduce_bytes=dp.reduce_bytes,
               step_bytes=dp.last_step.reduce.bytes, indices=dp.last_step.indices)
    return out


def rank_sum_then_wait(wait_s: float = 2.0) -> list[float]:
    """One all-reduce (sum of rank + 1), then ``wait_s`` seconds with the group up, so a
    test can look at what the job listens on."""
    import time

    import torch.distributed as dist

    t = torch.ones(3) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    time.sleep(wait_s)
    return t.tolist()


def rank_found_inf() -> bool:
    """The loss scaler's overflow flag on one rank when only rank 1's gradient holds an
    inf: every rank must report True (the flag is agreed over the ranks)."""
    import torch.distributed as dist

    from betty.precision import LossScaler

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 4.0)
    if dist.get_rank() == 1:
        p.grad[1] = float("inf")  # only rank 1 overflowed
    return LossScaler(init_scale=4.0).unscale([p], all_ranks=True)


def assert_same_training(reference: dict[str, torch.Tensor], ref_records, params: dict[str, torch.Tensor],
                         records) -> None:
    """Two runs of a sampled-block Trainer trained bit for bit alike: the same parameters
    (``name -> tensor``), and epoch by epoch the same loss, accuracy, K and every
    micro-batch's input count."""
    assert reference.keys() == params.keys()
    for name, value in reference.items():
        assert torch.equal(value, params[name]), name
    assert len(ref_records) == len(records)
    for a, b in zip(ref_records, records):
        assert a.loss == b.loss and a.train_acc == b.train_acc and a.k == b.k
        assert [m.num_inputs for x in a.batches for m in x.micro] == \
               [m.num_inputs for x in b.batches for m in x.micro]
