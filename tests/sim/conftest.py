"""Fixtures for the simulated-target tests: a `cluster` factory whose processes are always stopped."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from simkit import Cluster


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    """cluster(**kwargs) -> a Cluster under tmp_path (nothing started yet); every process it started is
    stopped (TERM, then KILL) after the test, whatever happened."""
    made: list[Cluster] = []

    def _make(**kwargs) -> Cluster:
        work = tmp_path / f"cluster{len(made)}"
        work.mkdir()
        c = Cluster(work, **kwargs)
        made.append(c)
        return c

    try:
        yield _make
    finally:
        for c in made:
            c.stop_all()
