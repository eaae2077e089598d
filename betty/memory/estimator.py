"""Analytic peak memory of training micro-batches, before running them.

:func:`estimate_micro_batch` estimates one micro-batch (a carved
:class:`~betty.batch.MicroBatch`, a full :class:`~betty.batch.SampledBatch` for K = 1,
or precomputed :class:`~betty.memory.sizes.MicroBatchSizes`); :func:`estimate_micro_batches`
estimates every micro-batch of a K-way split at once, without carving (sizes from
:func:`betty.memory.sizes.split_sizes`, one vectorized replay).

The number estimated is what :class:`betty.memory.meter.MemoryMeter` measures around a
micro-batch in :func:`betty.train.accumulate_gradients` with the model and optimizer
tracked: the peak, over the whole forward and backward, of

    parameters + optimizer state + gradients + everything the micro-batch allocates,

computed by replaying the micro-batch's allocations symbolically
(:mod:`betty.memory.replay`). Inputs per layer: source/destination node counts, edge
counts and, for the LSTM aggregator, the in-degree histogram.

Conventions: the optimizer state is assumed to exist (the steady state after the first
step); ``fresh_grads`` says whether the micro-batch starts without ``.grad`` tensors (in
:func:`betty.train.train_step` the first micro-batch does, the others accumulate into them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from betty.batch import MicroBatch, SampledBatch
from betty.memory.constants import BackendConstants, load_constants
from betty.memory.ops import itemsize, step_temporaries
from betty.memory.replay import ReplayConfig, input_bytes, replay
from betty.memory.sizes import MicroBatchSizes, micro_batch_sizes, split_sizes
from betty.memory.spec import as_model_spec, as_optimizer_spec
from betty.precision import Precision, input_dtype

__all__ = ["MemoryEstimate", "estimate_micro_batch", "estimate_micro_batches", "estimate_sizes", "persistent_bytes",
           "replay_config"]


@dataclass
class MemoryEstimate:
    """The estimated peak of one micro-batch.

    Attributes:
        peak: estimated peak bytes (what the meter's ``peak_bytes`` reads).
        breakdown: bytes per component live at the peak (sums to ``peak``):
            ``parameters``, ``optimizer_state``, ``gradients``, ``blocks``,
            ``global_ids``, ``features``, ``labels``, ``activations`` (layer outputs and
            what autograd saves), ``aggregation`` (aggregator intermediates),
            ``attention`` (GAT per-edge tensors), ``lstm`` (LSTM buckets),
            ``dropout``, ``loss``, ``activation_gradients``; with preparation on the
            device (:mod:`betty.memory.device_preparation`) ``device_store`` and
            ``carved``; with copy-ahead ``next_inputs`` (the next micro-batch's inputs).
        peak_at: the phase and op where the peak is reached.
        sizes: the micro-batch's per-layer sizes.
        backend: the backend whose constants were used.
    """

    peak: int
    breakdown: dict[str, int] = field(default_factory=dict)
    peak_at: str = ""
    sizes: dict = field(default_factory=dict)
    backend: str = "cpu"

    @property
    def fixed(self) -> int:
        """Bytes that do not shrink with K: parameters, their gradients and optimizer
        state, and the device store and batch of preparation on the device, at the peak."""
        return sum(self.breakdown.get(c, 0)
                   for c in ("parameters", "gradients", "optimizer_state", "device_store"))

    @property
    def dominant(self) -> str:
        """The largest component at the peak."""
        return max(self.breakdown, key=self.breakdown.get) if self.breakdown else ""

    def to_dict(self) -> dict:
        """JSON-ready."""
        return {"peak_bytes": self.peak, "breakdown": dict(self.breakdown),
                "peak_at": self.peak_at, "sizes": self.sizes, "backend": self.backend}


def _itemsize(dtype: torch.dtype | None, name: str) -> int:
    """:func:`betty.memory.ops.itemsize`, with 4 bytes (float32) for ``None``."""
    return 4 if dtype is None else itemsize(dtype, name)


def _constants(backend: str, constants: BackendConstants | None) -> BackendConstants:
    return constants if constants is not None else load_constants(backend)


def replay_config(model, optimizer="adam", dtype: torch.dtype | None = None, backend: str = "cpu",
                  *, feat_dtype: torch.dtype | None = torch.float32,
                  feature_dtype: torch.dtype | None = None, fresh_grads=False,
                  num_micro_batches: int = 1, label_columns: int = 0,
                  label_dtype: torch.dtype = torch.float32,
                  constants: BackendConstants | None = None,
                  precision: "str | Precision" = "32", device_store: float = 0.0,
                  carved=0.0) -> ReplayConfig:
    """The :class:`~betty.memory.replay.ReplayConfig` of a step of ``model`` on
    ``num_micro_batches`` micro-batches (arguments as in :func:`estimate_sizes`).

    Element sizes, in bytes: ``feat_elt`` of the host feature matrix; ``elt`` of the
    features the model receives. Without autocast that is ``dtype`` (``None``: the
    host's). Under a mixed precision it is what
    :func:`betty.precision.input_dtype` gives the trainer: features already in the
    compute dtype stay in it (``elt = feat_elt = autocast_elt``), any other dtype (float32, or
    float16 under ``bf16-mixed``, bfloat16 under ``16-mixed``) is cast to the parameters'
    dtype on the device, a copy the replay counts (``elt = 4``). So every 2-byte tensor
    the replay sees under autocast is in the compute dtype, and comparing bytes per element
    tells a tensor autocast must cast from one it takes as it is."""
    spec = as_model_spec(model)
    opt = as_optimizer_spec(optimizer)
    prec = Precision.parse(precision)
    if feature_dtype is not None:
        feat_dtype = feature_dtype
    feat_elt = _itemsize(feat_dtype, "feature_dtype")
    if prec.mixed and dtype is not None:
        raise ValueError(f"dtype must be None under precision {prec.name!r} (autocast casts "
                         f"the features); got dtype={dtype}")
    autocast_elt = prec.compute_bytes if prec.mixed else 0
    if prec.mixed:
        cast = input_dtype(feat_dtype if feat_dtype is not None else torch.float32, prec,
                           spec.param_dtype)
        elt = _itemsize(cast, "dtype") if cast is not None else feat_elt
    else:
        elt = _itemsize(dtype, "dtype") if dtype is not None else feat_elt
    consts = _constants(backend, constants)
    p = int(num_micro_batches)
    fresh = np.broadcast_to(np.asarray(fresh_grads, dtype=bool), (p,)).copy()
    return ReplayConfig(model=spec, optimizer=opt, elt=elt, feat_elt=feat_elt, constants=consts,
                        fresh_grads=fresh, label_columns=int(label_columns),
                        label_elt=_itemsize(label_dtype, "label_dtype"),
                        autocast_elt=autocast_elt, host=not backend.startswith("cuda"),
                        device_store=float(device_store),
                        carved=np.broadcast_to(np.asarray(carved, dtype=np.float64), (p,)).copy())


def estimate_sizes(sizes: MicroBatchSizes, model, optimizer="adam", dtype: torch.dtype | None = None,
                   backend: str = "cpu", *, feat_dtype: torch.dtype | None = torch.float32,
                   fresh_grads=False, label_columns: int = 0,
                   label_dtype: torch.dtype = torch.float32,
                   constants: BackendConstants | None = None,
                   precision: "str | Precision" = "32",
                   feature_dtype: torch.dtype | None = None,
                   device_store: float = 0.0, carved=0.0,
                   copy_ahead: bool = False) -> list[MemoryEstimate]:
    """Estimate every micro-batch described by ``sizes`` (one vectorized replay).

    Args:
        sizes: per-layer sizes of P micro-batches.
        model: a :class:`~betty.memory.spec.ModelSpec` or a betty model.
        optimizer: an :class:`~betty.memory.spec.OptimizerSpec`, ``"adam"``/``"sgd"``,
            or a torch optimizer.
        dtype: compute dtype the features are cast to (``None``: ``feat_dtype``).
        backend: ``"cpu"``, ``"cuda"`` or ``"cuda-nocudnn"``.
        feat_dtype: dtype of the host feature matrix.
        fresh_grads: bool or ``(P,)`` bools, see the module docstring.
        label_columns: T for multi-label targets (0: single-label).
        label_dtype: dtype of multi-label targets.
        constants: override the backend's constants.
        precision: the training precision (:class:`~betty.precision.Precision` or its
            name). ``"32"`` / ``"64"``: the step runs in ``dtype``. A mixed precision
            (``"bf16-mixed"``, ``"16-mixed"``): the forward pass and the loss run under
            ``torch.autocast`` in the precision's compute dtype, parameters, gradients
            and optimizer state stay in the model's parameter dtype (float32); features
            already in the compute dtype reach the model as they are, others are cast to
            the parameter dtype first (:func:`betty.precision.input_dtype`; ``dtype``
            must be None).
        feature_dtype: dtype of the host feature matrix (overrides ``feat_dtype``;
            None: ``feat_dtype``, float32 by default).
        device_store, carved: bytes preparation on the device keeps there beside each
            micro-batch's step (:mod:`betty.memory.device_preparation`): the store and batch
            (one number), each carved micro-batch (one or ``(P,)``).
        copy_ahead: the P micro-batches run in this order in one step that copies each
            micro-batch's successor's inputs to the device while the micro-batch computes
            (:func:`betty.train.accumulate_gradients` with ``copy_ahead``): micro-batch ``i``'s
            peak also counts micro-batch ``i + 1``'s inputs
            (:func:`betty.memory.replay.input_bytes`; none for the last micro-batch), the
            ``next_inputs`` component.
    """
    p = sizes.num_micro_batches
    cfg = replay_config(model, optimizer, dtype, backend, feat_dtype=feat_dtype,
                        feature_dtype=feature_dtype, fresh_grads=fresh_grads,
                        num_micro_batches=p, label_columns=label_columns,
                        label_dtype=label_dtype, constants=constants, precision=precision,
                        device_store=device_store, carved=carved)
    if copy_ahead:  # micro-batch i holds micro-batch i + 1's inputs; the last micro-batch holds none
        cfg.next_inputs = np.append(input_bytes(sizes, cfg)[1:], 0.0)
    tl = replay(sizes, cfg)
    breakdown = tl.breakdown()
    where = tl.peak_event()
    return [
        MemoryEstimate(peak=int(round(tl.peak[i])), breakdown=breakdown[i], peak_at=where[i],
                       sizes=sizes.as_dict(i), backend=backend)
        for i in range(p)
    ]


def persistent_bytes(model, optimizer="adam", backend: str = "cpu") -> int:
    """Bytes that stay on the device whatever K is: parameters, one gradient per
    parameter and the optimizer state (the floor of every micro-batch's peak)."""
    from betty.memory.spec import parameter_shapes

    spec = as_model_spec(model)
    opt = as_optimizer_spec(optimizer)
    shapes = [s for layer in parameter_shapes(spec) for s in layer]
    elt = _itemsize(spec.param_dtype, "param_dtype")
    pbytes = sum(int(np.prod(s)) for s in shapes) * elt
    n_state, has_step = opt.state_tensors()
    step = 4 * len(shapes) if has_step and (not backend.startswith("cuda") or opt.step_on_device) else 0
    return 2 * pbytes + n_state * pbytes + step


def step_bytes(model, optimizer="adam", backend: str = "cpu") -> int:
    """The temporaries of one ``optimizer.step()`` beyond :func:`persistent_bytes` (the
    step runs once every micro-batch's activations are freed: its peak is
    ``persistent_bytes + step_bytes``): :func:`betty.memory.ops.step_temporaries` of the
    model's parameters (the model in ``OptimizerSpec.groups``' order where the spec was
    read off a torch optimizer), the same figure :mod:`betty.rev.replay` counts for a
    RevGNN's step."""
    from betty.memory.spec import parameter_shapes

    spec = as_model_spec(model)
    numels = [int(np.prod(s)) for layer in parameter_shapes(spec) for s in layer]
    return int(step_temporaries(as_optimizer_spec(optimizer), numels,
                                _itemsize(spec.param_dtype, "param_dtype"), not backend.startswith("cuda")))


def estimate_micro_batch(mb_or_sizes: MicroBatch | SampledBatch | MicroBatchSizes, model,
                         optimizer="adam", dtype: torch.dtype | None = None,
                         backend: str = "cpu", **kwargs) -> MemoryEstimate:
    """Estimate one micro-batch. Keyword arguments are those of :func:`estimate_sizes`
    (``fresh_grads`` defaults to False: gradients already exist)."""
    sizes = micro_batch_sizes(mb_or_sizes)
    if sizes.num_micro_batches != 1:
        raise ValueError(f"estimate_micro_batch takes one micro-batch, got sizes of {sizes.num_micro_batches}")
    return estimate_sizes(sizes, model, optimizer, dtype, backend, **kwargs)[0]


def estimate_micro_batches(batch: SampledBatch, groups, k: int, model, optimizer="adam",
                           dtype: torch.dtype | None = None, backend: str = "cpu", *,
                           zeroed_grads: bool = True, device_store_bytes: int | None = None,
                           **kwargs) -> list[MemoryEstimate]:
    """Estimate every micro-batch of the split ``groups`` of ``batch``, without carving.

    Micro-batch ``i`` is the one :func:`betty.train.accumulate_gradients` runs
    ``i``-th. With ``zeroed_grads`` (what :func:`betty.train.train_step` does) micro-batch 0
    starts without ``.grad`` and the others with it. ``device_store_bytes``: the batch
    is prepared on the device (sampled, kept and carved there) beside a store of that
    many bytes (:func:`betty.memory.device_preparation.store_bytes`); each micro-batch's peak
    then counts the store, the batch and its carved micro-batch. Other keyword
    arguments are those of :func:`estimate_sizes` (``copy_ahead``: micro-batch ``i`` also
    holds micro-batch ``i + 1``'s inputs).

    Raises:
        ValueError: ``copy_ahead`` with ``device_store_bytes``: a batch prepared on the
            device is not copied from the host.
    """
    if kwargs.get("copy_ahead") and device_store_bytes is not None:
        raise ValueError("copy_ahead overlaps each next micro-batch's copy from the host; a batch "
                         "prepared on the device (device_store_bytes) is not copied from it")
    sizes = split_sizes(batch, groups, k)
    fresh = np.zeros(k, dtype=bool)
    fresh[0] = bool(zeroed_grads)
    if device_store_bytes is not None:
        from betty.memory import device_preparation as prep

        granule = _constants(backend, kwargs.get("constants")).granule_bytes
        out_degrees = batch.layers[0].src_out_degree is not None
        kwargs = dict(kwargs, device_store=prep.fixed_bytes(batch, device_store_bytes, granule),
                      carved=prep.carved_bytes(sizes, out_degrees, granule))
    return estimate_sizes(sizes, model, optimizer, dtype, backend, fresh_grads=fresh, **kwargs)


