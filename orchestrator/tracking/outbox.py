"""What an arm measured while its MLflow tracking server could not be reached, kept on disk and sent later.

MLflow's client retries a request with backoff (`MLFLOW_HTTP_REQUEST_MAX_RETRIES`, ...). A server down for
longer than that used to fail the arm's next write, and the arm with it: sessions measured, run lost. Now
the arm's tracker goes on into an outbox instead (`OutboxClient`): from the first write the server did not
answer, that write and every later one of the run (metrics, tags, artifacts, the run's end) are appended,
in order, to `<outbox_dir>/<run id>/calls.jsonl`, the files copied beside it. The arm runs to its end.

The outbox is sent (`deliver_all`) when the study next talks to the server: at the end of the sweep, before
the report is built, and at the start of any later sweep of the study (`resume=true`), before runs left
RUNNING are taken for orphans. Sent in order, a run's calls end it as the arm ended it; its dir is then
removed. A delivery the server again refuses keeps the dir for the next one.

Only for a tracking server (http/https): a store this process opens itself fails for other reasons (a
busy sqlite file is waited for: layout.retry_store).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag

log = logging.getLogger(__name__)

CALLS = "calls.jsonl"
META = "run.json"
# what the client says once its retries are spent on a server it could not reach or that kept failing
UNREACHABLE = (
    "Max retries exceeded",
    "Failed to establish a new connection",
    "Connection refused",
    "Connection reset",
    "Connection aborted",
    "Read timed out",
    "too many 5",  # "too many 503 error responses"
)


def is_server_unreachable(error: BaseException) -> bool:
    """The tracking server did not answer (down, restarting, unreachable) after the client's retries, as
    opposed to an answer that refused the request (a bad value, a missing run)."""
    text = str(error)
    return any(marker in text for marker in UNREACHABLE)


# log_batch's entities by argument; each kept as MLflow's own fields (`dict(entity)`, `from_dictionary`)
ENTITIES = {"metrics": Metric, "params": Param, "tags": RunTag}


def _encode(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """One call as JSON."""
    entities = {key: [dict(e) for e in kwargs[key]] for key in ENTITIES if kwargs.get(key)}
    return {"call": name, **kwargs, **entities}


def _decode(row: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    kwargs = {k: v for k, v in row.items() if k != "call"}
    for key, kind in ENTITIES.items():
        if kwargs.get(key):
            kwargs[key] = [kind.from_dictionary(d) for d in kwargs[key]]
    return row["call"], kwargs


@dataclass(frozen=True)
class Outbox:
    """One run's outbox: `root/<run_id>/`."""

    root: Path
    run_id: str

    @property
    def dir(self) -> Path:
        return self.root / self.run_id

    def open(self, uri: str, study: str, why: str) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        meta = {"uri": uri, "study": study, "run_id": self.run_id, "why": why}
        (self.dir / META).write_text(json.dumps(meta, indent=1) + "\n")

    def append(self, name: str, **kwargs: Any) -> None:
        """Record one call; a file it names is copied in first (the original may be a temporary one)."""
        if name == "log_artifact":
            n = sum(1 for _ in (self.dir / "files").glob("*")) if (self.dir / "files").is_dir() else 0
            keep = self.dir / "files" / str(n) / Path(kwargs["local_path"]).name
            keep.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(kwargs["local_path"], keep)
            kwargs = {**kwargs, "local_path": str(keep)}
        with (self.dir / CALLS).open("a") as f:
            f.write(json.dumps(_encode(name, kwargs)) + "\n")
            f.flush()

    def calls(self) -> list[tuple[str, dict[str, Any]]]:
        path = self.dir / CALLS
        if not path.is_file():
            return []
        return [_decode(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]

    def meta(self) -> dict[str, Any]:
        return json.loads((self.dir / META).read_text())


class OutboxClient:
    """The arm tracker's client over a tracking server: calls go to the server until one finds it
    unreachable; that one and every later one go to the run's outbox, in order (a later write must not
    reach the server before an earlier one). Other errors are raised as before."""

    KEPT = ("log_batch", "log_artifact", "set_terminated")

    def __init__(self, client: Any, outbox_root: Path, uri: str, study: str, warn: Callable[[str], None]):
        self._client = client
        self._root, self._uri, self._study, self._warn = Path(outbox_root), uri, study, warn
        self.outbox: Outbox | None = None

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if name not in self.KEPT:
            return attr

        def kept(run_id: str, *args: Any, **kwargs: Any) -> Any:
            kwargs = {**dict(zip(_ARGS[name], args, strict=False)), **kwargs}
            if self.outbox is None:
                try:
                    return attr(run_id, **kwargs)
                except Exception as e:
                    if not is_server_unreachable(e):
                        raise
                    self.outbox = Outbox(self._root, run_id)
                    self.outbox.open(self._uri, self._study, str(e).splitlines()[0][:500])
                    self._warn(
                        f"the MLflow server {self._uri} did not answer ({str(e).splitlines()[0][:200]}); "
                        f"this arm goes on, its results kept in {self.outbox.dir} and sent when the server "
                        f"answers (at the end of this sweep, or with resume=true)"
                    )
            self.outbox.append(name, **kwargs)
            return None

        return kept


# each kept call's positional parameters after run_id, as MlflowClient names them
_ARGS = {
    "log_batch": ("metrics", "params", "tags"),
    "log_artifact": ("local_path", "artifact_path"),
    "set_terminated": ("status", "end_time"),
}


def pending(outbox_root: Path, uri: str, study: str) -> list[Outbox]:
    """The outboxes of `study` on `uri` not yet sent, oldest first."""
    root = Path(outbox_root)
    if not root.is_dir():
        return []
    found = []
    for run_dir in sorted(root.iterdir(), key=lambda p: p.stat().st_mtime):
        if not (run_dir / META).is_file():
            continue
        box = Outbox(root, run_dir.name)
        meta = box.meta()
        if meta.get("uri") == uri and meta.get("study") == study:
            found.append(box)
    return found


def deliver(client: Any, box: Outbox) -> None:
    """Send one run's outbox in order; its dir removed once all is sent. Raises what the server says."""
    for name, kwargs in box.calls():
        getattr(client, name)(box.run_id, **kwargs)
    shutil.rmtree(box.dir)


def deliver_all(client: Any, outbox_root: Path, uri: str, study: str) -> tuple[list[str], list[str]]:
    """Every pending outbox of `study` sent: (run ids sent, run ids still kept: the server refused or
    did not answer; said in the log)."""
    sent, kept = [], []
    for box in pending(outbox_root, uri, study):
        try:
            deliver(client, box)
            sent.append(box.run_id)
            log.info("sent the results kept in %s to %s (run %s)", box.dir, uri, box.run_id)
        except Exception as e:
            kept.append(box.run_id)
            log.warning("the results kept in %s are not sent yet: %s", box.dir, str(e).splitlines()[0][:300])
    return sent, kept
