"""The free-GPU gate on a real GPU host, shown end to end (run/gpus.py through a real Deployment):

1. a process of this script's own takes GPU memory (torch);
2. the gate of the study's first arm, with a short bound, refuses the start and names that process;
3. the process exits a few seconds later; the gate with the deployment's own bound waits, then lets the
   start go on.

    python scripts/gpu_gate_demo.py +experiment=real_determinism [other overrides]

Nothing is started but the holder: the gate runs before any server of the arm would start. Needs torch
with CUDA and nvidia-smi (the lent H200: scripts/real-sglang.sh runs it before the study).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time

from hydra import compose, initialize_config_dir

from orchestrator.config.load import CONF_DIR, load_job
from orchestrator.config.plan import plan_arm
from orchestrator.remote.local import LocalTransport
from orchestrator.run.deploy import DeployError, Deployment

HOLD_MIB, HOLD_S, REFUSE_AFTER_S = 4096, 20.0, 5.0
HOLD = """
import sys, time, torch
x = torch.empty(int(sys.argv[1]) << 20, dtype=torch.uint8, device="cuda")
print("holding", flush=True)
time.sleep(float(sys.argv[2]))
"""


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def main(overrides: list[str]) -> int:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        plan = plan_arm(load_job(compose("config", overrides=overrides, return_hydra_config=True)))
    transports = {role: LocalTransport() for role in plan.roles}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(HOLD_MIB), str(HOLD_S)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        say(f"holder pid {holder.pid} holds {HOLD_MIB} MiB for {HOLD_S:g} s")
        short = dataclasses.replace(plan, gpu_free_timeout_s=REFUSE_AFTER_S)
        try:
            Deployment(short, transports, "gate-demo", on_event=say).wait_gpus_free()
            say("NOT REFUSED: the gate let the start go on while the holder held memory")
            return 1
        except DeployError as e:
            say(f"refused: {e}")
        started = time.monotonic()
        Deployment(plan, transports, "gate-demo", on_event=say).wait_gpus_free()
        waited = time.monotonic() - started
        say(f"the start goes on after {waited:.1f} s; the holder's exit status {holder.wait(10)}")
        return 0
    finally:
        holder.kill()
        holder.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
