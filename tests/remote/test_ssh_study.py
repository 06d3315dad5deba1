"""A whole study over real SSH (cluster=ssh_local) gives the same verdicts as locally: the default study
(the one `python -m orchestrator` runs, and tests/test_dsv4_study.py checks locally), every arm co-restarted,
stressed and swept through sshd. (The dsv4 study's 20 arms run locally; over SSH they would add minutes to
the suite and no path the default study does not take.)

Every role is reached through paramiko against a real sshd on loopback (host key checked against a
known_hosts file, key auth); processes are started, stopped and their logs fetched over SSH.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import FAST_SIM
from tests.test_dsv4_study import verdicts
from tests.test_study import finish, no_servers_left, orchestrator


@pytest.mark.slow
@pytest.mark.ssh
def test_the_default_study_over_ssh_gives_the_local_verdicts(sshd, tmp_path, monkeypatch):
    monkeypatch.setenv("HH_SSH_PORT", str(sshd.port))
    monkeypatch.setenv("HH_SSH_KEY_FILE", str(sshd.key_file))
    monkeypatch.setenv("HH_SSH_KNOWN_HOSTS", str(sshd.known_hosts))
    monkeypatch.setenv("HH_SSH_USER", sshd.user)
    monkeypatch.setenv("HH_SSH_CONFIG", str(tmp_path / "no-ssh-config"))
    logins_before = sshd.log_text().count("Accepted publickey")
    # the default study, in rounds (the sequential design: two starts per arm when the evidence is clear)
    proc = orchestrator(tmp_path, "cluster=ssh_local", "hydra.sweeper.default_design=sequential", *FAST_SIM)
    out = finish(proc, 900)
    assert proc.returncode == 0, out[-5000:]
    report = json.loads((tmp_path / "reports" / "quick" / "report.json").read_text())
    assert verdicts(report) == {"H-multistream": "implicated"}, out[-3000:]
    # the sweep ran through the SSH cluster for the fix; whether it regressed is the local study's
    # check (a throughput ratio needs a quiet host, which a suite run in parallel does not promise)
    fix = next(t for t in report["throughput"] if t["label"] == "multi_stream=off")
    assert fix["levels"] and all(level["ratio"] > 0 for level in fix["levels"]), fix
    # the arms really went through sshd: one login per arm (roles share the connection)
    logins = sshd.log_text().count("Accepted publickey") - logins_before
    assert logins >= 4, logins
    # server logs came back over SFTP into the job dirs
    assert list((tmp_path / "multirun").rglob("server_logs/decode.log"))
    assert not no_servers_left(tmp_path)
    assert os.environ["HH_SSH_PORT"] == str(sshd.port)
