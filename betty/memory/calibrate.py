"""Measure the backend constants of :mod:`betty.memory.constants` on this machine.

:func:`calibrate` runs small synthetic workloads under
:class:`~betty.memory.meter.MemoryMeter` on ``device`` and fits the constants the
replay cannot derive from shapes:

* **LSTM state.** For a grid of degree-bucket shapes (steps T, sequences B, width W) one
  ``nn.LSTM(W, W)`` call runs forward on a ``(B, T, W)`` input. What it keeps after the
  forward, minus the tensors the replay already counts (time-major input copy when
  T > 1, output ``(T, B, W)``, final states ``2·(B, W)``, returned ``h_n, c_n``), is the
  kernel's saved state ``S(T, B, W)``. A weighted least-squares fit of
  ``S = (a·T·B·Ŵ + b·B·Ŵ)·elt + c`` gives ``lstm_step_words = a``,
  ``lstm_seq_words = b``, ``lstm_call_bytes = c``. On the host both LSTM paths are
  measured: float32 (oneDNN), whose exact workspace formula
  (:func:`~betty.memory.constants.onednn_lstm_workspace_bytes`) is selected
  (``lstm_kernel = "onednn"``) when it matches every shape, and float64, torch's
  native per-step LSTM, checked against
  :func:`~betty.memory.constants.native_lstm_saved_bytes` (the replay follows it op by
  op). The linear model, the host's fallback for other dtypes (which run the native
  LSTM too), is fitted on the float64 measurements; elsewhere on ``dtype``'s.
  The backward's extra transient tensors give ``lstm_backward_step_words``.
* **Device graph formats.** A block is built with ``dgl.create_block`` inside a meter
  region and one message pass (forward and backward) runs on it; the bytes beyond the
  edge-index copies and the pass's own tensors, fitted on two block sizes, give
  ``block_bytes_per_edge`` and ``block_bytes_per_node`` (0 on the host, where DGL
  allocates them outside PyTorch).

The result is written to the user constants file (:func:`~betty.memory.constants.
user_constants_path`), which :func:`~betty.memory.constants.load_constants` reads on top
of the shipped values. The shipped ``cpu`` entry is the output of this function on the
development machine.
"""

from __future__ import annotations

import platform
import time

import numpy as np
import torch

from betty.backends import available
from betty.memory.constants import (
    BackendConstants,
    default_backend,
    load_constants,
    native_lstm_saved_bytes,
    onednn_lstm_workspace_bytes,
    save_user_constants,
)
from betty.memory.meter import MemoryMeter

__all__ = ["calibrate", "block_constants", "measure_lstm_state", "measure_block_formats", "LSTM_GRID"]

#: (steps, sequences, width) shapes measured for the LSTM fit.
LSTM_GRID = tuple(
    (t, b, w) for w in (16, 40, 64, 128) for t in (1, 2, 4, 8) for b in (16, 200)
)


