"""The GPUs are free before a start: a bounded wait until every GPU the server roles use is back to its
idle memory, and a refusal that names what still holds it.

On a shared node a start that meets memory still held is minutes of GPU time lost to an out-of-memory
failure; the holder may be the previous arm's processes still dying (an engine's scheduler and detokenizer
children outlive the process group's leader by seconds) or someone else's job. So before a co-restart,
after every role of this tool was stopped, each server host is asked (`nvidia-smi`):
- which GPUs the roles use: the indices in a role's `CUDA_VISIBLE_DEVICES`, else every GPU of the host;
- what each of those holds: its memory in use, and the compute processes on it (pid, name, memory).
A GPU is free when no compute process is on it and its memory in use is at most `idle_mib` (a driver's
context and ECC pages hold a little on an idle GPU). The gate polls until all are free, at most
`timeout_s`; past that it refuses the start (`GpusBusy`), naming each holder and its host. A host
without nvidia-smi (the embedded default, a CPU box) passes at once. SGLang's own config-search
benchmarks wait the same way between cells.

`gpu_state` parses nvidia-smi's CSV and `busy` judges it (pure); `wait_free` is the loop, with the clock
and the query passed in.
"""

from __future__ import annotations

import logging
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from orchestrator.remote.base import CommandResult, Transport

log = logging.getLogger(__name__)

_NO_SMI = "__heisenhunt_no_nvidia_smi__"
GPU_QUERY = "--query-gpu=index,uuid,memory.used,memory.total --format=csv,noheader,nounits"
APP_QUERY = "--query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv,noheader,nounits"
_SPLIT = "__heisenhunt_apps__"


class GpusBusy(RuntimeError):
    """The GPUs a start needs were still held when the wait ran out."""


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    used_mib: int
    total_mib: int


@dataclass(frozen=True)
class Holder:
    """A compute process on a GPU the roles use."""

    gpu: int
    pid: int
    name: str
    used_mib: int | None  # None: nvidia-smi could not say ([N/A], e.g. another container's process)

    def describe(self) -> str:
        memory = f"{self.used_mib} MiB" if self.used_mib is not None else "memory n/a"
        return f"pid {self.pid} ({self.name}, {memory} on GPU {self.gpu})"


@dataclass(frozen=True)
class HostGpus:
    """One host's GPUs and the compute processes on them, as nvidia-smi reported them."""

    host: str
    gpus: tuple[Gpu, ...]
    holders: tuple[Holder, ...]


def _number(text: str) -> int | None:
    try:
        return int(float(text))
    except ValueError:
        return None  # [N/A], [Not Supported]


def gpu_state(host: str, gpus_csv: str, apps_csv: str) -> HostGpus:
    """nvidia-smi's two answers (GPU_QUERY, APP_QUERY) as one host's state. Pure."""
    gpus = []
    for line in gpus_csv.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 4 and _number(fields[0]) is not None:
            gpus.append(Gpu(int(fields[0]), fields[1], _number(fields[2]) or 0, _number(fields[3]) or 0))
    by_uuid = {g.uuid: g.index for g in gpus}
    holders = []
    for line in apps_csv.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 4 or _number(fields[1]) is None:
            continue
        name = ",".join(fields[2:-1]) or "?"  # a process name may hold a comma
        holders.append(Holder(by_uuid.get(fields[0], -1), int(fields[1]), name, _number(fields[-1])))
    return HostGpus(host, tuple(gpus), tuple(holders))


def visible_gpus(envs: Sequence[Mapping[str, str]]) -> set[int] | None:
    """The GPU indices the roles on one host use (their CUDA_VISIBLE_DEVICES, integers only); None:
    some role sets none (or names GPUs by UUID), so it may use any. Pure."""
    used: set[int] = set()
    for env in envs:
        value = env.get("CUDA_VISIBLE_DEVICES")
        if value is None:
            return None
        for part in value.split(","):
            if not part.strip().isdigit():
                return None
            used.add(int(part))
    return used


def busy(state: HostGpus, use: set[int] | None, idle_mib: int) -> list[str]:
    """What keeps the GPUs of `use` (None: all) from being free, one line each ([] when all are): each
    compute process on one of them (or on a GPU nvidia-smi did not place), and each of them holding more
    than `idle_mib` with no process listed. Pure."""
    out = [h.describe() for h in state.holders if use is None or h.gpu == -1 or h.gpu in use]
    for gpu in state.gpus:
        listed = any(h.gpu == gpu.index for h in state.holders)
        if (use is None or gpu.index in use) and not listed and gpu.used_mib > idle_mib:
            out.append(
                f"GPU {gpu.index}: {gpu.used_mib} MiB in use, no process listed (idle: <= {idle_mib} MiB)"
            )
    return out


def run_smi(t: Transport, arguments: str, nvidia_smi: str = "nvidia-smi") -> CommandResult | None:
    """`nvidia-smi ARGUMENTS` on a host (the arguments are shell words of ours), None where it has none."""
    smi = shlex.quote(nvidia_smi)
    result = t.run_shell(
        f"command -v {smi} >/dev/null 2>&1 || {{ echo {_NO_SMI}; exit 0; }}; {smi} {arguments}", 60.0
    )
    return None if result.stdout.strip() == _NO_SMI else result


def query(t: Transport, nvidia_smi: str = "nvidia-smi") -> HostGpus | None:
    """One host's GPUs and compute processes (None: no nvidia-smi there)."""
    result = run_smi(t, f"{GPU_QUERY} && echo {_SPLIT} && {shlex.quote(nvidia_smi)} {APP_QUERY}", nvidia_smi)
    if result is None:
        return None
    if result.returncode != 0 or _SPLIT not in result.stdout:
        raise GpusBusy(
            f"on {t.host}: nvidia-smi failed ({result.returncode}): {(result.stderr or result.stdout)[-400:]}"
        )
    gpus_csv, _, apps_csv = result.stdout.partition(_SPLIT)
    return gpu_state(t.host, gpus_csv, apps_csv)


def wait_free(
    hosts: Mapping[str, tuple[Transport, set[int] | None]],
    timeout_s: float,
    idle_mib: int,
    poll_s: float = 2.0,
    on_event: Callable[[str], None] = log.info,
    ask: Callable[[Transport], HostGpus | None] = query,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Wait until the GPUs each host's roles use are free (`busy` says none held), at most `timeout_s`;
    returns the seconds waited. `hosts`: host name -> (its transport, the GPU indices used or None).
    Raises GpusBusy naming every holder and its host when the wait runs out."""
    started = clock()
    said: dict[str, list[str]] = {}
    while True:
        held = {}
        for host, (transport, use) in hosts.items():
            state = ask(transport)
            lines = busy(state, use, idle_mib) if state is not None else []
            if lines:
                held[host] = lines
        waited = clock() - started
        if not held:
            if said:
                on_event(f"GPUs free after {waited:.1f}s")
            return waited
        if held != said:  # say what holds them when it changes, not every poll
            for host, lines in held.items():
                on_event(f"GPU memory held on {host}: {'; '.join(lines)}; waiting up to {timeout_s:g}s")
            said = held
        if waited >= timeout_s:
            names = "; ".join(f"on {host}: {', '.join(lines)}" for host, lines in held.items())
            raise GpusBusy(
                f"the GPUs are not free after {waited:.0f}s ({names}): a start now would run out of memory; "
                "stop those processes or raise deployment.gpu_free_timeout_s"
            )
        sleep(poll_s)
