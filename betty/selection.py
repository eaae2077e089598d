"""Model selection on validation scores: keep the best epoch's weights, stop early.

Papers and OGB's examples report the test score of the epoch with the best validation
score, and often stop training once validation has not improved for a while.
:class:`BestValidation` does both for any training loop, whatever the trainer
(``betty.engine.Trainer``, ``betty.rev.engine.RevTrainer``, or one rank of a
distributed run): after each full optimizer step that was scored on validation, call
:meth:`BestValidation.update`; it keeps an in-memory copy of the model's ``state_dict``
whenever the score improves (strictly: ties keep the earlier epoch), in host memory. Selection happens
between steps, so it never touches the gradient computation.

``select``: ``"last"`` (the final weights; the tracker still records the best score
and epoch, and stops early when asked) or ``"best_valid"`` (the best epoch's weights).
``patience``: stop once this many consecutive scored evaluations brought no
improvement (``None``: never stop early).
"""

from __future__ import annotations

import math

import torch

__all__ = ["SELECT_CHOICES", "BestValidation"]

SELECT_CHOICES = ("last", "best_valid")
"""Which weights a training run hands on: the last epoch's or the best validation epoch's."""


def _copy_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of ``model``'s ``state_dict`` in host memory (same dtype): the
    copy takes no device memory, which the K search's budget leaves to the steps."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


class BestValidation:
    """Track validation scores (higher is better) over a run.

    Args:
        select: one of :data:`SELECT_CHOICES`.
        patience: evaluations without improvement before :meth:`should_stop` is true
            (an integer >= 1), or ``None`` for no early stopping.
    """

    def __init__(self, select: str = "best_valid", patience: int | None = None) -> None:
        if select not in SELECT_CHOICES:
            raise ValueError(f"select must be one of {', '.join(SELECT_CHOICES)}, got {select!r}")
        if patience is not None and (isinstance(patience, bool) or not isinstance(patience, int)
                                     or patience < 1):
            raise ValueError(f"patience must be an integer >= 1 or None, got {patience!r}")
        self.select = select
        self.patience = patience
        self.best_score: float | None = None
        self.best_epoch: int | None = None
        self.stopped_epoch: int | None = None
        self.evaluations = 0
        self._since_best = 0
        self._state: dict[str, torch.Tensor] | None = None

    def update(self, epoch: int, valid_score: float, model: torch.nn.Module | None = None) -> bool:
        """Record epoch ``epoch``'s validation score (taken after its optimizer step);
        returns whether it improved on every earlier score. With ``select="best_valid"``
        an improvement copies ``model``'s weights. A NaN score never improves."""
        if self.select == "best_valid" and model is None:
            raise ValueError("select='best_valid' needs the model to copy its weights")
        score = float(valid_score)
        self.evaluations += 1
        improved = not math.isnan(score) and (self.best_score is None or score > self.best_score)
        if improved:
            self.best_score, self.best_epoch, self._since_best = score, int(epoch), 0
            if self.select == "best_valid":
                self._state = _copy_state(model)
        else:
            self._since_best += 1
        if self.should_stop() and self.stopped_epoch is None:
            self.stopped_epoch = int(epoch)
        return improved

    def should_stop(self) -> bool:
        """Whether ``patience`` evaluations in a row brought no improvement."""
        return self.patience is not None and self._since_best >= self.patience

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The best epoch's weights (``select="best_valid"``; ``None`` before any
        scored epoch, and always with ``select="last"``)."""
        return self._state

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """Load the selected weights into ``model`` (nothing to do for ``last``, or when
        no epoch was scored); returns ``model``."""
        if self._state is not None:
            model.load_state_dict(self._state)
        return model

    def metrics(self, name: str = "valid_acc") -> dict[str, float]:
        """``best_<name>``, ``best_epoch`` and, after an early stop, ``stopped_epoch``
        (empty before any scored epoch)."""
        out: dict[str, float] = {}
        if self.best_epoch is not None:
            out[f"best_{name}"] = float(self.best_score)
            out["best_epoch"] = float(self.best_epoch)
        if self.stopped_epoch is not None:
            out["stopped_epoch"] = float(self.stopped_epoch)
        return out
