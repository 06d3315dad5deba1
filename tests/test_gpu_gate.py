"""The free-GPU gate before a start (orchestrator/run/gpus.py): nvidia-smi's answers parsed and judged,
the bounded wait, and the gate through a real Deployment on this host.

Where no GPU is (here, CI), `nvidia-smi` is a FAKE: a shell script on PATH that prints what a state file
says, so the gate's real code (its shell line, the transport, the wait, the refusal) runs against
nvidia-smi's documented CSV. On a machine with an NVIDIA GPU and torch, the last test holds real GPU
memory in a process of its own: the start is refused naming it, then the process exits and the start
goes on (the H200 run: docs/real-sglang.md)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from orchestrator.remote.local import LocalTransport
from orchestrator.run import gpus

GPUS = "0, GPU-aaa, 3, 143771\n1, GPU-bbb, 70000, 143771\n"
APPS = "GPU-bbb, 4242, python3, 69800\n"


def test_nvidia_smi_csv_is_parsed_into_gpus_and_holders():
    state = gpus.gpu_state("node1", GPUS, APPS + "GPU-ccc, 17, [Not Found], [N/A]\n")
    assert [g.index for g in state.gpus] == [0, 1] and state.gpus[1].used_mib == 70000
    assert state.holders[0] == gpus.Holder(1, 4242, "python3", 69800)
    # a process nvidia-smi cannot place or size (another container's) still counts, as unknown
    assert state.holders[1] == gpus.Holder(-1, 17, "[Not Found]", None)


def test_only_the_gpus_the_roles_use_must_be_free():
    state = gpus.gpu_state("node1", GPUS, APPS)
    assert gpus.busy(state, {0}, 1024) == []
    assert gpus.busy(state, {1}, 1024) == ["pid 4242 (python3, 69800 MiB on GPU 1)"]
    assert gpus.busy(state, None, 1024) == ["pid 4242 (python3, 69800 MiB on GPU 1)"]
    # memory held with no process listed (a process of another namespace) is not idle either
    quiet = gpus.gpu_state("node1", GPUS, "")
    assert gpus.busy(quiet, {1}, 1024) == ["GPU 1: 70000 MiB in use, no process listed (idle: <= 1024 MiB)"]
    assert gpus.visible_gpus([{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "1"}]) == {0, 1}
    assert gpus.visible_gpus([{"CUDA_VISIBLE_DEVICES": "0"}, {}]) is None


def test_the_wait_ends_when_the_holder_goes_and_refuses_naming_it_when_it_does_not():
    answers = [gpus.gpu_state("node1", GPUS, APPS)] * 3 + [
        gpus.gpu_state("node1", GPUS.replace("70000", "2"), "")
    ]
    now = [0.0]
    events: list[str] = []

    def ask(_):
        return answers.pop(0) if len(answers) > 1 else answers[0]

    waited = gpus.wait_free(
        {"node1": (None, {1})}, 60, 1024, poll_s=2, on_event=events.append, ask=ask,
        clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s),
    )  # fmt: skip
    assert waited == 6.0
    assert events == [
        "GPU memory held on node1: pid 4242 (python3, 69800 MiB on GPU 1); waiting up to 60s",
        "GPUs free after 6.0s",
    ]
    now[0] = 0.0
    with pytest.raises(gpus.GpusBusy, match=r"not free after 10s \(on node1: pid 4242 \(python3, 69800 MiB"):
        gpus.wait_free(
            {"node1": (None, {1})}, 10, 1024, poll_s=2,
            ask=lambda _: gpus.gpu_state("node1", GPUS, APPS),
            clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s),
        )  # fmt: skip


FAKE_SMI = """#!/bin/sh
# FAKE nvidia-smi for a machine without a GPU: prints the state file's GPU or process lines
case "$*" in
  *query-gpu*) cat "{state}/gpus" ;;
  *query-compute-apps*) cat "{state}/apps" 2>/dev/null ;;
  *) exit 2 ;;
esac
"""


def test_the_deployment_waits_for_the_gpus_then_starts_or_refuses(tmp_path, monkeypatch, compose_cfg):
    """The gate through a real Deployment and LocalTransport, against the fake nvidia-smi on PATH."""
    from orchestrator.config.load import load_job
    from orchestrator.config.plan import plan_arm
    from orchestrator.run.deploy import DeployError, Deployment

    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI.format(state=state))
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    (state / "gpus").write_text("0, GPU-aaa, 30000, 143771\n")
    (state / "apps").write_text("GPU-aaa, 999, someone-elses-job, 29990\n")
    plan = plan_arm(load_job(compose_cfg("deployment.gpu_free_timeout_s=1")))
    transports = {role: LocalTransport() for role in ("prefill", "decode", "router")}
    events: list[str] = []
    deployment = Deployment(plan, transports, run_label="gate", on_event=events.append)
    with pytest.raises(
        DeployError, match=r"GPUs: .*on localhost: pid 999 \(someone-elses-job, 29990 MiB on GPU 0\)"
    ):
        deployment.wait_gpus_free()
    assert "GPU memory held on localhost: pid 999" in events[0]

    def job_ends():
        time.sleep(1.5)
        (state / "gpus").write_text("0, GPU-aaa, 3, 143771\n")
        (state / "apps").write_text("")

    ender = threading.Thread(target=job_ends)
    ender.start()
    started = time.monotonic()
    Deployment(dataclasses.replace(plan, gpu_free_timeout_s=30.0), transports, "gate").wait_gpus_free()
    ender.join()
    assert 1.0 < time.monotonic() - started < 20


HOLD = """
import sys, time, torch
x = torch.empty(int(sys.argv[1]) << 20, dtype=torch.uint8, device="cuda")
print("holding", flush=True)
time.sleep(float(sys.argv[2]))
"""


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="no nvidia-smi: no NVIDIA GPU on this machine")
def test_on_a_real_gpu_a_holder_is_named_then_the_start_goes_on_once_it_exits(capsys):
    pytest.importorskip("torch")
    transport = LocalTransport()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, "2048", "12"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(gpus.GpusBusy) as refused:
            gpus.wait_free({"localhost": (transport, None)}, 3, 1024, poll_s=1)
        print(f"refused: {refused.value}")
        assert f"pid {holder.pid} " in str(refused.value) or "no process listed" in str(refused.value)
        events: list[str] = []
        waited = gpus.wait_free({"localhost": (transport, None)}, 60, 1024, poll_s=1, on_event=events.append)
        print("\n".join(events))
        print(f"waited {waited:.1f}s; the holder exited with {holder.wait(timeout=5)}")
        assert waited > 3 and events[-1].startswith("GPUs free after")
    finally:
        holder.kill()
        holder.wait()
