"""The embedded default target: a simulated SGLang prefill/decode deployment (a test target, not SGLang).

`python -m orchestrator.sim.server ...` starts one role with SGLang's flags and env; the real
`sglang-router` fronts the pair. Its behaviour comes from a fault model (faults.py, format in
docs/fault-model.md). The orchestrator treats it as any SGLang cluster; its preflight may validate a
fault-model file with `load_fault_model(path)` (raises `FaultModelError`, a ValueError).
"""

from orchestrator.sim.faults import FaultModel, FaultModelError, load_fault_model, validate_fault_model

__all__ = ["FaultModel", "FaultModelError", "load_fault_model", "validate_fault_model"]
