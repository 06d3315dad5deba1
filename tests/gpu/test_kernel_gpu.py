"""The GPU engine's decode step on a real CUDA device: the configurations without the race are exact.

Skipped without torch or a CUDA device (CI). On a GPU machine: `python -m pytest tests/gpu`. What the
racy configuration does is measured, not asserted (it is the GPU's and allocator's business):
`python -m orchestrator.gpu.probe` prints it per bucket.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the GPU decode step needs torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the GPU decode step cannot run here", allow_module_level=True)

from orchestrator.gpu.buckets import capture_sizes  # noqa: E402
from orchestrator.gpu.kernel import DecodeStep, StepConfig  # noqa: E402

SIZES = capture_sizes(32)


def mismatching_steps(config: StepConfig, graph: bool, replays: int = 10) -> dict[int, int]:
    step = DecodeStep(config, seed=7)
    if graph:
        step.capture(SIZES)
    return {b: sum(any(step.step(b, b if graph else None)) for _ in range(replays)) for b in SIZES}


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp8"])
@pytest.mark.parametrize(
    ("multi_stream", "record_stream", "graph"),
    [(False, False, True), (True, True, True), (False, False, False)],
    ids=["graph-single-stream", "graph-record-stream", "eager-single-stream"],
)
def test_without_the_race_every_step_matches_the_serialized_reference(
    bf16, multi_stream, record_stream, graph
):
    counts = mismatching_steps(StepConfig(bf16, multi_stream, record_stream), graph)
    assert counts == dict.fromkeys(SIZES, 0)


def test_a_batch_smaller_than_its_bucket_compares_only_its_real_rows():
    step = DecodeStep(StepConfig(True, False, False), seed=7)
    step.capture(SIZES)
    assert step.step(3, 4) == [False, False, False]
    assert len(step.step(40, None)) == 40  # above the largest bucket: eager


def test_the_real_engine_serves_a_planned_call_behind_the_server_and_counts_its_buckets(serve):
    from orchestrator.workload import tasks
    from tests.gpu.conftest import chat, get_json

    _, base = serve(engine="orchestrator.gpu.engine:GpuDecodeEngine", startup_s=120)
    messages = tasks.initial_messages(tasks.make_task(seed=1, session_index=0, rounds=2))
    assert chat(base, messages, tasks.TOOLS)["choices"][0]["message"] is not None
    engine = get_json(f"{base}/server_info")["sim"]["decode_engine"]
    assert engine["device"]["gpu"] and engine["captured_sizes"] == SIZES
    assert engine["buckets"]["1"]["steps"] > 0
