"""Batch buckets of the GPU decode engine (pure): which captured graph a decode batch replays.

SGLang captures one decode graph per size in a fixed list up to `--cuda-graph-max-bs-decode`, pads a batch
up to the smallest captured size that holds it, and runs a larger batch eager. The list is the one
the sim server logs at capture (`orchestrator.sim.server.CUDA_GRAPH_SIZES`).
"""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.sim.server import CUDA_GRAPH_SIZES


def capture_sizes(max_bs: int, sizes: Sequence[int] = CUDA_GRAPH_SIZES) -> list[int]:
    """The batch sizes captured with `--cuda-graph-max-bs-decode max_bs`, ascending."""
    return sorted(b for b in sizes if b <= max_bs)


def bucket_for(batch: int, captured: Sequence[int]) -> int | None:
    """The captured size a batch of `batch` rows replays (padded up), or None: it runs eager."""
    if batch < 1:
        raise ValueError(f"a decode batch has at least one row, got {batch}")
    fitting = [b for b in captured if b >= batch]
    return min(fitting) if fitting else None
