"""The op sequences both replays share (betty.memory.ops), against hand-counted bytes.

Each expected number below is the live-bytes walk of the docstring's op sequence, done
by hand: a change to the modelled order (what is freed before what is allocated) or to
what is kept moves a peak or a leftover.
"""

import numpy as np
import pytest

from betty.memory import ops
from betty.memory.replay import ReplayConfig
from betty.memory.spec import OptimizerSpec
from betty.memory.timeline import Timeline
from betty.rev.replay import RevReplayConfig

EH, NH = 100.0, 10.0  # bytes of an (E, H) and of an (N, H) tensor


def _timeline(*sizes):
    tl = Timeline(1)
    return tl, [tl.alloc(s, ops.BWD, f"input {i}") for i, s in enumerate(sizes)]


def test_pyg_softmax_forward_keeps_max_exp_and_denominators():
    tl = Timeline(1)
    mx, ex, den = ops.pyg_softmax_forward(tl, NH, EH, "t")
    # max 10; max[dst] + x - max 210; - max[dst], + exp 210; - (x - max) 110;
    # sum + sum + eps 130; - sum 120; + sum[dst] 220; - (sum + eps) 210
    assert tl.peak[0] == 220.0
    assert tl.live[0] == NH + 2 * EH
    assert (mx.size[0], ex.size[0], den.size[0]) == (NH, EH, EH)


def test_pyg_softmax_backward_peak_and_result():
    tl, (ga, ex, den) = _timeline(EH, EH, EH)
    gl = ops.pyg_softmax_backward(tl, ga, ex, den, EH, NH, "t")
    # ga, ex, den + four (E, H) division terms: 7 EH; the index_add's zeros add 2 NH to
    # at most 3 EH later; only the logits' gradient is left
    assert tl.peak[0] == 7 * EH
    assert tl.live[0] == EH and gl.size[0] == EH
    assert tl.peak_event() == ["start: t grad den"]


def test_pyg_softmax_backward_index_add_can_be_the_peak():
    tl, (ga, ex, den) = _timeline(EH, EH, EH)
    big = 300.0  # (N, H) larger than (E, H): the zeros + index_add pair dominates
    ops.pyg_softmax_backward(tl, ga, ex, den, EH, big, "t")
    # after the numerator's gradient: ex, gden, gex (3 EH) + zeros + index_add
    assert tl.peak[0] == 3 * EH + 2 * big
    assert tl.peak_event() == ["start: t index backward"]


def test_edge_softmax_backward():
    tl, (ga, att, scores) = _timeline(EH, EH, EH)
    gel, ger = ops.edge_softmax_backward(tl, ga, att, scores, EH, 30.0, 20.0, "t")
    # ga, att, scores + softmax transient + logits' gradient: 5 EH; then ga, att, the
    # transient and (after leaky_relu's) the logits' gradient and scores go
    assert tl.peak[0] == 5 * EH
    assert tl.live[0] == 50.0
    assert (gel.size[0], ger.size[0]) == (30.0, 20.0)


def test_through_frees_the_temporary_after_the_result_exists():
    tl = Timeline(1)
    out = ops.through(tl, ops.ACT, 7.0, "tmp", 5.0, "out")
    assert tl.peak[0] == 12.0 and tl.live[0] == 5.0 and out.size[0] == 5.0


def _step(optimizer, host, buffers=None):
    cfg = ops.StepConfig(optimizer=optimizer, elt=4, feat_elt=4,
                         fresh_grads=np.array([True, False]), host=host)
    tl = Timeline(2)
    ops.step_baseline(tl, cfg, 1000, 3, buffers)
    return tl.breakdown()


def test_step_baseline_counts_adam_state_steps_and_existing_grads():
    host = _step(OptimizerSpec("adam"), host=True, buffers=50)
    assert host[0] == {"parameters": 1050, "optimizer_state": 2 * 1000 + 4 * 3}
    assert host[1] == {"parameters": 1050, "optimizer_state": 2012, "gradients": 1000}
    cuda = _step(OptimizerSpec("adam"), host=False)
    assert cuda[1] == {"parameters": 1000, "optimizer_state": 2000, "gradients": 1000}
    fused = _step(OptimizerSpec("adam", step_on_device=True), host=False)
    assert fused[0]["optimizer_state"] == 2012
    sgd = _step(OptimizerSpec("sgd"), host=True)
    assert sgd[0] == {"parameters": 1000}


def test_param_grads_kept_where_fresh_else_transient():
    tl = Timeline(2)
    ops.param_grads(tl, 40, np.array([True, False]), "g", "g acc")
    assert tl.live.tolist() == [40.0, 0.0] and tl.peak.tolist() == [40.0, 40.0]


def test_both_configs_take_the_step_fields_by_keyword():
    """The shared fields come after each config's own ones (keyword-only), so a config
    still reads its own fields positionally."""
    step = dict(optimizer=OptimizerSpec("adam"), elt=2, feat_elt=4, fresh_grads=np.array([True]),
                label_columns=3, host=False)
    cfg = ReplayConfig("model", "constants", **step)
    assert (cfg.model, cfg.constants, cfg.training, cfg.label_columns, cfg.host) == (
        "model", "constants", True, 3, False)
    rev = RevReplayConfig(8, 2, 3, 5, 4, "gcn", 1, "mean", "layer", "reversible", False, 0.0,
                          True, **step)
    assert (rev.hidden, rev.check_consistency, rev.granule, rev.elt) == (8, True, 1, 2)


def test_pyg_scatter_mean():
    tl = Timeline(1)
    counts, mean = ops.pyg_scatter_mean(tl, ops.ACT, 10, 4, 3, 2, "t")
    # messages 60, zeros 8, ones 20 (transient: 88), counts 8 (zeros go: 68), sum 24,
    # mean 24: 116 at the mean; messages and sum go: counts + mean
    assert tl.peak[0] == 116.0 and tl.peak_event() == ["start: t mean"]
    assert tl.live[0] == 32.0 and (counts.size[0], mean.size[0]) == (8.0, 24.0)


def test_pyg_edge_scores_and_backward():
    tl = Timeline(1)
    scores = ops.pyg_edge_scores(tl, EH, "t")
    assert tl.peak[0] == 3 * EH and tl.live[0] == EH  # two gathers + their sum; gathers go
    gl = tl.alloc(EH, ops.BWD, "logits grad")
    gel, ger = ops.pyg_edge_scores_backward(tl, gl, scores, EH, 150.0, 200.0, "t")
    # leaky_relu's gradient (EH) lives through both index backwards: er's zeros + result
    # (500), er's zeros go (300), el's zeros + result (600), then it goes
    assert tl.peak[0] == 600.0 and tl.peak_event() == ["start: t index backward"]
    assert tl.live[0] == 350.0 and (gel.size[0], ger.size[0]) == (150.0, 200.0)


def test_index_backward_frees_zeros_then_the_rows_gradient():
    tl, (rows,) = _timeline(EH)
    gi = ops.index_backward(tl, rows, 40.0, "t")
    assert tl.peak[0] == EH + 80.0 and tl.live[0] == 40.0 and gi.size[0] == 40.0
    assert rows.holders == 0
    kept = ops.index_backward(tl, None, 5.0, "t")  # caller frees rows
    assert tl.live[0] == 45.0 and kept.holders == 1
