"""MLflow-native records: the experiment, its kind, the dataset input, the logged model.

* **Store.** Applied on import: :func:`guard_store_sessions` holds signals back while
  MLflow's SQL store is inside a database session; :func:`serialize_store_creation`
  lets one process at a time create a sqlite store (the first creates its schema).
* **Experiment.** :func:`experiment_name` picks where ``betty run`` / ``betty stage``
  write: ``--experiment`` > ``$MLFLOW_EXPERIMENT_NAME`` > ``$MLFLOW_EXPERIMENT_ID`` (kept
  as is) > the spec's ``experiment`` key > the spec's ``name``. Under ``mlflow run`` the
  launcher has already fixed the experiment (``mlflow run --experiment-name``; the
  Makefile passes the spec name) and nothing is changed.
* **Kind.** MLflow 3's UI picks an experiment's pages from its tag
  ``mlflow.experimentKind``; :func:`mark_model_training` sets it to
  ``custom_model_development`` (model training) unless the experiment already has one.
* **Dataset.** :func:`dataset_input` describes the spec's dataset as an MLflow
  ``MetaDataset``: name = the dataset name, digest = :func:`betty.data.dataset_digest`
  (16 hex digits over name, resolved options and the source files' fingerprint, the
  same key as betty's processed-data cache), source = the dataset folder for files read
  from disk, or the generator and its options for synthetic data.
* **Model.** :func:`log_pytorch_model` logs the trained ``torch.nn.Module`` with the
  pytorch flavor (pickled, as ``mlflow.pytorch.load_model`` expects), the ``betty``
  package as ``code_paths`` (the model classes), the resolved ``spec.yaml`` as an extra
  file, and the pip requirements of this environment (given, not inferred: inference
  loads the model in a subprocess and takes many seconds).
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

from workflow.specfile import ResolvedSpec

__all__ = ["guard_store_sessions", "serialize_store_creation", "EXPERIMENT_KIND_TAG", "MODEL_TRAINING", "MODEL_NAME", "experiment_name",
           "use_spec_experiment", "mark_model_training", "dataset_input", "log_dataset_input",
           "log_pytorch_model"]

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING = "custom_model_development"  # the UI's value for classic model training (3.17)
MODEL_NAME = "model"  # the logged model's name in the train run (runs:/<id>/model)
_PACKAGE_DIR = Path(__file__).resolve().parent.parent / "betty"


def guard_store_sessions() -> None:
    """Run every database session of MLflow's SQL stores inside
    :func:`workflow.signals.defer`: a ``SIGINT``/``SIGTERM`` that lands inside one is
    raised once the session has committed or rolled back, never halfway through it
    (which broke the transaction: later writes failed and runs stayed ``RUNNING``).
    Applies to the stores created afterwards; idempotent."""
    import mlflow.store.db.utils as db_utils

    from workflow.signals import defer

    make = db_utils._get_managed_session_maker
    if getattr(make, "betty_guarded", False):
        return

    def guarded_maker(*args, **kwargs):
        inner = make(*args, **kwargs)

        @contextmanager
        def session(*a, **k):
            with defer(), inner(*a, **k) as sess:
                yield sess

        return session

    guarded_maker.betty_guarded = True
    db_utils._get_managed_session_maker = guarded_maker


def _sqlite_file(db_uri: str) -> Path | None:
    """The database file of a ``sqlite:///PATH`` URI, else ``None``."""
    prefix = "sqlite:///"
    if not db_uri.startswith(prefix) or db_uri[len(prefix):] in ("", ":memory:"):
        return None
    return Path(db_uri[len(prefix):].split("?", 1)[0])


