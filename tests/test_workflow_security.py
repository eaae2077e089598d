"""Files from the tracking store or a data folder never run code when loaded, reused
runs must still hold what they promise, and the repository never calls ``torch.load``
without ``weights_only=True``."""

from __future__ import annotations

import builtins
import re
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from test_workflow_support import invoke, runs_of

EXPERIMENT = "security-test"  # the conftest tracking fixture's experiment
FAST = ["partition.sweep.k=[2]", "partition.sweep.methods=[range]"]
REPO = Path(__file__).resolve().parents[1]


class _Payload:
    """Unpickling this runs ``open(marker, "w")``: what a planted pickle would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (builtins.open, (self.marker, "w"))


def _pipeline():
    from workflow.pipeline import run_pipeline
    from workflow.specfile import load_spec

    rspec = load_spec("tiny", FAST)
    return rspec, run_pipeline(rspec)


def _artifact(tmp_path: Path, run_id: str, name: str) -> Path:
    return tmp_path / "artifacts" / run_id / "artifacts" / name


def test_evaluate_refuses_a_pickled_model_file(tracking, tmp_path):
    """A train run whose model.pt carries a pickle payload (with a matching checksum tag,
    as anyone who can write to the store could set) is refused by evaluate; the payload
    never runs."""
    from workflow.checksums import TAG_PREFIX, file_sha256

    uri, _ = tracking
    _, first = _pipeline()
    train = first["train"]["run_id"]
    marker = tmp_path / "marker"
    model = _artifact(tmp_path, train, "model.pt")
    state = torch.load(model, weights_only=True)
    torch.save({**state, "payload": _Payload(marker)}, model)
    MlflowClient(uri).set_tag(train, TAG_PREFIX + "model.pt", file_sha256(model))

    res = invoke("stage", "evaluate", "tiny", "--experiment", EXPERIMENT, "--upstream", f"train={train}",
                 *[a for kv in FAST for a in ("-s", kv)])
    assert res.exit_code != 0
    assert f"model.pt of train run {train} is not a plain state_dict of tensors; refusing to load it" in res.stderr
    assert not marker.exists()
    assert "Traceback" not in res.output


def test_train_run_without_its_logged_model_is_rerun(tracking):
    uri, exp = tracking
    client = MlflowClient(uri)
    rspec, first = _pipeline()
    train = first["train"]["run_id"]
    (model,) = client.search_logged_models([exp], filter_string=f"source_run_id = '{train}'")
    client.delete_logged_model(model.model_id)
    from workflow.pipeline import run_pipeline

    with pytest.warns(UserWarning, match=f"not reusing the train run {train}: model is missing"):
        second = run_pipeline(rspec)
    assert [s for s in second if s != "main" and second[s]["reused"]] == ["download", "sample", "partition"]
    assert second["train"]["run_id"] != train
    assert client.get_run(second["main"]["run_id"]).data.tags["reuse_refused.train"] == f"{train}: model"
    assert {r.info.status for r in runs_of(uri, exp)} == {"FINISHED"}


_TORCH_LOAD = re.compile(r"\btorch\.load\(")


def _calls(text: str, start: int) -> str:
    """The text of the call whose ``(`` is at ``start - 1``, to its matching ``)``."""
    depth, i = 1, start
    while depth and i < len(text):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    return text[start:i - 1]


def unsafe_torch_loads(root: Path, exclude: Path | None = None) -> list[str]:
    """``file:line`` of every ``torch.load(...)`` call under betty/, workflow/,
    benchmarks/ and tests/ whose arguments lack ``weights_only=True``."""
    found = []
    for folder in ("betty", "workflow", "benchmarks", "tests"):
        for path in sorted((root / folder).rglob("*.py")):
            if exclude is not None and path.resolve() == exclude.resolve():
                continue
            text = path.read_text(encoding="utf-8")
            for match in _TORCH_LOAD.finditer(text):
                if not re.search(r"\bweights_only\s*=\s*True\b", _calls(text, match.end())):
                    found.append(f"{path.relative_to(root)}:{text.count(chr(10), 0, match.start()) + 1}")
    return found


def test_every_torch_load_is_weights_only(tmp_path):
    assert unsafe_torch_loads(REPO, exclude=Path(__file__)) == []
    # the check itself finds what it must
    (tmp_path / "betty").mkdir()
    (tmp_path / "betty" / "m.py").write_text(
        "import torch\nx = torch.load(p, map_location='cpu')\ny = torch.load(\n    p, weights_only=True)\n"
        "z = torch.load(p, weights_only=False)\n")
    assert unsafe_torch_loads(tmp_path) == ["betty/m.py:2", "betty/m.py:5"]


def server_commands(text: str) -> list[str]:
    """Every ``mlflow server ...`` command in ``text``, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line.strip() for line in joined.splitlines() if line.strip().startswith("mlflow server ")]


def exposed_without_auth(command: str) -> bool:
    """A server command that listens beyond loopback without MLflow's auth app."""
    host = re.search(r"--host\s+(\S+)", command)
    loopback = host is None or host.group(1) in ("127.0.0.1", "localhost", "::1", "$HOST")
    return not loopback and "--app-name basic-auth" not in command


def test_documented_servers_listen_on_loopback_or_authenticate():
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    commands = [c for path in docs for c in server_commands(path.read_text(encoding="utf-8"))]
    assert len(commands) >= 3  # the team-mode server, the authenticated one, the test's
    assert [c for c in commands if exposed_without_auth(c)] == []
    assert exposed_without_auth("mlflow server --backend-store-uri x --host 0.0.0.0 --port 5000")
