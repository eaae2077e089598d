"""Symbolic replay of one RevGNN training step on one graph part: every tensor it
allocates and frees, op by op.

The replay walks what :func:`betty.rev.engine.train_step_parts` does for
one part (``N`` nodes, ``E`` edges, ``T`` training nodes) of a
:class:`~betty.rev.model.RevGNN` and records each tensor storage on a
:class:`~betty.memory.timeline.Timeline` when it is created and when its last holder
(a Python variable, a tensor autograd saved, a DGL frame, an autograd input buffer, a
reversible hand-off) lets go of it. The estimate is the maximum of the live bytes over
the whole timeline, the number :class:`~betty.memory.meter.MemoryMeter` measures.

Phases (``D`` = hidden width, ``C`` groups of width ``w = D / C``, ``e`` bytes per
element):

1. **Part inputs**: the part's training mask ``(N,)`` bool (freed once the loss's
   backward has used it) and features ``(N, F)`` (cast to the compute dtype when stored
   in another).
2. **Dropout masks** (``p > 0``): two ``(N, D)`` multipliers per forward pass (one
   shared by the blocks, one for the head). RevGNN's own draws both up front, each
   through ``rand`` (float32), ``>=`` (bool), a cast and a scale; the trainer's
   :class:`~betty.rev.engine.SharedHashMasks` (``masks_held``) hashes the blocks' at the
   first block and the head's at the head dropout (SplitMix64 row words, a boolean
   keep-mask, an int64 chunk of scratch, the cast) and keeps both to the part's end.
3. **Encoder** ``(N, D)``.
4. **Blocks.** One coupling computes ``X'_i = f_i(X'_{i-1}) + X_i`` with
   ``f = Conv(G, M * ReLU(Norm(.)))``; its intermediates per group are
   ``O(N w)`` (norm, ReLU, masked input, conv outputs, degree vectors) plus, for GAT,
   ``O(N H w)`` projected features and ``O(E H)`` edge logits / softmax.

   * *reversible*: forward under ``no_grad`` (transients only), the block input's
     storage is freed, so about three ``(N, D)`` tensors are live at any time
     (input, the group outputs, the concatenated output). Backward per block: the
     output (handed down by the next block), its reconstruction (the inverse runs
     every ``f_i`` again), one block's recomputation *with* autograd (its saved
     tensors), the consistency check (two ``(N, D)`` transients), the incoming
     gradient and the gradients the block produces.
   * *residual*: every block keeps what autograd saves: its input (through the first
     group's norm, ``C = 2``), per group the norm statistics, ReLU output, conv saved
     tensors and the group output: activation memory grows with depth.
   * *residual + checkpointing*: each block keeps its input; backward recomputes one
     block (stopping at its last saved tensor) and runs its backward.

5. **Head**: norm, ReLU, dropout, decoder; **loss** (cross-entropy on the part's
   training rows, or BCE with logits for ``T``-column multi-label targets) and the
   backward of all of it in reverse order. Each parameter's gradient appears at the
   op that makes it (:meth:`_RevReplayer.param_grads`) and becomes ``.grad`` (the first
   part after ``zero_grad(set_to_none=True)``) or, on the others, is added in place and
   freed once its node's outputs are delivered; a reversible block's come back from its
   ``torch.autograd.grad`` together, when the block's node returns; weight-tied ones
   are summed over the blocks first.
6. **Correct count** after the backward: the part's training rows of the output and of
   the labels, the argmax and its comparison (multi-label: the sign comparisons and
   their integer count).
7. **Optimizer step** once all parts ran: on the host Adam and SGD loop over the
   parameters of each group; per parameter Adam allocates the gradient's copies
   (negated with ``maximize``, decayed with weight decay), ``sqrt(v)`` and
   ``sqrt(v) / c`` (the previous denominator is freed when the next one is assigned),
   SGD only the gradient's copies (negated, decayed, plus the Nesterov term); multi-
   tensor steps (CUDA's default) are one transient (peak:
   :func:`betty.memory.ops.step_temporaries`, as the sampled engine's
   :func:`betty.memory.estimator.step_bytes`). Before the optimizer's first step
   (``first_step``) its state does not exist during the parts: the step creates it
   (Adam: ``exp_avg``, ``exp_avg_sq`` and the 0-d ``step`` of every parameter before
   its loop; SGD: each momentum buffer as a copy of the gradient, inside its loop) and
   it stays. Only
   the parts whose meter region holds the step (``step_parts``) replay it.

The op sequences were read off the code of ``betty.rev.model*``, DGL 2.1's
``GraphConv`` (``norm='both'``), ``SAGEConv('mean')`` and ``GATConv``, betty's PyG
layers (:mod:`betty.backends.pyg_backend`, :func:`betty.models.gat.gat_forward`; PyG
2.8's ``scatter`` and ``softmax``), PyTorch 2.2's autograd engine (gradient
accumulation in its input buffers, non-reentrant checkpointing with early stop, whose
unpacked saved tensors die with their backward node) and checked op by op against a
dispatch-mode trace on the host: ``tests/test_memory_trace_diff_rev.py`` diffs the
event sequence against :class:`betty.memory.trace.AllocationTrace` for every coupling,
mode, norm and mask kind on both backends (the PyG ones under torch 2.2.1 and 2.13.0
alike). A block's parameter gradients are one buffer; tensors of a few bytes (scalars,
0-d losses) are left out.

All sizes are ``(P,)`` vectors, so the parts of a K-way split are replayed at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from betty.memory.ops import (ACT, ATT, BWD, DROP, FEATS, GRADS, INDEX_BYTES, LABELS, LOSS, OPT,
                              PARAMS, StepConfig, bce_backward, bce_forward, edge_softmax_backward,
                              hash_chunk_rows, hash_words, index_backward, multilabel_correct, numel,
                              optimizer_state_size, pyg_edge_scores, pyg_edge_scores_backward,
                              pyg_scatter_mean, pyg_softmax_backward, pyg_softmax_forward, step_baseline,
                              step_foreach, step_groups, step_temporaries)
from betty.memory.timeline import Buffer, Timeline

__all__ = ["RevReplayConfig", "replay_rev", "rev_parameter_shapes", "COMPONENTS"]

# components of the breakdown besides the shared ones (betty.memory.ops)
ENC, INT, HEAD, STEP = "encoder", "block_internals", "head", "optimizer_step"
COMPONENTS = (PARAMS, GRADS, OPT, FEATS, LABELS, DROP, ENC, ACT, INT, ATT, HEAD, LOSS, BWD, STEP)


CONV_BIAS_INDEX = {"gcn": 1, "sage": 2, "gat": 2}
"""Where the bias is among a group function's convolution shapes (:func:`rev_parameter_shapes`)."""


def rev_parameter_shapes(in_feats: int, hidden: int, out_feats: int, num_groups: int,
                         num_distinct_blocks: int, conv: str, norm: str, heads: int,
                         gat_merge: str) -> list[list[tuple[int, ...]]]:
    """Shapes of a RevGNN's parameters, grouped as ``[encoder, block_0, ..., head]``
    (the order of ``RevGNN.parameters()``; the head holds the final norm and the
    decoder)."""
    w = hidden // num_groups
    norm_shapes = [(w,), (w,)] if norm in ("layer", "batch") else []
    if conv == "gcn":
        conv_shapes = [(w, w), (w,)]
    elif conv == "sage":
        conv_shapes = [(w, w), (w, w), (w,)]
    elif conv == "gat":
        f = w if gat_merge == "mean" else w // heads
        conv_shapes = [(1, heads, f), (1, heads, f), (heads * f,), (heads * f, w)]
    else:
        raise ValueError(f"conv must be one of ('gcn', 'sage', 'gat'), got {conv!r}")
    group = norm_shapes + conv_shapes
    block = [s for _ in range(num_groups) for s in group]
    head_norm = [(hidden,), (hidden,)] if norm in ("layer", "batch") else []
    head = head_norm + [(out_feats, hidden), (out_feats,)]
    blocks = [list(block) for _ in range(num_distinct_blocks)]
    return [[(hidden, in_feats), (hidden,)]] + blocks + [head]