def _storage_bytes(*tensors: torch.Tensor) -> int:
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def measure_lstm_state(device, steps: int, seqs: int, width: int,
                       dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """``(saved state bytes S, backward transient bytes)`` of one LSTM call, measured.

    S excludes the tensors the replay counts explicitly (see the module docstring; the
    host's float64 LSTM, torch's native one, has no separate ``(B, W)`` final states
    besides ``h_n, c_n``); the transient excludes the input gradient, the weight
    gradients and the ``h0``/``c0`` gradients.
    """
    dev = torch.device(device)
    lstm = torch.nn.LSTM(width, width, batch_first=True).to(dev, dtype)
    x = torch.randn(seqs, steps, width, device=dev, dtype=dtype, requires_grad=True)
    h0 = torch.zeros(1, seqs, width, device=dev, dtype=dtype)
    c0 = torch.zeros(1, seqs, width, device=dev, dtype=dtype)
    meter = MemoryMeter(dev)
    meter.track(lstm, x, h0, c0)
    elt = x.element_size()
    with meter.measure() as fwd:
        _, (hn, cn) = lstm(x, (h0, c0))
    states = 2 if dev.type == "cpu" and elt == 8 else 4  # native LSTM: h_n, c_n only
    explicit = elt * (steps * seqs * width * (2 if steps > 1 else 1) + states * seqs * width)
    saved = fwd.end_bytes - fwd.baseline_bytes - explicit
    grad_out = torch.ones_like(hn)
    params = sum(p.numel() for p in lstm.parameters()) * elt
    with meter.measure() as bwd:
        hn.backward(grad_out)
    # live at backward start: everything tracked plus the forward's results (not tracked)
    start = bwd.baseline_bytes
    extra = bwd.peak_bytes - start - elt * steps * seqs * width * (2 if steps > 1 else 1) \
        - params - 2 * elt * seqs * width
    return int(saved), int(max(0, extra))


def measure_block_formats(device, num_src: int, num_dst: int, num_edges: int,
                          width: int = 4, seed: int = 0) -> int:
    """Bytes a block's device-side graph formats take during one message pass, beyond
    betty's two edge-index copies and the pass's own tensors (0 on the host)."""
    import dgl

    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, num_src, (num_edges,), generator=gen)
    dst = torch.sort(torch.randint(0, num_dst, (num_edges,), generator=gen)).values
    x = torch.randn(num_src, width, device=dev, requires_grad=True)
    meter = MemoryMeter(dev)
    meter.track(x)
    with meter.measure() as r:
        block = dgl.create_block((src.to(dev, copy=True), dst.to(dev, copy=True)),
                                 num_src_nodes=num_src, num_dst_nodes=num_dst,
                                 idtype=torch.int64, device=dev)
        out = dgl.ops.copy_u_sum(block, x)
        out.sum().backward()
        own = _storage_bytes(out) + 2 * 8 * num_edges
        measured = r  # filled on exit
        keep = (block, out)
    del keep
    elt = x.element_size()
    # pass's tensors: output (n_dst, W), grad of output (n_dst, W), grad of x (n_src, W)
    pass_bytes = own + elt * width * (num_dst + num_src)
    return int(max(0, measured.peak_bytes - measured.baseline_bytes - pass_bytes))


def _fit_lstm(rows, elt: int, width_multiple: int) -> tuple[float, float, float, float]:
    """Weighted least squares of S on [T·B·Ŵ·elt, B·Ŵ·elt, 1]; returns (a, b, c, max rel err)."""
    t, b, w, s = (np.array(c, dtype=np.float64) for c in zip(*rows))
    wp = np.ceil(w / width_multiple) * width_multiple
    x = np.stack([t * b * wp * elt, b * wp * elt, np.ones_like(t)], 1)
    weight = 1.0 / np.maximum(s, 1.0)
    coef, *_ = np.linalg.lstsq(x * weight[:, None], s * weight, rcond=None)
    rel = np.abs(x @ coef - s) / np.maximum(s, 1.0)
    return float(coef[0]), float(coef[1]), float(coef[2]), float(rel.max())


def block_constants(dev: torch.device, block_formats: bool | None, base: BackendConstants) -> tuple[float, float]:
    """``(block_bytes_per_edge, block_bytes_per_node)`` for :func:`calibrate`: 0 off CUDA
    and with ``block_formats=False``; measured (:func:`measure_block_formats`) with
    ``True``, or with ``None`` where DGL imports; ``None`` without DGL keeps ``base``'s
    (the shipped values: a machine without DGL cannot measure them, and its
    calibration must not zero them for a later install that has it)."""
    if dev.type != "cuda" or block_formats is False:
        return 0.0, 0.0
    if block_formats is None and not available("dgl"):  # not installed, or a broken install
        return base.block_bytes_per_edge, base.block_bytes_per_node
    small = measure_block_formats(dev, 2000, 1000, 20000)
    large = measure_block_formats(dev, 4000, 2000, 80000)
    per_edge = max(0.0, (large - small) / 60000.0)
    return per_edge, max(0.0, (small - per_edge * 20000) / 3000.0)


