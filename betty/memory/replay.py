"""Symbolic replay of one training micro-batch: every tensor it allocates and frees.

:func:`replay` walks the same steps as :func:`betty.train.accumulate_gradients` does for
one micro-batch and records, on a :class:`~betty.memory.timeline.Timeline`, each tensor
storage as it is created and when its last holder lets go of it:

1. **Blocks**: the two int64 edge-index copies per layer betty hands to
   ``dgl.create_block`` (``2·E_l·8`` bytes), plus DGL's device-side graph formats
   (backend constants; 0 on the host, where they live outside PyTorch, but for a
   16-byte tensor per block); on PyG the
   ``(2, E_l)`` ``edge_index`` of a :class:`~betty.backends.pyg_backend.PygBlock`
   (the same bytes) and nothing else.
2. **Global IDs** for deterministic dropout: ``n_src_l·8`` per layer (feature dropout),
   ``E_l·8`` per layer (GAT attention dropout).
3. **Features** ``n_in·F`` elements and **labels** (``n_out`` int64 or ``n_out·T``
   multi-label targets); with copy-ahead (``StepConfig.next_inputs``) the next micro-batch's
   blocks, IDs, features and labels, copied while this micro-batch computes; then a cast copy
   of the features where the model takes another dtype (``StepConfig.elt`` against
   ``feat_elt``: :func:`betty.precision.input_dtype`; under autocast, features not in the
   compute dtype are cast to float32).
4. **Forward**, layer by layer: input dropout (hash dropout keeps no mask, only
   bounded chunk buffers; standard dropout keeps a bool mask), the convolution with
   every intermediate DGL and autograd create, and the activation. What autograd saves
   for backward is *held*, everything else is released where Python drops it
   (DGL keeps ``srcdata``/``dstdata`` until its ``local_scope`` ends).
5. **Loss** (log-softmax; for multi-label targets BCE with logits, its ``(n_out, T)``
   per-element loss and row means, and in its backward ``grad / T``, ``sigmoid``,
   ``- target``, ``* grad``) and **backward** in reverse layer order: activation
   gradients appear, saved tensors are released node by node, parameter gradients are
   either created (the first micro-batch after ``zero_grad(set_to_none=True)``; a DGL
   pool layer's ``fc_pool``, the first one whose block there has edges) or
   accumulated in place (the others: a transient copy of each).
6. **Metrics** after the backward, for multi-label targets: ``count_correct``'s three
   ``(n_out, T)`` bool comparisons and their integer count (single-label: an
   ``(n_out,)`` argmax and comparison, left out as tiny).

The sequences were read off the code of DGL 2.1's ``SAGEConv`` (mean / gcn / pool /
lstm, with ``lin_before_mp`` when ``in_feats > out_feats``; the pool aggregator on a
block without edges is betty's ``EdgelessPoolSAGEConv``), ``betty.models.gat``,
``betty.models.dropout`` and PyTorch 2.2's autograd, and checked op by op against a
dispatch-mode trace (:class:`betty.memory.trace.AllocationTrace`;
``tests/test_memory_trace_diff.py`` diffs the two event sequences).

**Mixed precision** (``StepConfig.autocast_elt``; the models of
:func:`replays_mixed_precision`): the forward pass and the loss run under
``torch.autocast``. The features reach the first layer in the compute dtype (host
features already in it) or in float32 (the trainer's cast of any other dtype), so every
2-byte tensor of the step is in the compute dtype and bytes per element tell the two
dtypes apart. Each matrix product (``addmm``/``mm``) casts its parameters (the
copies stay in autocast's cache until the region ends after the loss, a weight's copy
until its backward where the product's input needs a gradient) and, where its input is
not in the compute dtype (float32 features; GCN's float32 ``h * src_norm`` or
aggregation), the input: that copy is saved instead of the input. The product's output
is in the compute dtype, and so is what follows it until an op meets a float32 operand
(type promotion: the wider of the two, :meth:`_Replayer.wide`):
SAGE mean's and pool's layers stay in the compute dtype from their first product on,
while SAGE gcn's ``/ (deg + 1)`` (degrees in the layer input's dtype) and ``+ bias``,
GCN's ``* dst_norm`` (norms in the layer input's dtype) and ``+ b`` (a float32 bias) and
GAT's ``z * attn_l`` / ``z * attn_r`` (float32 attention vectors) promote back to
float32, so those layers' outputs, activations and logits are float32 (GAT's DGL
aggregation casts ``z`` to float32 to meet the attention). With features in the compute
dtype, the first layer's degrees, norms and non-product ops before such an op run in
the compute dtype too (SAGE gcn's ``/ (deg + 1)``, GCN's ``h * src_norm`` and
``* dst_norm``). ``cross_entropy`` runs in float32 (on a float32 copy of logits in the
compute dtype), and so does ``binary_cross_entropy_with_logits``: where the logits are
in the compute dtype, ``target.to(logits.dtype)`` makes a compute-dtype copy of the
float32 targets and autocast casts both to float32 (:func:`betty.memory.ops.bce_forward`).
In backward, a gradient that reaches a
compute-dtype tensor from a float32 op is cast to the compute dtype; a product's node
gives its gradients in the compute dtype, then the casts' backward nodes turn them into
float32 copies (the input's, where it was cast, then each parameter's, into
``AccumulateGrad``): :meth:`_Replayer.autocast_mm_bwd`.

**SAGE-LSTM under autocast** follows the host's step (``StepConfig.host``), where
:class:`~betty.backends.lstm.AutocastLSTM` runs the recurrence in float32 with autocast
off: a bfloat16 mailbox (every layer after the first) and its zero ``h0``/``c0`` are
copied to float32 first (the copies saved instead of them), so the LSTM's output, state
and kernel workspace, the concatenated results and ``neigh`` are float32, and
``fc_neigh`` casts ``neigh`` like any float32 product input (the bfloat16 copy saved;
``fc_self`` and the layer's output are in the compute dtype). In backward each bucket's
float32 input gradient is cast back to the mailbox's dtype before the gather's backward.
On CUDA autocast runs the LSTM in its own dtype (cuDNN), a step not traced here:
:func:`replays_mixed_precision` says no for it and the replay refuses it.

**Backends.** ``ModelSpec.backend`` (read off the model) picks the op sequences where the
GNN backend's ops differ; everything else (parameters, dropout, features, labels,
linear layers, activations, loss, gradient accumulation) is one code path. The PyG
backend (:mod:`betty.backends.pyg_backend`, PyG 2.8) aggregates by gathering the
``(E, W)`` messages and scattering them into zeros, and the backward of such a gather is
an ``index_put`` into zeros (DGL's fused kernels have no per-edge tensor); its max
aggregation is a ``scatter_reduce_`` that autograd saves with a clone of its zeros; its
LSTM gathers a ``(B, d, W)`` mailbox per in-degree bucket and shares one zero state for
``h0`` and ``c0``; its GAT gathers ``el[src]``, ``er[dst]`` and ``z[src]`` and runs
``torch_geometric.utils.softmax`` (max, ``exp``, sum, gathered denominator, division).
Neither backend's aggregation keeps a copy of its input (DGL's sparse sum keeps the
graph, PyG's gather its index): where only ``fc_self`` keeps a layer's input (mean
without ``lin_before_mp``, LSTM) a dropped input (held by nothing else) is freed by
``fc_self``'s node, before ``AccumulateGrad`` and autocast's gradient casts run. The
peak is therefore the maximum over the whole timeline (end of
forward, the widest layer's transient, inside the backward where gradients of one
layer coexist with saved activations of the layers below), not a sum of parts.

The only non-exact parts are backend constants (:mod:`betty.memory.constants`): the
LSTM kernel's internal state per degree bucket, and the device graph formats. Tiny
tensors (scalars, per-bucket index lists of a few elements) are omitted or
approximated; they are far below the 1% level for any non-trivial micro-batch.

All sizes are per-micro-batch vectors, so one replay estimates every micro-batch of a split.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from betty.memory.constants import BackendConstants
from betty.memory.ops import (ACT, ATT, BWD, DROP, FEATS, FLOAT32_BYTES, GRADS, INDEX_BYTES, LABELS, LOSS,
                              NEXT_INPUTS, PARAMS, StepConfig, bce_backward, bce_forward,
                              edge_softmax_backward, hash_chunk_rows,
                              hash_words, multilabel_correct, numel, index_backward, param_grads, pyg_edge_scores,
                              pyg_edge_scores_backward, pyg_scatter_mean, pyg_softmax_backward,
                              pyg_softmax_forward, step_baseline, through)
from betty.memory.sizes import MicroBatchSizes
from betty.memory.spec import ModelSpec, parameter_shapes
from betty.memory.timeline import Buffer, Timeline

__all__ = ["ReplayConfig", "replay", "input_bytes", "INDEX_BYTES"]

# components of the breakdown besides the shared ones (betty.memory.ops); all indices are
# int64 (INDEX_BYTES: betty builds blocks with idtype=int64)
BLOCKS, IDS, AGG, LSTM = "blocks", "global_ids", "aggregation", "lstm"
METRICS = "metrics"  # count_correct's tensors after the backward
# dgl.create_block keeps a 2-element int64 tensor per block that PyTorch allocates on
# the host (measured: 16 bytes per layer of DGL blocks on the host, none with PyG)
DGL_BLOCK_HOST_BYTES = 16


@dataclass
class ReplayConfig(StepConfig):
    """Everything :func:`replay` needs besides the sizes: the step's
    :class:`~betty.memory.ops.StepConfig` fields (keyword arguments) and

    Attributes:
        model: the model's shapes.
        constants: the backend's constants.
        training: dropout active (betty trains in ``model.train()``).
    """

    model: ModelSpec
    constants: BackendConstants
    training: bool = True


def replays_mixed_precision(model: ModelSpec, host: bool = True) -> bool:
    """Whether the replay follows a mixed-precision (autocast) step of ``model``'s
    architecture on the host (``host``) or on CUDA: SAGE with the mean, gcn or pool
    aggregator, GAT and GCN; SAGE with the LSTM aggregator on the host only, where
    :class:`~betty.backends.lstm.AutocastLSTM` runs the LSTM in float32 (CUDA autocast
    runs it in its own dtype through cuDNN, a step not checked against a trace); with
    single-label or multi-label targets. ``32`` and ``64`` cover every model."""
    if model.arch in ("gcn", "gat"):
        return True
    return model.arch == "sage" and (model.aggregator in ("mean", "gcn", "pool")
                                     or (model.aggregator == "lstm" and host))


class _Replayer:
    def __init__(self, sizes: MicroBatchSizes, cfg: ReplayConfig) -> None:
        self.s = sizes
        self.cfg = cfg
        self.e = cfg.elt
        self.tl = Timeline(sizes.num_micro_batches, cfg.constants.granule_bytes)
        self.fresh = np.asarray(cfg.fresh_grads, dtype=bool)
        self.pelt = cfg.model.param_dtype.itemsize
        self.shapes = parameter_shapes(cfg.model)
        self.pyg = cfg.model.backend == "pyg"
        self.dropout_on = cfg.training and cfg.model.dropout > 0  # feature dropout in the forward
        self.ce = int(cfg.autocast_elt)  # autocast's compute bytes (0: no autocast)
        self._region_casts: list[Buffer] = []  # autocast's cached copies, freed at its exit
        # a layer whose output is not in the dtype its ops left in self.e sets it here
        # (under autocast: a float32 parameter added last promotes the output)
        self.out_e: int | None = None
        # DGL's pool layers, per layer: the micro-batches whose block has no edges (betty's
        # EdgelessPoolSAGEConv runs there) and those that start without fc_pool's .grad
        spec = cfg.model
        dgl_pool = spec.arch == "sage" and spec.aggregator == "pool" and not self.pyg
        self.edgeless = [np.asarray(sizes.num_edges[l]) == 0 if dgl_pool
                         else np.zeros(sizes.num_micro_batches, dtype=bool)
                         for l in range(spec.num_layers)]
        self.pool_fresh = [self._pool_grads_fresh(edgeless) for edgeless in self.edgeless]
        if self.ce and not replays_mixed_precision(cfg.model, cfg.host):
            raise NotImplementedError(
                "the memory replay under a mixed precision covers SAGE with the mean, "
                "gcn or pool aggregator, GAT and GCN, and SAGE with the lstm aggregator on "
                f"the host; got arch {cfg.model.arch!r}, aggregator "
                f"{cfg.model.aggregator!r} on {'the host' if cfg.host else 'CUDA'} "
                "(precision '32' and '64' cover every model)")

    # ------------------------------------------------------------------ params
    def param_grads(self, shapes, tag: str, casts: list[Buffer] | None = None,
                    cast: bool = True) -> None:
        """Gradients of ``shapes`` produced by one backward node, one tensor each
        (:func:`~betty.memory.ops.param_grads`).

        Under autocast, where autocast cast the parameters (``cast``: not for a bias
        added outside a product, which stays in ``param_dtype``), the node produces them
        in the compute dtype; then its saved ``casts`` (autocast's copies of the
        weights) go, and each gradient goes through the cast's backward (a
        ``param_dtype`` copy, the low-precision one freed) into ``AccumulateGrad``."""
        tl = self.tl
        if not self.ce or not cast:
            for shape in shapes:
                name = f"{tag} grad {shape}"
                param_grads(tl, numel(shape) * self.pelt, self.fresh, name, name)
            return
        self.autocast_mm_bwd(shapes, casts or [], [], None, 0, tag)

    def held_param_grads(self, shapes, tag: str) -> list[Buffer]:
        """The gradients of ``shapes`` one product's backward makes beside its input's
        gradient: where the micro-batch has no ``.grad`` yet they become it and stay;
        elsewhere each is a transient the node holds until ``AccumulateGrad`` adds it
        in, after the node's other output exists. Returns those transients, for the
        caller to release then."""
        held = []
        for shape in shapes:
            nbytes = numel(shape) * self.pelt
            self.tl.alloc(np.where(self.fresh, nbytes, 0.0), GRADS, f"{tag} grad {shape}")
            held.append(self.tl.alloc(np.where(self.fresh, 0.0, nbytes), GRADS, f"{tag} grad {shape} accumulated"))
        return held

    def _product_bwd(self, shapes, casts: list[Buffer], node_inputs: list[Buffer], x_numel,
                     x_elt: int, tag: str, x_label: str) -> Buffer | None:
        """Backward of a product ``x @ W``: :meth:`autocast_mm_bwd` under autocast; else
        ``W``'s gradients (:meth:`held_param_grads`), then ``x``'s (``x_numel`` elements of
        ``x_elt`` bytes, named ``x_label``; None where ``x`` needs no gradient), then
        ``node_inputs`` freed, then the accumulated gradients."""
        if self.ce:
            return self.autocast_mm_bwd(shapes, casts, node_inputs, x_numel, x_elt, tag)
        held = self.held_param_grads(shapes, f"{tag} weight")
        gx = None if x_numel is None else self.tl.alloc(x_numel * x_elt, BWD, f"{tag} {x_label}")
        self.tl.release(*node_inputs)
        self.tl.release(*held)
        return gx

    def autocast_mm_bwd(self, shapes, casts: list[Buffer], node_inputs: list[Buffer],
                        x_numel, x_elt: int, tag: str, weight_first: bool = True,
                        meanwhile: Callable[[], None] | None = None) -> Buffer | None:
        """Backward of a product ``x @ W`` that ran under autocast (``W``: the parameters
        ``shapes``, cast to the compute dtype; ``x``: ``x_numel`` elements of ``x_elt``
        bytes, None where ``x`` needs no gradient).

        The product's node gives the gradients of ``W`` and of ``x`` in the compute
        dtype (``weight_first``: ``W``'s first, as ``mm`` does; ``addmm`` gives ``x``'s
        first), then lets go of ``node_inputs`` (its incoming gradient and its saved
        copy of ``x``) and of the saved ``casts``. Then the casts' backward nodes run,
        the latest cast first: ``x``'s gradient becomes an ``x_elt`` copy where ``x``
        was cast (returned), then each parameter's a ``param_dtype`` copy that goes into
        ``AccumulateGrad`` (kept on a fresh micro-batch, added in place elsewhere).
        ``meanwhile``: run once the node has let go of its inputs (what other
        micro-batches run at that point, :meth:`_sage_pool_by_edges`)."""
        tl = self.tl

        def low_weights() -> list[Buffer]:
            return [tl.alloc(numel(shape) * self.ce, GRADS, f"{tag} grad {shape} (autocast)")
                    for shape in shapes]

        low = low_weights() if weight_first else []
        gx = None
        if x_numel is not None:
            gx = tl.alloc(x_numel * self.ce, BWD, f"{tag} grad input (autocast)")
        if not weight_first:
            low = low_weights()
        tl.release(*node_inputs, *casts)
        if meanwhile is not None:
            meanwhile()
        if gx is not None and x_elt != self.ce:
            full = tl.alloc(x_numel * x_elt, BWD, f"{tag} grad input")
            tl.release(gx)
            gx = full
        for shape, b in zip(shapes, low):
            g = tl.alloc(numel(shape) * self.pelt, GRADS, f"{tag} grad {shape}")
            tl.release(b)
            tl.release_where(g, ~self.fresh)
        return gx

    # ------------------------------------------------------------------ autocast
    def wide(self, elt: int | None = None) -> int:
        """Bytes per element of an op's result on a tensor of ``elt`` bytes (default
        ``self.e``) and a parameter (``param_dtype``): under autocast, where every 2-byte
        tensor is in the compute dtype and parameters are float32, type promotion gives
        the wider of the two (a compute-dtype tensor meeting a float32 parameter becomes
        float32); without autocast the step runs in one dtype, ``elt``."""
        elt = self.e if elt is None else elt
        return max(elt, self.pelt) if self.ce else elt

    def cast_grad(self, g: Buffer, nelem, elt: int, tag: str, src: int | None = None) -> Buffer:
        """The engine's cast of a gradient ``g`` (``nelem`` elements of ``src`` bytes,
        default ``self.e``; released) to ``elt`` bytes, the dtype of the tensor it is
        the gradient of, where they differ (a compute-dtype tensor that met a float32
        operand, or the reverse); ``g`` itself otherwise."""
        if elt == (self.e if src is None else src):
            return g
        gc = self.tl.alloc(nelem * elt, BWD, f"{tag} (cast)")
        self.tl.release(g)
        return gc

    @contextlib.contextmanager
    def elt(self, elt: int) -> Iterator[None]:
        """Run the shared op sequences (aggregations and their backward) on tensors of
        ``elt`` bytes per element (under autocast: the compute dtype after a product)."""
        saved, self.e = self.e, elt
        try:
            yield
        finally:
            self.e = saved

    def cast_input(self, nelem, in_elt: int, tag: str) -> Buffer | None:
        """Autocast's copy of a linear layer's input in the compute dtype, where the
        input (``nelem`` elements of ``in_elt`` bytes) is not in it already; None
        otherwise (and without autocast). The linear layer saves the copy."""
        if not self.ce or in_elt == self.ce:
            return None
        return self.tl.alloc(nelem * self.ce, ACT, f"{tag} input (autocast copy)")

    def cast_params(self, shapes, saved: bool, tag: str) -> list[Buffer]:
        """Autocast's cached compute-dtype copies of a linear layer's parameters
        (``shapes``: a bias first, as ``addmm`` casts it, then the weight). A weight's
        copy is saved for backward when the layer's input needs a gradient (returned:
        the caller releases it in backward); the others stay in autocast's cache until
        the autocast region ends."""
        if not self.ce:
            return []
        kept = []
        for shape in sorted(shapes, key=len):
            b = self.tl.alloc(numel(shape) * self.ce, PARAMS, f"{tag} {shape} (autocast copy)")
            if saved and len(shape) > 1:
                kept.append(b)
            else:
                self._region_casts.append(b)
        return kept

    def _pool_grads_fresh(self, edgeless: np.ndarray) -> np.ndarray:
        """``(P,)``: the micro-batch starts without ``.grad`` of a pool layer's
        ``fc_pool``, the layer's block having no edges in the micro-batches ``edgeless``.
        The micro-batches run in order, each after the one before it in the same step
        unless it starts fresh (``cfg.fresh_grads``). An edgeless micro-batch gives
        ``fc_pool`` no gradient (:meth:`_sage_pool_edgeless`), so after a fresh start it
        has none until a micro-batch with edges creates it."""
        fresh = np.zeros_like(self.fresh)
        absent = False
        for p, starts in enumerate(self.fresh):
            absent = absent or bool(starts)
            fresh[p] = absent
            absent = absent and bool(edgeless[p])
        return fresh

    @contextlib.contextmanager
    def grads_fresh(self, fresh: np.ndarray) -> Iterator[None]:
        """Create the parameter gradients of the backward nodes run inside where
        ``fresh`` (``(P,)``: no ``.grad`` of those parameters yet), and accumulate them
        elsewhere, instead of following ``cfg.fresh_grads``."""
        saved, self.fresh = self.fresh, fresh
        try:
            yield
        finally:
            self.fresh = saved

    def baseline(self) -> None:
        all_shapes = [s for layer in self.shapes for s in layer]
        pbytes = sum(numel(s) for s in all_shapes) * self.pelt
        # fc_pool's .grad does not exist yet where only edgeless micro-batches ran since
        # the step started
        absent = sum(np.where(fresh & ~self.fresh, numel(shp[0]) + numel(shp[1]), 0)
                     for shp, fresh in zip(self.shapes, self.pool_fresh))
        step_baseline(self.tl, self.cfg, pbytes, len(all_shapes),
                      grad_bytes=pbytes - absent * self.pelt)

    # ------------------------------------------------------------------ dropout
    def dropout_fwd(self, h: Buffer, n, width: int, needs_grad: bool, tag: str) -> Buffer:
        """Input dropout of a ``(n, width)`` tensor; returns the new output buffer."""
        cfg, tl, e = self.cfg, self.tl, self.e
        if cfg.model.dropout_mode == "standard":
            # host: a float noise tensor (bernoulli, scaled) then input * noise, the noise
            # saved for backward; CUDA's fused kernel keeps a bool mask instead
            mask_elt = e if cfg.host else 1
            mask = tl.alloc(n * width * mask_elt, DROP, f"{tag} dropout mask")
            out = tl.alloc(n * width * e, DROP, f"{tag} dropout out")
            if not needs_grad:
                tl.release(mask)
                mask = None
            self._std_mask = mask
            return out
        self._hash_mask(n, width, tag)
        out = tl.alloc(n * width * e, DROP, f"{tag} dropout out")
        self._hash_chunks(n, width, tag)
        return out

    def _hash_mask(self, n, width: int, tag: str) -> None:
        self._rows, self._cols = hash_words(self.tl, n, width, DROP, f"{tag} dropout")

    def _hash_chunks(self, n, width: int, tag: str) -> None:
        tl = self.tl
        rows_per_chunk = hash_chunk_rows(n, width)
        scratch = tl.alloc(rows_per_chunk * width * INDEX_BYTES, DROP, f"{tag} dropout scratch")
        keep = tl.alloc(rows_per_chunk * width, DROP, f"{tag} dropout keep chunk")
        tl.release(self._rows, self._cols, scratch, keep)

    def dropout_bwd(self, g: Buffer, n, width: int, tag: str, mask: Buffer | None = None) -> Buffer:
        tl, e = self.tl, self.e
        if self.cfg.model.dropout_mode == "standard":
            out = tl.alloc(n * width * e, BWD, f"{tag} dropout grad")
            tl.release(g, mask)
            return out
        self._hash_mask(n, width, tag)
        out = tl.alloc(n * width * e, BWD, f"{tag} dropout grad")
        self._hash_chunks(n, width, tag)
        tl.release(g)
        return out

    # ------------------------------------------------------------------ helpers
    def accumulate_src_grad(self, g_full: Buffer, g_dst: Buffer | None, n_src, width, tag) -> Buffer:
        """``g_full`` (n_src, W) plus the gradient of the ``[:n_dst]`` slice
        (``slice_backward`` pads it to (n_src, W), then an out-of-place add)."""
        tl, e = self.tl, self.e
        if g_dst is None:
            return g_full
        sb = tl.alloc(n_src * width * e, BWD, f"{tag} slice_backward")
        tl.release(g_dst)
        acc = tl.alloc(n_src * width * e, BWD, f"{tag} grad accumulate")
        tl.release(g_full, sb)
        return acc

    def bucket_sum(self, run, have, new, mask, tag: str):
        """Sum per-bucket gradients out of place, in the micro-batches that have the bucket.

        ``run``: per tensor, the buffers holding the running sum (None before the first
        bucket); ``have``: ``(P,)`` micro-batches where a running sum exists; ``new``: this
        bucket's gradient per tensor (0 bytes where ``mask`` is False, the micro-batches
        without this degree bucket). Where ``mask & have`` each tensor's sum is
        allocated and its old parts freed (tensor by tensor), then the bucket's own
        gradients are freed; where only ``mask`` the bucket's gradient becomes the sum.
        Returns ``(run, have)``.
        """
        tl = self.tl
        if run is None:
            return [[b] for b in new], np.asarray(mask, dtype=bool).copy()
        both = mask & have
        out = []
        for parts, b in zip(run, new):
            summed = tl.alloc(np.where(both, b.size, 0.0), b.component, f"{tag} sum")
            for part in parts:
                tl.free_where(part, both)
            out.append(parts + [summed])
        for b in new:
            tl.free_where(b, both)
        return [parts + [b] for parts, b in zip(out, new)], have | mask

    # ------------------------------------------------------------------ SAGE
    def sage_layer(self, l: int, h: Buffer, h_grad: bool):
        s = self.s
        agg = self.cfg.model.aggregator
        wi, wo = self.cfg.model.widths[l], self.cfg.model.widths[l + 1]
        n_src, n_dst, n_e = s.n_src[l], s.n_dst[l], s.num_edges[l]
        lbm = wi > wo
        tag = f"layer {l} sage-{agg}"
        shp = self.shapes[l]
        if agg == "mean":
            return self._sage_mean(tag, shp, h, h_grad, n_src, n_dst, n_e, wi, wo, lbm)
        if agg == "gcn":
            return self._sage_gcn(tag, shp, h, h_grad, n_src, n_dst, n_e, wi, wo, lbm)
        if agg == "pool":
            return self._sage_pool_by_edges(tag, shp, l, h, h_grad, n_src, n_dst, n_e, wi, wo)
        lstm = self._pyg_sage_lstm if self.pyg else self._sage_lstm
        return lstm(tag, shp, l, h, h_grad, n_src, n_dst, n_e, wi, wo)

    def _fc_out(self, tag, n_dst, wo, autocast=None) -> Buffer:
        """SAGEConv's output ``fc_neigh(h_neigh) + fc_self(h[:n_dst])``: the two
        ``(n_dst, wo)`` ``addmm``/``mm`` results, then their out-of-place sum (the two
        products freed). ``autocast``: a callable run before each product with its
        name (``"fc_neigh"``, ``"fc_self"``), for autocast's casts."""
        tl = self.tl
        if autocast is not None:
            autocast("fc_neigh")
        e = self.e
        mm = tl.alloc(n_dst * wo * e, ACT, f"{tag} fc_neigh")
        if autocast is not None:
            autocast("fc_self")
        f = tl.alloc(n_dst * wo * e, ACT, f"{tag} fc_self")
        out = tl.alloc(n_dst * wo * e, ACT, f"{tag} out")
        tl.release(f, mm)
        return out

    def _fc_self_bwd(self, tag, fc_self, n_dst, wi, h_grad: bool, casts=None,
                     saved: Buffer | None = None, g: Buffer | None = None,
                     meanwhile: Callable[[], None] | None = None) -> Buffer | None:
        """Backward of ``fc_self(h[:n_dst])`` (the first node the gradient of ``out``
        reaches, unless ``fc_self`` ran first): the ``(n_dst, wi)`` gradient of
        ``h[:n_dst]`` (``addmm``: the input's first) where ``h`` needs one, then
        ``fc_self``'s weight and bias gradients; the node then lets go of ``g`` (the
        gradient of ``out``, where no node after it uses it) and ``saved`` (``h``, where
        it saved ``h[:n_dst]`` itself; ``casts``: its saved autocast copies), and
        ``meanwhile`` runs (:meth:`autocast_mm_bwd`), before ``AccumulateGrad`` takes the
        gradients (:meth:`held_param_grads`; under autocast, before the casts' backward:
        :meth:`autocast_mm_bwd`). Returns the former."""
        gs = self.tl.alloc(n_dst * wi * self.e, BWD, f"{tag} grad h_dst") if h_grad else None
        if self.ce:
            self.autocast_mm_bwd(fc_self, casts or [], [g, saved], None, 0, f"{tag} fc_self",
                                 meanwhile=meanwhile)
            return gs
        held = self.held_param_grads(fc_self, f"{tag} fc_self")
        self.tl.release(g, saved)
        if meanwhile is not None:
            meanwhile()
        self.tl.release(*held)
        return gs

    # ------------------------------------------------------------------ aggregations
    # The two backends aggregate with different ops: DGL with fused sparse kernels
    # (gspmm: no per-edge tensor), PyG with a gather of the (E, W) messages and a
    # scatter into zeros (scatter's backward: a gather, then index_put into zeros).
    def _mean_aggregate(self, tag, n_dst, n_e, w):
        """Mean over in-edges of a ``(n_src, w)`` input: ``(degrees, mean)`` buffers."""
        tl, e = self.tl, self.e
        if self.pyg:  # scatter(x[src], dst, reduce="mean")
            return pyg_scatter_mean(tl, AGG, n_e, n_dst, w, e, tag)
        z = tl.alloc(n_dst * w * e, AGG, f"{tag} sum")
        deg = self._degrees(n_dst, tag, clamp=True)
        q = tl.alloc(n_dst * w * e, AGG, f"{tag} mean")
        tl.release(z)
        return deg, q

    def _copy_u_sum_bwd(self, g_dst: Buffer, n_src, n_e, w, tag) -> Buffer:
        """Gradient ``(n_src, w)`` of a sum over in-edges from the ``(n_dst, w)``
        gradient ``g_dst`` (released)."""
        tl, e = self.tl, self.e
        if not self.pyg:
            gz = tl.alloc(n_src * w * e, BWD, f"{tag} grad h (gspmm)")
            tl.release(g_dst)
            return gz
        ge = tl.alloc(n_e * w * e, BWD, f"{tag} grad messages (gather)")
        tl.release(g_dst)
        return self._index_bwd(ge, n_src, w, tag)

    def _index_bwd(self, g_rows: Buffer | None, n_src, w, tag) -> Buffer:
        """Backward of ``x[index]`` (``x`` of ``(n_src, w)``): zeros, then an
        out-of-place ``index_put`` accumulating ``g_rows`` (released unless None;
        :func:`~betty.memory.ops.index_backward`)."""
        return index_backward(self.tl, g_rows, n_src * w * self.e, tag)

    def _degrees(self, n_dst, tag, clamp: bool) -> Buffer:
        """``in_degrees()`` as a float vector (DGL's result itself is not a torch tensor)."""
        tl = self.tl
        tl.temp(n_dst * INDEX_BYTES, AGG, f"{tag} dst arange")
        if clamp:
            return through(self.tl, AGG, n_dst * INDEX_BYTES, f"{tag} degree clamp",
                           n_dst * self.e, f"{tag} degrees")
        return tl.alloc(n_dst * self.e, AGG, f"{tag} degrees")

    # ------------------------------------------------------------------ SAGE, shared
    # mean and gcn: fc_neigh runs on the sources before message passing
    # (``lin_before_mp``) when in_feats > out_feats, else on the aggregated destinations.
    def _lin_before_mp(self, tag, n_src, wi, wo, lbm: bool, autocast=None, elt=None):
        """``fc_neigh(h)`` on the ``(n_src, wi)`` sources where ``lbm``: returns the
        ``(n_src, wo)`` result (``elt`` bytes per element, default ``self.e``) and the
        width aggregated (``(None, wi)`` otherwise). ``autocast``: run before the
        product, for autocast's casts."""
        if not lbm:
            return None, wi
        if autocast is not None:
            autocast("fc_neigh")
        return self.tl.alloc(n_src * wo * (elt or self.e), AGG, f"{tag} fc_neigh(src)"), wo

    def _fc_neigh_bwd(self, g: Buffer, q: Buffer | None, fc_neigh, rows, wi, h_grad: bool, tag,
                      name: str, casts=None, x_elt: int | None = None) -> Buffer | None:
        """Backward of ``fc_neigh(q)`` on the ``(rows, wi)`` ``q``: the destinations'
        aggregate, or the sources' ``h`` where the linear map comes before message passing
        (``name`` ``h``). ``g`` and ``q`` are released (``q`` is ``None`` where the product
        saved its input itself); returned: ``q``'s gradient (``grad {name}``) where ``h``
        needs one, after the weight gradient. Under autocast (``casts``: its saved autocast
        copies; ``x_elt``: ``q``'s bytes per element) :meth:`autocast_mm_bwd`."""
        if self.ce:
            return self.autocast_mm_bwd(fc_neigh, casts or [], [g, q],
                                        rows * wi if h_grad else None, x_elt or self.e,
                                        f"{tag} fc_neigh")
        held = self.held_param_grads(fc_neigh, f"{tag} fc_neigh")
        gq = self.tl.alloc(rows * wi * self.e, BWD, f"{tag} grad {name}") if h_grad else None
        self.tl.release(g, q)
        self.tl.release(*held)
        return gq

    def _div_bwd(self, g: Buffer, deg: Buffer | None, n_dst, w, tag, name: str,
                 x_elt: int | None = None) -> Buffer:
        """Backward of ``x / deg`` (``deg`` broadcast over the ``w`` columns) for ``x``:
        the ``(n_dst, w)`` ``g / deg`` (``grad {name}``), cast to ``x``'s ``x_elt`` bytes
        where ``x`` is in another dtype (:meth:`cast_grad`); ``g`` and the saved ``deg``
        released."""
        gd = self.tl.alloc(n_dst * w * self.e, BWD, f"{tag} grad {name}")
        if x_elt is not None:
            gd = self.cast_grad(gd, n_dst * w, x_elt, f"{tag} grad {name}")
        self.tl.release(g, deg)
        return gd

    def _sage_mean(self, tag, shp, h, h_grad, n_src, n_dst, n_e, wi, wo, lbm):
        """SAGEConv mean: ``fc_neigh(mean_{in-edges} h_src) + fc_self(h[:n_dst])``
        (``lbm``: ``mean(fc_neigh(h)) + fc_self(h[:n_dst])``); the mean is the
        backend's (:meth:`_mean_aggregate`).

        Under autocast each linear layer first casts its parameters (:meth:`cast_params`)
        and, where the input is not in the compute dtype (float32 features in the first
        layer), its input (:meth:`cast_input`: the copy is saved instead of the input);
        everything after a linear layer is in the compute dtype."""
        tl = self.tl
        in_e = self.e
        fc_neigh, fc_self = [shp[0]], shp[1:]
        agg_grad = h_grad or lbm
        casts = {"fc_neigh": [], "fc_self": []}
        copies = {}

        pending = []  # the aggregated q once autocast's copy of it replaced it

        def autocast(name: str) -> None:
            if not self.ce:
                return
            if name == "fc_self" and self.pyg and pending:
                tl.release(pending.pop())  # PyG drops q after fc_neigh (DGL: with its scope)
            casts[name] = self.cast_params(fc_neigh if name == "fc_neigh" else fc_self,
                                           h_grad, f"{tag} {name}")
            if name == "fc_self":
                copies[name] = self.cast_input(n_dst * wi, in_e, f"{tag} fc_self")
            elif lbm:
                copies[name] = self.cast_input(n_src * wi, in_e, f"{tag} fc_neigh")
            else:
                copies[name] = self.cast_input(n_dst * wi, in_e, f"{tag} fc_neigh")
            self.e = self.ce

        m, w = self._lin_before_mp(tag, n_src, wi, wo, lbm, autocast)
        deg, q = self._mean_aggregate(tag, n_dst, n_e, w)
        if not agg_grad:
            tl.release(deg)
            deg = None
        if lbm:
            autocast("fc_self")
            f = tl.alloc(n_dst * wo * self.e, ACT, f"{tag} fc_self")
            out = tl.alloc(n_dst * wo * self.e, ACT, f"{tag} out")
            tl.release(f, m, q)
        else:
            if self.ce and in_e != self.ce:
                pending.append(q)
            out = self._fc_out(tag, n_dst, wo, autocast)
            if copies.get("fc_neigh") is not None:  # fc_neigh saved the copy; q goes
                tl.release(*pending)
                q = copies["fc_neigh"]
        # fc_self saves h[:n_dst], and fc_neigh(h) on the sources (lbm) saves h, each
        # unless it saved autocast's copy instead; the mean's sparse sum (DGL) and gather
        # (PyG) keep no copy of h
        hh = None if copies.get("fc_self") is not None else h
        hn = h if lbm and copies.get("fc_neigh") is None else None
        tl.hold(hh, hn)
        self_casts = casts["fc_self"] + [c for c in [copies.get("fc_self")] if c is not None]
        neigh_casts = casts["fc_neigh"]
        if lbm and copies.get("fc_neigh") is not None:
            neigh_casts = neigh_casts + [copies["fc_neigh"]]

        def backward(g: Buffer) -> Buffer | None:
            gs = self._fc_self_bwd(tag, fc_self, n_dst, wi, h_grad, self_casts, hh)
            if lbm:
                gd = self._div_bwd(g, deg, n_dst, wo, tag, "mean")
                gz = self._copy_u_sum_bwd(gd, n_src, n_e, wo, tag)
                gh = self._fc_neigh_bwd(gz, hn, fc_neigh, n_src, wi, h_grad, tag, "h", neigh_casts, in_e)
                return self.accumulate_src_grad(gh, gs, n_src, wi, tag) if h_grad else None
            gq = self._fc_neigh_bwd(g, q, fc_neigh, n_dst, wi, h_grad, tag, "mean", neigh_casts,
                                    in_e)
            if not h_grad:
                return None
            gd = self._div_bwd(gq, deg, n_dst, wi, tag, "sum")
            gz = self._copy_u_sum_bwd(gd, n_src, n_e, wi, tag)
            return self.accumulate_src_grad(gz, gs, n_src, wi, tag)

        return out, backward

    def _sage_gcn(self, tag, shp, h, h_grad, n_src, n_dst, n_e, wi, wo, lbm):
        """SAGEConv gcn: ``fc_neigh((sum_{in-edges} h_src + h_dst) / (deg + 1)) + bias``
        (``lbm``: ``fc_neigh`` applied to the sources first); the sum is the backend's
        (:meth:`_gcn_aggregate`).

        Under autocast ``fc_neigh`` casts its weight and, where it is not in the compute
        dtype, its input (the copy is saved instead of the input) and gives the compute
        dtype; the aggregation of its output (``lbm``) stays in it up to ``/ (deg +
        1)``, whose degrees (in the layer input's dtype) give the wider of the two; ``+
        bias`` (float32) then makes the layer's output float32 (:meth:`wide`)."""
        tl, e = self.tl, self.e
        lo = self.ce or e  # fc_neigh's output dtype
        fc_neigh, bias = [shp[0]], [shp[1]]
        agg_grad = h_grad or lbm
        casts: list[Buffer] = []
        x_copy = None
        if lbm:
            casts = self.cast_params(fc_neigh, h_grad, f"{tag} fc_neigh")
            x_copy = self.cast_input(n_src * wi, e, f"{tag} fc_neigh")
            if x_copy is not None:
                casts.append(x_copy)  # saved instead of h
        m, w = self._lin_before_mp(tag, n_src, wi, wo, lbm, elt=lo)
        we = lo if lbm else e  # the aggregated tensor's dtype
        q_e = max(we, e)  # / (deg + 1), deg in the input's dtype
        z, deg, deg1, q = self._gcn_aggregate(tag, n_dst, n_e, w, we)
        out_e = self.out_e = self.wide(lo if not lbm else q_e)  # + bias
        if not agg_grad:
            tl.release(deg1)
            deg1 = None
        if lbm:
            out = tl.alloc(n_dst * wo * out_e, ACT, f"{tag} out")
            tl.release(z, m, q, deg)
        else:
            casts = self.cast_params(fc_neigh, h_grad, f"{tag} fc_neigh")
            q_copy = self.cast_input(n_dst * wi, e, f"{tag} fc_neigh")
            mm = tl.alloc(n_dst * wo * lo, ACT, f"{tag} fc_neigh")
            if q_copy is not None:  # fc_neigh saved the copy; q goes
                tl.release(q)
                q = q_copy
            out = tl.alloc(n_dst * wo * out_e, ACT, f"{tag} out")
            tl.release(z, mm, deg)
        h_saved = lbm and x_copy is None
        if h_saved:
            tl.hold(h)  # fc_neigh(feat_src) saves its input

        def backward(g: Buffer) -> Buffer | None:
            if not lbm and lo != out_e:  # + bias: the engine casts fc_neigh's gradient first
                g_mm = tl.alloc(n_dst * wo * lo, BWD, f"{tag} grad fc_neigh (cast)")
                self.param_grads(bias, f"{tag} bias", cast=False)
                tl.release(g)
                g = g_mm
            else:
                self.param_grads(bias, f"{tag} bias", cast=False)
            if lbm:
                g = self.cast_grad(g, n_dst * wo, q_e, f"{tag} grad normalized", src=out_e)
                with self.elt(q_e):
                    gd = self._div_bwd(g, deg1, n_dst, wo, tag, "normalized", lo)
                with self.elt(lo):
                    acc = self._gcn_neigh_bwd(gd, n_src, n_e, wo, tag)
                return self._fc_neigh_bwd(acc, h if h_saved else None, fc_neigh, n_src, wi, h_grad, tag,
                                          "h", casts, e)
            gq = self._fc_neigh_bwd(g, q, fc_neigh, n_dst, wi, h_grad, tag, "normalized",
                                    casts, e)
            if not h_grad:
                return None
            gd = self._div_bwd(gq, deg1, n_dst, wi, tag, "sum + self")
            return self._gcn_neigh_bwd(gd, n_src, n_e, wi, tag)

        return out, backward

    def _gcn_aggregate(self, tag, n_dst, n_e, w, we: int | None = None):
        """``(sum_{in-edges} x_src + x_dst) / (deg + 1)``: the ``(sum, degrees,
        degrees + 1, normalized)`` buffers (``sum`` None where it is already freed).
        ``we``: bytes per element of ``x`` and the sums (default ``self.e``, the dtype
        of the degrees); the normalized result is in the wider of the two."""
        tl, e = self.tl, self.e
        we = we or e
        if self.pyg:  # in_degrees() (bincount, cast), scatter(x[src], dst, reduce="sum")
            deg = through(self.tl, AGG, n_dst * INDEX_BYTES, f"{tag} bincount",
                          n_dst * e, f"{tag} degrees")
            z = through(self.tl, AGG, n_e * w * we, f"{tag} messages", n_dst * w * we,
                        f"{tag} sum")
            sm = tl.alloc(n_dst * w * we, AGG, f"{tag} sum + self")
            tl.release(z)
            z = None
        else:
            z = tl.alloc(n_dst * w * we, AGG, f"{tag} sum")
            deg = self._degrees(n_dst, tag, clamp=False)
            sm = tl.alloc(n_dst * w * we, AGG, f"{tag} sum + self")
        deg1 = tl.alloc(n_dst * e, AGG, f"{tag} degrees + 1")
        q = tl.alloc(n_dst * w * max(we, e), AGG, f"{tag} normalized")
        tl.release(sm)
        return z, deg, deg1, q

    def _gcn_neigh_bwd(self, gd: Buffer, n_src, n_e, w, tag) -> Buffer:
        """``(n_src, w)`` gradient of ``sum_{in-edges} x_src + x_src[:n_dst]`` from
        ``gd`` ``(n_dst, w)`` (released)."""
        tl, e = self.tl, self.e
        if not self.pyg:
            gz = tl.alloc(n_src * w * e, BWD, f"{tag} grad h (gspmm)")
            return self.accumulate_src_grad(gz, gd, n_src, w, tag)
        sb = tl.alloc(n_src * w * e, BWD, f"{tag} slice_backward")
        gi = self._copy_u_sum_bwd(gd, n_src, n_e, w, tag)
        acc = tl.alloc(n_src * w * e, BWD, f"{tag} grad accumulate")
        tl.release(sb, gi)
        return acc

    def _sage_pool_by_edges(self, tag, shp, l, h, h_grad, n_src, n_dst, n_e, wi, wo):
        """SAGEConv pool: :meth:`_sage_pool`, and on DGL, in the micro-batches whose block
        has no edges, :meth:`_sage_pool_edgeless` (betty's ``EdgelessPoolSAGEConv``).
        Where a layer has both kinds, each sequence allocates :meth:`Timeline.within` its
        own micro-batches, and the two outputs, like the two gradients of ``h``, are one
        tensor (merged). Both backwards use the gradient of the output and ``h``: the
        edgeless one lets go of them at ``fc_self``'s node and then the other one runs
        (``meanwhile``), so that in each micro-batch they go where its own sequence frees
        them."""
        edgeless = self.edgeless[l]
        if not edgeless.any():
            return self._sage_pool(tag, shp, l, h, h_grad, n_src, n_dst, n_e, wi, wo)
        if edgeless.all():
            return self._sage_pool_edgeless(tag, shp, h, h_grad, n_src, n_dst, wi, wo)
        tl, in_e = self.tl, self.e
        with tl.within(~edgeless):
            out, edges_bwd = self._sage_pool(tag, shp, l, h, h_grad, n_src, n_dst, n_e, wi, wo)
        self.e = in_e  # the edgeless sequence starts from the layer's input too
        with tl.within(edgeless):
            out_edgeless, edgeless_bwd = self._sage_pool_edgeless(tag, shp, h, h_grad, n_src,
                                                                  n_dst, wi, wo)
        out = tl.merge(out, out_edgeless)

        def backward(g: Buffer) -> Buffer | None:
            tl.hold(g)  # each sequence lets go of it
            edges_grad = []

            def meanwhile() -> None:
                with tl.within(~edgeless):
                    edges_grad.append(edges_bwd(g))

            with tl.within(edgeless):
                gh = edgeless_bwd(g, meanwhile)
            return None if gh is None else tl.merge(edges_grad[0], gh)

        return out, backward

    def _sage_pool_edgeless(self, tag, shp, h, h_grad, n_src, n_dst, wi, wo):
        """betty's ``EdgelessPoolSAGEConv``, DGL's pool layer on a block without edges:
        ``fc_self(h[:n_dst]) + fc_neigh(zeros)`` with ``(n_dst, wi)`` zeros
        (:meth:`_edgeless_zeros`), ``(n_dst, wo)`` products and output; nothing runs
        through ``fc_pool``, which gets no gradient. ``fc_neigh``'s input needs none: its
        node, the first to run (the later product), gives the weight's gradient only,
        from the saved zeros. ``fc_self``'s node then gives the ``(n_dst, wi)`` gradient
        of ``h[:n_dst]``, and ``slice_backward`` pads it to ``h``'s ``(n_src, wi)``.

        Under autocast ``fc_self`` casts its parameters and, where ``h`` is not in the
        compute dtype, ``h[:n_dst]`` (the copy saved instead of ``h``); ``fc_neigh`` casts
        its weight (a copy autocast's cache keeps: the product's input needs no gradient)
        and float32 zeros (the copy saved instead); the output is in the compute dtype.

        The backward takes ``meanwhile``: run once ``fc_self``'s node has let go of the
        gradient of the output and ``h`` (:meth:`_sage_pool_by_edges`)."""
        tl = self.tl
        in_e = self.e
        fc_neigh, fc_self = [shp[2]], shp[3:]
        zeros = self._edgeless_zeros(tag, n_dst, wi, in_e)
        self_casts = self.cast_params(fc_self, h_grad, f"{tag} fc_self")
        h_copy = self.cast_input(n_dst * wi, in_e, f"{tag} fc_self")
        if self.ce:
            self.e = self.ce
        e = self.e
        f = tl.alloc(n_dst * wo * e, ACT, f"{tag} fc_self")
        self.cast_params(fc_neigh, False, f"{tag} fc_neigh")
        z_copy = self.cast_input(n_dst * wi, in_e, f"{tag} fc_neigh")
        mm = tl.alloc(n_dst * wo * e, ACT, f"{tag} fc_neigh")
        out = tl.alloc(n_dst * wo * e, ACT, f"{tag} out")
        tl.release(f, mm)
        if z_copy is not None:  # fc_neigh saved the copy; the forward's zeros go at its return
            tl.release(zeros)
            zeros = z_copy
        saved = None  # fc_self saves h[:n_dst], or its copy
        if h_copy is not None:
            self_casts.append(h_copy)
        else:
            saved = h
            tl.hold(h)

        def backward(g: Buffer, meanwhile: Callable[[], None] | None = None) -> Buffer | None:
            self._product_bwd(fc_neigh, [], [zeros], None, 0, f"{tag} fc_neigh", "grad zeros")
            gs = self._fc_self_bwd(tag, fc_self, n_dst, wi, h_grad, self_casts, saved, g,
                                   meanwhile)
            if gs is None:
                return None
            sb = tl.alloc(n_src * wi * self.e, BWD, f"{tag} slice_backward")
            tl.release(gs)
            return sb

        return out, backward

    def _edgeless_zeros(self, tag, n_dst, wi, in_e: int) -> Buffer:
        """``EdgelessPoolSAGEConv``'s ``torch.zeros(n_dst, wi).to(h)``: float32 zeros on
        the host (not on the measured device where that is CUDA), then, where ``h``
        (``in_e`` bytes per element) is in another dtype or on CUDA, their copy in ``h``'s
        dtype on its device (the float32 zeros freed). Returns the zeros in ``h``'s
        dtype, held once (the forward's local)."""
        tl = self.tl
        host = tl.alloc(n_dst * wi * FLOAT32_BYTES, AGG, f"{tag} zeros") if self.cfg.host else None
        if host is not None and in_e == FLOAT32_BYTES:
            return host
        zeros = tl.alloc(n_dst * wi * in_e, AGG, f"{tag} zeros (to h)")
        tl.release(host)
        return zeros

    def _sage_pool(self, tag, shp, l, h, h_grad, n_src, n_dst, n_e, wi, wo):
        """SAGEConv pool: ``fc_neigh(max_{in-edges} relu(fc_pool(h))) + fc_self(h[:n_dst])``;
        the max is the backend's (:meth:`_max_aggregate`), everything else is shared.
        ``fc_pool``'s gradients are created where the micro-batch has none of them yet
        (:meth:`_pool_grads_fresh`).

        Under autocast ``fc_pool`` and ``fc_self`` cast their parameters and, where ``h``
        is not in the compute dtype, ``h`` (each saves its copy instead of ``h``);
        ``fc_neigh`` casts its parameters (its weight's copy saved: its input always
        needs a gradient); everything from ``fc_pool`` on is in the compute dtype."""
        tl = self.tl
        in_e = self.e
        fc_pool, fc_neigh, fc_self = shp[0:2], [shp[2]], shp[3:]
        pool_casts: list[Buffer] = []
        casts = {"fc_neigh": [], "fc_self": []}
        if self.ce:
            pool_casts = self.cast_params(fc_pool, h_grad, f"{tag} fc_pool")
            pool_casts += [c for c in [self.cast_input(n_src * wi, in_e, f"{tag} fc_pool")] if c]
            self.e = self.ce
        e = self.e
        p2 = through(self.tl, AGG, n_src * wi * e, f"{tag} fc_pool",
                     n_src * wi * e, f"{tag} relu(fc_pool)")
        h_saved = in_e == e  # fc_pool saves h; fc_self saves h[:n_dst] (else their copies)
        if h_saved:
            tl.hold(h)
        max_backward, mm_saved = self._max_aggregate(tag, n_src, n_dst, n_e, wi)

        def autocast(name: str) -> None:
            if not self.ce:
                return
            if name == "fc_neigh":
                casts[name] = self.cast_params(fc_neigh, True, f"{tag} fc_neigh")
            else:
                casts[name] = self.cast_params(fc_self, h_grad, f"{tag} fc_self")
                casts[name] += [c for c in [self.cast_input(n_dst * wi, in_e, f"{tag} fc_self")]
                                if c]

        out = self._fc_out(tag, n_dst, wo, autocast)

        def backward(g: Buffer) -> Buffer | None:
            gs = self._fc_self_bwd(tag, fc_self, n_dst, wi, h_grad, casts["fc_self"])
            if self.ce:  # fc_neigh's node: its input's gradient in the compute dtype
                gm = self.autocast_mm_bwd(fc_neigh, casts["fc_neigh"], [g, *mm_saved],
                                          n_dst * wi, e, f"{tag} fc_neigh")
            else:
                gm = self._product_bwd(fc_neigh, [], [g, *mm_saved], n_dst * wi, e, f"{tag} fc_neigh",
                                       "grad max (filled)" if not self.pyg else "grad max")
            gp = max_backward(gm)
            tb = tl.alloc(n_src * wi * e, BWD, f"{tag} grad fc_pool")
            tl.release(gp, p2)
            h_last = h if h_saved else None  # fc_pool's node is the last holder of h
            with self.grads_fresh(self.pool_fresh[l]):
                if self.ce:
                    gh = self.autocast_mm_bwd(fc_pool, pool_casts, [tb, h_last],
                                              n_src * wi if h_grad else None, in_e,
                                              f"{tag} fc_pool", weight_first=False)
                else:
                    gh = tl.alloc(n_src * wi * e, BWD, f"{tag} grad h") if h_grad else None
                    held = self.held_param_grads(fc_pool, f"{tag} fc_pool")
                    tl.release(tb, h_last)
                    tl.release(*held)
            return self.accumulate_src_grad(gh, gs, n_src, wi, tag) if h_grad else None

        return out, backward

    def _max_aggregate(self, tag, n_src, n_dst, n_e, w):
        """Max over in-edges of the ``(n_src, w)`` pooled messages. Returns its backward,
        which maps the ``(n_dst, w)`` gradient of the max (released) to the messages'
        ``(n_src, w)`` gradient, and the buffers that ``fc_neigh`` saves of the max
        (and frees in its backward).

        DGL: ``gspmm`` max keeps the ``(n_dst, w)`` int64 arg-max, then
        ``max.masked_fill(isinf, 0)`` (the bool mask kept, the filled copy saved by
        ``fc_neigh``). PyG: ``scatter(reduce="max")`` gathers the ``(E, w)`` messages and
        runs a ``scatter_reduce_`` into zeros that autograd saves with a clone of the
        zeros and its result; its backward finds the arg-max by comparisons and counts
        ties.
        """
        tl, e = self.tl, self.e
        if not self.pyg:
            z = tl.alloc(n_dst * w * e, AGG, f"{tag} max")
            arg = tl.alloc(n_dst * w * INDEX_BYTES, AGG, f"{tag} argmax")
            inf = tl.alloc(n_dst * w, AGG, f"{tag} isinf mask")
            mf = tl.alloc(n_dst * w * e, AGG, f"{tag} max (filled)")
            tl.release(z)

            def dgl_backward(gmf: Buffer) -> Buffer:
                gmf2 = tl.alloc(n_dst * w * e, BWD, f"{tag} grad max")
                tl.release(gmf, inf)
                gp = tl.alloc(n_src * w * e, BWD, f"{tag} grad relu(fc_pool)")
                tl.release(gmf2, arg)
                return gp

            return dgl_backward, [mf]
        msg = tl.alloc(n_e * w * e, AGG, f"{tag} messages")
        z = tl.alloc(n_dst * w * e, AGG, f"{tag} max")
        cl = tl.alloc(n_dst * w * e, AGG, f"{tag} max zeros (saved clone)")

        def pyg_backward(gz: Buffer) -> Buffer:
            # scatter_reduce(amax) backward: which entries reached the max, how many tie
            val = tl.alloc(n_e * w * e, BWD, f"{tag} max gathered")
            t1 = through(self.tl, BWD, n_dst * w, f"{tag} self == max",
                         n_dst * w * e, f"{tag} self == max (float)")
            t2 = through(self.tl, BWD, n_e * w, f"{tag} src == max",
                         n_e * w * e, f"{tag} src == max (float)")
            ties = tl.alloc(n_dst * w * e, BWD, f"{tag} ties")
            gd = tl.alloc(n_dst * w * e, BWD, f"{tag} grad / ties")
            gself = through(self.tl, BWD, n_dst * w, f"{tag} self == max",
                            n_dst * w * e, f"{tag} grad self")
            gg = tl.alloc(n_e * w * e, BWD, f"{tag} grad gathered")
            eq = tl.alloc(n_e * w, BWD, f"{tag} src == max")
            gsrc = tl.alloc(n_e * w * e, BWD, f"{tag} grad messages")
            tl.release(eq, gg)
            tl.release(gd, ties, t2, t1, val)
            tl.temp(n_dst * w * e, BWD, f"{tag} grad self (scatter)")
            tl.release(gself)
            tl.release(gz, cl, msg, z)
            return self._index_bwd(gsrc, n_src, w, tag)

        return pyg_backward, []

    # ------------------------------------------------------------------ LSTM, shared
    # Both backends run one nn.LSTM call per distinct in-degree t on a (B, t, W) mailbox
    # of the B destinations with that degree; they differ in how the mailboxes are built.
    # Under autocast (on the host) betty's AutocastLSTM runs the recurrence in float32
    # with autocast off: float32 copies of a low-precision mailbox and initial states go
    # in, float32 hidden states come out, and fc_neigh casts them like any product input.
    def _lstm_elt(self) -> int:
        """Bytes per element the LSTM computes in: float32 under autocast
        (:class:`betty.backends.lstm.AutocastLSTM` on the host), else the layer's."""
        return FLOAT32_BYTES if self.ce else self.e

    def _buckets(self, l: int):
        """``(t, b)`` per nonzero in-degree ``t`` of layer ``l``: ``b`` ``(P,)`` the number
        of destinations of each micro-batch with that in-degree (0: no such bucket there)."""
        counts = self.s.degree_counts[l]
        for j, t in enumerate(self.s.degrees[l].tolist()):
            if t > 0:
                yield t, counts[:, j]

    def _bucket_rows(self, l: int) -> np.ndarray:
        """``(P,)`` destinations of layer ``l`` with at least one in-edge (the rows of the
        concatenated bucket results)."""
        n = np.zeros(self.s.num_micro_batches)
        for _, b in self._buckets(l):
            n = n + b
        return n

    def _smallest_buckets(self, l: int) -> list[np.ndarray]:
        """Per bucket of :meth:`_buckets` (ascending degree), the ``(P,)`` micro-batches where it
        is the bucket of smallest degree: the last one the backward pass reaches there."""
        seen = np.zeros(self.s.num_micro_batches, dtype=bool)
        out = []
        for _, b in self._buckets(l):
            out.append((b > 0) & ~seen)
            seen = seen | (b > 0)
        return out

    def _lstm_call(self, tag, t: int, b, w: int, mb: Buffer):
        """``nn.LSTM`` over the ``(B, t, w)`` mailbox ``mb`` (``B = b``, ``self.e`` bytes
        per element), after the caller's ``h0``/``c0``. Where the LSTM computes in another
        dtype (:meth:`_lstm_elt`) ``AutocastLSTM`` first copies ``h0``, ``c0`` and then
        the mailbox to float32 (the copies are saved instead of them). Then the
        time-major ``transpose().contiguous()`` copy (``t > 1``; for ``t = 1`` the input
        is already time-major and saved as is), the ``(t, B, w)`` output, ``h_T``,
        ``c_T`` and the kernel's saved state
        (:meth:`~betty.memory.constants.BackendConstants.lstm_saved_bytes`), all in the
        LSTM's dtype.

        Returns ``(saved, dropped, inputs_saved)``: the buffers the call keeps for
        backward, those the caller drops once the call has returned (the float32 copy of
        the mailbox for ``t > 1``), and whether the call saved the caller's ``h0``/``c0``
        (no copies) and, for ``t = 1``, ``mb``; the caller drops what it did not save.
        """
        tl, c = self.tl, self.cfg.constants
        le = self._lstm_elt()
        if c.lstm_native(le):
            return self._native_lstm_call(tag, t, b, w, mb)
        cast = le != self.e
        copies = [tl.alloc(b * w * le, LSTM, f"{tag} {name} (float32 copy) deg {t}")
                  for name in ("h0", "c0")] if cast else []
        x = tl.alloc(t * b * w * le, LSTM, f"{tag} mailbox (float32 copy) deg {t}") if cast else mb
        dropped = []
        if t > 1:
            x_in = tl.alloc(t * b * w * le, LSTM, f"{tag} time-major input deg {t}")
            if cast:
                dropped.append(x)
        else:
            x_in = x  # (B, 1, W) is already time-major: saved as is
        o = tl.alloc(t * b * w * le, LSTM, f"{tag} lstm output deg {t}")
        hy = tl.alloc(b * w * le, LSTM, f"{tag} h_T deg {t}")
        cy = tl.alloc(b * w * le, LSTM, f"{tag} c_T deg {t}")
        ws = tl.alloc(c.lstm_saved_bytes(t, b, w, le), LSTM, f"{tag} lstm state deg {t}")
        return [*copies, x_in, o, hy, cy, ws], dropped, not cast

    def _native_lstm_call(self, tag, t: int, b, w: int, mb: Buffer):
        """:meth:`_lstm_call` where torch runs its native per-step LSTM (the host's
        float64: :meth:`~betty.memory.constants.BackendConstants.lstm_native`), op by
        op, with ``u = B·w·elt``: for ``t > 1`` the time-major copy of the input
        (``t·u``, saved), the input projection ``x W_ihᵀ`` (``4t·u``) and its bias sum
        (``4t·u``; the product freed); for ``t = 1`` one ``addmm`` on the mailbox itself
        (``4u``, the mailbox saved). Then per step ``s`` the gates ``h_{s-1} W_hhᵀ +
        b_hh`` (``4u``, activated in place and saved), ``c_s = f·c_{s-1} + i·g``
        (``u``, with an ``i·g`` temporary of ``u``), ``tanh(c_s)`` (``u``, saved) and
        ``h_s = o·tanh(c_s)`` (``u``); then the stacked ``(t, B, w)`` output and the
        projection freed. ``c_s`` and ``h_s`` are saved by step ``s + 1``, so the call
        keeps ``(7t - 2)·u`` besides its input and the caller's states
        (:meth:`~betty.memory.constants.BackendConstants.lstm_saved_bytes`); ``c_T``,
        ``h_T`` and the output go once the caller has stacked ``h_n`` and ``c_n``.

        Returns ``(saved, dropped, True)`` as :meth:`_lstm_call`: ``saved`` is the
        input, then per step gates, ``c_s``, ``tanh(c_s)``, ``h_s`` (the last step's
        gates and ``tanh(c_T)`` only), the order :meth:`_native_lstm_bwd` reads."""
        tl = self.tl
        u = b * w * self._lstm_elt()
        if t > 1:
            x_in = tl.alloc(t * u, LSTM, f"{tag} time-major input deg {t}")
            prod = tl.alloc(4 * t * u, LSTM, f"{tag} lstm input product deg {t}")
            proj = tl.alloc(4 * t * u, LSTM, f"{tag} lstm input projection deg {t}")
            tl.release(prod)
        else:
            x_in = mb  # (B, 1, W) is already time-major: saved as is
            proj = tl.alloc(4 * u, LSTM, f"{tag} lstm input projection deg {t}")
        saved: list[Buffer] = [x_in]
        for s in range(1, t + 1):
            gates = tl.alloc(4 * u, LSTM, f"{tag} lstm gates deg {t} step {s}")
            c_s = tl.alloc(u, LSTM, f"{tag} lstm c deg {t} step {s}")
            tl.temp(u, LSTM, f"{tag} lstm i*g deg {t} step {s}")
            tanh_c = tl.alloc(u, LSTM, f"{tag} lstm tanh(c) deg {t} step {s}")
            h_s = tl.alloc(u, LSTM, f"{tag} lstm h deg {t} step {s}")
            saved += [gates, c_s, tanh_c, h_s] if s < t else [gates, tanh_c]
        out = tl.alloc(t * u, LSTM, f"{tag} lstm output deg {t}")
        tl.release(proj)
        return saved, [c_s, h_s, out], True

    def _native_lstm_bwd(self, tag, t: int, b, w: int, m, bufs: list[Buffer], n_states: int,
                         gc: Buffer, last, lstm_params, sums: list,
                         input_grad: bool) -> Buffer | None:
        """Backward of :meth:`_native_lstm_call`, node by node, steps ``s = t … 1``
        (``u = B·w·elt``): ``h_s = o·tanh(c_s)``'s gradients (``2u``; ``gc``, whose
        slice is ``h_t``'s gradient, freed after step ``t``'s in the micro-batches
        ``last``; else the incoming ``h_s`` gradient), ``tanh``'s (``u``; ``tanh(c_s)``
        freed) plus the incoming ``c_s`` gradient (``u``, ``s < t``), the four (three
        at ``s = 1``: ``c_0`` needs none) gradients of ``f·c_{s-1} + i·g`` (``c_{s-1}``
        freed), the gate activations' (``4u``; the gates freed) concatenated (``4u``,
        kept until the input projection's backward), then ``addmm``'s: ``h_{s-1}``'s
        gradient (``u``, ``s > 1``) and ``W_hh``'s and ``b_hh``'s (summed into their
        running sums as they come; ``h_{s-1}`` freed). Then the ``(t, B, 4w)`` stack of
        the gate gradients, ``b_ih``'s and ``W_ih``'s gradients and the input's
        (``t·u``, only where ``input_grad``); the stack and the input freed.

        ``bufs``: the caller's ``n_states`` saved initial states (``h0``, ``c0``; PyG's one
        zero state), then :meth:`_native_lstm_call`'s ``saved``; all released here.
        ``sums``: per LSTM parameter (``W_ih``, ``W_hh``, ``b_ih``, ``b_hh``) ``[run,
        have]`` of :meth:`bucket_sum`, updated in place; a parameter's sum is settled
        (:meth:`_settle_summed_grads`) in ``last`` after its last gradient. Returns the
        input's gradient (None without ``input_grad``)."""
        tl, le = self.tl, self._lstm_elt()
        u = b * w * le
        states, x_in, rest = bufs[:n_states], bufs[n_states], bufs[n_states + 1:]
        steps = [rest[4 * i:4 * i + 4] for i in range(t - 1)] + [[rest[-2], None, rest[-1], None]]

        def add(j: int, grad: Buffer, final: bool) -> None:
            run, have = sums[j]
            run, have = self.bucket_sum(run, have, [grad], m, f"{tag} lstm weight grads")
            sums[j][:] = [run, have]
            if final:
                self._settle_summed_grads(run, last)

        def grad(j: int, name: str) -> Buffer:
            return tl.alloc(np.where(m, numel(lstm_params[j]) * self.pelt, 0), GRADS,
                            f"{tag} lstm {name} grad deg {t}")

        gh = gcs = None
        cats = []
        for s in range(t, 0, -1):
            gates, _, tanh_c, _ = steps[s - 1]
            c_prev = steps[s - 2][1] if s > 1 else None
            h_prev = steps[s - 2][3] if s > 1 else None
            g_tanh = tl.alloc(u, BWD, f"{tag} lstm grad tanh(c) deg {t} step {s}")
            g_o = tl.alloc(u, BWD, f"{tag} lstm grad o deg {t} step {s}")
            if s == t:
                tl.free_where(gc, last)  # h_t's gradient is a slice of it
            else:
                tl.release(gh)
            g_c = tl.alloc(u, BWD, f"{tag} lstm grad c (tanh) deg {t} step {s}")
            tl.release(g_tanh, tanh_c)
            if gcs is not None:
                g_sum = tl.alloc(u, BWD, f"{tag} lstm grad c deg {t} step {s}")
                tl.release(gcs, g_c)
                g_c = g_sum
            # the two products' gradients: two gate gradients, c_{s-1}'s (s > 1), a gate's
            g_1 = tl.alloc(u, BWD, f"{tag} lstm grad gate product deg {t} step {s}")
            g_2 = tl.alloc(u, BWD, f"{tag} lstm grad gate product deg {t} step {s}")
            gcs = tl.alloc(u, BWD, f"{tag} lstm grad c_prev deg {t} step {s}") if s > 1 else None
            g_3 = tl.alloc(u, BWD, f"{tag} lstm grad gate product deg {t} step {s}")
            tl.release(g_c)
            if s > 1:
                tl.release(c_prev)
            elif len(states) == 2:
                tl.release(states[1])  # c0
            acts = []
            for g in (g_o, g_1, g_3, g_2):
                acts.append(tl.alloc(u, BWD, f"{tag} lstm grad gate deg {t} step {s}"))
                tl.release(g)
            tl.release(gates)
            cats.append(tl.alloc(4 * u, BWD, f"{tag} lstm grad gates deg {t} step {s}"))
            tl.release(*acts)
            gh = tl.alloc(u, BWD, f"{tag} lstm grad h deg {t} step {s}") if s > 1 else None
            w_hh, b_hh = grad(1, "W_hh"), grad(3, "b_hh")
            tl.release(h_prev if s > 1 else states[0])
            add(3, b_hh, s == 1)
            add(1, w_hh, s == 1)
        stacked = tl.alloc(4 * t * u, BWD, f"{tag} lstm grad projection deg {t}")
        tl.release(*reversed(cats))
        gx = None
        if t > 1:
            b_ih = grad(2, "b_ih")
            add(2, b_ih, True)
            w_ih = grad(0, "W_ih")
            if input_grad:
                gx = tl.alloc(t * u, BWD, f"{tag} lstm grad input deg {t}")
            tl.release(stacked, x_in)
            add(0, w_ih, True)
        else:
            if input_grad:
                gx = tl.alloc(t * u, BWD, f"{tag} lstm grad input deg {t}")
            w_ih, b_ih = grad(0, "W_ih"), grad(2, "b_ih")
            tl.release(stacked, x_in)
            add(2, b_ih, True)
            add(0, w_ih, True)
        return gx

    def _lstm_call_bwd(self, tag, t: int, b, w: int, m, lstm_params, input_grad: bool):
        """The LSTM call's backward node: the ``(t, B, w)`` input gradient, the kernel's
        transient scratch (``lstm_backward_step_words``: :meth:`~betty.memory.constants.
        BackendConstants.lstm_backward_words`), one gradient per LSTM
        parameter (in the micro-batches ``m`` that have the bucket) and the ``(B, w)``
        gradients of ``h0`` and ``c0`` (dropped: the zero states need none), all in the
        LSTM's dtype but the parameters'. Returns ``(grad input, parameter grads)``; the
        input's gradient is dropped too (None) where ``input_grad`` is False."""
        tl, le, c = self.tl, self._lstm_elt(), self.cfg.constants
        gx = tl.alloc(t * b * w * le, BWD, f"{tag} lstm grad input deg {t}")
        tl.temp(b * t * w * le * c.lstm_backward_words(le), LSTM, f"{tag} lstm backward deg {t}")
        new = [tl.alloc(np.where(m, numel(s) * self.pelt, 0), GRADS, f"{tag} lstm weight grad")
               for s in lstm_params]
        state_grads = [tl.alloc(b * w * le, BWD, f"{tag} lstm grad {name} deg {t}")
                       for name in ("h0", "c0")]
        if not input_grad:
            tl.release(gx)
            gx = None
        tl.release(*state_grads)
        return gx, new

    def _settle_summed_grads(self, summed, where) -> None:
        """AccumulateGrad on parameter gradients summed over buckets (``summed`` from
        :meth:`bucket_sum`) in the micro-batches ``where`` whose last bucket has been summed:
        the sum becomes ``.grad`` on a fresh micro-batch (kept), else it is added in place
        into ``.grad`` and freed."""
        for parts in summed:
            for buf in parts:
                self.tl.free_where(buf, np.asarray(where, dtype=bool) & ~self.fresh)

    def _lstm_fc(self, tag, fc_neigh, fc_self, neigh: Buffer, h: Buffer, h_grad: bool, n_dst,
                 wi: int, wo: int):
        """``fc_neigh(neigh) + fc_self(h[:n_dst])`` on the LSTM's ``(n_dst, wi)`` result
        ``neigh`` (in the LSTM's dtype; ``h`` in ``self.e``) (:meth:`_fc_out`).

        Under autocast ``fc_neigh`` casts its weight (saved: ``neigh`` needs a gradient)
        and ``neigh`` (the copy is saved instead; PyG drops ``neigh`` after
        ``fc_neigh``, DGL when its local scope ends after the sum), ``fc_self`` its
        parameters and, where ``h`` is not in the compute dtype, ``h[:n_dst]`` (the
        copy saved instead of ``h``); the output is in the compute dtype.

        Returns ``(out, neigh_kept, neigh_casts, self_casts, h_kept)``: what
        ``fc_neigh`` saved of its input, the saved autocast copies of each product, and
        ``h`` where ``fc_self`` holds it (else None)."""
        tl, in_e = self.tl, self.e
        if not self.ce:
            out = self._fc_out(tag, n_dst, wo)
            tl.hold(h)  # fc_self saves h[:n_dst]
            return out, neigh, [], [], h
        casts: dict[str, list[Buffer]] = {}
        copies: dict[str, Buffer | None] = {}

        def autocast(name: str) -> None:
            if name == "fc_neigh":
                casts[name] = self.cast_params(fc_neigh, True, f"{tag} fc_neigh")
                copies[name] = self.cast_input(n_dst * wi, self._lstm_elt(), f"{tag} fc_neigh")
            else:
                if self.pyg and copies["fc_neigh"] is not None:
                    tl.release(neigh)  # a temporary of PyG's forward
                casts[name] = self.cast_params(fc_self, h_grad, f"{tag} fc_self")
                copies[name] = self.cast_input(n_dst * wi, in_e, f"{tag} fc_self")
            self.e = self.ce

        out = self._fc_out(tag, n_dst, wo, autocast)
        kept = neigh
        if copies["fc_neigh"] is not None:
            kept = copies["fc_neigh"]
            if not self.pyg:
                tl.release(neigh)  # DGL's local scope ends
        h_kept = None
        self_casts = casts["fc_self"]
        if copies["fc_self"] is not None:
            self_casts = self_casts + [copies["fc_self"]]
        else:
            h_kept = h
            tl.hold(h)  # fc_self saves h[:n_dst]
        return out, kept, casts["fc_neigh"], self_casts, h_kept

    def _lstm_head_bwd(self, g: Buffer, tag, fc_neigh, fc_self, neigh_kept: Buffer, neigh_casts,
                       self_casts, h_kept: Buffer | None, h_grad: bool, n_dst, n_rows, wi: int,
                       *saved: Buffer):
        """Backward of :meth:`_lstm_fc` and of putting the ``(n_rows, wi)`` concatenated
        bucket results into zeros: ``fc_self``'s node (the ``(n_dst, wi)`` gradient of
        ``h[:n_dst]`` where ``h`` needs one, returned; then ``fc_self`` lets go of
        ``h_kept``: neither backend's mailbox keeps ``h``), ``fc_neigh``'s (the gradient of
        ``neigh``, in the LSTM's dtype: :meth:`autocast_mm_bwd` under autocast; ``g``
        and ``neigh_kept`` released), then the gathered ``(n_rows, wi)`` gradient of the
        results (the gradient of ``neigh`` and ``saved`` released). Returns
        ``(grad h_dst, grad results)``."""
        tl, le = self.tl, self._lstm_elt()
        gs = self._fc_self_bwd(tag, fc_self, n_dst, wi, h_grad, self_casts, h_kept)
        if self.ce:
            gn = self.autocast_mm_bwd(fc_neigh, neigh_casts, [g, neigh_kept], n_dst * wi, le,
                                      f"{tag} fc_neigh")
        else:
            gn = self._product_bwd(fc_neigh, [], [g, neigh_kept], n_dst * wi, le, f"{tag} fc_neigh",
                                   "grad neigh")
        gc = tl.alloc(n_rows * wi * le, BWD, f"{tag} grad bucket results")
        tl.release(gn, *saved)
        return gs, gc

    def _lstm_buckets_bwd(self, tag, l: int, saved, gc: Buffer, h_grad: bool, lstm_params,
                          w: int, scatter, n_states: int):
        """Backward of the buckets' LSTM calls, largest degree first, from ``gc``, the
        gradient of the concatenated results (released with the last bucket's node of
        each micro-batch). Per bucket: its node (:meth:`_lstm_call_bwd`), its saved tensors
        released, the parameter gradients summed over the buckets (:meth:`bucket_sum`,
        then AccumulateGrad after a micro-batch's last bucket); where ``h`` needs a gradient,
        the input's gradient cast back to the mailbox's dtype (``self.e``) where the
        LSTM ran in float32, then ``scatter(t, b, m, g_input, index)`` (the backend's
        backward of building the mailbox: releases ``g_input`` and ``index``, returns
        the ``(P,)`` gradient to sum). Returns the running sum and the micro-batches that have
        one, ``(acc, have_acc)`` (None, all False without ``h_grad``). Where torch runs its
        native per-step LSTM, each bucket's backward is :meth:`_native_lstm_bwd`
        (``n_states``: how many initial states the caller saved before the call's
        buffers)."""
        tl, in_e, le = self.tl, self.e, self._lstm_elt()
        acc = lstm_grad = None
        have_acc = have_grad = np.zeros(self.s.num_micro_batches, dtype=bool)
        smallest = self._smallest_buckets(l)
        native = self.cfg.constants.lstm_native(le)
        sums = [[None, have_grad] for _ in lstm_params]  # native: per parameter
        for (t, b, bufs, index), last in reversed(list(zip(saved, smallest))):
            m = b > 0  # the micro-batches that have this bucket
            if native:
                gx = self._native_lstm_bwd(tag, t, b, w, m, bufs, n_states, gc, last,
                                           lstm_params, sums, h_grad)
            else:
                gx, new = self._lstm_call_bwd(tag, t, b, w, m, lstm_params, h_grad)
                tl.free_where(gc, last)  # the results' gradient goes with their last consumer
                tl.release(*bufs)  # the node's saved tensors go before its outputs are summed
                # the engine sums each parameter's gradients out of place, one parameter at
                # a time, then drops the bucket's own gradients
                lstm_grad, have_grad = self.bucket_sum(lstm_grad, have_grad, new, m,
                                                       f"{tag} lstm weight grads")
                self._settle_summed_grads(lstm_grad, last)
            if gx is None:
                continue
            if in_e != le:  # the backward of AutocastLSTM's input.float()
                gxc = tl.alloc(t * b * w * in_e, BWD, f"{tag} lstm grad input (cast) deg {t}")
                tl.release(gx)
                gx = gxc
            acc, have_acc = self.bucket_sum(acc, have_acc, [scatter(t, b, m, gx, index)], m,
                                            f"{tag} grad messages")
        tl.release(gc)
        return acc, have_acc

    def _dgl_degree_buckets(self, l: int, n_dst, tag):
        """DGL's degree bucketing (``dgl.core._bucketing``) of the ``n_dst``
        destinations: the sorted degrees and their order (``(n_dst,)`` int64 each,
        freed once every bucket is found), the ``(D,)`` distinct degrees (0 included;
        NumPy keeps the tensor until the reduction returns); per distinct degree a
        ``nonzero`` (held until the next one) and the bucket's positions (kept by the
        bucketing closure until the reduction returns); then per degree the bucket's
        node IDs, then their original IDs (``(B,)`` int64 each).

        Returns ``(kept, release_after_loop)``: the buffers freed when the reduction
        returns, and a callable to run when the loop over the buckets ends, which frees
        the lists only that loop held (degree 0's, and the original IDs of every
        bucket but the last one of each micro-batch)."""
        tl = self.tl
        degrees, counts = self.s.degrees[l].tolist(), self.s.degree_counts[l].T
        order = [tl.alloc(n_dst * INDEX_BYTES, AGG, f"{tag} sorted degrees"),
                 tl.alloc(n_dst * INDEX_BYTES, AGG, f"{tag} degree order")]
        distinct = (counts > 0).sum(axis=0) * INDEX_BYTES
        kept, nz = [tl.alloc(distinct, AGG, f"{tag} distinct degrees")], None
        for b in counts:
            new_nz = tl.alloc(b * INDEX_BYTES, AGG, f"{tag} degree nonzero")
            tl.release(nz)
            nz = new_nz
            kept.append(tl.alloc(b * INDEX_BYTES, AGG, f"{tag} bucket positions"))
        tl.release(*order, nz)
        nodes = [tl.alloc(b * INDEX_BYTES, AGG, f"{tag} bucket nodes") for b in counts]
        origs = [tl.alloc(b * INDEX_BYTES, AGG, f"{tag} bucket original ids") for b in counts]
        # the loop variable keeps the largest degree's original IDs of each micro-batch
        later = np.zeros(self.s.num_micro_batches, dtype=bool)
        largest = []
        for b in counts[::-1]:
            largest.append((b > 0) & ~later)
            later = later | (b > 0)
        largest = largest[::-1]

        def release_after_loop() -> None:
            for t, node_ids, orig_ids, last in zip(degrees, nodes, origs, largest):
                if t == 0:  # skipped by the loop, kept by nothing else
                    tl.release(node_ids)
                tl.free_where(orig_ids, ~last)

        kept += [ids for t, ids in zip(degrees, nodes) if t != 0]
        return kept + origs, release_after_loop

    def _sage_lstm(self, tag, shp, l, h, h_grad, n_src, n_dst, n_e, wi, wo):
        """DGL's SAGEConv lstm: ``copy_u`` messages, DGL's degree bucketing
        (:meth:`_dgl_degree_buckets`; per in-degree ``t`` the ``(B·t,)`` edge IDs from
        NumPy, kept by the gather where ``h`` needs a gradient, and the ``(B, t, W)``
        mailbox gathered from the messages), an LSTM call on each mailbox from two zero
        states, its ``h_T`` the bucket's result, the results concatenated and put into
        zeros; then :meth:`_lstm_fc`."""
        tl, in_e, le = self.tl, self.e, self._lstm_elt()
        native = self.cfg.constants.lstm_native(le)
        lstm_params, fc_neigh, fc_self = shp[0:4], [shp[4]], shp[5:]
        w = wi
        msg = tl.alloc(n_e * w * in_e, AGG, f"{tag} messages")
        tl.temp(n_dst * INDEX_BYTES, AGG, f"{tag} dst arange")
        idx = tl.alloc(n_dst * INDEX_BYTES, AGG, f"{tag} destination nodes")
        book, release_after_loop = self._dgl_degree_buckets(l, n_dst, tag)
        saved, results = [], []
        mailbox = eids = None
        n_nonzero = self._bucket_rows(l)
        for t, b in self._buckets(l):
            if not h_grad:
                tl.release(eids)  # the loop variable moves on
            eids = tl.alloc(b * t * INDEX_BYTES, AGG, f"{tag} edge ids deg {t}")
            mb = tl.alloc(b * t * w * in_e, LSTM, f"{tag} mailbox deg {t}")
            tl.release(mailbox)
            h0 = tl.alloc(b * w * in_e, LSTM, f"{tag} h0 deg {t}")
            c0 = tl.alloc(b * w * in_e, LSTM, f"{tag} c0 deg {t}")
            call_saved, dropped, inputs_saved = self._lstm_call(tag, t, b, w, mb)
            if native:  # torch's native LSTM stacks c_n before h_n
                cs = tl.alloc(b * w * le, LSTM, f"{tag} c stack deg {t}")
                st = tl.alloc(b * w * le, LSTM, f"{tag} result deg {t}")
                tl.release(*dropped, cs)
            else:
                st = tl.alloc(b * w * le, LSTM, f"{tag} result deg {t}")
                tl.temp(b * w * le, LSTM, f"{tag} c stack deg {t}")
                tl.release(*dropped)
            states = [h0, c0]
            if not inputs_saved:
                tl.release(h0, c0)
                states = []
            mailbox = None if inputs_saved and t == 1 else mb
            saved.append((t, b, [*states, *call_saved], eids if h_grad else None))
            results.append(st)
        release_after_loop()
        cat = tl.alloc(n_nonzero * w * le, AGG, f"{tag} bucket results")
        cat_idx = tl.alloc(n_nonzero * INDEX_BYTES, AGG, f"{tag} bucket result index")
        z = tl.alloc(n_dst * w * le, AGG, f"{tag} neigh zeros")
        neigh = tl.alloc(n_dst * w * le, AGG, f"{tag} neigh")
        tl.release(z, idx, *book, *results, mailbox, None if h_grad else eids, msg)
        out, neigh_kept, neigh_casts, self_casts, h_kept = self._lstm_fc(
            tag, fc_neigh, fc_self, neigh, h, h_grad, n_dst, wi, wo)

        def scatter(t, b, m, gx, eid):
            """Backward of the mailbox gather: the batch-major copy of the input's
            gradient (``t > 1``), then ``index_add`` into ``(E, W)`` zeros."""
            if t > 1:
                gxb = tl.alloc(t * b * w * in_e, BWD, f"{tag} lstm grad input batch-major deg {t}")
                tl.release(gx)
                gx = gxb
            ne = np.where(m, n_e * w * in_e, 0)
            zeros = tl.alloc(ne, BWD, f"{tag} grad messages zeros deg {t}")
            ia = tl.alloc(ne, BWD, f"{tag} grad messages deg {t}")
            tl.release(zeros, gx, eid)
            return ia

        def backward(g: Buffer) -> Buffer | None:
            with self.elt(in_e):
                gs, gc = self._lstm_head_bwd(g, tag, fc_neigh, fc_self, neigh_kept, neigh_casts,
                                             self_casts, h_kept, h_grad, n_dst, n_nonzero, wi,
                                             cat_idx, cat)
                acc, _ = self._lstm_buckets_bwd(tag, l, saved, gc, h_grad, lstm_params, w,
                                                scatter, 2)
                if not h_grad:
                    return None
                gsrc = tl.alloc(n_src * w * in_e, BWD, f"{tag} grad h (copy_u)")
                tl.release(*(acc[0] if acc is not None else []))
                return self.accumulate_src_grad(gsrc, gs, n_src, wi, tag)

        return out, backward

    # ------------------------------------------------------------------ SAGE, PyG ops
    def _pyg_sage_lstm(self, tag, shp, l, h, h_grad, n_src, n_dst, n_e, wi, wo):
        """:func:`betty.backends.pyg_backend.lstm_aggregate`: edges sorted by
        destination, then one LSTM call per in-degree bucket on a mailbox gathered from
        ``h`` (``(B, d, W)``, its index kept for backward when ``h`` needs a gradient)
        from one zero state for ``h0`` and ``c0``, the buckets' last hidden states
        concatenated and put into zeros; then :meth:`_lstm_fc`."""
        tl, in_e, le = self.tl, self.e, self._lstm_elt()
        native = self.cfg.constants.lstm_native(le)
        lstm_params, fc_neigh, fc_self = shp[0:4], [shp[4]], shp[5:]
        w = wi
        n_nonzero = self._bucket_rows(l)
        book = [tl.alloc(n_e * INDEX_BYTES, AGG, f"{tag} edge order"),
                tl.alloc(n_e * INDEX_BYTES, AGG, f"{tag} sorted sources"),
                tl.alloc(n_dst * INDEX_BYTES, AGG, f"{tag} in-degrees")]
        cs = tl.alloc(n_dst * INDEX_BYTES, AGG, f"{tag} cumsum")
        book.append(tl.alloc(n_dst * INDEX_BYTES, AGG, f"{tag} first edge"))
        tl.release(cs)
        gt = tl.alloc(n_dst, AGG, f"{tag} degree > 0")
        nz = tl.alloc(n_nonzero * INDEX_BYTES, AGG, f"{tag} nonzero degrees")
        tl.release(gt, nz)
        saved, results = [], []
        steps = mailbox = c_last = zeros = None
        for t, b in self._buckets(l):
            eq = tl.alloc(np.where(b > 0, n_dst, 0), AGG, f"{tag} degree == {t}")
            book.append(tl.alloc(b * INDEX_BYTES, AGG, f"{tag} nodes deg {t}"))
            tl.release(eq)
            first = tl.alloc(b * INDEX_BYTES, AGG, f"{tag} first edges deg {t}")
            new_steps = tl.alloc(b * t * INDEX_BYTES, AGG, f"{tag} steps deg {t}")
            tl.release(first, steps)
            steps = new_steps
            idx = tl.alloc(b * t * INDEX_BYTES, AGG, f"{tag} mailbox index deg {t}")
            mb = tl.alloc(b * t * w * in_e, LSTM, f"{tag} mailbox deg {t}")
            if not h_grad:  # the gather saves its index only when h needs a gradient
                tl.release(idx)
                idx = None
            tl.release(mailbox)
            z0 = tl.alloc(b * w * in_e, LSTM, f"{tag} h0 = c0 deg {t}")
            tl.release(zeros)  # the previous zero state, where the LSTM did not save it
            call_saved, dropped, inputs_saved = self._lstm_call(tag, t, b, w, mb)
            if native:  # torch's native LSTM stacks c_n before h_n
                c_new = tl.alloc(b * w * le, LSTM, f"{tag} c_n deg {t}")
                results.append(tl.alloc(b * w * le, LSTM, f"{tag} h_n deg {t}"))
            else:
                results.append(tl.alloc(b * w * le, LSTM, f"{tag} h_n deg {t}"))
                c_new = tl.alloc(b * w * le, LSTM, f"{tag} c_n deg {t}")
            tl.release(*dropped, c_last)
            c_last = c_new
            zeros = None if inputs_saved else z0
            mailbox = None if inputs_saved and t == 1 else mb
            saved.append((t, b, ([z0] if inputs_saved else []) + call_saved, idx))
        cat = tl.alloc(n_nonzero * w * le, AGG, f"{tag} bucket results")
        z = tl.alloc(n_dst * w * le, AGG, f"{tag} neigh zeros")
        cat_idx = tl.alloc(n_nonzero * INDEX_BYTES, AGG, f"{tag} bucket result index")
        neigh = tl.alloc(n_dst * w * le, AGG, f"{tag} neigh")
        tl.release(z, *book, *results, c_last, steps, mailbox, zeros, cat)
        out, neigh_kept, neigh_casts, self_casts, h_kept = self._lstm_fc(
            tag, fc_neigh, fc_self, neigh, h, h_grad, n_dst, wi, wo)

        def scatter(t, b, m, gx, idx):
            """Backward of the mailbox gather ``h[index]``: an ``index_put`` into
            ``(n_src, W)`` zeros."""
            gi = index_backward(tl, None, np.where(m, n_src * w * in_e, 0), tag)
            tl.release(gx, idx)
            return gi

        def backward(g: Buffer) -> Buffer | None:
            with self.elt(in_e):
                gs, gc = self._lstm_head_bwd(g, tag, fc_neigh, fc_self, neigh_kept, neigh_casts,
                                             self_casts, h_kept, h_grad, n_dst, n_nonzero, wi,
                                             cat_idx)
                acc, have_acc = self._lstm_buckets_bwd(tag, l, saved, gc, h_grad, lstm_params,
                                                       w, scatter, 1)
                if not h_grad:
                    return None
                acc = tl.merge(*acc[0]) if acc is not None else None
                if not have_acc.all():  # no in-edges in a micro-batch: no index_put ran there
                    zeros_h = tl.alloc(np.where(have_acc, 0, n_src * w * in_e), BWD,
                                       f"{tag} grad h (zeros)")
                    acc = zeros_h if acc is None else tl.merge(acc, zeros_h)
                return self.accumulate_src_grad(acc, gs, n_src, wi, tag)

        return out, backward

    # ------------------------------------------------------------------ GCN
    def _norm(self, n, tag: str, name: str, deg: Buffer | None = None) -> Buffer:
        """``(deg.to(dtype) + 1).rsqrt()`` of an ``(n,)`` degree vector: the cast (DGL's
        ``in_degrees``: its arange and cast, :meth:`_degrees`; PyG's: bincount then
        cast; the carried out-degrees: a cast), ``+ 1``, ``rsqrt``; returns the norm."""
        tl, e = self.tl, self.e
        if deg is None:
            deg = tl.alloc(n * e, AGG, f"{tag} {name} cast")
        p1 = tl.alloc(n * e, AGG, f"{tag} {name} + 1")
        tl.release(deg)
        norm = tl.alloc(n * e, AGG, f"{tag} {name} norm")
        tl.release(p1)
        return norm

    def gcn_layer(self, l: int, h: Buffer, h_grad: bool):
        """:func:`betty.models.gcn.gcn_forward`: ``src_norm``, ``dst_norm``, ``hs = h *
        src_norm``, then (``in > out``) ``hs @ W`` before the aggregation or ``@ W``
        after it, ``copy_u_sum(hs) + hs[:n_dst]``, ``* dst_norm``, ``+ b``. The function's
        locals (``hs``, ``agg``, the norms) live until it returns.

        Under autocast only the product runs in the compute dtype: autocast casts ``W``
        and, where it is not in the compute dtype, the product's input (the copy is
        saved instead of the input, which goes when its variable is reassigned); the
        aggregation of a projected ``hs`` stays in the compute dtype, ``* dst_norm``
        (``dst_norm`` in the layer input's dtype) gives the wider of the two, and ``+
        b`` (float32) makes the layer's output float32 (:meth:`wide`). In backward the
        engine casts the gradient of each of those ops to its input's dtype where they
        differ, and the product's gradients go through the casts' backward
        (:meth:`autocast_mm_bwd`)."""
        s, tl, e = self.s, self.tl, self.e
        wi, wo = self.cfg.model.widths[l], self.cfg.model.widths[l + 1]
        n_src, n_dst, n_e = s.n_src[l], s.n_dst[l], s.num_edges[l]
        pf = wi > wo  # project first
        lo = self.ce or e  # the product's output dtype
        tag = f"layer {l} gcn"
        weight, bias = [self.shapes[l][0]], [self.shapes[l][1]]
        src_norm = self._norm(n_src, tag, "out-degree")
        if self.pyg:
            deg = through(tl, AGG, n_dst * INDEX_BYTES, f"{tag} bincount", n_dst * e, f"{tag} in-degree cast")
        else:
            deg = self._degrees(n_dst, tag, clamp=False)
        dst_norm = self._norm(n_dst, tag, "in-degree", deg)
        hs0 = tl.alloc(n_src * wi * e, AGG, f"{tag} h * src_norm")
        w, we = wi, e  # the aggregated width and dtype
        hs = hs0
        w_casts: list[Buffer] = []
        if pf:
            w_casts = self.cast_params(weight, h_grad, f"{tag} weight")
            x_copy = self.cast_input(n_src * wi, e, f"{tag} hs")
            hs = tl.alloc(n_src * wo * lo, AGG, f"{tag} hs @ W")
            w, we = wo, lo  # hs0 (or autocast's copy of it) is saved by the mm
            if x_copy is not None:
                tl.release(hs0)  # the variable is reassigned: only the copy stays
                hs0 = x_copy
        if self.pyg:  # scatter(hs[src], dst, reduce="sum")
            z = through(tl, AGG, n_e * w * we, f"{tag} messages", n_dst * w * we, f"{tag} sum")
        else:
            z = tl.alloc(n_dst * w * we, AGG, f"{tag} sum")
        agg = tl.alloc(n_dst * w * we, AGG, f"{tag} sum + self")
        tl.release(z)
        agg_in = None
        if not pf:
            agg_in = agg  # saved by the mm (or autocast's copy of it)
            w_casts = self.cast_params(weight, h_grad, f"{tag} weight")
            x_copy = self.cast_input(n_dst * wi, e, f"{tag} agg")
            agg = tl.alloc(n_dst * wo * lo, AGG, f"{tag} agg @ W")
            if x_copy is not None:
                tl.release(agg_in)
                agg_in = x_copy
        scaled_e = max(lo, e)  # agg (lo) * dst_norm (the input's dtype)
        self.out_e = self.wide(scaled_e)  # + b
        scaled = tl.alloc(n_dst * wo * scaled_e, ACT, f"{tag} * dst_norm")
        out = tl.alloc(n_dst * wo * self.out_e, ACT, f"{tag} out")
        tl.release(scaled)
        # the function returns: its locals go, except what autograd saved
        tl.release(agg)
        if pf:
            tl.release(hs)
        else:
            tl.release(hs0)
        if not h_grad:
            tl.release(src_norm)  # the mul saves src_norm only when h needs a gradient
            src_norm = None

        def backward(g: Buffer) -> Buffer | None:
            self.param_grads(bias, f"{tag} bias", cast=False)
            g = self.cast_grad(g, n_dst * wo, scaled_e, f"{tag} grad + b", src=self.wide(scaled_e))
            gm = tl.alloc(n_dst * wo * scaled_e, BWD, f"{tag} grad * dst_norm")
            gm = self.cast_grad(gm, n_dst * wo, lo, f"{tag} grad * dst_norm", src=scaled_e)
            tl.release(g, dst_norm)
            if not pf:
                ga = self._product_bwd(weight, w_casts, [gm, agg_in], n_dst * wi if h_grad else None,
                                       e, tag, "grad agg")
                if not h_grad:
                    return None
                ghs = self._gcn_neigh_bwd(ga, n_src, n_e, wi, tag)
            else:
                with self.elt(lo):
                    acc = self._gcn_neigh_bwd(gm, n_src, n_e, wo, tag)
                ghs = self._product_bwd(weight, w_casts, [acc, hs0], n_src * wi if h_grad else None,
                                        e, tag, "grad hs")
                if not h_grad:
                    return None
            gh = tl.alloc(n_src * wi * e, BWD, f"{tag} grad h")
            tl.release(ghs, src_norm)
            return gh

        return out, backward

    # ------------------------------------------------------------------ GAT
    def gat_layer(self, l: int, h: Buffer, h_grad: bool, last: bool):
        """:func:`betty.models.gat.gat_forward`.

        Under autocast only ``fc`` runs in the compute dtype (it casts its weight and,
        where ``h`` is not in it, ``h``: the copy is saved instead of ``h``); ``z *
        attn_l`` and ``z[:n_dst] * attn_r`` meet the float32 attention vectors and
        promote back to float32, so the scores, the softmax and the layer's output are
        float32. The aggregation multiplies the compute-dtype ``z`` by float32
        attention: DGL's backend casts ``z`` to float32 first (that copy saved for the
        aggregation's backward), PyG gathers ``z[src]`` in the compute dtype (saved) and
        the product promotes. In backward the gradients of ``z`` (aggregation, ``el``,
        ``er``) come out in float32 and are cast to the compute dtype (:meth:`cast_grad`)
        where they are summed, then ``fc``'s node and the casts' backward
        (:meth:`autocast_mm_bwd`)."""
        s, tl, cfg = self.s, self.tl, self.cfg
        ein = self.e  # h's dtype
        lo = self.ce or ein  # fc's output dtype
        # the scores, the softmax, the aggregation and the output: z meets the attention
        # vectors and the bias in the parameters' dtype
        e = self.e = self.wide(ein)
        heads = cfg.model.layer_heads(l)
        wi, wo = cfg.model.widths[l], cfg.model.widths[l + 1]
        f = wo if last else wo // heads
        hf = heads * f
        n_src, n_dst, n_e = s.n_src[l], s.n_dst[l], s.num_edges[l]
        tag = f"layer {l} gat"
        fc_w, attn_l, attn_r, bias = self.shapes[l]
        fc_casts: list[Buffer] = []
        if self.ce:
            fc_casts = self.cast_params([fc_w], h_grad, f"{tag} fc")
            fc_casts += [c for c in [self.cast_input(n_src * wi, ein, f"{tag} fc")] if c]
        z = tl.alloc(n_src * hf * lo, ACT, f"{tag} fc")
        h_saved = not self.ce or ein == lo
        if h_saved:
            tl.hold(h)  # fc saves its input
        # (z * attn).sum(-1): the product is freed once the sum exists
        zl = tl.alloc(n_src * hf * e, ATT, f"{tag} z*attn_l")
        el = tl.alloc(n_src * heads * e, ATT, f"{tag} el")
        tl.release(zl)
        zr = tl.alloc(n_dst * hf * e, ATT, f"{tag} z*attn_r")
        er = tl.alloc(n_dst * heads * e, ATT, f"{tag} er")
        tl.release(zr)
        if self.pyg:  # el[src] + er[dst]: two gathers
            uav = pyg_edge_scores(tl, n_e * heads * e, tag)
        else:
            uav = tl.alloc(n_e * heads * e, ATT, f"{tag} el+er")
        lr = tl.alloc(n_e * heads * e, ATT, f"{tag} leaky_relu")
        if self.pyg:
            mx, ex, den = pyg_softmax_forward(tl, n_dst * heads * e, n_e * heads * e, tag)
        a = tl.alloc(n_e * heads * e, ATT, f"{tag} edge_softmax")
        if self.pyg:
            tl.release(mx)
        attn_drop = cfg.training and cfg.model.attn_dropout > 0
        a_used, amask = a, None
        if attn_drop:
            a_used = self.dropout_fwd(a, n_e, heads, True, f"{tag} attention")
            amask = getattr(self, "_std_mask", None) if cfg.model.dropout_mode == "standard" else None
        z_wide = None
        if self.pyg:  # scatter(z[src] * a, dst): the gathered z[src] is saved
            if attn_drop:
                tl.release(a)  # the softmax's output is not saved by PyG's ops
            zs = tl.alloc(n_e * hf * lo, ATT, f"{tag} z[src]")
            m = tl.alloc(n_e * hf * e, ATT, f"{tag} z[src] * a")
            u = tl.alloc(n_dst * hf * e, ACT, f"{tag} u_mul_e_sum")
            tl.release(m)
        else:
            if lo != e:  # the backend casts z to a's float32 (saved by the aggregation)
                z_wide = tl.alloc(n_src * hf * e, ATT, f"{tag} z (float32 copy)")
            u = tl.alloc(n_dst * hf * e, ACT, f"{tag} u_mul_e_sum")
        o = tl.alloc(n_dst * hf * e, ACT, f"{tag} out + bias")
        tl.release(el, er, lr, u)
        if last:
            out = tl.alloc(n_dst * f * e, ACT, f"{tag} mean over heads")
            tl.release(o)
            o = None
        else:
            out = o

        def attention_param_grad(g_attn: Buffer, rows, param, name: str) -> Buffer:
            """Backward of ``z_rows * attn`` from the score gradient ``g_attn``
            (released): the node computes the attention vector's ``(rows, H, F)``
            gradient, then that of ``z_rows``; the engine casts the latter to ``z``'s
            dtype, then sums the former to ``attn``'s ``(1, H, F)`` and frees it."""
            t = tl.alloc(rows * hf * e, BWD, f"{tag} grad attn_{name}")
            gz = tl.alloc(rows * hf * e, BWD, f"{tag} grad z ({name})")
            gz = self.cast_grad(gz, rows * hf, lo, f"{tag} grad z ({name})")
            self.param_grads([param], f"{tag} attn_{name}", cast=False)
            tl.release(t)
            tl.release(g_attn)
            return gz

        def backward(g: Buffer) -> Buffer | None:
            if last:
                gm = tl.alloc(n_dst * hf * e, BWD, f"{tag} grad mean over heads")
                tl.release(g)
                g = gm
            self.param_grads([bias], f"{tag} bias", cast=False)
            if self.pyg:
                gza, gel, ger = self._pyg_attention_bwd(g, zs, a_used, amask, attn_drop, ex, den,
                                                        uav, n_src, n_dst, n_e, heads, hf, tag,
                                                        lo)
            else:
                gza = tl.alloc(n_src * hf * e, BWD, f"{tag} grad z (aggregation)")
                ga = tl.alloc(n_e * heads * e, BWD, f"{tag} grad attention")
                tl.release(g)
                if attn_drop:  # the aggregation's node held the dropped attention
                    tl.release(a_used)
                if z_wide is not None:  # the aggregation's node ends, then the cast's backward
                    tl.release(z_wide)
                    gza = self.cast_grad(gza, n_src * hf, lo, f"{tag} grad z (aggregation)")
                if attn_drop:
                    ga = self.dropout_bwd(ga, n_e, heads, f"{tag} attention", amask)
                gel, ger = edge_softmax_backward(tl, ga, a, uav, n_e * heads * e, n_src * heads * e,
                                                 n_dst * heads * e, tag)
            gzr = attention_param_grad(ger, n_dst, attn_r, "r")
            with self.elt(lo):
                acc = self.accumulate_src_grad(gza, gzr, n_src, hf, tag)
            gzl = attention_param_grad(gel, n_src, attn_l, "l")
            tl.release(z)
            acc2 = tl.alloc(n_src * hf * lo, BWD, f"{tag} grad z")
            tl.release(acc, gzl)
            return self._product_bwd([fc_w], fc_casts, [acc2, h if h_saved else None],
                                     n_src * wi if h_grad else None, ein, f"{tag} fc", "grad h")

        return out, backward, o

    def _pyg_attention_bwd(self, g, zs, a_used, amask, attn_drop, ex, den, uav,
                           n_src, n_dst, n_e, heads, hf, tag, lo):
        """Backward of ``scatter(z[src] * a, dst)``, PyG's softmax and ``el[src] +
        er[dst]`` from the ``(n_dst, H, F)`` gradient ``g`` (released): the
        gradients of ``z`` (aggregation path, in ``z``'s ``lo`` bytes per element:
        the gradient of ``z[src]`` is cast to it where the product promoted), ``el``
        and ``er``."""
        tl, e = self.tl, self.e
        eh = n_e * heads * e
        ge = tl.alloc(n_e * hf * e, BWD, f"{tag} grad messages (gather)")
        tl.release(g)
        # the product's node: a's gradient, then z[src]'s; the engine casts z[src]'s,
        # then sums a's over the broadcast F
        gaf = tl.alloc(n_e * hf * e, BWD, f"{tag} grad a (broadcast)")
        gzs = tl.alloc(n_e * hf * e, BWD, f"{tag} grad z[src]")
        gzs = self.cast_grad(gzs, n_e * hf, lo, f"{tag} grad z[src]")
        ga = tl.alloc(eh, BWD, f"{tag} grad attention")
        tl.release(gaf, ge)
        tl.release(a_used, zs)
        with self.elt(lo):
            gza = self._index_bwd(gzs, n_src, hf, tag)
        if attn_drop:
            ga = self.dropout_bwd(ga, n_e, heads, f"{tag} attention", amask)
        gl = pyg_softmax_backward(tl, ga, ex, den, eh, n_dst * heads * e, tag)
        gel, ger = pyg_edge_scores_backward(tl, gl, uav, eh, n_src * heads * e, n_dst * heads * e,
                                            tag)
        return gza, gel, ger

    # ------------------------------------------------------------------ multi-label loss
    def bce_autocast(self) -> int:
        """Autocast's compute bytes where the multi-label loss casts the logits to
        float32 under it (:func:`~betty.memory.ops.bce_forward`), else 0."""
        return self.ce if self.ce and self.e != FLOAT32_BYTES else 0

    def multilabel_metrics(self, n_out, t: int) -> None:
        """``count_correct`` after the backward (:func:`~betty.memory.ops.multilabel_correct`)."""
        multilabel_correct(self.tl, n_out, t, METRICS)

    # ------------------------------------------------------------------ whole step
    def inputs(self) -> tuple[Buffer, Buffer]:
        """What the step copies to the device for one micro-batch, in its order
        (:func:`betty.train.accumulate_gradients`' staging): each layer's block (edge
        index copies, the GCN's source out-degrees, DGL's block structures), the global
        IDs dropout keys on, the input features in the host matrix's dtype, the labels.
        Returns ``(features, labels)``, each held once."""
        s, cfg, tl = self.s, self.cfg, self.tl
        spec = cfg.model
        L = spec.num_layers
        tl.phase = "blocks"
        for l in range(L):
            tl.alloc(2 * s.num_edges[l] * INDEX_BYTES, BLOCKS, f"layer {l} edge index copies")
            if spec.arch == "gcn":  # the sources' out-degrees travel with the block
                tl.alloc(s.n_src[l] * INDEX_BYTES, BLOCKS, f"layer {l} source out-degrees")
            if self.pyg:  # PygBlock: the (2, E) edge_index only, no graph formats
                continue
            if cfg.host:
                tl.alloc(DGL_BLOCK_HOST_BYTES, BLOCKS,
                         f"layer {l} DGL block node counts")
            tl.alloc(cfg.constants.block_bytes_per_edge * s.num_edges[l]
                     + cfg.constants.block_bytes_per_node * (s.n_src[l] + s.n_dst[l]),
                     BLOCKS, f"layer {l} device graph formats")
        if self.dropout_on and spec.dropout_mode == "deterministic":
            for l in range(L):
                tl.alloc(s.n_src[l] * INDEX_BYTES, IDS, f"layer {l} node ids")
        if (cfg.training and spec.arch == "gat" and spec.attn_dropout > 0
                and spec.dropout_mode == "deterministic"):
            for l in range(L):
                tl.alloc(s.num_edges[l] * INDEX_BYTES, IDS, f"layer {l} edge ids")
        tl.phase = "inputs"
        x = tl.alloc(s.n_src[0] * spec.widths[0] * cfg.feat_elt, FEATS, "input features")
        if cfg.label_columns:
            labels = tl.alloc(s.num_outputs * cfg.label_columns * cfg.label_elt, LABELS, "labels")
        else:
            labels = tl.alloc(s.num_outputs * INDEX_BYTES, LABELS, "labels")
        return x, labels

    def run(self) -> Timeline:
        s, cfg, tl, e = self.s, self.cfg, self.tl, self.e
        spec = cfg.model
        L = spec.num_layers
        self.baseline()
        x, labels = self.inputs()
        if np.any(cfg.next_inputs):  # copy-ahead: the next micro-batch's inputs, live to the end
            tl.alloc(cfg.next_inputs, NEXT_INPUTS, "next micro-batch's inputs")
        f_in = spec.widths[0]
        if cfg.feat_elt != e:  # betty.precision.input_dtype's cast (under autocast: to float32)
            x2 = tl.alloc(s.n_src[0] * f_in * e, FEATS, "input features (cast)")
            tl.release(x)
            x = x2
        n_out = s.num_outputs

        backwards: list[Callable] = []
        h, h_grad = x, False
        tl.hold(h)  # the layer loop's variable
        for l in range(L):
            tl.phase = f"forward layer {l}"
            last = l == L - 1
            inp = h
            in_e = self.e  # the layer input's dtype
            conv_in, conv_grad = inp, h_grad
            drop = None
            if self.dropout_on:
                width = spec.widths[l]
                conv_in = self.dropout_fwd(inp, s.n_src[l], width, h_grad, f"layer {l}")
                drop = (s.n_src[l], width, h_grad, getattr(self, "_std_mask", None))
            if spec.arch == "sage":
                out, conv_bwd = self.sage_layer(l, conv_in, conv_grad)
            elif spec.arch == "gcn":
                out, conv_bwd = self.gcn_layer(l, conv_in, conv_grad)
            else:
                out, conv_bwd, _ = self.gat_layer(l, conv_in, conv_grad, last)
            if conv_in is not inp:
                tl.release(conv_in)  # forward_layer's variable moves on
            work_e = self.e  # what the layer's ops ran in, and its backward runs in
            e, self.out_e = self.out_e or work_e, None  # the layer's output dtype
            self.e = e
            act = pre_act = None
            if not last:
                wo = spec.widths[l + 1]
                act = tl.alloc(s.n_dst[l] * wo * e, ACT, f"layer {l} {spec.activation_name}")
                if spec.activation_saves_result:  # relu saves its result; its input is freed
                    tl.hold(act)
                    tl.release(out)
                else:  # elu/leaky_relu/gelu save their input: `out` keeps its one holder
                    pre_act = out
                new_h = act
            else:
                new_h = out
            tl.release(inp)  # the loop variable moves on (x itself stays held by the caller)
            backwards.append((l, conv_bwd, act, pre_act, drop, last, in_e, work_e, e))
            h, h_grad = new_h, True  # new_h's one holder is now the loop variable
        logits = h  # the loop variable becomes accumulate_gradients' `logits`

        tl.phase = "loss"
        n_cls = spec.widths[-1]
        if cfg.label_columns:
            saved = bce_forward(tl, labels, n_out, cfg.label_columns, e, cfg.label_elt, self.bce_autocast())
        elif self.ce and e != FLOAT32_BYTES:  # cross_entropy on a float32 copy of the logits
            lsm = through(tl, LOSS, n_out * n_cls * FLOAT32_BYTES, "logits (autocast float32 copy)",
                          n_out * n_cls * FLOAT32_BYTES, "log_softmax")
            saved = [lsm]
        else:
            lsm = tl.alloc(n_out * n_cls * e, LOSS, "log_softmax")
            saved = [lsm]
        tl.release(*self._region_casts)  # the autocast region ends after the loss
        self._region_casts = []

        tl.phase = "backward loss"
        if cfg.label_columns:
            g = bce_backward(tl, saved, n_out, cfg.label_columns, e, self.bce_autocast())
        elif self.ce and e != FLOAT32_BYTES:  # float32 loss gradients, then the cast's backward
            g1 = tl.alloc(n_out * n_cls * FLOAT32_BYTES, BWD, "grad nll")
            g2 = tl.alloc(n_out * n_cls * FLOAT32_BYTES, BWD, "grad logits (float32)")
            tl.release(g1, *saved)
            g = tl.alloc(n_out * n_cls * self.ce, BWD, "grad logits")
            tl.release(g2)
        else:
            g1 = tl.alloc(n_out * n_cls * e, BWD, "grad nll")
            g = tl.alloc(n_out * n_cls * e, BWD, "grad logits")
            tl.release(g1, *saved)

        for l, conv_bwd, act, pre_act, drop, last, in_e, work_e, out_e in reversed(backwards):
            tl.phase = f"backward layer {l}"
            if not last:
                wo = spec.widths[l + 1]
                ga = tl.alloc(s.n_dst[l] * wo * out_e, BWD, f"layer {l} activation grad")
                tl.release(g)
                if spec.activation_saves_result:
                    tl.release(act)  # relu's saved result
                else:
                    tl.release(pre_act)  # the saved input
                g = ga
            with self.elt(work_e):
                g = conv_bwd(g)
            if drop is not None and g is not None:
                n, width, needs, mask = drop
                with self.elt(in_e):
                    g = self.dropout_bwd(g, n, width, f"layer {l}", mask)
            if g is None:
                break
        if cfg.label_columns:
            tl.phase = "metrics"
            self.multilabel_metrics(n_out, cfg.label_columns)
        tl.phase = "end"
        del logits
        return tl


def _replayer(sizes: MicroBatchSizes, cfg: ReplayConfig) -> _Replayer:
    if len(sizes.n_src) != cfg.model.num_layers:
        raise ValueError(
            f"sizes describe {len(sizes.n_src)} layers but the model has {cfg.model.num_layers}")
    return _Replayer(sizes, cfg)


def input_bytes(sizes: MicroBatchSizes, cfg: ReplayConfig) -> np.ndarray:
    """``(P,)`` bytes of what the step copies to the device for each micro-batch of ``sizes``
    before its forward (:meth:`_Replayer.inputs`: blocks, global IDs, features in the
    host matrix's dtype, labels), each allocation rounded to the backend's granule: the
    bytes copy-ahead holds beside the micro-batch before it (``StepConfig.next_inputs``)."""
    r = _replayer(sizes, cfg)
    r.inputs()
    return r.tl.live.copy()


def replay(sizes: MicroBatchSizes, cfg: ReplayConfig, *, record: bool = False) -> Timeline:
    """Replay every micro-batch of ``sizes`` at once; see the module docstring.
    ``record``: keep every allocation and free in ``Timeline.log``."""
    r = _replayer(sizes, cfg)
    if record:
        r.tl.log = []
    return r.run()