@dataclass
class RevReplayConfig(StepConfig):
    """Everything :func:`replay_rev` needs besides the part sizes: the step's
    :class:`~betty.memory.ops.StepConfig` fields (keyword arguments; ``fresh_grads``:
    the first part *with training nodes* starts fresh, ``elt`` is also the parameters'
    width) and

    Attributes:
        hidden, num_groups, num_layers, in_feats, out_feats: the model's shape.
        conv, heads, gat_merge, norm: the group function.
        mode: ``"reversible"``, ``"residual"`` or ``"checkpoint"``.
        weight_tied: one block's weights applied at every depth.
        dropout: the model's dropout probability (masks exist when > 0).
        check_consistency: the reversible backward checks each recomputed block.
        granule: allocation rounding in bytes (CUDA's caching allocator: 512).
        graph_backend: ``"dgl"`` (DGL's fused message passing) or ``"pyg"`` (betty's
            PyG layers: gathered ``(E, w)`` messages and ``scatter_add``; GAT's
            gathered ``(E, H)`` scores and ``(E, H, F)`` products, PyG's softmax).
        masks_held: the dropout masks live until the part ends (a per-part mask cache);
            else the residual network frees each with its last autograd holder.
        first_step: the optimizer holds no state yet (before its first step): the
            parts run without it and the step creates it (``optimizer`` says which).
        step_parts: ``(P,)`` bools: the part's meter region holds the optimizer step
            (``None``: every part's does, the steady-state convention: each estimate
            covers the step's temporaries whichever part runs last).
    """

    hidden: int
    num_groups: int
    num_layers: int
    in_feats: int
    out_feats: int
    conv: str
    heads: int
    gat_merge: str
    norm: str
    mode: str
    weight_tied: bool
    dropout: float
    check_consistency: bool
    granule: int = 1
    graph_backend: str = "dgl"
    masks_held: bool = False
    first_step: bool = False
    step_parts: np.ndarray | None = None

    @property
    def shapes(self) -> list[list[tuple[int, ...]]]:
        return rev_parameter_shapes(self.in_feats, self.hidden, self.out_feats, self.num_groups,
                                    1 if self.weight_tied else self.num_layers, self.conv,
                                    self.norm, self.heads, self.gat_merge)