def calibrate(device: torch.device | str = "cpu", *, dtype: torch.dtype = torch.float32,
              write: bool = True, lstm_grid=LSTM_GRID, block_formats: bool | None = None) -> dict:
    """Measure this machine's constants for ``device``'s backend; see the module docstring.

    Args:
        device: where to measure (its backend: :func:`~betty.memory.constants.
            default_backend`; on CUDA, ``torch.backends.cudnn.enabled`` selects
            ``cuda`` or ``cuda-nocudnn``).
        dtype: LSTM dtype measured (the compute dtype of the runs to estimate); on the
            host float32 and float64 are both measured and the linear fallback is fitted
            on float64 (see the module docstring), whatever ``dtype``.
        write: save to the user constants file.
        lstm_grid: ``(steps, sequences, width)`` shapes for the LSTM fit.
        block_formats: on CUDA, measure DGL's device graph formats (imports DGL);
            ``False`` leaves ``block_bytes_per_edge/node`` at 0 (a backend that builds
            no formats beyond the edge index); ``None`` (default): measure them where
            DGL imports, else keep the shipped values (:func:`block_constants`).

    Returns:
        A JSON-ready dict: ``backend``, ``constants``, ``lstm_fit_max_rel_error``,
        ``onednn_formula_max_rel_error`` (host float32) and
        ``native_formula_max_rel_error`` (host float64; both None elsewhere), ``path``
        (or None),
        ``seconds``, ``environment``.
    """
    start = time.perf_counter()
    dev = torch.device(device)
    backend = default_backend(dev)
    base = load_constants(backend, use_user=False)
    host = dev.type == "cpu"
    fit_dtype = torch.float64 if host else dtype
    elt = torch.empty((), dtype=fit_dtype).element_size()

    def measure(dt: torch.dtype) -> tuple[list, list]:
        rows, bwd = [], []
        for t, b, w in lstm_grid:
            saved, extra = measure_lstm_state(dev, t, b, w, dt)
            rows.append((t, b, w, saved))
            bwd.append(extra / (t * b * w * torch.empty((), dtype=dt).element_size()))
        return rows, bwd

    def max_rel_error(formula, rows) -> float:
        pred = np.array([float(formula(t, b, w)) for t, b, w, _ in rows])
        meas = np.array([s for *_, s in rows], dtype=np.float64)
        return float(np.max(np.abs(pred - meas) / np.maximum(meas, 1.0)))

    rows, bwd = measure(fit_dtype)
    a, bb, c, fit_err = _fit_lstm(rows, elt, base.lstm_width_multiple)
    onednn_err = native_err = None
    kernel = "linear"
    if host:
        native_err = max_rel_error(lambda t, b, w: native_lstm_saved_bytes(t, b, w, 8), rows)
        onednn_err = max_rel_error(onednn_lstm_workspace_bytes, measure(torch.float32)[0])
        if onednn_err < 1e-3:
            kernel = "onednn"
    per_edge, per_node = block_constants(dev, block_formats, base)
    consts = BackendConstants(
        granule_bytes=base.granule_bytes,
        lstm_kernel=kernel,
        block_bytes_per_edge=round(per_edge, 3),
        block_bytes_per_node=round(per_node, 3),
        lstm_width_multiple=base.lstm_width_multiple,
        lstm_step_words=round(a, 4),
        lstm_seq_words=round(bb, 4),
        lstm_call_bytes=round(c, 1),
        lstm_backward_step_words=round(float(np.median(bwd)), 4),
        source="calibrated",
        note=(f"betty.memory.calibrate on {platform.node() or 'unknown host'}, torch "
              f"{torch.__version__}, {fit_dtype}, device {dev}"),
    )
    path = save_user_constants(backend, consts) if write else None
    return {
        "backend": backend,
        "constants": consts.to_dict(),
        "lstm_fit_max_rel_error": fit_err,
        "onednn_formula_max_rel_error": onednn_err,
        "native_formula_max_rel_error": native_err,
        "path": None if path is None else str(path),
        "seconds": time.perf_counter() - start,
        "environment": {"torch": torch.__version__, "python": platform.python_version(),
                        "device": str(dev)},
    }
