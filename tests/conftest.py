import os
import sys

os.environ.setdefault("DGLBACKEND", "pytorch")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("OUTDATED_IGNORE", "1")  # ogb checks PyPI for updates on import
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see betty/__init__.py
sys.path.insert(0, os.path.dirname(__file__))  # tests/graphs.py helpers

# Tests never read or write the user's calibrated memory constants
# (~/.cache/betty/memory_constants.json or a $BETTY_MEMORY_CONSTANTS of their own): they
# would change estimates and therefore test results. Point the variable at a fresh,
# empty temp dir for the whole session (subprocesses inherit it).
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

ISOLATED_CONSTANTS_DIR = tempfile.mkdtemp(prefix="betty-test-constants-")
os.environ["BETTY_MEMORY_CONSTANTS"] = os.path.join(ISOLATED_CONSTANTS_DIR, "memory_constants.json")
atexit.register(shutil.rmtree, ISOLATED_CONSTANTS_DIR, ignore_errors=True)

import torch  # noqa: E402

# Test graphs are tiny: with two OpenMP threads per op, thread start/sync costs dominate
# (measured 40x slower than one thread when the machine is busy).
torch.set_num_threads(1)

try:
    # ogb and its `outdated` dependency ask PyPI for newer versions in background threads
    # at import; offline that ends in a warning printed in the middle of some test. Start
    # them now and let them finish (quickly, the network is closed) under the global
    # "ignore" filter `outdated` installs for OUTDATED_IGNORE.
    import threading

    import ogb.version  # noqa: F401

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join(timeout=10)
except ImportError:  # pragma: no cover
    pass
