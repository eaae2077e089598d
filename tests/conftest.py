import os
import sys

os.environ.setdefault("DGLBACKEND", "pytorch")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("OUTDATED_IGNORE", "1")  # ogb checks PyPI for updates on import
sys.path.insert(0, os.path.dirname(__file__))  # tests/graphs.py helpers

import torch  # noqa: E402

# Test graphs are tiny: with two OpenMP threads per op, thread start/spin costs dominate
# (measured 40x slower than one thread when the machine is busy).
torch.set_num_threads(1)

try:  # ogb starts a thread that asks PyPI for a newer ogb on import; offline it warns
    import outdated

    outdated.check_outdated = lambda package, version, *a, **k: (False, version)
except ImportError:  # pragma: no cover
    pass