def serialize_store_creation() -> None:
    """Create MLflow's SQL tracking stores under an exclusive ``fcntl.flock`` on
    ``<database>.init-lock`` beside a sqlite file: the first process creates the schema
    while the others wait, instead of several migrating it at once (MLflow checks for
    the tables before taking its own lock, so the others saw half-made tables and failed
    with schema-migration errors). Once the schema exists the lock is held for
    milliseconds. Applies to the stores created afterwards; idempotent; POSIX only."""
    try:
        import fcntl
    except ImportError:
        return
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    init = SqlAlchemyStore.__init__
    if getattr(init, "betty_serialized", False):
        return

    def serialized_init(self, db_uri, *args, **kwargs):
        path = _sqlite_file(str(db_uri))
        if path is None or not path.parent.is_dir():
            return init(self, db_uri, *args, **kwargs)
        with open(path.with_name(path.name + ".init-lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return init(self, db_uri, *args, **kwargs)

    serialized_init.betty_serialized = True
    SqlAlchemyStore.__init__ = serialized_init


guard_store_sessions()
serialize_store_creation()


def experiment_name(rspec: ResolvedSpec, cli_name: str | None = None) -> str | None:
    """The experiment to use (see the module docstring); ``None`` when the environment
    fixes it by ID (``MLFLOW_EXPERIMENT_ID``) or ``mlflow run`` launched this process."""
    if cli_name:
        return cli_name
    if os.environ.get("MLFLOW_EXPERIMENT_NAME"):
        return os.environ["MLFLOW_EXPERIMENT_NAME"]
    if os.environ.get("MLFLOW_EXPERIMENT_ID") or os.environ.get("MLFLOW_RUN_ID"):
        return None
    return rspec.spec.experiment or rspec.name


def use_spec_experiment(rspec: ResolvedSpec, cli_name: str | None = None) -> str | None:
    """Make :func:`experiment_name` the active experiment (created if needed) and mark it
    as model training. Returns its ID, or ``None`` when the environment fixes it."""
    from mlflow.exceptions import MlflowException

    name = experiment_name(rspec, cli_name)
    if name is None:
        return None
    try:
        exp = mlflow.set_experiment(name)
    except MlflowException:
        # two team members creating it at once: one create fails; the other's now exists
        if MlflowClient().get_experiment_by_name(name) is None:
            raise
        exp = mlflow.set_experiment(name)
    # MLflow 3.17's set_experiment, when its create loses that race
    # (RESOURCE_ALREADY_EXISTS), returns the experiment WITHOUT making it active, so the
    # runs would go to "Default" (seen in the team-server test). Activating it by ID is
    # idempotent and always sets it.
    exp = mlflow.set_experiment(experiment_id=exp.experiment_id)
    mark_model_training(exp.experiment_id)
    return exp.experiment_id


def mark_model_training(experiment_id: str) -> None:
    """Tag ``experiment_id`` as model training unless it already has a kind.

    Two runs starting at once on one server may both find the tag missing; the second
    insert then fails with a unique-key violation, which is fine once the tag is there."""
    from mlflow.exceptions import MlflowException

    client = MlflowClient()
    if EXPERIMENT_KIND_TAG in client.get_experiment(experiment_id).tags:
        return
    try:
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING)
    except MlflowException:
        if EXPERIMENT_KIND_TAG not in client.get_experiment(experiment_id).tags:
            raise


def dataset_input(rspec: ResolvedSpec):
    """The spec's dataset as an ``mlflow.data.meta_dataset.MetaDataset`` (no data read)."""
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.sources import LocalArtifactDatasetSource

    from betty.data import SYNTHETIC_PRESETS, dataset_digest

    ds = rspec.spec.dataset
    options = rspec.dataset_options
    if ds.name in SYNTHETIC_PRESETS:
        source = CodeDatasetSource({"generator": f"betty.data synthetic preset {ds.name}",
                                    **{k: str(v) for k, v in options.items()}})
    else:
        where = options.get("path") or ds.root
        source = LocalArtifactDatasetSource(str(Path(where).resolve()))
    return MetaDataset(source, name=ds.name, digest=dataset_digest(ds.name, ds.root, **options))


def log_dataset_input(rspec: ResolvedSpec, context: str = "training") -> None:
    """Log the spec's dataset as an input of the active run (the runs table's Dataset).

    MLflow's SQL store looks the dataset up and then inserts it; two runs logging the
    same new dataset at once (two team members, one server) make one insert fail with a
    unique-key violation. The dataset then exists, so the call is retried (3 tries)."""
    import time

    from mlflow.exceptions import MlflowException

    dataset = dataset_input(rspec)
    for attempt in range(3):
        try:
            mlflow.log_input(dataset, context=context)
            return
        except MlflowException:
            if attempt == 2:
                raise
            time.sleep(0.2 * (attempt + 1))


def _pip_requirements() -> list[str]:
    from importlib import metadata

    out = []
    for dist in ("torch", "numpy", "dgl", "torch_geometric", "scipy"):
        try:
            out.append(f"{dist}=={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            continue
    return out


def log_pytorch_model(model, rspec: ResolvedSpec) -> str:
    """Log ``model`` (on the CPU, in eval mode) with the pytorch flavor as ``model`` of
    the active run, with the ``betty`` package and ``spec.yaml``; returns the model URI.

    ``mlflow.pytorch.load_model(f"runs:/{run_id}/model")`` returns a module whose
    outputs equal the trained one's (checked in ``tests/test_workflow_tracking.py``).
    """
    import copy

    import mlflow.pytorch

    was_training = model.training
    cpu = copy.deepcopy(model).cpu().eval()
    with tempfile.TemporaryDirectory(prefix="betty-model-") as tmp:
        spec_file = Path(tmp) / "spec.yaml"
        spec_file.write_text(rspec.yaml())
        info = mlflow.pytorch.log_model(cpu, name=MODEL_NAME, code_paths=[str(_PACKAGE_DIR)],
                                        extra_files=[str(spec_file)], pip_requirements=_pip_requirements(),
                                        serialization_format="pickle")
    model.train(was_training)
    return info.model_uri
