"""The GPU decode engine's real work (torch, CUDA): one decode step of a small DeepSeek-V4-shaped layer.

Each step, for a batch of B token rows `x` [B, HIDDEN] (bf16):

1. main stream: the token's index key `k = x @ W_index` [B, INDEX_DIM], kept in bf16
   (`SGLANG_DSV4_BF16_INDEX_K=1`) or stored as fp8 e4m3 (half the bytes; the indexer reads it back
   through a bf16 conversion).
2. the sparse "indexer": scores of `k` against the index-key cache [KEYS, INDEX_DIM], top-TOP_K
   indices per row. With `SGLANG_OPT_USE_MULTI_STREAM_OVERLAP` on it runs on a side stream, overlapped
   with step 3, as DeepSeek-V4's decode does; off, it runs on the main stream first.
3. main stream: `k` is dropped (the bug: without `record_stream`, the caching allocator may hand its
   block to the next main-stream allocation while the side stream still reads it), then the MoE block:
   a fixed-size dispatch workspace (EXPERTS x capacity int32, zeroed: the same bytes whatever B is),
   router logits and top-2 experts, per-expert counts into the workspace, and an MLP.

Nothing here decides an outcome. Whether the workspace lands on k's freed block, and on which of its
rows, is the caching allocator's choice (what it did on an H200 is noted at WORKSPACE_BYTES); whether
the side stream has read k before the zeroing kernel overwrites it is the GPU's scheduling.
`DecodeStep.step` compares every row's indices with a serialized reference (the same ops, one stream,
after the step) and reports which rows disagree.

CUDA graphs: `capture(sizes)` records one graph per batch bucket, largest first, into one shared memory
pool, as SGLang's CudaGraphRunner does. A batch above the largest bucket runs eager.

All calls must come from one thread (CUDA's current stream is per thread); the engine runs them on a
dedicated worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HIDDEN = 1024
INDEX_DIM = 512  # a bf16 index-key row is 1 KiB, an fp8 one 512 B
KEYS = 16384  # index-key cache entries the indexer scores
TOP_K = 256
EXPERTS = 64
EXPERT_TOP = 2
FFN = 2048
# The MoE dispatch workspace: EXPERTS x 8 int32 slots, 2 KiB whatever the batch. What the allocator
# makes of it was measured, not designed (orchestrator.gpu.probe on an H200, torch 2.11, sweep of 8-32 KiB
# in reports/gpu_race/probe_workspace_sweep.txt):
# the workspace starts at k's address in every bf16 bucket (the freed block coalesces with free space
# after it), so it overwrites the first workspace/1 KiB rows; with fp8 keys the bf16 projection freed
# just before k sits first, and k's rows are hit only while B x 1 KiB < workspace (bucket 1 here).
WORKSPACE_BYTES = 2 * 1024


@dataclass(frozen=True)
class StepConfig:
    bf16_keys: bool  # SGLANG_DSV4_BF16_INDEX_K
    multi_stream: bool  # SGLANG_OPT_USE_MULTI_STREAM_OVERLAP
    record_stream: bool  # the fix: k.record_stream(side) before dropping k
    workspace_bytes: int = WORKSPACE_BYTES


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor  # the graph's static input
    indices: torch.Tensor  # the graph's indexer output


class DecodeStep:
    def __init__(self, config: StepConfig, seed: int, device: str = "cuda"):
        if config.workspace_bytes % (4 * EXPERTS):
            raise ValueError(f"workspace_bytes must be a multiple of {4 * EXPERTS}")
        self.config = config
        self.device = torch.device(device)
        g = torch.Generator(device=self.device).manual_seed(seed)
        bf16 = torch.bfloat16

        def weight(rows: int, cols: int, scale: float) -> torch.Tensor:
            return torch.randn(rows, cols, device=self.device, dtype=bf16, generator=g) * scale

        self.w_index = weight(HIDDEN, INDEX_DIM, HIDDEN**-0.5)
        self.index_keys = weight(KEYS, INDEX_DIM, 1.0)
        self.w_router = weight(HIDDEN, EXPERTS, HIDDEN**-0.5)
        self.w1 = weight(HIDDEN, FFN, HIDDEN**-0.5)
        self.w2 = weight(FFN, HIDDEN, FFN**-0.5)
        self.inputs = torch.Generator(device=self.device).manual_seed(seed + 1)
        self.side = torch.cuda.Stream(self.device) if config.multi_stream else None
        self.graphs: dict[int, Captured] = {}

    # --- the step ----------------------------------------------------------------------------------

    def _index_key(self, x: torch.Tensor) -> torch.Tensor:
        k = x @ self.w_index
        return k if self.config.bf16_keys else k.to(torch.float8_e4m3fn)

    def _indexer(self, k: torch.Tensor) -> torch.Tensor:
        keys = k if k.dtype == torch.bfloat16 else k.to(torch.bfloat16)
        return (keys @ self.index_keys.T).topk(TOP_K, dim=-1).indices

    def _moe(self, x: torch.Tensor) -> torch.Tensor:
        dispatch = torch.zeros(self.config.workspace_bytes // 4, dtype=torch.int32, device=x.device)
        experts = (x @ self.w_router).topk(EXPERT_TOP, dim=-1).indices.flatten()
        stride = dispatch.numel() // EXPERTS
        dispatch.index_add_(0, experts * stride, torch.ones_like(experts, dtype=torch.int32))
        return x + torch.relu(x @ self.w1) @ self.w2 + dispatch[:1].to(x.dtype) * 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The indexer's top-k indices [B, TOP_K] of one step (the MoE output is the step's other work)."""
        k = self._index_key(x)
        if self.side is None:
            indices = self._indexer(k)
            del k
            self._moe(x)
            return indices
        main = torch.cuda.current_stream(self.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            indices = self._indexer(k)
        if self.config.record_stream:
            k.record_stream(self.side)
        del k  # freed on the main stream while the side stream may still be reading it
        self._moe(x)
        main.wait_stream(self.side)
        return indices

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same indices computed serially on the main stream, after everything before it."""
        return self._indexer(self._index_key(x))

    # --- graphs ------------------------------------------------------------------------------------

    def capture(self, sizes: list[int]) -> None:
        """One graph per batch bucket, largest first, in one shared pool (as SGLang captures)."""
        pool = torch.cuda.graph_pool_handle()
        main = torch.cuda.current_stream(self.device)
        for size in sorted(set(sizes), reverse=True):
            x = torch.zeros(size, HIDDEN, device=self.device, dtype=torch.bfloat16)
            warm = torch.cuda.Stream(self.device)
            warm.wait_stream(main)
            with torch.cuda.stream(warm):
                for _ in range(2):
                    self.forward(x)
            main.wait_stream(warm)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                indices = self.forward(x)
            self.graphs[size] = Captured(graph, x, indices)
        torch.cuda.synchronize(self.device)

    def step(self, batch: int, bucket: int | None) -> list[bool]:
        """Run one decode step for `batch` rows: replay `bucket`'s graph (its padding rows are
        computed and ignored) or, with bucket None, run eager. Returns, per real row, whether its
        indices disagree with the serialized reference."""
        if bucket is None:
            x = torch.randn(batch, HIDDEN, device=self.device, dtype=torch.bfloat16, generator=self.inputs)
            indices = self.forward(x)
        else:
            captured = self.graphs[bucket]
            x = captured.x
            x.normal_(generator=self.inputs)
            captured.graph.replay()
            indices = captured.indices
        expected = self.reference(x)
        differs = (indices.sort(dim=-1).values != expected.sort(dim=-1).values).any(dim=-1)
        return differs[:batch].tolist()


def device_facts() -> dict[str, str]:
    """GPU, driver, torch and CUDA versions, for the report's provenance."""
    facts = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts["gpu"] = props.name
        facts["gpu_memory_gib"] = f"{props.total_memory / 2**30:.0f}"
        facts["compute_capability"] = f"{props.major}.{props.minor}"
        try:
            import pynvml  # nvidia-ml-py, where installed

            pynvml.nvmlInit()
            facts["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception as e:  # the driver version is provenance, not a requirement
            facts["driver"] = f"unknown ({type(e).__name__})"
    return facts
