"""The outbox (orchestrator/tracking/outbox.py): an arm's writes that a tracking server did not answer are
kept on disk, in order, and sent later as the arm made them. Here against a real closed port (a server
that is down: the client's own error, retries off) and delivered into a real MLflow store; the whole path
through a real `mlflow server` that goes down mid-study is in test_team_server.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from orchestrator.tracking.outbox import OutboxClient, deliver_all, is_server_unreachable, pending
from tests.conftest import free_port, seed_mlflow_store


@pytest.fixture
def down(monkeypatch) -> str:
    """The URI of a tracking server that is down (nothing listens on its port), the client's retries off."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    return f"http://127.0.0.1:{free_port()}"


def test_writes_a_down_server_does_not_answer_are_kept_in_order_and_sent_later_as_made(tmp_path, down):
    store = MlflowClient(seed_mlflow_store(tmp_path / "mlflow.db"))
    run = store.create_run(store.create_experiment("s"))
    run_id = run.info.run_id
    warned: list[str] = []
    client = OutboxClient(MlflowClient(down), tmp_path / "outbox", down, "s", warned.append)
    sessions = tmp_path / "sessions.jsonl"
    sessions.write_text('{"id": 1}\n{"id": 2}\n')

    client.log_batch(run_id, metrics=[Metric("corrupted", 1.0, 5, 0)], params=[Param("factor.x", "on")])
    client.log_artifact(run_id, str(sessions), "stress")
    sessions.unlink()  # a temporary file the arm removes: the outbox kept its own copy
    client.log_batch(run_id, tags=[RunTag("outcomes", "complete")])
    client.set_terminated(run_id, "FINISHED")
    assert len(warned) == 1 and down in warned[0] and "resume=true" in warned[0]
    [box] = pending(tmp_path / "outbox", down, "s")
    assert [name for name, _ in box.calls()] == ["log_batch", "log_artifact", "log_batch", "set_terminated"]
    assert pending(tmp_path / "outbox", down, "another study") == []

    # still down: kept
    assert deliver_all(MlflowClient(down), tmp_path / "outbox", down, "s") == ([], [run_id])
    # the server answers again (here the store it stands for): sent, in order, and the outbox emptied
    assert deliver_all(store, tmp_path / "outbox", down, "s") == ([run_id], [])
    got = store.get_run(run_id)
    assert got.info.status == "FINISHED"
    assert got.data.metrics == {"corrupted": 1.0} and got.data.params == {"factor.x": "on"}
    assert got.data.tags["outcomes"] == "complete"
    local = store.download_artifacts(run_id, "stress/sessions.jsonl", str(tmp_path))
    assert Path(local).read_text() == '{"id": 1}\n{"id": 2}\n'
    assert pending(tmp_path / "outbox", down, "s") == [] and not (tmp_path / "outbox" / run_id).exists()


def test_a_server_that_answers_no_is_not_an_outage(tmp_path):
    # a refusal (a bad value, a missing run) is raised as before: keeping it would only delay the error
    store = MlflowClient(seed_mlflow_store(tmp_path / "mlflow.db"))
    client = OutboxClient(store, tmp_path / "outbox", "sqlite", "s", lambda m: pytest.fail(m))
    with pytest.raises(Exception) as caught:
        client.set_terminated("no-such-run", "FINISHED")
    assert not is_server_unreachable(caught.value)
    assert not (tmp_path / "outbox").exists()
