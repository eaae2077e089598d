"""Environment defaults, applied on import where the user has not set them (the list:
docs/workflow.md, end of *Team mode*), and the library's own process defaults
(``OMP_WAIT_POLICY``, ``THP_MEM_ALLOC_ENABLE``: :mod:`betty`), which must be set before
torch is imported.

Imported first by every entry point (CLI, MLproject) and by :mod:`workflow.runs`, before
MLflow, so the defaults hold even when ``workflow`` is imported as a namespace package
(an editable install made before ``workflow/__init__.py`` existed does that).
"""

import os

import betty  # noqa: F401  (its process defaults; imports no torch)

DEFAULTS = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",  # no tqdm bars when stages read artifacts
    # against a server MLflow prints "View run ... at: URL" on stdout when a run ends,
    # which broke `betty run --json` (stdout is betty's own: tables and JSON)
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
    "DGLBACKEND": "pytorch",
    "OUTDATED_IGNORE": "1",  # ogb does not query PyPI for a newer version on import
}

for _key, _value in DEFAULTS.items():
    os.environ.setdefault(_key, _value)
