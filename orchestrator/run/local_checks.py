"""Checks of this machine's side of a study, run before any server is touched.

An unreachable tracking store or an unwritable reports folder would otherwise surface only after the
first arm had restarted servers and measured for minutes; these fail in a second with a clear message.
"""

from __future__ import annotations

import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from orchestrator.config.load import ConfigError
from orchestrator.config.schema import TrackingConf


def check_writable_dir(path: str | Path, key: str) -> None:
    """Create `path` if needed and prove a file can be written there."""
    target = Path(path).expanduser()
    try:
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target, prefix=".heisenhunt-check-"):
            pass
    except OSError as e:
        raise ConfigError(
            [
                f"{key}: {str(target)!r} is not a writable directory ({e.strerror or e}); "
                f"accepted: a directory this user can create and write"
            ]
        ) from e


def check_tracking_uri(uri: str, timeout_s: float = 5.0) -> None:
    """A quick proof that MLflow can reach the tracking store at `uri`."""
    parsed = urlparse(uri)
    scheme = parsed.scheme
    if scheme == "sqlite":
        db_path = TrackingConf(uri=uri).sqlite_file
        if not db_path:
            raise ConfigError(
                [f"tracking.uri: {uri!r} names no database file; accepted: sqlite:///path/to/file.db"]
            )
        check_writable_dir(
            Path(db_path).parent if Path(db_path).parent != Path("") else Path("."),
            "tracking.uri (sqlite folder)",
        )
    elif scheme in ("", "file"):
        check_writable_dir(parsed.path or uri, "tracking.uri (file store)")
    elif scheme in ("http", "https"):
        health = f"{uri.rstrip('/')}/health"
        try:
            with urllib.request.urlopen(health, timeout=timeout_s) as response:
                if response.status != 200:
                    raise OSError(f"HTTP {response.status}")
        except urllib.error.HTTPError as e:
            raise ConfigError(
                [
                    f"tracking.uri: {uri!r} answered {health} with HTTP {e.code}; accepted: a "
                    f"reachable MLflow tracking server"
                ]
            ) from e
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ConfigError(
                [
                    f"tracking.uri: cannot reach {uri!r} within {timeout_s:.0f}s ({reason}); "
                    f"accepted: a reachable MLflow server, sqlite:///file.db or a folder"
                ]
            ) from e
    # other schemes (databricks, postgresql, ...) are checked by MLflow itself on first use


def check_local_side(tracking_uri: str, reports_dir: str) -> None:
    """Every local check, all problems reported together."""
    problems: list[str] = []
    for check in (
        lambda: check_tracking_uri(tracking_uri),
        lambda: check_writable_dir(reports_dir, "report.dir"),
    ):
        try:
            check()
        except ConfigError as e:
            problems += e.problems
    if problems:
        raise ConfigError(problems)
