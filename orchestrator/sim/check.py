"""`python -m orchestrator.sim.check`: check the fault model a sim server would load with this env.

The sim deployment's preflight (conf/deployment/sim_dsv4.yaml), run on the host with the role's env
before any restart: prints what would load, or the FaultModelError naming the file, the bad key and
what is accepted, and exits 2 (as the server itself would, but before anything was stopped).
"""

from __future__ import annotations

import os
import sys

# not from server.py: this runs before every arm, and the server's imports (aiohttp) cost more than the check
from orchestrator.sim.faults import FAULT_MODEL_ENV, FaultModelError, load_fault_model


def main() -> int:
    path = os.environ.get(FAULT_MODEL_ENV) or None
    try:
        model = load_fault_model(path)
    except FaultModelError as e:
        print(f"invalid fault model: {e}", file=sys.stderr)
        return 2
    print(f"fault model {model.name!r} from {path or 'the built-in file'}: {len(model.rules)} rule(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
