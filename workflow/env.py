"""Environment defaults, applied on import (only where the user has not set them).

* ``MLFLOW_DISABLE_TELEMETRY=true``: no usage telemetry;
* ``MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR=false``: no tqdm bars when stages read each
  other's artifacts;
* ``DGLBACKEND=pytorch``;
* ``OUTDATED_IGNORE=1``: ``ogb`` does not query PyPI for a newer version on import.

Imported first by every entry point (CLI, MLproject) and by :mod:`workflow.runs`, before
MLflow, so the defaults hold even when ``workflow`` is imported as a namespace package
(an editable install made before ``workflow/__init__.py`` existed does that).
"""

import os

DEFAULTS = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "DGLBACKEND": "pytorch",
    "OUTDATED_IGNORE": "1",
}

for _key, _value in DEFAULTS.items():
    os.environ.setdefault(_key, _value)
