"""Backend constants of the memory model, in one place.

Most of a micro-batch's memory is exact arithmetic on tensor shapes (see
:mod:`betty.memory.replay`). A few quantities depend on the backend's kernels and are
constants here, one set per backend:

``cpu``
    PyTorch on the host (the float32 LSTM runs through oneDNN, the float64 one as
    torch's native per-step LSTM).
``cuda``
    CUDA with cuDNN enabled (the default).
``cuda-nocudnn``
    CUDA with ``torch.backends.cudnn.enabled = False`` (Betty's setting for its LSTM
    figures): the LSTM runs as one fused cell kernel per time step.

The shipped values live in ``memory_constants.json`` beside this module: ``cpu`` comes
from :func:`betty.memory.calibrate.calibrate` run on the development machine;
``cuda`` and ``cuda-nocudnn`` could not be measured there and are best-effort values
derived from reading the code paths (marked ``"source": "derived"``). Running
:func:`~betty.memory.calibrate.calibrate` on a machine writes measured values to the
user file (:func:`user_constants_path`), which overrides the shipped ones key by key.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from pathlib import Path

import torch

__all__ = [
    "BackendConstants",
    "BACKENDS",
    "load_constants",
    "shipped_constants_path",
    "user_constants_path",
    "default_backend",
    "save_user_constants",
    "onednn_lstm_workspace_bytes",
    "onednn_lstm_state_arrays",
    "native_lstm_saved_bytes",
]

BACKENDS = ("cpu", "cuda", "cuda-nocudnn")
ENV_PATH = "BETTY_MEMORY_CONSTANTS"


@dataclass(frozen=True)
class BackendConstants:
    """Constants of one backend.

    Attributes:
        granule_bytes: every allocation is rounded up to a multiple of this. CUDA's
            caching allocator hands out 512-byte blocks and ``max_memory_allocated``
            counts block sizes (1 on the host, where the meter counts storage bytes).
        block_bytes_per_edge: bytes per edge of the graph formats DGL builds on the
            device for a block (COO/CSR/CSC index arrays beyond the two edge-index
            copies betty makes). On the host DGL allocates them outside PyTorch, so the
            meter cannot see them and the constant is 0.
        block_bytes_per_node: same, per source plus destination node (CSR/CSC row
            pointers).
        lstm_kernel: how the LSTM keeps its state for backward. ``"onednn"``: PyTorch's
            host LSTM: float32 runs oneDNN (``mkldnn_rnn_layer``), whose workspace
            layout is known exactly (see :func:`onednn_lstm_workspace_bytes`); float64
            runs torch's native per-step LSTM, which the replay follows op by op
            (:meth:`lstm_native`, :func:`native_lstm_saved_bytes`); other dtypes fall
            back to the linear model. ``"linear"``: the linear model below.
        lstm_width_multiple: the LSTM kernel pads the feature width W to a multiple of
            this many elements in the linear model; ``Ŵ`` below (1 on the host, whose
            fallback dtypes run the unpadded native LSTM; the oneDNN formula pads by
            itself).
        lstm_step_words: saved LSTM state per time step and sequence, in elements of
            the compute dtype per padded width: one call over a degree bucket of ``B``
            destinations with in-degree ``T`` keeps
            ``(lstm_step_words·T·B·Ŵ + lstm_seq_words·B·Ŵ)·elt + lstm_call_bytes``
            bytes from its forward to its backward (oneDNN's workspace; cuDNN's reserve
            space; the per-step gates of the native kernel). This is Betty's
            "18 × 4 bytes per degree × bucket size × width", refined.
        lstm_seq_words: the per-sequence part of the same (initial/final states).
        lstm_call_bytes: fixed bytes per LSTM call (page rounding of the workspace).
        lstm_backward_step_words: transient bytes (in the same units as
            ``lstm_step_words``) the LSTM backward allocates as tensors on top of the
            input gradient (0 where the kernel's scratch is not a tensor).
        source: ``"calibrated"`` (measured by :func:`betty.memory.calibrate.calibrate`)
            or ``"derived"`` (read off the code paths, not measured).
        note: where the numbers come from.
    """

    granule_bytes: int = 1
    lstm_kernel: str = "linear"
    block_bytes_per_edge: float = 0.0
    block_bytes_per_node: float = 0.0
    lstm_width_multiple: int = 16
    lstm_step_words: float = 21.0
    lstm_seq_words: float = 14.0
    lstm_call_bytes: float = 0.0
    lstm_backward_step_words: float = 0.0
    source: str = "derived"
    note: str = ""

    def padded_width(self, width: int) -> int:
        """``Ŵ``: ``width`` rounded up to ``lstm_width_multiple``."""
        m = max(1, int(self.lstm_width_multiple))
        return int(math.ceil(width / m) * m)

    def lstm_onednn(self, elt: int) -> bool:
        """Whether an LSTM computing in ``elt``-byte elements runs oneDNN's kernel: the
        host's (``lstm_kernel == "onednn"``) float32, whose workspace layout is exact."""
        return self.lstm_kernel == "onednn" and elt == 4

    def lstm_native(self, elt: int) -> bool:
        """Whether an LSTM computing in ``elt``-byte elements runs torch's native per-step
        LSTM, which the replay follows op by op: the host's (``lstm_kernel ==
        "onednn"``) float64, for which torch has no oneDNN LSTM."""
        return self.lstm_kernel == "onednn" and elt == 8

    def lstm_backward_words(self, elt: int) -> float:
        """``lstm_backward_step_words`` for an LSTM computing in ``elt``-byte elements: 0
        for the host's float32 oneDNN LSTM, whose backward scratch is not a tensor (the
        field is the linear model's, fitted on the host's native float64 LSTM)."""
        return 0.0 if self.lstm_onednn(elt) else self.lstm_backward_step_words

    def lstm_saved_bytes(self, steps, seqs, width: int, elt: int):
        """Bytes one LSTM call over ``seqs`` sequences of ``steps`` steps keeps for its
        backward (array-friendly; 0 where ``seqs == 0``): the oneDNN workspace for the
        host's float32; for its float64 (:meth:`lstm_native`) the native LSTM's per-step
        tensors ``(7T - 2)·B·W·elt`` (gates ``4BW``, ``c_t``, ``tanh(c_t)`` and ``h_t``
        per step; the last step's ``c_T`` and ``h_T`` are not saved); else the linear
        model."""
        import numpy as np

        seqs = np.asarray(seqs, dtype=np.float64)
        if self.lstm_onednn(elt):
            return np.where(seqs > 0, onednn_lstm_workspace_bytes(steps, seqs, width), 0.0)
        if self.lstm_native(elt):
            return np.where(seqs > 0, native_lstm_saved_bytes(steps, seqs, width, elt), 0.0)
        w = self.padded_width(width)
        words = self.lstm_step_words * steps * seqs * w + self.lstm_seq_words * seqs * w
        return np.where(seqs > 0, words * elt + self.lstm_call_bytes, 0.0)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "BackendConstants":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown memory constants {sorted(unknown)}; allowed: {sorted(known)}")
        return cls(**data)


ONEDNN_PAGE_BYTES = 4096


def _onednn_ld(dim: int) -> int:
    """oneDNN's leading dimension for float32 rows of ``dim`` values: rounded up to 16
    values (64 bytes), plus 16 more when that is a multiple of 256 (4K aliasing)."""
    ld = -(-int(dim) // 16) * 16
    return ld + 16 if ld % 256 == 0 else ld


@lru_cache(maxsize=None)
def onednn_lstm_state_arrays() -> int:
    """How many ``ld``-padded state arrays this torch build's oneDNN LSTM workspace holds
    (see :func:`onednn_lstm_workspace_bytes`): 5 with torch 2.2.1 (oneDNN 2.x), 3 with
    torch 2.13 (oneDNN 3.x). Read off one float32 LSTM call with T = B = 1, W = 8, whose
    every workspace region is one page: ``pages - 4`` (gates, hidden outputs and the two
    unpadded state arrays are the other four)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Workspace(TorchDispatchMode):
        nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mkldnn_rnn_layer.default:
                self.nbytes = out[3].untyped_storage().nbytes()
            return out

    lstm = torch.nn.LSTM(8, 8, batch_first=True)
    x = torch.zeros(1, 1, 8, requires_grad=True)
    probe = _Workspace()
    with probe:
        lstm(x)
    if probe.nbytes == 0:  # no oneDNN LSTM in this build: the formula of torch 2.2.1
        return 5
    return int(probe.nbytes // ONEDNN_PAGE_BYTES) - 4


def onednn_lstm_workspace_bytes(steps, seqs, width: int, state_arrays: int | None = None):
    """Bytes of the training workspace oneDNN allocates for one single-layer,
    unidirectional float32 LSTM call over ``seqs`` sequences of ``steps`` steps with
    input and hidden width ``width`` (what ``torch.ops.aten.mkldnn_rnn_layer`` returns as
    its last output and autograd keeps until the backward).

    The workspace is a sequence of regions, each starting on a 4096-byte page: the gate
    pre-activations ``T·B·ld(4W)``, the hidden outputs ``T·B·ld(W)``, five state arrays
    ``2(T+1)·B·ld(W)`` and two ``2(T+1)·B·W`` (layer and iteration states, cell states
    and their gradients, for the 2 = layers + 1 state slots), float32 each, with
    ``ld`` from :func:`_onednn_ld`. Matched byte for byte on 192 (T, B, W) combinations
    (T 1-12, B 1-300, W 8-256) with torch 2.2.1 here. Newer oneDNN (torch 2.13) keeps
    three padded state arrays instead of five (matched on 216 combinations, T 1-12,
    B 1-300, W 8-256); ``state_arrays`` defaults to this build's count
    (:func:`onednn_lstm_state_arrays`).
    """
    import numpy as np

    t = np.asarray(steps, dtype=np.float64)
    b = np.asarray(seqs, dtype=np.float64)
    w = int(width)

    def pages(nbytes):
        return np.ceil(nbytes / ONEDNN_PAGE_BYTES)

    n_ld = onednn_lstm_state_arrays() if state_arrays is None else int(state_arrays)
    state = 2.0 * (t + 1.0) * b * 4.0
    total = (pages(t * b * _onednn_ld(4 * w) * 4.0) + pages(t * b * _onednn_ld(w) * 4.0)
             + n_ld * pages(state * _onednn_ld(w)) + 2.0 * pages(state * w))
    return total * ONEDNN_PAGE_BYTES


def native_lstm_saved_bytes(steps, seqs, width: int, elt: int):
    """Bytes torch's native (non-oneDNN) LSTM keeps for the backward of one single-layer,
    unidirectional call over ``seqs`` sequences of ``steps`` steps with input and hidden
    width ``width``, besides its input, output and final states:
    ``(7T - 2)·B·W·elt``. Per step ``t`` autograd saves the gates
    ``h_{t-1} W_hhᵀ + b_hh + x_t W_ihᵀ + b_ih`` (``(B, 4W)``, activated in place), ``c_t``,
    ``tanh(c_t)`` and ``h_t`` (``(B, W)`` each); ``c_T`` and ``h_T`` feed no later step.
    Measured on the host in float64 (torch 2.2.1 and 2.13, 2026-12-06), byte for byte, on
    :data:`betty.memory.calibrate.LSTM_GRID`."""
    import numpy as np

    t = np.asarray(steps, dtype=np.float64)
    return (7.0 * t - 2.0) * np.asarray(seqs, dtype=np.float64) * int(width) * int(elt)


def shipped_constants_path() -> Path:
    """The JSON shipped with betty."""
    return Path(__file__).with_name("memory_constants.json")


def user_constants_path() -> Path:
    """Where calibration writes: ``$BETTY_MEMORY_CONSTANTS`` if set, else
    ``$XDG_CACHE_HOME/betty/memory_constants.json`` (``~/.cache`` by default)."""
    env = os.environ.get(ENV_PATH)
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "betty" / "memory_constants.json"


def _read(path: Path) -> dict:
    with open(path) as fh:
        data = json.load(fh)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: memory constants must be a JSON object keyed by backend")
    return data


def load_constants(backend: str, *, use_user: bool = True) -> BackendConstants:
    """The constants of ``backend``: the shipped ones, overridden key by key by the user
    file when it exists and ``use_user`` (tests pass ``use_user=False``)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    merged = dict(_read(shipped_constants_path())[backend])
    user = user_constants_path()
    if use_user and user.exists():
        merged.update(_read(user).get(backend, {}))
    return BackendConstants.from_dict(merged)


def save_user_constants(backend: str, constants: BackendConstants) -> Path:
    """Write ``constants`` for ``backend`` into the user file (other backends kept)."""
    path = user_constants_path()
    data = _read(path) if path.exists() else {}
    data[backend] = constants.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
    os.replace(tmp, path)
    return path


def default_backend(device: torch.device | str) -> str:
    """``cpu`` for host devices, ``cuda`` or ``cuda-nocudnn`` (per
    ``torch.backends.cudnn.enabled``) for CUDA devices."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return "cuda" if torch.backends.cudnn.enabled else "cuda-nocudnn"
    if dev.type == "cpu":
        return "cpu"
    raise ValueError(f"no memory constants for device type {dev.type!r}; allowed: cpu, cuda")
