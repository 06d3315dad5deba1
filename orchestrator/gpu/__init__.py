"""A GPU decode engine for the test target: the sim server's surface, real torch work per decode step.

`HEISENHUNT_DECODE_ENGINE=orchestrator.gpu.engine:GpuDecodeEngine` on the decode role of
`python -m orchestrator.sim.server` (conf/deployment/gpu_dsv4.yaml) replaces the simulated decode's
fault model by a real race: CUDA graphs per batch bucket, an indexer on a side stream, a tensor freed
on the main stream without `record_stream` (kernel.py). Corruption is whatever the GPU does.
"""
