"""MLflow-native records: the experiment (:func:`use_spec_experiment`), its kind
(:func:`mark_model_training`), the dataset input (:func:`dataset_input`) and the logged
model (:func:`log_pytorch_model`). On import it also guards MLflow's SQL store
(:func:`guard_store_sessions`, :func:`serialize_store_creation`).

What MLflow shows: docs/workflow.md, *Experiments, models and datasets as MLflow shows them*.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

from workflow.specfile import ResolvedSpec

__all__ = ["guard_store_sessions", "serialize_store_creation", "EXPERIMENT_KIND_TAG", "MODEL_TRAINING", "MODEL_NAME",
           "logged_model_problem", "experiment_name", "spec_experiment_name", "leave_default_experiment",
           "use_spec_experiment", "mark_model_training", "dataset_input", "log_dataset_input",
           "log_pytorch_model"]

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING = "custom_model_development"  # MLflow 3.17's kind for classic model training
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
    """The experiment to use: ``cli_name`` (``--experiment``), else
    ``$MLFLOW_EXPERIMENT_NAME``, else :func:`spec_experiment_name`; ``None`` when the
    environment fixes it by ID (``MLFLOW_EXPERIMENT_ID``) or ``mlflow run`` launched this
    process (``MLFLOW_RUN_ID``)."""
    if cli_name:
        return cli_name
    if os.environ.get("MLFLOW_EXPERIMENT_NAME"):
        return os.environ["MLFLOW_EXPERIMENT_NAME"]
    if os.environ.get("MLFLOW_EXPERIMENT_ID") or os.environ.get("MLFLOW_RUN_ID"):
        return None
    return spec_experiment_name(rspec)


def spec_experiment_name(rspec: ResolvedSpec) -> str:
    """The experiment a spec writes to when nothing else names one: its ``experiment``
    key, else its name."""
    return rspec.spec.experiment or rspec.name


DEFAULT_EXPERIMENT_ID = "0"  # MLflow's "Default"
MOVED_TAG = "betty.pipeline_experiment"


def leave_default_experiment(rspec: ResolvedSpec) -> str | None:
    """Under ``mlflow run`` without ``--experiment-name``/``--experiment-id``, MLflow has
    created this process's run (``MLFLOW_RUN_ID``) in "Default". Make the spec's
    experiment (:func:`spec_experiment_name`) this process's experiment instead, with no
    run to resume, so that the entry point's runs are created there. MLflow can neither
    move the launcher's run nor let it be deleted while ``mlflow run`` still has to end
    it, so it stays in "Default", empty, tagged and noted (docs/workflow.md, *One
    experiment per spec*). Returns its ID, or ``None`` when nothing was changed."""
    launcher_run = os.environ.get("MLFLOW_RUN_ID")
    if (not launcher_run or os.environ.get("MLFLOW_EXPERIMENT_NAME")
            or os.environ.get("MLFLOW_EXPERIMENT_ID", DEFAULT_EXPERIMENT_ID) != DEFAULT_EXPERIMENT_ID):
        return None
    for var in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID"):
        os.environ.pop(var, None)
    name = spec_experiment_name(rspec)
    exp_id = use_spec_experiment(rspec)
    os.environ["MLFLOW_EXPERIMENT_ID"] = exp_id
    client = MlflowClient()
    client.set_tag(launcher_run, MOVED_TAG, f"{name} (ID {exp_id})")
    client.set_tag(launcher_run, "mlflow.note.content",
                   f"betty logged this pipeline in experiment '{name}' (ID {exp_id}); "
                   "this run, created by `mlflow run` in Default, holds nothing.")
    return launcher_run


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
    """The spec's dataset as an ``mlflow.data.meta_dataset.MetaDataset`` (no data read):
    digest :func:`betty.data.dataset_digest`, source the data folder or, for a generated
    dataset, the generator and its options."""
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.sources import LocalArtifactDatasetSource

    from betty.data import SYNTHETIC_PRESETS

    from workflow.components import dataset_digest

    ds = rspec.spec.dataset
    options = rspec.dataset_options
    if ds.name in SYNTHETIC_PRESETS:
        source = CodeDatasetSource({"generator": f"betty.data synthetic preset {ds.name}",
                                    **{k: str(v) for k, v in options.items()}})
    else:
        where = options.get("path") or ds.root
        source = LocalArtifactDatasetSource(str(Path(where).resolve()))
    return MetaDataset(source, name=ds.name, digest=dataset_digest(rspec))


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


def logged_model_problem(run_id: str) -> str | None:
    """Why the model logged by train run ``run_id`` (``runs:/<id>/model``) is unusable,
    or ``None`` when its ``MLmodel`` file can be downloaded (a deleted logged model, or
    one whose files are gone, cannot)."""
    try:
        with tempfile.TemporaryDirectory(prefix="betty-model-check-") as tmp:
            mlflow.artifacts.download_artifacts(f"runs:/{run_id}/{MODEL_NAME}/MLmodel", dst_path=tmp)
    except Exception as err:  # noqa: BLE001  (MLflow raises several types for a missing model)
        first = str(err).splitlines()[0][:160] if str(err) else ""
        return f"missing or unreadable ({type(err).__name__}: {first})"
    return None


def log_pytorch_model(model, rspec: ResolvedSpec, step: int = 0) -> str:
    """Log ``model`` (on the CPU, in eval mode) with the pytorch flavor as ``model`` of
    the active run, with the ``betty`` package and ``spec.yaml``; returns the model URI.
    The pip requirements are given (:func:`_pip_requirements`): inferring them loads the
    model in a subprocess and takes many seconds.

    ``step``: the epoch the model is from (the last one). Metrics logged at that step
    afterwards are linked to the logged model (and those already logged at that step are
    copied onto it, without their dataset).
    """
    import copy

    import mlflow.pytorch

    was_training = model.training
    cpu = copy.deepcopy(model).cpu().eval()
    with tempfile.TemporaryDirectory(prefix="betty-model-") as tmp, _quiet_pickle_warning():
        spec_file = Path(tmp) / "spec.yaml"
        spec_file.write_text(rspec.yaml())
        info = mlflow.pytorch.log_model(cpu, name=MODEL_NAME, code_paths=[str(_PACKAGE_DIR)],
                                        extra_files=[str(spec_file)], pip_requirements=_pip_requirements(),
                                        serialization_format="pickle", step=step)
    model.train(was_training)
    return info.model_uri


PICKLE_WARNING = "Saving pytorch model by Pickle or CloudPickle format"


@contextlib.contextmanager
def _quiet_pickle_warning():
    """Drop MLflow's "Saving pytorch model by Pickle..." warning (logger ``mlflow.pytorch``)
    while the model is logged, and nothing else.

    The warning recommends ``serialization_format='pt2'`` (``torch.export``), which needs
    a model taking only tensors; betty's models take sampled blocks / graphs, which
    ``torch.export`` cannot trace, so pickle is the only format that loads back with
    ``mlflow.pytorch.load_model`` and the user has nothing to change."""
    logger = logging.getLogger("mlflow.pytorch")

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(PICKLE_WARNING)

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)
