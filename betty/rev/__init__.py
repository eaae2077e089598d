"""Reversible GNNs (RevGNN, Li et al., "Training Graph Neural Networks with 1000 Layers",
ICML 2021) in one place: activation memory independent of depth.

* :mod:`betty.rev.coupling` — the grouped reversible coupling
  ``X'_0 = Σ_{i≥2} X_i;  X'_i = f_i(X'_{i−1}) + X_i`` and its inverse;
* :mod:`betty.rev.autograd` — forward under ``no_grad``, inputs freed, rebuilt from the
  outputs in backward and recomputed with grad;
* :mod:`betty.rev.model` — ``RevGNN`` (and weight-tied), :mod:`betty.rev.deq` — the DEQ
  variant, :mod:`betty.rev.check` — reconstruction checks;
* :mod:`betty.rev.training` — cluster parts (random / METIS) and part-wise steps;
* :mod:`betty.rev.engine` — epochs over parts through betty's one training-step
  skeleton (:mod:`betty.train`);
* :mod:`betty.rev.memory`, :mod:`betty.rev.replay` — the op-level memory replay and the
  K search over parts (the one loop in :mod:`betty.memory.ksearch`).
* :mod:`betty.rev.sweep` — the first epoch's split, measured, and cluster methods
  compared over K.

Submodules are imported on use (no heavy imports here).
"""
