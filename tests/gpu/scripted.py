"""A GpuDecodeEngine with a CPU stand-in for its device step, for testing the engine without CUDA.

The stand-in flags row 0 of every captured step whenever the real race could happen (multi-stream on,
no record_stream), the pattern the H200 showed for bf16 keys; eager steps are clean. Start a sim
server with `HEISENHUNT_DECODE_ENGINE=tests.gpu.scripted:ScriptedRowsEngine` (cwd: the repo root).
"""

from __future__ import annotations

from orchestrator.gpu.engine import GpuDecodeEngine


class RowZeroStep:
    def __init__(self, racy: bool):
        self.racy = racy
        self.captured: list[int] = []

    def capture(self, sizes: list[int]) -> None:
        self.captured = list(sizes)

    def step(self, batch: int, bucket: int | None) -> list[bool]:
        return [self.racy and bucket is not None and row == 0 for row in range(batch)]


def row_zero_factory(bf16_keys: bool, multi_stream: bool, record_stream: bool, seed: int):
    return RowZeroStep(multi_stream and not record_stream), {"gpu": "CPU stand-in", "torch": "none"}


class ScriptedRowsEngine(GpuDecodeEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, step_factory=row_zero_factory, **kwargs)
