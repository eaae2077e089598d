"""Op sequences that both symbolic replays model alike: :mod:`betty.memory.replay` (one
sampled micro-batch) and :mod:`betty.rev.replay` (one RevGNN part).

Each function records, on a :class:`~betty.memory.timeline.Timeline`, the tensors one
stretch of PyTorch / PyG / DGL ops allocates and frees, in the order they do. Sizes are
bytes, scalars or ``(P,)`` per-micro-batch vectors (every micro-batch of a split is replayed at
once). A function here is written once and called by both replayers; where the two
replays model different op sequences they keep their own code (see their modules).

Kept apart because the code paths differ:

* **loss inputs**: the sampled replay's loss runs on every output row, next to labels
  that live for the whole batch; RevGNN's on the part's training rows
  (``output[train]``, ``labels[train]``, released by the loss's backward, then an
  ``index_put`` back into ``(N, C)`` zeros). The multi-label loss itself is shared
  (:func:`bce_forward`, :func:`bce_backward`);
* **dropout**: the sampled layers drop each layer's input (hash dropout's chunked
  SplitMix64, or a standard mask); RevGNN draws two ``(N, D)`` multipliers per forward;
* **optimizer step**: only RevGNN's replay includes it (the sampled replay covers one
  micro-batch; the step follows the last one, :func:`betty.memory.estimator.step_bytes`);
  both size its temporaries by :func:`step_temporaries`;
* **GAT scores and products**: the same ops (``el = (z * attn_l).sum(-1)``, likewise
  ``er``; PyG's message product ``z[src] * a``), in the recorder's order in both
  replays: ``z * attn_l`` is freed once ``el`` exists, and the backwards of the score
  products and of PyG's message product compute the other factor's gradient first.

Labels: each shared op has one name in both replays' traces (the names reach
``MemoryEstimate.peak_at``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from betty.memory.spec import OptimizerSpec
from betty.memory.timeline import Buffer, Timeline

__all__ = ["StepConfig", "itemsize", "numel", "step_baseline", "optimizer_state_size", "step_groups",
           "step_foreach", "step_temporaries", "param_grads", "through", "edge_softmax_backward",
           "pyg_softmax_forward", "pyg_softmax_backward", "pyg_edge_scores", "pyg_edge_scores_backward",
           "index_backward", "pyg_scatter_mean", "hash_words", "hash_chunk_rows", "bce_forward", "bce_backward",
           "multilabel_correct", "INDEX_BYTES", "FLOAT32_BYTES", "PARAMS", "GRADS", "OPT", "FEATS",
           "LABELS", "DROP", "ACT", "ATT", "LOSS", "BWD"]

INDEX_BYTES = 8  # int64 indices, node IDs, degrees, class labels
FLOAT32_BYTES = 4  # what autocast computes losses in

# components of the breakdown both replays report
PARAMS, GRADS, OPT = "parameters", "gradients", "optimizer_state"
DEVICE_STORE, CARVED = "device_store", "carved"
NEXT_INPUTS = "next_inputs"
FEATS, LABELS, DROP = "features", "labels", "dropout"
ACT, ATT, LOSS, BWD = "activations", "attention", "loss", "activation_gradients"


@dataclass(kw_only=True)
class StepConfig:
    """What a replayed training step needs besides the model and the sizes (keyword
    arguments of both replays' configs).

    Attributes:
        optimizer: which optimizer state exists (it is assumed to exist: the steady
            state after the first step).
        elt: bytes per element of the compute dtype (features after the cast,
            activations, parameters of a RevGNN).
        feat_elt: bytes per element of the host feature matrix.
        fresh_grads: ``(P,)`` bools: the micro-batch starts with no ``.grad`` (the first micro-batch
            after ``zero_grad(set_to_none=True)``), so its backward creates them.
        label_columns: T for multi-label targets (0: single-label int64 classes).
        label_elt: bytes per element of multi-label targets.
        autocast_elt: bytes per element of autocast's compute dtype when the forward
            pass and loss run under ``torch.autocast`` (a mixed precision: 2 for
            bfloat16 / float16), 0 when there is no autocast.
        host: the measured device is the host: Adam's 0-d ``step`` tensors are counted,
            Adam runs single-tensor, standard dropout keeps a float noise tensor. On CUDA
            the steps stay on the host unless capturable/fused, Adam runs foreach and
            dropout keeps a bool mask.
        device_store: bytes preparation on the device keeps there through the step
            whatever the micro-batch (:mod:`betty.memory.device_preparation`: the store and
            the batch); 0 when preparation runs on the host.
        carved: ``(P,)`` bytes (or one for all) of each carved micro-batch on
            the device, beside its step; 0 when carving runs on the host.
        next_inputs: ``(P,)`` bytes (or one for all) of the inputs the step copies to
            the device for the micro-batch after micro-batch ``i`` while micro-batch ``i`` computes
            (copy-ahead, :func:`betty.train.accumulate_gradients`): allocated right after
            micro-batch ``i``'s own inputs and live to its end; 0 without copy-ahead.
    """

    optimizer: OptimizerSpec
    elt: int
    feat_elt: int
    fresh_grads: np.ndarray
    label_columns: int = 0
    label_elt: int = 4
    autocast_elt: int = 0
    host: bool = True
    device_store: float = 0.0
    carved: np.ndarray | float = 0.0
    next_inputs: np.ndarray | float = 0.0


def itemsize(dtype: torch.dtype, name: str) -> int:
    """Bytes per element of ``dtype``; ``name`` (the argument's name) goes into the
    ``TypeError`` when ``dtype`` is not a ``torch.dtype``."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {dtype!r}")
    return torch.empty((), dtype=dtype).element_size()


def numel(shape: Iterable[int]) -> int:
    """Number of elements of a tensor of ``shape`` (``1`` for ``()``)."""
    n = 1
    for s in shape:
        n *= int(s)
    return n


def step_baseline(tl: Timeline, cfg: StepConfig, param_bytes, num_params: int,
                  buffers=None, *, state: bool = True, grad_bytes=None) -> None:
    """What lives through the whole step: the parameters (``param_bytes`` in all, in
    ``num_params`` tensors) and the model's ``buffers`` (bytes, e.g. batch-norm running
    statistics; None: none), the optimizer state (``n_state · param_bytes``, plus a
    4-byte ``step`` per parameter where it is counted: on the host or on the device
    with capturable/fused Adam) and, in the micro-batches that do not start fresh, the
    existing ``.grad`` (``grad_bytes``, scalar or ``(P,)``; default ``param_bytes``: every
    parameter has one); with preparation on the device, its store and
    batch (``cfg.device_store``) and each carved micro-batch (``cfg.carved``).
    ``state=False``: the optimizer holds no state yet (before its first step)."""
    tl.add_baseline(param_bytes, PARAMS)
    if buffers is not None:
        tl.add_baseline(buffers, PARAMS)
    tl.add_baseline(optimizer_state_size(cfg, param_bytes, num_params) if state else 0.0, OPT)
    grad_bytes = param_bytes if grad_bytes is None else grad_bytes
    tl.add_baseline(np.where(np.asarray(cfg.fresh_grads, dtype=bool), 0.0, grad_bytes), GRADS)
    if cfg.device_store:
        tl.add_baseline(cfg.device_store, DEVICE_STORE)
    if np.any(cfg.carved):
        tl.add_baseline(cfg.carved, CARVED)


def optimizer_state_size(cfg: StepConfig, param_bytes, num_params: int):
    """Bytes of the optimizer state of parameters of ``param_bytes`` in ``num_params``
    tensors: ``n_state · param_bytes`` (:meth:`OptimizerSpec.state_tensors`), plus a
    4-byte ``step`` per parameter where it is counted (on the host, or on the device
    with capturable/fused Adam)."""
    n_state, has_step = cfg.optimizer.state_tensors()
    state = n_state * param_bytes
    if has_step and (cfg.host or cfg.optimizer.step_on_device):
        state += 4 * num_params
    return state


def step_groups(optimizer: OptimizerSpec, numels: Sequence[int]) -> tuple[tuple[tuple[int, ...], bool], ...]:
    """The parameter groups one ``optimizer.step()`` visits, in its order: per group the
    element counts of its parameters and whether weight decay is added to their
    gradients (``OptimizerSpec.groups``; a spec made by name: one group of ``numels``,
    the model's parameters in order, decayed where ``optimizer.decay``)."""
    if optimizer.groups is not None:
        return optimizer.groups
    return ((tuple(int(n) for n in numels), bool(optimizer.decay)),)


def step_foreach(optimizer: OptimizerSpec, host: bool) -> bool:
    """Whether the step runs multi-tensor (torch's default: on CUDA, not on the host)."""
    return optimizer.foreach if optimizer.foreach is not None else not host


def step_temporaries(optimizer: OptimizerSpec, numels: Sequence[int], elt: int, host: bool) -> int:
    """Peak bytes of the temporaries of one ``optimizer.step()`` over parameters of
    ``numels`` elements of ``elt`` bytes (beyond the parameters, gradients and state).
    The step updates one parameter group at a time (:func:`step_groups`) and frees a
    group's temporaries before the next; the peak is the largest group's. Measured on
    the host with torch 2.2 and 2.13 for a group's parameters of sizes ``s_1..s_P``
    (bytes, in the group's order; ``s_0 = 0``: a group starts with none), ``d`` = 1
    where the group adds weight decay to the gradient (Adam's, not AdamW's; SGD's),
    ``m`` = 1 with ``maximize`` (the negated gradient), ``n`` = 1 with SGD's
    ``nesterov`` (the gradient plus the momentum term):

    * Adam, one tensor at a time (the host's default): ``sqrt(v)`` and the denominator of
      parameter ``i`` beside the previous denominator, ``max_i (s_{i-1} + (2 + g) s_i)``
      with ``g = max(d, m)``: the gradient with decay added or negated (the two are
      never alive together beside the denominators);
    * Adam, multi-tensor (CUDA's default): one list of ``sqrt(v)``, ``Σ s_i``; with
      ``maximize`` the negated list, ``Σ s_i``, exists beside the 4-byte step increment
      on the host (the decayed list is freed before the square roots);
    * SGD, one tensor at a time: parameter ``i``'s gradient copies (``c = m + d + n`` of
      them, each freed once the next exists) peak at ``min(c, 2) s_i``; the last one
      stays until parameter ``i + 1`` rebinds it, which with ``maximize`` happens after
      its negation exists: ``m s_{i-1} + m s_i`` where parameter ``i - 1`` kept a copy
      (``c > 0``, unless momentum without Nesterov replaced it by the buffer);
    * SGD, multi-tensor: one list of the negated or decayed gradients, ``Σ s_i`` where
      ``max(d, m)`` (Nesterov adds in place)."""
    foreach = step_foreach(optimizer, host)
    m = int(optimizer.maximize)

    def group_bytes(sizes: list[int], decay: bool) -> int:
        if not sizes:
            return 0
        if optimizer.name == "adam":
            if foreach:
                return sum(sizes) + (4 if m and host and not optimizer.step_on_device else 0)
            g = max(int(decay), m)
            return max(sizes[i - 1] * (i > 0) + (2 + g) * sizes[i] for i in range(len(sizes)))
        if foreach:
            return sum(sizes) if decay or m else 0
        copies = m + int(decay) + int(optimizer.nesterov and optimizer.momentum > 0)
        kept = copies > 0 and not (optimizer.momentum > 0 and not optimizer.nesterov)
        return max(max(min(copies, 2) * sizes[i],
                       m * (sizes[i] + (sizes[i - 1] if kept and i > 0 else 0)))
                   for i in range(len(sizes)))

    groups = step_groups(optimizer, numels)
    return max((group_bytes([n * elt for n in group], decay) for group, decay in groups), default=0)


def param_grads(tl: Timeline, nbytes, keep, name: str, accumulated_name: str) -> None:
    """Parameter gradients (``nbytes``) one backward node produces, through
    ``AccumulateGrad``: where ``keep`` (``(P,)`` bools: the micro-batch has no ``.grad`` yet)
    the new gradient becomes ``.grad`` and stays; elsewhere it is added in place into
    the existing ``.grad`` and freed (a transient)."""
    tl.alloc(np.where(keep, nbytes, 0.0), GRADS, name)
    tl.temp(np.where(keep, 0.0, nbytes), GRADS, accumulated_name)


def through(tl: Timeline, component: str, tmp_bytes, tmp_name: str, out_bytes,
            out_name: str) -> Buffer:
    """``out = f(tmp)`` where nothing keeps ``tmp``: ``tmp`` is allocated, then ``out``,
    then ``tmp`` is freed (e.g. ``relu(fc(x))`` without autograd saving ``fc(x)``).
    Returns ``out``."""
    tmp = tl.alloc(tmp_bytes, component, tmp_name)
    out = tl.alloc(out_bytes, component, out_name)
    tl.release(tmp)
    return out


# ---------------------------------------------------------------------- attention
def edge_softmax_backward(tl: Timeline, ga: Buffer, att: Buffer, scores: Buffer, eh,
                          el_bytes, er_bytes, tag: str) -> tuple[Buffer, Buffer]:
    """Backward of DGL's GAT attention ``a = edge_softmax(leaky_relu(el[src] + er[dst]))``
    from the attention's ``(E, H)`` gradient ``ga`` (``eh`` bytes): ``edge_softmax``'s
    backward (``a · ga``, then ``a · (ga - sum_dst(a · ga))``: one transient and the
    logits' gradient; releases ``ga`` and the saved output ``att``), ``leaky_relu``'s
    (releases the saved input ``scores``), then ``u_add_v``'s two reductions: the
    gradients of ``el`` (``el_bytes``) and ``er`` (``er_bytes``). Returns ``(gel, ger)``."""
    t = tl.alloc(eh, BWD, f"{tag} softmax backward")
    gs = tl.alloc(eh, BWD, f"{tag} grad logits")
    tl.release(t, ga, att)
    gl = tl.alloc(eh, BWD, f"{tag} grad leaky_relu")
    tl.release(gs, scores)
    gel = tl.alloc(el_bytes, BWD, f"{tag} grad el")
    ger = tl.alloc(er_bytes, BWD, f"{tag} grad er")
    tl.release(gl)
    return gel, ger


def pyg_softmax_forward(tl: Timeline, n_h, eh, tag: str) -> tuple[Buffer, Buffer, Buffer]:
    """``torch_geometric.utils.softmax(x, dst)`` on ``(E, H)`` logits (``eh`` bytes;
    ``n_h``: bytes of an ``(N_dst, H)`` tensor) up to its last op: the per-destination
    max (``scatter_reduce_`` into zeros), ``max[dst]``, ``x - max[dst]``, ``exp`` (saves
    its result), the sum (``scatter_add_`` into zeros), ``+ 1e-16``, ``sum[dst]``.
    Returns ``(max, exp, denominators)``; the caller allocates the division ``exp /
    denominators`` (it saves both operands) and then lets go of ``max``."""
    mx = tl.alloc(n_h, ATT, f"{tag} softmax max")
    sub = through(tl, ATT, eh, f"{tag} softmax max[dst]", eh, f"{tag} softmax x - max")
    ex = tl.alloc(eh, ATT, f"{tag} softmax exp")
    tl.release(sub)
    s = through(tl, ATT, n_h, f"{tag} softmax sum", n_h, f"{tag} softmax sum + eps")
    den = tl.alloc(eh, ATT, f"{tag} softmax sum[dst]")
    tl.release(s)
    return mx, ex, den


def pyg_softmax_backward(tl: Timeline, ga: Buffer, ex: Buffer, den: Buffer, eh, n_h,
                         tag: str) -> Buffer:
    """Backward of :func:`pyg_softmax_forward` and its division from the attention's
    ``(E, H)`` gradient ``ga``: the division's (``ga / den``, ``/ den`` again, ``neg``,
    ``mul``: the denominators' gradient; then the numerator's ``ga / den``), ``sum[dst]``'s
    (zeros ``(N_dst, H)`` and ``index_add``), the scatter sum's (a gather back to the
    edges), the two gradients of ``exp``'s result summed, ``exp``'s ``mul``. Releases
    ``ga``, ``ex``, ``den``; returns the logits' gradient ``(E, H)`` (the max is
    detached)."""
    d1 = tl.alloc(eh, BWD, f"{tag} softmax grad / den")
    d2 = tl.alloc(eh, BWD, f"{tag} softmax grad / den / den")
    ng = tl.alloc(eh, BWD, f"{tag} softmax -grad")
    gden = tl.alloc(eh, BWD, f"{tag} grad den")
    tl.release(ng, d2, d1)
    gex = tl.alloc(eh, BWD, f"{tag} grad exp (division)")
    tl.release(ga, den)
    gs = index_backward(tl, gden, n_h, tag)  # sum[dst]'s backward
    gg = tl.alloc(eh, BWD, f"{tag} grad sum (gather)")
    tl.release(gs)
    gsum = tl.alloc(eh, BWD, f"{tag} grad exp")
    tl.release(gex, gg)
    gl = tl.alloc(eh, BWD, f"{tag} grad logits")
    tl.release(gsum, ex)
    return gl


def pyg_edge_scores(tl: Timeline, eh, tag: str) -> Buffer:
    """PyG GAT's ``el[src] + er[dst]``: two ``(E, H)`` gathers (``eh`` bytes each), their
    sum, the gathers go. Returns the sum, held once."""
    i1 = tl.alloc(eh, ATT, f"{tag} el[src]")
    i2 = tl.alloc(eh, ATT, f"{tag} er[dst]")
    scores = tl.alloc(eh, ATT, f"{tag} el[src] + er[dst]")
    tl.release(i1, i2)
    return scores


def index_backward(tl: Timeline, g_rows: Buffer | None, nbytes, tag: str) -> Buffer:
    """Backward of a gather ``x[index]`` (``x`` of ``nbytes``) from the gathered rows'
    gradient ``g_rows``: ``zeros_like(x)``, then the out-of-place
    ``index_put(accumulate=True)``; the zeros go, then ``g_rows`` (None: the caller lets
    go of it). Returns the ``x``-shaped gradient."""
    gi = through(tl, BWD, nbytes, f"{tag} index backward zeros", nbytes, f"{tag} index backward")
    if g_rows is not None:
        tl.release(g_rows)
    return gi


def pyg_edge_scores_backward(tl: Timeline, gl: Buffer, scores: Buffer, eh, el_bytes, er_bytes,
                             tag: str) -> tuple[Buffer, Buffer]:
    """Backward of ``leaky_relu(el[src] + er[dst])`` (:func:`pyg_edge_scores`) from the
    logits' ``(E, H)`` gradient ``gl``: ``leaky_relu``'s (releases ``gl`` and the saved
    input ``scores``), then the two gathers', ``er[dst]``'s first: each ``zeros``
    (``er_bytes``, ``el_bytes``) and an out-of-place ``index_put`` (the zeros go); the
    edge gradient goes last. Returns ``(gel, ger)``."""
    glr = tl.alloc(eh, BWD, f"{tag} grad leaky_relu")
    tl.release(gl, scores)
    ger = index_backward(tl, None, er_bytes, tag)
    gel = index_backward(tl, None, el_bytes, tag)
    tl.release(glr)
    return gel, ger


# ---------------------------------------------------------------------- aggregation
def pyg_scatter_mean(tl: Timeline, component: str, n_e, n_dst, width: int, elt: int,
                     tag: str) -> tuple[Buffer, Buffer]:
    """PyG's ``scatter(x[src], dst, reduce='mean')`` over ``n_e`` edges into ``n_dst``
    rows of ``width`` (``elt`` bytes per element): the gathered ``(E, width)`` messages,
    the counts (``zeros`` ``(N_dst,)``, ``scatter_add_`` of an ``(E,)`` ``ones``, a clamped
    copy), the sum (``scatter_add_`` into zeros), the division; the messages and the
    sum go. Returns ``(counts, mean)``, each held once (the division saves the counts
    where its input needs a gradient)."""
    msg = tl.alloc(n_e * width * elt, component, f"{tag} messages")
    c0 = tl.alloc(n_dst * elt, component, f"{tag} count zeros")
    tl.temp(n_e * elt, component, f"{tag} count ones")
    counts = tl.alloc(n_dst * elt, component, f"{tag} count clamp")
    tl.release(c0)
    z = tl.alloc(n_dst * width * elt, component, f"{tag} sum")
    mean = tl.alloc(n_dst * width * elt, component, f"{tag} mean")
    tl.release(msg, z)
    return counts, mean


def hash_words(tl: Timeline, n, width: int, component: str, tag: str) -> tuple[Buffer, Buffer]:
    """The SplitMix64 words of hash dropout (``betty.models.dropout._row_col_words``): of
    the ``(n,)`` row IDs three int64 vectors alive at once, one kept, then the
    ``(width,)`` column words. Returns ``(rows, cols)``, for the caller to release once
    the keep-mask is made."""
    rows = tl.alloc(n * INDEX_BYTES, component, f"{tag} row words")
    tl.release(tl.alloc(n * INDEX_BYTES, component, f"{tag} mix"), tl.alloc(n * INDEX_BYTES, component, f"{tag} mix"))
    return rows, tl.alloc(width * INDEX_BYTES, component, f"{tag} column words")


def hash_chunk_rows(n, width: int):
    """Rows of one chunk of hash dropout's int64 scratch (``betty.models.dropout``:
    ``CHUNK_ELEMENTS`` elements, at most ``n`` rows)."""
    from betty.models.dropout import CHUNK_ELEMENTS

    return np.minimum(n, max(1, CHUNK_ELEMENTS // max(width, 1)))


def bce_forward(tl: Timeline, labels: Buffer, rows, tasks: int, elt: int, label_elt: int,
                autocast_elt: int = 0) -> list[Buffer]:
    """Multi-label loss of :func:`betty.train.node_loss_sum`:
    ``binary_cross_entropy_with_logits(logits, target.to(logits.dtype),
    reduction="none").mean(1).sum()`` on ``(rows, tasks)`` logits of ``elt`` bytes and
    targets of ``label_elt`` bytes (``labels``).

    ``target.to`` copies the targets where their dtype differs from the logits' (told
    apart by bytes per element). ``autocast_elt``: the logits are in autocast's compute
    dtype of that many bytes (0: no autocast, or float32 logits); the loss then runs in
    float32, autocast casting the logits and the targets' copy to it (the compute-dtype
    copy is freed once the loss's output exists). The loss saves its two inputs; the
    copies among them are returned, for :func:`bce_backward` to release (the logits and
    the labels themselves are the caller's). Its ``(rows, tasks)`` per-element output and
    the ``(rows,)`` row means are freed once the sum exists."""
    target, copied = labels, label_elt != elt
    if copied:
        target = tl.alloc(rows * tasks * elt, LOSS, "targets cast")
    logits = None  # the logits themselves: the caller's
    loss_elt, low_target = elt, None
    if autocast_elt:
        loss_elt = FLOAT32_BYTES
        logits = tl.alloc(rows * tasks * loss_elt, LOSS, "logits (autocast float32 copy)")
        wide = tl.alloc(rows * tasks * loss_elt, LOSS, "targets (autocast float32 copy)")
        low_target = target if copied else None
        target, copied = wide, True
    per_elem = tl.alloc(rows * tasks * loss_elt, LOSS, "bce per element")
    if low_target is not None:
        tl.release(low_target)
    mean = tl.alloc(rows * loss_elt, LOSS, "bce mean over tasks")
    tl.release(mean, per_elem)
    return [b for b, own in ((logits, logits is not None), (target, copied)) if own]


def bce_backward(tl: Timeline, saved: list[Buffer], rows, tasks: int, elt: int,
                 autocast_elt: int = 0) -> Buffer:
    """Backward of :func:`bce_forward` from the loss (no tensor of note): ``mean``'s
    ``grad / T`` (a ``(rows, tasks)`` division), then ``(sigmoid(x) - target) * grad``
    (``sigmoid``, ``sub``, ``mul``, each freed once the next exists), all in the loss's
    dtype (float32 under autocast); the loss's node then lets go of its ``saved``
    inputs. Under autocast (``autocast_elt``) the cast's backward turns the float32
    gradient into a compute-dtype copy. Returns the logits' gradient."""
    nbytes = rows * tasks * (FLOAT32_BYTES if autocast_elt else elt)
    g_mean = tl.alloc(nbytes, BWD, "grad bce mean over tasks")
    sig = tl.alloc(nbytes, BWD, "grad bce sigmoid")
    diff = tl.alloc(nbytes, BWD, "grad bce sigmoid - target")
    tl.release(sig)
    g = tl.alloc(nbytes, BWD, "grad logits" + (" (float32)" if autocast_elt else ""))
    tl.release(diff, g_mean, *saved)
    if autocast_elt:
        low = tl.alloc(rows * tasks * autocast_elt, BWD, "grad logits")
        tl.release(g)
        g = low
    return g


def multilabel_correct(tl: Timeline, rows, tasks: int, component: str) -> None:
    """``count_correct`` of multi-label targets (``betty.train.count_correct``):
    ``((logits > 0) == (target > 0.5))`` (three ``(rows, tasks)`` bool tensors, the two
    comparisons freed once the third exists), then its integer ``.sum()``."""
    pos = tl.alloc(rows * tasks, component, "logits > 0")
    truth = tl.alloc(rows * tasks, component, "target > 0.5")
    right = tl.alloc(rows * tasks, component, "correct tasks")
    tl.release(pos, truth)
    tl.release(right)