class _RevReplayer:
    def __init__(self, n, e, nt, cfg: RevReplayConfig) -> None:
        self.cfg = cfg
        self.n = np.asarray(n, dtype=np.float64)
        self.e_cnt = np.asarray(e, dtype=np.float64)
        self.nt = np.asarray(nt, dtype=np.float64)
        self.tl = Timeline(self.n.shape[0], cfg.granule)
        self.fresh = np.asarray(cfg.fresh_grads, dtype=bool)
        self.w = cfg.hidden // cfg.num_groups
        self.el = cfg.elt
        self.stat_el = max(cfg.elt, 4)  # norm statistics are at least float32
        self.has_mask = cfg.dropout > 0
        f = self.w if cfg.gat_merge == "mean" else self.w // max(cfg.heads, 1)
        self.hf = cfg.heads * f  # GAT projected width
        self.shapes = cfg.shapes
        self.pbytes = [sum(numel(s) for s in group) * cfg.elt for group in self.shapes]
        group = self.shapes[1][:len(self.shapes[1]) // cfg.num_groups]  # one group function's
        n_norm = 2 if cfg.norm in ("layer", "batch") else 0
        self.norm_shapes, self.conv_shapes = group[:n_norm], group[n_norm:]
        self.bias_shape = self.conv_shapes[CONV_BIAS_INDEX[cfg.conv]]
        self._pre_mean: Buffer | None = None  # see _gat's backward
        self._grad_is_view = False  # the gradient reaching a group function is a slice
        self._pending_grads: list[Buffer] = []  # see settle_pending
        self._bias_ran = False  # see run's checkpoint branch
        self._bias_pending: list[Buffer] = []  # see bias_grad
        self._deferred: list[Buffer] | None = None  # see settle
        self._masked_last: Buffer | None = None  # see coupling_backward
        self._block = 0  # the block whose backward runs
        self._tied_new: set[int] = set()  # weight-tied gradients not settled yet
        self._tied_sums: list[Buffer] = []  # their running sums over the blocks
        self._tied_index = 0  # the next one a block settles

    # ------------------------------------------------------------------ helpers
    def alloc(self, nbytes, comp: str, name: str) -> Buffer:
        """A new buffer of ``nbytes`` per micro-batch (component ``comp``)."""
        return self.tl.alloc(nbytes, comp, name)

    def release(self, *bufs) -> None:
        """Drop one holder of each of ``bufs``; the ones nobody holds are freed."""
        self.tl.release(*bufs)

    def hold(self, *bufs) -> None:
        """One more holder for each of ``bufs`` (e.g. autograd saved it)."""
        self.tl.hold(*bufs)

    def node_bytes(self, width: int | None = None) -> np.ndarray:
        """Bytes of an ``(N, width)`` tensor per micro-batch (``width``: one group's ``w``)."""
        return self.n * (self.w if width is None else width) * self.el

    def bwd(self, name: str, *freed, nbytes=None) -> Buffer:
        """One backward op's output (``nbytes``; ``(N, w)`` by default), then ``freed``
        let go (the gradient it consumed, the saved tensors it used)."""
        out = self.alloc(self.node_bytes() if nbytes is None else nbytes, BWD, name)
        self.release(*freed)
        return out

    def param_grads(self, shapes, tag: str, block: bool = False) -> list[Buffer]:
        """The gradients of parameters of ``shapes``, in that order, as a backward node
        produces them. ``AccumulateGrad`` keeps each as ``.grad`` on a fresh part; on the
        others it adds it in place into ``.grad`` once the node has finished and its
        outputs have been delivered (an out-of-place sum where a tensor's gradient
        arrives twice): pass the returned buffers to :meth:`settle` there. ``block``: a
        block's parameters (weight-tied: one set for every block, see :meth:`settle`)."""
        grads = [self.alloc(numel(shape) * self.el, GRADS, f"{tag} grad {shape}") for shape in shapes]
        if block and self.cfg.weight_tied:
            self._tied_new.update(id(g) for g in grads)
        return grads

    def settle(self, *grads: Buffer) -> None:
        """``AccumulateGrad`` of ``grads`` (:meth:`param_grads`): freed on the parts that
        had ``.grad`` already, kept as ``.grad`` on a fresh one. Inside a reversible
        block's backward (``_deferred`` is a list) the block's ``torch.autograd.grad``
        returns them instead, all at its end (:meth:`_reversible_block_backward`)."""
        if self._deferred is not None:
            self._deferred += grads
            return
        for g in grads:
            if id(g) in self._tied_new:
                self._settle_tied(g)
            else:
                self.tl.release_where(g, ~self.fresh)

    def _settle_tied(self, g: Buffer) -> None:
        """A weight-tied parameter's gradient from block ``self._block`` (the blocks run
        backward from the last): the engine sums the blocks' contributions out of place
        in the parameter's input buffer (the ``k``-th gradient a block settles is the
        ``k``-th of every block); ``AccumulateGrad`` runs once block 0's has arrived."""
        self._tied_new.discard(id(g))
        k = self._tied_index
        self._tied_index += 1
        if self._block == self.cfg.num_layers - 1:
            self._tied_sums.append(g)
        else:
            total = self.alloc(g.size, GRADS, "tied parameter grad (sum over blocks)")
            self.release(self._tied_sums[k], g)
            self._tied_sums[k] = total
        if self._block == 0:
            self.tl.release_where(self._tied_sums[k], ~self.fresh)

    def bias_grad(self, shape, tag: str) -> None:
        """The gradient of a group function's bias, added last in its forward (GCN, GAT):
        its node saves nothing; skipped where it ran before a checkpoint recomputation
        (``_bias_ran``). ``AccumulateGrad`` follows at once, except on PyG's GAT, whose
        bias is viewed ``(H, F)`` before the layer runs: that view's backward node is
        older than every node of the layer, so the engine runs it, and the parameter's
        ``AccumulateGrad``, once the layer's backward is done (``_bias_pending``)."""
        if self._bias_ran:
            self._bias_ran = False
            return
        grads = self.param_grads([shape], f"{tag} bias", block=True)
        if self.cfg.graph_backend == "pyg" and self.cfg.conv == "gat":
            self._bias_pending += grads
        else:
            self.settle(*grads)

    def settle_pending(self) -> None:
        """:meth:`settle` the gradients a group function's last node (its norm) left for
        the coupling, once the coupling has delivered that node's output."""
        self.settle(*self._pending_grads)
        self._pending_grads = []

    # ------------------------------------------------------------------ baseline
    def baseline(self) -> None:
        cfg = self.cfg
        bn_buffers = None
        if cfg.norm == "batch":  # running mean/var (w) and num_batches_tracked per group
            n_bn = (1 if cfg.weight_tied else cfg.num_layers) * cfg.num_groups
            bn_buffers = n_bn * (2 * self.w * cfg.elt + 8) + 2 * cfg.hidden * cfg.elt + 8
        step_baseline(self.tl, cfg, float(sum(self.pbytes)), sum(len(g) for g in self.shapes),
                      bn_buffers, state=not cfg.first_step)

    # ------------------------------------------------------------------ group function
    def group_forward(self, hin: Buffer, grad: bool, tag: str, stop_early: bool = False):
        """``f(H) = Conv(G, M * ReLU(Norm(H)))`` on ``hin`` ``(N, w)`` (a view keeps its
        base buffer). Returns the output buffer and, with ``grad``, its backward.

        ``stop_early``: a checkpoint recomputation that ends once the group's last saved
        tensor exists (PyTorch's non-reentrant checkpoint stops there); no output."""
        cfg, n = self.cfg, self.n
        nw = self.node_bytes()
        stats: list[Buffer] = []
        if cfg.norm in ("layer", "batch"):
            z = self.alloc(nw, INT, f"{tag} norm")
            rows = n if cfg.norm == "layer" else self.w  # per node, or (batch norm) per channel
            stats = [self.alloc(rows * self.stat_el, INT, f"{tag} norm mean"),
                     self.alloc(rows * self.stat_el, INT, f"{tag} norm rstd")]
            if grad:
                self.hold(hin)  # the norm saves its input
            else:
                self.release(*stats)
                stats = []
        else:
            z = hin
            self.hold(z)
        relu = self.alloc(nw, INT, f"{tag} relu")
        self.release(z)
        if grad:
            self.hold(relu)  # relu saves its result
        if self.has_mask:
            m = self.alloc(nw, INT, f"{tag} masked")
            self.release(relu)
        else:
            m = relu
        convs = {"gcn": self._gcn, "sage": self._sage, "gat": self._gat}
        if cfg.graph_backend == "pyg":
            convs.update(gcn=self._gcn_pyg, sage=self._sage_pyg, gat=self._gat_pyg)
        conv = convs[cfg.conv]
        out, conv_bwd = conv(m, grad, tag, stop_early)
        self.release(m)  # the group function returns
        if not grad:
            return out, None

        def backward(g: Buffer) -> Buffer:
            gm = conv_bwd(g)
            if self.has_mask:
                gm = self.bwd(f"{tag} grad masked", gm)
                self.release(self._masked_last)
                self._masked_last = None
            t = self.bwd(f"{tag} grad relu", gm, relu)
            if cfg.norm in ("layer", "batch"):
                gn = self.alloc(self.node_bytes(), BWD, f"{tag} grad norm")
                self._pending_grads += self.param_grads(self.norm_shapes, f"{tag} norm", block=True)
                self.release(t, hin, *stats)
                return gn
            return t

        return out, backward

    # ---------------------------------------------------------------- shared op sequences
    # The DGL and PyG variants of a group function run the same dense ops around a
    # different message-passing core; each shared sequence below is written once.
    def _gspmm_backward(self, g: Buffer, tag: str) -> Buffer:
        """Backward of DGL's fused aggregation (``gspmm`` copy_u/sum): one ``(N, w)``
        gradient, no per-edge tensor; releases ``g``."""
        return self.bwd(f"{tag} grad aggregation (gspmm)", g)

    def _scatter_backward(self, g: Buffer, width, tag: str) -> Buffer:
        """Backward of ``scatter(msg, dst, reduce='sum')`` from ``g`` ``(N, width)``: the
        gather ``g[dst]``, ``(E, width)``; releases ``g``."""
        ge = self.alloc(self.e_cnt * width * self.el, BWD, f"{tag} grad scatter_add (gather, E x w)")
        self.release(g)
        return ge

    def _gather_backward(self, ge: Buffer, width, tag: str) -> Buffer:
        """Backward of the gather ``h[src]`` from ``ge`` ``(E, width)``: ``zeros`` ``(N,
        width)`` then ``index_put_(accumulate=True)`` out of place; releases ``ge``."""
        return index_backward(self.tl, ge, self.node_bytes(width), tag)

    def _pyg_aggregation_backward(self, g: Buffer, tag: str) -> Buffer:
        """Backward of PyG's ``scatter(h[src], dst, reduce='sum')``: ``(N, w)`` from
        ``(N, w)`` through an ``(E, w)`` gather; releases ``g``."""
        return self._gather_backward(self._scatter_backward(g, self.w, tag), self.w, tag)

    def _gcn_norm_dst_bias(self, mmo: Buffer, nd: Buffer, grad: bool, stop: bool, tag: str,
                           early: tuple = (), late: tuple = (), product_late: bool = False) -> Buffer | None:
        """GraphConv's tail ``(aggregate @ W) * norm_dst + bias``: ``mul`` (saves
        ``norm_dst``) then ``add``. ``early`` go when the product exists, ``late``
        when the sum does (the variants keep different locals alive); ``mmo`` with the
        early ones, or last of the late ones with ``product_late`` (PyG's layer holds
        it in a local until it returns). With ``stop`` (checkpoint recomputation):
        ``mul`` saves ``norm_dst`` before running and the recomputation ends there: no
        output."""
        nw = self.node_bytes()
        if stop:
            self.hold(nd)
            self.release(mmo, *early, *late)
            return None
        mo = self.alloc(nw, INT, f"{tag} * norm dst")
        if grad:
            self.hold(nd)
        self.release(*(() if product_late else (mmo,)), *early)
        out = self.alloc(nw, INT, f"{tag} + bias")
        self.release(mo, *late, *((mmo,) if product_late else ()))
        return out

    def _gcn_backward(self, g: Buffer, nd: Buffer, agg: Buffer, ns: Buffer, agg_backward,
                      tag: str) -> Buffer:
        """Backward of GraphConv's dense ops around the aggregation: ``* norm_dst``
        (``mul``), ``@ W`` (``mm``: grad ``@ W^T``), ``agg_backward`` (the backend's
        aggregation, releases its input), ``* norm_src`` (``mul``); releases ``g`` and
        the saved ``nd``, ``agg``, ``ns``; returns ``(N, w)``. The bias's gradient comes
        first, ``W``'s before the aggregate's."""
        weight, _ = self.conv_shapes
        self.bias_grad(self.bias_shape, tag)
        g1 = self.bwd(f"{tag} grad * norm dst", g, nd)
        w = self.param_grads([weight], f"{tag} W", block=True)
        g2 = self.bwd(f"{tag} grad aggregate", g1, agg)
        self.settle(*w)
        return self.bwd(f"{tag} grad * norm src", agg_backward(g2, tag), ns)

    def _sage_fc(self, m: Buffer, q: Buffer, grad: bool, stop: bool, tag: str) -> Buffer | None:
        """SAGEConv's tail ``fc_neigh(mean) + fc_self(h)`` (``mm``, ``addmm``, ``add``):
        ``fc_neigh`` saves the mean, ``fc_self`` its input; releases ``q`` (PyG: once
        ``fc_neigh`` has run). With
        ``stop``: ``fc_self`` saves its input before running, the recomputation ends
        there: no output."""
        nw = self.node_bytes()
        mn = self.alloc(nw, INT, f"{tag} fc_neigh")
        if grad:
            self.hold(q, m)
        if self.cfg.graph_backend == "pyg":  # the local is reassigned; DGL's dstdata keeps it
            self.release(q)
            q = None
        if stop:
            self.release(mn, q)
            return None
        ms = self.alloc(nw, INT, f"{tag} fc_self")
        out = self.alloc(nw, INT, f"{tag} self + neigh")
        self.release(ms, mn, q)
        return out

    def _sage_backward(self, g: Buffer, m: Buffer, q: Buffer, deg: Buffer, agg_backward,
                       tag: str, sliced: bool = False) -> Buffer:
        """Backward of :meth:`_sage_fc` and the mean's division: ``fc_self`` (releases
        its input ``m``), ``fc_neigh`` (releases the mean ``q``), ``/ degree`` (releases
        ``deg``), ``agg_backward`` (the backend's neighbour sum, releases its input),
        (``sliced``: the self features were the view ``h[:n_dst]``, whose
        ``slice_backward`` copies the self gradient into zeros) then the sum of the self
        and neighbour gradients; returns ``(N, w)``. ``fc_self``'s weight, the bias and
        ``fc_neigh``'s weight get their gradients between the self and mean gradients."""
        gs = self.alloc(self.node_bytes(), BWD, f"{tag} grad self")
        w_self, w_neigh, bias = self.conv_shapes
        fc_self = self.param_grads([w_self], f"{tag} fc_self", block=True)
        self.release(m)  # the node returns: its saved input goes
        self.settle(*self.param_grads([bias], f"{tag} bias", block=True), *fc_self)
        fc_neigh = self.param_grads([w_neigh], f"{tag} fc_neigh", block=True)
        gn = self.bwd(f"{tag} grad mean", g, q)
        self.settle(*fc_neigh)
        gd = self.bwd(f"{tag} grad mean / degree", gn, deg)
        agg = agg_backward(gd, tag)
        if sliced:
            gs = self.bwd(f"{tag} grad self slice_backward", gs)
        return self.bwd(f"{tag} grad self + neigh", gs, agg)

    # ------------------------------------------------------------------ group convolutions
    def _gcn(self, m: Buffer, grad: bool, tag: str, stop: bool = False):
        """DGL GraphConv(norm='both'), in = out width: aggregate, then multiply."""
        n, el = self.n, self.el
        nw = self.node_bytes()

        def backward(g: Buffer) -> Buffer:
            return self._gcn_backward(g, nd, rst, ns, self._gspmm_backward, tag)

        ar = self.alloc(n * INDEX_BYTES, INT, f"{tag} out_degrees arange")
        self.tl.temp(n, INT, f"{tag} has_nodes mask")
        self.release(ar)
        d0 = self.alloc(n * el, INT, f"{tag} out degrees")
        dc = self.alloc(n * el, INT, f"{tag} out degrees clamp")
        self.release(d0)
        ns = self.alloc(n * el, INT, f"{tag} norm src")
        fs = self.alloc(nw, INT, f"{tag} feat * norm src")
        if grad:
            self.hold(ns)
        rst = self.alloc(nw, INT, f"{tag} aggregate")
        mmo = self.alloc(nw, INT, f"{tag} aggregate @ W")
        if grad:
            self.hold(rst)
        self.tl.temp(n * INDEX_BYTES, INT, f"{tag} in_degrees arange")
        d1 = self.alloc(n * el, INT, f"{tag} in degrees")
        dc2 = self.alloc(n * el, INT, f"{tag} in degrees clamp")
        self.release(d1, dc)
        nd = self.alloc(n * el, INT, f"{tag} norm dst")
        self.release(ns)
        # the graph's local_scope keeps the aggregate, degree and norm tensors to the end
        out = self._gcn_norm_dst_bias(mmo, nd, grad, stop, tag, late=(rst, fs, dc2, nd))
        return out, backward

    def _sage(self, m: Buffer, grad: bool, tag: str, stop: bool = False):
        """DGL SAGEConv('mean'), in = out width (no lin_before_mp)."""
        n, el = self.n, self.el
        nw = self.node_bytes()

        def backward(g: Buffer) -> Buffer:
            return self._sage_backward(g, m, q, dg, self._gspmm_backward, tag)

        z = self.alloc(nw, INT, f"{tag} neighbour sum")
        self.tl.temp(n * INDEX_BYTES, INT, f"{tag} in_degrees arange")
        c = self.alloc(n * INDEX_BYTES, INT, f"{tag} degrees clamp")
        dg = self.alloc(n * el, INT, f"{tag} degrees")
        self.release(c)
        q = self.alloc(nw, INT, f"{tag} neighbour mean")
        self.release(z)
        if not grad:
            self.release(dg)
        return self._sage_fc(m, q, grad, stop, tag), backward

    def _gcn_pyg(self, m: Buffer, grad: bool, tag: str, stop: bool = False):
        """:class:`betty.backends.pyg_backend.PygGraphConv`, in = out width: scale by the
        source norm, gather ``(E, w)`` messages, ``scatter_add`` into zeros, ``@ W``,
        scale by the destination norm, ``+ bias``."""
        nw, ew = self.node_bytes(), self.e_cnt * self.w * self.el

        def backward(g: Buffer) -> Buffer:
            return self._gcn_backward(g, nd, agg, ns, self._pyg_aggregation_backward, tag)

        ns = self._pyg_degree_norm(tag, "out")
        fs = self.alloc(nw, INT, f"{tag} feat * norm src")
        if grad:
            self.hold(ns)
        self.release(ns)
        msg = self.alloc(ew, INT, f"{tag} messages h[src] (E x w)")
        agg = self.alloc(nw, INT, f"{tag} scatter_add")
        self.release(msg)
        mmo = self.alloc(nw, INT, f"{tag} aggregate @ W")
        if grad:
            self.hold(agg)
        self.release(agg)
        nd = self._pyg_degree_norm(tag, "in")
        out = self._gcn_norm_dst_bias(mmo, nd, grad, stop, tag, early=(nd,), late=(fs,), product_late=True)
        return out, backward

    def _pyg_degree_norm(self, tag: str, which: str) -> Buffer:
        """``bincount(...).to(dtype).clamp(min=1).pow(-0.5)``: ``(N,)``, temporaries freed."""
        n, el = self.n, self.el
        b = self.alloc(n * INDEX_BYTES, INT, f"{tag} {which} degrees (bincount)")
        t = self.alloc(n * el, INT, f"{tag} {which} degrees .to")
        self.release(b)
        c = self.alloc(n * el, INT, f"{tag} {which} degrees clamp")
        self.release(t)
        norm = self.alloc(n * el, INT, f"{tag} norm {which}")
        self.release(c)
        return norm

    def _sage_pyg(self, m: Buffer, grad: bool, tag: str, stop: bool = False):
        """:class:`betty.backends.pyg_backend.PygSAGEConv` ('mean', in = out width):
        gather ``(E, w)`` messages, PyG's ``scatter(reduce='mean')`` (counts, sum,
        divide), ``fc_neigh``, ``fc_self``, sum."""
        def backward(g: Buffer) -> Buffer:
            return self._sage_backward(g, m, q, cnt, self._pyg_aggregation_backward, tag, sliced=True)

        cnt, q = pyg_scatter_mean(self.tl, INT, self.e_cnt, self.n, self.w, self.el, tag)
        if not grad:  # the division saves the counts
            self.release(cnt)
        return self._sage_fc(m, q, grad, stop, tag), backward

    # GAT (betty.models.gat.gat_forward on PyG, DGL's GATConv on DGL): both project,
    # score and merge heads alike; they differ in the edge softmax and the weighted sum.
    def _gat_scores(self, m: Buffer, grad: bool, tag: str):
        """``z = fc(m)`` ``(N, H, F)`` (``mm``), ``el = (z * attn_l).sum(-1)`` and
        ``er = (z * attn_r).sum(-1)`` ``(N, H)`` (``mul``, ``sum``): ``fc`` saves its
        input, the products save ``z``. Returns ``(z, el, er)``."""
        nh, n_h = self.node_bytes(self.hf), self.n * self.cfg.heads * self.el
        ft = self.alloc(nh, INT, f"{tag} projection")
        if grad:
            self.hold(m, ft)
        t = self.alloc(nh, INT, f"{tag} ft * attn_l")
        el_ = self.alloc(n_h, ATT, f"{tag} el")
        self.release(t)
        t = self.alloc(nh, INT, f"{tag} ft * attn_r")
        er = self.alloc(n_h, ATT, f"{tag} er")
        self.release(t)
        return ft, el_, er

    def _gat_scores_backward(self, gel: Buffer, ger: Buffer, gz: Buffer, ft: Buffer, m: Buffer,
                             tag: str, sliced: bool = False) -> Buffer:
        """Backward of :meth:`_gat_scores` from the ``(N, H)`` gradients of ``el`` and
        ``er`` and ``gz`` ``(N, H, F)`` (``z``'s gradient through the weighted sum):
        per score a ``mul`` for the attention vector's gradient and one for ``z``'s
        (``sliced``: ``er`` was computed on the view ``z[:n_dst]``, whose
        ``slice_backward`` copies into zeros), each added to ``z``'s gradient; then
        ``fc``'s ``mm``. Releases all inputs; returns ``(N, w)``. Each attention vector's
        gradient (the engine's sum to ``(1, H, F)``) comes while its two products exist,
        ``fc``'s weight's before the input's."""
        nh = self.node_bytes(self.hf)
        attn_l, attn_r, _, weight = self.conv_shapes
        t = self.alloc(nh, BWD, f"{tag} grad attn_r")
        gfd = self.alloc(nh, BWD, f"{tag} grad ft (er)")
        ar = self.param_grads([attn_r], f"{tag} attn_r", block=True)  # the engine's sum over nodes
        self.release(t, ger)
        if sliced:
            gfd = self.bwd(f"{tag} grad ft (er) slice_backward", gfd, nbytes=nh)
        acc = self.alloc(nh, BWD, f"{tag} grad ft sum")
        self.release(gz, gfd)
        self.settle(*ar)
        t = self.alloc(nh, BWD, f"{tag} grad attn_l")
        gfs = self.alloc(nh, BWD, f"{tag} grad ft (el)")
        al = self.param_grads([attn_l], f"{tag} attn_l", block=True)
        self.release(t, gel, ft)
        acc2 = self.alloc(nh, BWD, f"{tag} grad ft")
        self.release(acc, gfs)
        self.settle(*al)
        w = self.param_grads([weight], f"{tag} fc", block=True)
        gx = self.bwd(f"{tag} grad input", acc2, m)
        self.settle(*w)
        return gx

    def _gat_finish(self, rst: Buffer, stop: bool, tag: str, *local) -> Buffer | None:
        """``rst + bias`` (``add``), the layer's locals ``local`` go, then the heads
        merged: ``mean(1)`` (``mean``) or ``flatten(1)`` (``concat``, a view). With
        ``stop``: ``rst``'s op saved the group's last tensor, the checkpoint
        recomputation ends there (no output)."""
        if stop:
            self.release(rst, *local)
            return None
        o = self.alloc(self.node_bytes(self.hf), INT, f"{tag} + bias")
        self.release(rst, *local)
        if self.cfg.gat_merge != "mean":
            return o
        out = self.alloc(self.node_bytes(), INT, f"{tag} mean over heads")
        self.release(o)
        return out

    def _gat_merge_backward(self, g: Buffer, tag: str) -> Buffer:
        """Backward of the head merge: ``mean`` allocates ``(N, H, F)`` (or takes the one
        that ran before a checkpoint recomputation) and releases ``g``; ``concat``
        passes ``g`` on; then the bias's gradient."""
        if self.cfg.gat_merge != "mean":
            self.bias_grad(self.bias_shape, tag)
            return g
        if self._pre_mean is not None:  # ran before the checkpoint recomputation
            gm, self._pre_mean = self._pre_mean, None
        else:
            gm = self.alloc(self.node_bytes(self.hf), BWD, f"{tag} grad mean over heads")
        self.bias_grad(self.bias_shape, tag)
        self.release(g)
        return gm

    def _gat(self, m: Buffer, grad: bool, tag: str, stop: bool = False):
        """DGL GATConv: projection, attention logits, edge softmax, weighted sum, bias;
        heads averaged (``mean``) or concatenated (``concat``, a view)."""
        n, el, heads = self.n, self.el, self.cfg.heads
        mean = self.cfg.gat_merge == "mean"
        e = self.e_cnt
        nh = self.node_bytes(self.hf)
        eh = e * heads * el

        def backward(g: Buffer) -> Buffer:
            gm = self._gat_merge_backward(g, tag)
            # a strided gradient (a column slice of the coupling's output gradient) is
            # copied to a contiguous one each time DGL hands it to its kernels
            strided = not mean and self._grad_is_view
            gft = self.alloc(nh, BWD, f"{tag} grad ft (weighted sum)")
            if strided:
                self.tl.temp(nh, BWD, f"{tag} contiguous grad copy")
            ga = self.alloc(eh, BWD, f"{tag} grad attention")
            if strided:
                self.tl.temp(nh, BWD, f"{tag} contiguous grad copy")
            self.release(gm)
            n_h = n * heads * el
            gel, ger = edge_softmax_backward(self.tl, ga, att, ee, eh, n_h, n_h, tag)
            return self._gat_scores_backward(gel, ger, gft, ft, m, tag)

        ft, el_, er = self._gat_scores(m, grad, tag)
        ee = self.alloc(eh, ATT, f"{tag} el + er (edges)")
        lr = self.alloc(eh, ATT, f"{tag} leaky_relu")
        if grad:
            self.hold(ee)  # leaky_relu saves its input
        self.release(ee)
        att = self.alloc(eh, ATT, f"{tag} edge_softmax")
        if grad:
            self.hold(att)  # softmax saves its output
        rst = self.alloc(nh, INT, f"{tag} weighted sum")
        # the weighted sum saved the group's last tensors; DGL's local_scope ends
        return self._gat_finish(rst, stop, tag, att, ft, el_, er, lr), backward

    def _gat_pyg(self, m: Buffer, grad: bool, tag: str, stop: bool = False):
        """:func:`betty.models.gat.gat_forward` on a :class:`PygGraph`: the scores'
        gathers ``el[src] + er[dst]`` ``(E, H)``, ``leaky_relu``, PyG's ``softmax``
        (:meth:`_pyg_softmax`), the gathered ``z[src]`` times the attention ``(E, H,
        F)``, ``scatter_add_`` into zeros, ``+ bias``; heads merged."""
        heads = self.cfg.heads
        eh, ehf = self.e_cnt * heads * self.el, self.e_cnt * self.hf * self.el
        # a checkpoint recomputation hands saved tensors to the backward through its
        # unpack hook: the node holds the only reference, gone when the node returns
        unpacked = self.cfg.mode == "checkpoint"

        def backward(g: Buffer) -> Buffer:
            ge = self._scatter_backward(self._gat_merge_backward(g, tag), self.hf, tag)
            # z[src] * a: the attention's gradient (broadcast over F, then summed over F by
            # the engine once the node returns) and z[src]'s
            gab = self.alloc(ehf, BWD, f"{tag} grad attention (broadcast)")
            gzs = self.alloc(ehf, BWD, f"{tag} grad z[src]")
            if unpacked:  # the node's unpacked factors die with it, before that sum
                self.release(att, zs)
            ga = self.alloc(eh, BWD, f"{tag} grad attention")
            self.release(gab, ge)
            if not unpacked:  # saved factors are released after the node's outputs exist
                self.release(att, zs)
            gza = self._gather_backward(gzs, self.hf, tag)
            glr = pyg_softmax_backward(self.tl, ga, ex, den, eh, self.node_bytes(heads), tag)
            n_h = self.node_bytes(heads)
            gel, ger = pyg_edge_scores_backward(self.tl, glr, ee, eh, n_h, n_h, tag)
            gx = self._gat_scores_backward(gel, ger, gza, ft, m, tag, sliced=True)
            self.settle(*self._bias_pending)  # the bias view's node (bias_grad)
            self._bias_pending = []
            return gx

        ft, el_, er = self._gat_scores(m, grad, tag)
        ee = pyg_edge_scores(self.tl, eh, tag)
        lr = self.alloc(eh, ATT, f"{tag} leaky_relu")
        if grad:
            self.hold(ee)  # leaky_relu saves its input
        self.release(ee)
        att, ex, den = self._pyg_softmax(grad, tag)
        zs = self.alloc(ehf, ATT, f"{tag} z[src]")
        prod = self.alloc(ehf, ATT, f"{tag} z[src] * a")
        if grad:
            self.hold(zs, att)  # the product saves both factors
        self.release(zs)
        rst = self.alloc(self.node_bytes(self.hf), INT, f"{tag} weighted sum (scatter_add)")
        self.release(prod)
        # scatter_add_ saves its index: the group's last saved tensor
        return self._gat_finish(rst, stop, tag, att, ft, el_, er, lr), backward

    def _pyg_softmax(self, grad: bool, tag: str):
        """PyG's ``softmax`` on the ``(E, H)`` logits
        (:func:`~betty.memory.ops.pyg_softmax_forward`) and its division. Returns ``(a,
        exp, denominators)`` (the last two kept only with ``grad``: the division saves
        them)."""
        eh, n_h = self.e_cnt * self.cfg.heads * self.el, self.n * self.cfg.heads * self.el
        mx, ex, den = pyg_softmax_forward(self.tl, n_h, eh, tag)
        att = self.alloc(eh, ATT, f"{tag} edge_softmax")
        if grad:
            self.hold(ex, den)
        self.release(mx, ex, den)  # softmax returns
        return att, ex, den

    # ------------------------------------------------------------------ coupling
    def coupling_forward(self, x: Buffer, grad: bool, tag: str, stop_early: bool = False):
        """``Y = [X'_1 .. X'_C]`` from ``X`` ``(N, D)`` (groups are views of ``x``).

        Returns ``(y, backward)``; ``y`` is None with ``stop_early`` (checkpoint
        recomputation stops after the last group's saved tensors exist).
        """
        cfg = self.cfg
        nw = self.node_bytes()
        C = cfg.num_groups
        if C == 2:
            prev = x  # X'_0 = X_2, a view
            self.hold(x)
        else:  # X'_0 = X_2 + ... + X_C, summed left to right
            prev = self.alloc(nw, ACT, f"{tag} X'_0")
            for j in range(3, C):
                nxt = self.alloc(nw, ACT, f"{tag} X'_0")
                self.release(prev)
                prev = nxt
        outs: list[Buffer] = []
        backs = []
        for i in range(C):
            stop = stop_early and i == C - 1
            fo, bwd = self.group_forward(prev, grad, f"{tag} group {i}", stop_early=stop)
            backs.append(bwd)
            if stop:
                self.release(fo, prev, *outs)
                return None, backs
            o = self.alloc(nw, ACT, f"{tag} X'_{i + 1}")
            self.release(fo, prev)
            outs.append(o)
            prev = o
            self.hold(o)  # `prev` and the list of outputs
        self.release(prev)
        y = self.alloc(self.n * cfg.hidden * self.el, ACT, f"{tag} output (cat)")
        self.release(*outs)
        return y, backs

    def coupling_inverse(self, y: Buffer, tag: str) -> Buffer:
        """``X`` from ``Y`` (no autograd): ``X_i = Y_i - f_i(Y_{i-1})``, ``i = C .. 1``."""
        cfg = self.cfg
        nw = self.node_bytes()
        C = cfg.num_groups
        xs: list[Buffer] = []
        for i in range(C - 1, -1, -1):
            if i > 0:
                prev = y
                self.hold(y)
            elif C == 2:
                prev = xs[0]  # X_2, reconstructed just before
                self.hold(prev)
            else:
                prev = self.alloc(nw, ACT, f"{tag} inverse X'_0")
                for j in range(3, C):
                    nxt = self.alloc(nw, ACT, f"{tag} inverse X'_0")
                    self.release(prev)
                    prev = nxt
            fo, _ = self.group_forward(prev, False, f"{tag} inverse group {i}")
            xi = self.alloc(nw, ACT, f"{tag} inverse X_{i + 1}")
            self.release(fo)
            if i > 0 or C == 2:
                self.release(prev)
            xs.append(xi)
        x = self.alloc(self.n * cfg.hidden * self.el, ACT, f"{tag} reconstructed input (cat)")
        self.release(*xs)
        if C > 2:
            self.release(prev)  # the sum X'_0 is a local until the function returns
        return x

    def coupling_backward(self, gy: Buffer, backs, tag: str, frame: Sequence[Buffer] = (),
                          masked_last: Buffer | None = None) -> Buffer:
        """Gradient wrt the coupling input from ``gy`` ``(N, D)`` (one engine holder),
        through the saved group functions ``backs``; returns ``(N, D)``. ``frame``: what a
        checkpoint's frame holds (its input; the first block's, the model's own masks too),
        let go of once the first group function's backward, the last to use what the
        recomputation saved, has run. ``masked_last``: a mask whose last holder is the
        first group function's multiplication (freed after its backward)."""
        cfg = self.cfg
        nw = self.node_bytes()
        C = cfg.num_groups
        self.hold(*([gy] * C))  # CatBackward: one narrow view of gy per group output
        self.release(gy)
        slots: list[Buffer | None] = [None] * C  # SplitBackward's input buffer
        carry = None
        for i in range(C - 1, -1, -1):
            if carry is None:
                go = gy  # the view's holder goes to f_i
            else:  # cat's view + what f_{i+1} sent back: an out-of-place sum
                go = self.alloc(nw, BWD, f"{tag} grad X'_{i + 1}")
                self.release(gy, carry)
                self.settle_pending()  # f_{i+1}'s output delivered
            slots[i] = go
            self.hold(go)  # X'_i = f_i(.) + X_i: the same gradient goes to X_i
            self._grad_is_view = go is gy
            if i == 0:
                self._masked_last = masked_last
            gin = backs[i](go)
            self._grad_is_view = False
            if i > 0:
                carry = gin
                continue
            self.release(*frame)
            self.settle_pending()  # delivered to X'_0's sum, which has no other input
            # gradient wrt X'_0 reaches X_2 .. X_C: an out-of-place sum into every slot
            # (a view of gy, or a sum the group function's backward also took)
            for j in range(1, C):
                new = self.alloc(nw, BWD, f"{tag} grad X_{j + 1}")
                self.release(slots[j])
                slots[j] = new
            self.release(gin)
        gx = self.alloc(self.n * cfg.hidden * self.el, BWD, f"{tag} grad input (cat)")
        self.release(*slots)
        return gx

    # ------------------------------------------------------------------ whole step
    def run(self) -> Timeline:
        cfg, tl, n, el = self.cfg, self.tl, self.n, self.el
        D, L = cfg.hidden, cfg.num_layers
        nd = n * D * el
        self.baseline()

        tl.phase = "inputs"
        local_train = self.alloc(n, LABELS, "part training mask")
        feat = self.alloc(n * cfg.in_feats * cfg.feat_elt, FEATS, "part features")
        if cfg.feat_elt != el:  # cast to the compute dtype: the cast copy is what the part keeps
            cast = self.alloc(n * cfg.in_feats * el, FEATS, "part features, compute dtype")
            self.release(feat)
            feat = cast

        masks: list[Buffer | None] = [None, None]  # the blocks' and the head's multipliers
        if self.has_mask and not cfg.masks_held:  # the model's own Bernoulli masks, drawn up front
            tl.phase = "dropout masks"
            masks = []
            for which in ("blocks", "head"):
                u = self.alloc(n * D * 4, DROP, f"{which} mask uniform")
                keep = self.alloc(n * D, DROP, f"{which} keep mask")
                self.release(u)
                cast = self.alloc(nd, DROP, f"{which} mask cast")
                masks.append(self.alloc(nd, DROP, f"{which} mask"))
                self.release(cast, keep)

        tl.phase = "encoder"
        x = enc = self.alloc(nd, ENC, "encoder output")
        mode = cfg.mode
        saved_backs = []
        frames: list[Buffer] = []
        for l in range(L):
            tl.phase = f"forward block {l}"
            tag = f"block {l}"
            if l == 0 and self.has_mask and cfg.masks_held:  # asked for by the first block, then cached
                masks[0] = self.hash_mask(D, "blocks")
            if mode == "reversible":
                y, _ = self.coupling_forward(x, False, tag)
                self.release(x)  # the input's storage is freed (resize_(0))
            elif mode == "residual":
                y, backs = self.coupling_forward(x, True, tag)
                saved_backs.append(backs)
                if l > 0:  # the loop variable moves on; the stack's call keeps the encoder output
                    self.release(x)
            else:  # checkpoint: keeps the input only
                y, _ = self.coupling_forward(x, False, tag)
                frames.append(x)
            x = y
        if mode == "residual":
            self.release(enc)  # the stack returns
        y_last = x
        handoff = None
        if mode == "reversible":
            handoff = y_last
            self.hold(handoff)  # the last block's hand-off keeps its output until the graph goes

        tl.phase = "head"
        has_norm = cfg.norm in ("layer", "batch")
        hstats: list[Buffer] = []
        if has_norm:
            hz = self.alloc(nd, HEAD, "head norm")
            rows = n if cfg.norm == "layer" else cfg.hidden  # per node, or per channel
            hstats = [self.alloc(rows * self.stat_el, HEAD, "head norm mean"),
                      self.alloc(rows * self.stat_el, HEAD, "head norm rstd")]
            self.hold(y_last)  # the norm saves its input
        else:
            hz = y_last
            self.hold(hz)
        hr = self.alloc(nd, HEAD, "head relu")
        self.release(hz)
        # the body's output is a temporary of relu(norm(body)): dropped here, kept only by
        # what saved it (the norm) or holds it (a reversible body's hand-off)
        self.release(y_last)
        self.hold(hr)  # relu saves its result
        if self.has_mask and cfg.masks_held:
            masks[1] = self.hash_mask(D, "head")
        if self.has_mask:
            hm = self.alloc(nd, HEAD, "head dropout")
            self.release(hr)
        else:
            hm = hr
        out = self.alloc(n * cfg.out_feats * el, HEAD, "decoder output")
        self.hold(hm)  # the decoder saves its input
        self.release(hm)

        tl.phase = "loss"  # target = label[ids][local_train], then the loss of out[local_train]
        nt, T = self.nt, cfg.label_columns
        lab = self.alloc(n * (T * cfg.label_elt if T else INDEX_BYTES), LABELS, "labels[part]")
        li = self.alloc(nt * (T * cfg.label_elt if T else INDEX_BYTES), LABELS, "labels[train]")
        self.release(lab)
        oi = self.alloc(nt * cfg.out_feats * el, LOSS, "output[train]")
        if T:
            saved = bce_forward(tl, li, nt, T, el, cfg.label_elt)
        else:
            lsm = self.alloc(nt * cfg.out_feats * el, LOSS, "log_softmax")
            self.release(oi)
            saved = [lsm]

        tl.phase = "backward loss"
        C_out = cfg.out_feats
        if T:
            g2 = bce_backward(tl, saved, nt, T, el)
            self.release(oi, li)  # the loss's saved inputs
        else:
            g1 = self.alloc(nt * C_out * el, BWD, "grad nll")
            self.release(li)
            g2 = self.alloc(nt * C_out * el, BWD, "grad log_softmax")
            self.release(g1, *saved)
        z = self.alloc(n * C_out * el, BWD, "grad output (zeros)")
        g3 = self.alloc(n * C_out * el, BWD, "grad output (index_put)")
        self.release(z, g2, local_train)  # out[local_train] saved the mask until its backward ran

        tl.phase = "backward head"
        head_norm, decoder = self.shapes[-1][:-2], self.shapes[-1][-2:]
        g = self.alloc(nd, BWD, "grad decoder input")
        grads = self.param_grads(decoder, "decoder")
        self.release(g3, hm)
        self.settle(*grads)
        if self.has_mask:
            g2 = self.alloc(nd, BWD, "grad head dropout")
            self.release(g)
            g = g2
            if mode == "residual" and not cfg.masks_held:
                self.release(masks[1])  # its only holder was the head's multiplication
                masks[1] = None
        t = self.alloc(nd, BWD, "grad head relu")
        self.release(g, hr)
        if has_norm:
            g = self.alloc(nd, BWD, "grad head norm")
            grads = self.param_grads(head_norm, "head norm")
            self.release(t, y_last, *hstats)
            self.settle(*grads)
        else:
            g = t

        y_block = y_last
        for l in range(L - 1, -1, -1):
            tl.phase = f"backward block {l}"
            tag = f"block {l}"
            self._block, self._tied_index = l, 0
            if mode == "reversible":
                g, y_block = self._reversible_block_backward(l, g, y_block, tag)
            elif mode == "residual":
                # the model's own blocks mask: the first group's multiplication is its last holder
                own_mask = masks[0] if l == 0 and self.has_mask and not cfg.masks_held else None
                g = self.coupling_backward(g, saved_backs[l], tag, masked_last=own_mask)
                if own_mask is not None:
                    masks[0] = None
            else:
                xin = frames[l]
                if cfg.conv == "gat" and cfg.gat_merge == "mean":
                    # the last group's mean-over-heads backward saves nothing: it runs
                    # before the first saved tensor is asked for (and recomputed)
                    self._pre_mean = self.alloc(self.node_bytes(self.hf), BWD, f"{tag} grad mean over heads")
                if cfg.conv in ("gcn", "gat"):  # so does its bias's, the forward's last op
                    self.bias_grad(self.bias_shape, f"{tag} group {cfg.num_groups - 1}")
                    self._bias_ran = True
                _, backs = self.coupling_forward(xin, True, f"{tag} recompute", stop_early=True)
                frame = [xin]
                if l == 0 and self.has_mask and not cfg.masks_held:  # every frame holds the model's masks
                    frame += masks
                    masks = [None, None]
                g = self.coupling_backward(g, backs, tag, frame=frame)

        tl.phase = "backward encoder"
        grads = self.param_grads(self.shapes[0], "encoder")
        self.release(g)
        self.settle(*grads)
        tl.phase = "metrics"  # count_correct(out[local_train], label[ids][local_train])
        self.correct_count(out)
        tl.phase = "end of part"
        self.release(out, feat)  # del fwd: the output, the kept features; the graph goes
        if handoff is not None:
            self.release(handoff)  # the last block's hand-off
        self.release(*[m for m in masks if m is not None])

        self.optimizer_step()
        return tl

    def hash_mask(self, width: int, which: str) -> Buffer:
        """:class:`betty.rev.engine.SharedHashMasks`' multiplier ``(N, width)``: the
        SplitMix64 words of the row IDs (three ``(N,)`` int64 vectors alive at once, one
        kept) and of the columns, the boolean keep-mask, the chunk's int64 scratch, then
        the mask cast to the compute dtype (scaled in place)."""
        n = self.n
        rows, cols = hash_words(self.tl, n, width, DROP, f"{which} mask")
        keep = self.alloc(n * width, DROP, f"{which} keep mask")
        scratch = self.alloc(hash_chunk_rows(n, width) * width * INDEX_BYTES, DROP, f"{which} mask scratch")
        self.release(rows, cols, scratch)
        mask = self.alloc(n * width * self.el, DROP, f"{which} mask")
        self.release(keep)
        return mask

    def correct_count(self, out: Buffer) -> None:
        """``count_correct`` after the backward: the training rows of the output and of
        the labels, then (classes) the argmax and its comparison, or (multi-label) the
        sign comparisons and their count."""
        cfg, n, nt, T = self.cfg, self.n, self.nt, self.cfg.label_columns
        mask = self.alloc(n, LOSS, "training mask (metrics)")
        rows = self.alloc(nt * cfg.out_feats * self.el, LOSS, "output[train] (metrics)")
        lab = self.alloc(n * (T * cfg.label_elt if T else INDEX_BYTES), LOSS, "labels[part] (metrics)")
        target = self.alloc(nt * (T * cfg.label_elt if T else INDEX_BYTES), LOSS, "labels[train] (metrics)")
        self.release(lab)
        if T:
            multilabel_correct(self.tl, nt, T, LOSS)
        else:
            pred = self.alloc(nt * INDEX_BYTES, LOSS, "argmax")
            self.release(self.alloc(nt, LOSS, "argmax == target"), pred)
        self.release(mask, rows, target)

    def _reversible_block_backward(self, l: int, gy: Buffer, y: Buffer, tag: str):
        """One reversible block's backward: reconstruct, recompute with autograd, check,
        differentiate. ``y`` is the block output (handed down by the next block)."""
        cfg = self.cfg
        nd = self.n * cfg.hidden * self.el
        x = self.coupling_inverse(y, tag)
        self._deferred = []
        y_re, backs = self.coupling_forward(x, True, f"{tag} recompute")
        if cfg.check_consistency:
            self.tl.temp(nd, BWD, f"{tag} check |y|")
            d = self.alloc(nd, BWD, f"{tag} check y_re - y")
            a = self.alloc(nd, BWD, f"{tag} check |y_re - y|")
            self.release(d, a)
        self.hold(gy)  # the engine's input of the node, until the node returns
        gx = self.coupling_backward(gy, backs, tag)
        self.release(y_re, gy)  # locals of the backward go, and the node returns
        if l < cfg.num_layers - 1:
            self.release(y)  # handed down by block l + 1; the last block's stays in its hand-off
        if l == 0:
            self.release(x)
        grads, self._deferred = self._deferred, None
        self.settle(*grads)  # the parameters' AccumulateGrad, once the block's node returned
        return gx, x

    # ------------------------------------------------------------------ optimizer
    def optimizer_step(self) -> None:
        """The optimizer step in the parts whose region holds it (``cfg.step_parts``): on
        the first step the state it creates (:func:`~betty.memory.ops.optimizer_state_size`),
        then its temporaries, whose peak is :func:`~betty.memory.ops.step_temporaries`
        (single-tensor steps replayed op by op, multi-tensor ones as one transient)."""
        cfg, tl = self.cfg, self.tl
        tl.phase = "optimizer step"
        # gradients of the parts that did not create them exist from the baseline
        held = np.ones(self.n.shape[0], dtype=bool) if cfg.step_parts is None else cfg.step_parts
        el, opt = cfg.elt, cfg.optimizer
        foreach = step_foreach(opt, cfg.host)
        # the state the first step creates, kept: Adam's before its loop (and the
        # multi-tensor steps', all of it beside their temporaries either way), single-
        # tensor SGD's momentum buffers one parameter at a time in its loop
        buffers_in_loop = cfg.first_step and opt.name == "sgd" and opt.momentum > 0 and not foreach
        if cfg.first_step and not buffers_in_loop:
            state = optimizer_state_size(cfg, float(sum(self.pbytes)), sum(len(g) for g in self.shapes))
            tl.alloc(np.where(held, state, 0.0), OPT, "optimizer state (first step)")
        numels = [numel(s) for group in self.shapes for s in group]
        if foreach:
            temporaries = step_temporaries(opt, numels, el, cfg.host)
            if temporaries:  # Adam's list of sqrt(v); SGD's list of gradient copies
                tl.temp(np.where(held, temporaries, 0.0), STEP,
                        "adam foreach sqrt(v)" if opt.name == "adam" else "sgd foreach gradient copies")
            return
        for sizes, decay in step_groups(opt, numels):
            copy = denom = None  # the loop's gradient copy and (Adam) denominator
            for count in sizes:
                nb = np.where(held, count * el, 0.0)
                copy = self._step_gradient(nb, copy, decay, buffers_in_loop)
                if opt.name == "adam":  # denom = sqrt(v) / c, the previous one freed once assigned
                    sq = tl.alloc(nb, STEP, "adam sqrt(v)")
                    d = tl.alloc(nb, STEP, "adam denominator")
                    tl.release(sq, *[b for b in (denom,) if b is not None])
                    denom = d
            tl.release(*[b for b in (denom, copy) if b is not None])

    def _step_gradient(self, nb, previous: Buffer | None, decay: bool, new_buffer: bool) -> Buffer | None:
        """One parameter's gradient in a single-tensor step: negated (``maximize``), with
        weight decay added, then (SGD) with the Nesterov momentum term added, each copy
        freed once the next exists; ``previous``, the last parameter's copy, is freed when
        the loop variable is rebound (after the negation, before the rest).
        ``new_buffer``: SGD's first step clones the gradient into the parameter's momentum
        buffer (state, kept) before the Nesterov term. Returns the copy the loop variable
        keeps (``None``: the ``.grad`` itself or SGD's momentum buffer)."""
        tl, opt = self.tl, self.cfg.optimizer
        momentum = opt.name == "sgd" and opt.momentum > 0
        current = tl.alloc(nb, STEP, f"{opt.name} -grad (maximize)") if opt.maximize else None
        if previous is not None:  # `grad = grads[i]` (or its negation) rebinds
            tl.release(previous)
        if decay:
            made = tl.alloc(nb, STEP, f"{opt.name} grad + weight decay")
            if current is not None:
                tl.release(current)
            current = made
        if new_buffer:
            tl.alloc(nb, OPT, "sgd momentum buffer (first step)")
        if momentum and opt.nesterov:
            made = tl.alloc(nb, STEP, "sgd grad + momentum (nesterov)")
            if current is not None:
                tl.release(current)
            current = made
        elif momentum and current is not None:
            tl.release(current)  # `grad = buf`
            current = None
        return current


def replay_rev(num_nodes, num_edges, num_train, cfg: RevReplayConfig, *, record: bool = False) -> Timeline:
    """Replay one training step's part (per entry of the ``(P,)`` size vectors).
    ``record``: keep every allocation and free in ``Timeline.log`` (a trace diff's side)."""
    r = _RevReplayer(num_nodes, num_edges, num_train, cfg)
    if record:
        r.tl.log = []
    return r.run()
