"""Studies that tests in two files each judge for what they own, run once: a session fixture runs the
study once per pytest worker, and the tests that share it are one `xdist_group`, so one worker runs it
for both. A small study on the embedded default is ~12-14 CPU-s, most of it each arm's co-restart,
host checks and records, whatever its sessions; two tests of the same command paid it twice (issue 52,
item 7: CI under 12 minutes on 2 cores).

- `default_run`: `python -m orchestrator` as a user types it, started cold (tests/test_dsv4_study.py judges
  the study and its report, tests/test_console.py what a pipe shows of it);
- `factorial_run`: the 2x2 sweep on the command line over the conjunction fault model
  (tests/test_study.py judges the multirun, tests/test_cause.py the minimal cause).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.report import console
from tests import warm

DEFAULT_RUN = "default-run"  # the xdist_group of the tests that share `default_run`
FACTORIAL_RUN = "factorial-run"  # and of those that share `factorial_run`


@dataclass(frozen=True)
class StudyRun:
    root: Path  # the study's tmp dir: its store, reports, sweep dir and cluster work dirs
    returncode: int
    out: str  # stdout and stderr as one stream, as a pipe shows them
    cold: bool  # started as a fresh interpreter, not forked from the warm zygote


def run_study(root: Path, *overrides: str, timeout: float) -> StudyRun:
    from tests.test_study import finish, orchestrator

    proc = orchestrator(root, *overrides)
    out = finish(proc, timeout)
    return StudyRun(root, proc.returncode, out, isinstance(proc, subprocess.Popen))


@pytest.fixture(scope="session")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> StudyRun:
    with pytest.MonkeyPatch.context() as env:
        # started cold, as a user starts it: the one study of the suite that is (tests/warm.py); quiet, as
        # a user's terminal is unless they ask for the logs
        env.setenv(warm.COLD_ENV, "1")
        env.delenv(console.VERBOSE_ENV, raising=False)
        return run_study(tmp_path_factory.mktemp(DEFAULT_RUN), timeout=600)


@pytest.fixture(scope="session")
def factorial_run(tmp_path_factory: pytest.TempPathFactory) -> StudyRun:
    # one start per arm, no throughput sweep: it adds time, not information about the cause. The
    # experiment's two rounds per session: with one, the baseline's ~9% of 200 sessions fell short of
    # "shown corrupting" in about one run in ten (seen in CI: 98.75% lower bound under the ceiling)
    return run_study(
        tmp_path_factory.mktemp(FACTORIAL_RUN),
        "-m",
        "+experiment=graph_and_multistream",
        "factor/multi_stream=on,off",
        "factor/capture=graph,eager",
        "bench.enabled=false",
        timeout=300,
    )
