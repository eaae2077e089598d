import os
import sys

import pytest

os.environ.setdefault("DGLBACKEND", "pytorch")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("OUTDATED_IGNORE", "1")  # ogb checks PyPI for updates on import
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see betty/__init__.py
sys.path.insert(0, os.path.dirname(__file__))  # the helper modules beside the tests (graphs.py, fsclock.py, ...)

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



PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What code run with the checkout as working directory would leave there: data folders
# (betty's processed-data cache under data/betty-cache), MLflow's default store.
WRITTEN_BY_RUNS = ("data", "mlflow.db", "mlruns")
_PRESENT_AT_START = {name for name in WRITTEN_BY_RUNS if os.path.exists(os.path.join(PROJECT, name))}


@pytest.fixture(autouse=True)
def _outside_the_checkout(tmp_path_factory, monkeypatch):
    """Every test runs in a fresh temporary working directory, so relative paths (the
    default data root ``data``, MLflow's ``sqlite:///mlflow.db``) never land in the checkout."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


def pytest_sessionfinish(session, exitstatus):
    """Fail the session if a test wrote a data folder or MLflow store into the checkout."""
    new = [name for name in WRITTEN_BY_RUNS
           if name not in _PRESENT_AT_START and os.path.exists(os.path.join(PROJECT, name))]
    if new:
        sys.stderr.write(f"\ntests wrote into the checkout {PROJECT}: {', '.join(new)}\n")
        session.exitstatus = 1


@pytest.fixture
def tracking(tmp_path, monkeypatch, request):
    """A fresh MLflow store with an active experiment, ``tmp_path`` as the working
    directory (the data root); yields ``(tracking URI, experiment ID)`` and afterwards
    ends any run a failing test left active. The experiment is named by the test
    module's ``EXPERIMENT`` (default ``"workflow-test"``)."""
    from test_workflow_support import activate_store, end_active_runs

    yield activate_store(tmp_path, monkeypatch, experiment=getattr(request.module, "EXPERIMENT", "workflow-test"))
    end_active_runs()


def _parametrized_here(metafunc, name: str) -> bool:
    """Whether the test's own ``@pytest.mark.parametrize`` marks (of the function, class
    or module) name argument ``name``."""
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs["argnames"]
        if isinstance(names, str):
            names = names.split(",")
        if name in (n.strip() for n in names):
            return True
    return False


def pytest_generate_tests(metafunc):
    """A test that takes ``backend`` without parametrizing it itself runs once per graph
    backend (:func:`graphs.backend_params`: each marked with its framework's marker, so
    ``-m "not dgl"`` deselects the DGL half, and skipped where it does not import). A hook
    rather than a parametrized fixture, so the frameworks are imported only by sessions
    that collect such a test."""
    if "backend" in metafunc.fixturenames and not _parametrized_here(metafunc, "backend"):
        from graphs import backend_params

        metafunc.parametrize("backend", backend_params())


# Modules that exercise only the workflow layer (specs, CLI, MLflow runs and their
# lifecycle): what they check does not depend on the torch / numpy / backend stack, so
# the second environment (.venv-pyg, `-m "not dgl and (not workflow or pyg) and not slow"`) does not
# run them again. Their few tests that do depend on the stack (the pipeline and the
# reversible model trained end to end on PyG without DGL) carry `pyg` as well.
WORKFLOW_MODULES = {
    "test_spec", "test_cli", "test_cli_memory", "test_workflow", "test_workflow_compare",
    "test_workflow_guards", "test_workflow_interrupts", "test_workflow_mlproject",
    "test_workflow_rev", "test_workflow_support", "test_workflow_tracking", "test_team_server",
    "test_pipeline_workflow",
}
STACK_DEPENDENT_WORKFLOW_TESTS = {
    "test_workflow.py::test_pipeline_logs_contract_and_reuses_by_content",
    "test_workflow.py::test_full_and_sampled_inference_scores",
    "test_workflow_rev.py::test_betty_run_reversible_spec",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__ in WORKFLOW_MODULES:
            item.add_marker(pytest.mark.workflow)
            if item.nodeid.split("/")[-1].split("[")[0] in STACK_DEPENDENT_WORKFLOW_TESTS:
                item.add_marker(pytest.mark.pyg)


@pytest.fixture
def one_thread():
    """One intra-op thread: PyG's CPU scatter with several threads sums in an order that
    differs from run to run (two serial runs differ by about 1e-8 then), which would
    hide a bit-for-bit comparison; with one thread two runs of the same step agree bit
    for bit. Modules comparing runs that way use it for every test
    (``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def temp_in_tmp_path(tmp_path, monkeypatch):
    """The temporary directory of this process (``tempfile.tempdir``) and of the
    processes it starts (``TMPDIR``) is the test's ``tmp_path``: what the code under
    test leaves there is seen, and kept out of the machine's /tmp."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    return tmp_path
