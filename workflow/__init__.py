"""The workflow layer: YAML specs, MLflow project stages and the ``betty`` CLI.

Thin by design: every computation is a call into :mod:`betty`; this package validates
specs, orders the stages, and records what happened in MLflow (no MLflow import lives
in :mod:`betty`). Importing it applies the environment defaults of :mod:`workflow.env`.
"""

from workflow import env as _env  # noqa: F401
