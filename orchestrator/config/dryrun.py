"""`dry_run=true` (pure): every arm of a sweep with the exact launch of each role, secrets redacted.

Printed by the sweeper after every job is composed, typed and planned, instead of launching anything:
no host is contacted, no server started, no MLflow run opened.
"""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.config.plan import ArmPlan, arm_label
from orchestrator.config.redact import redact_env, redact_text
from orchestrator.config.schema import ROLES
from orchestrator.config.shell import command_line


def arm_listing(
    planned: Sequence[tuple[str, ArmPlan]], baseline: dict[str, str], study: str, design: str
) -> str:
    """The dry run's text: one block per distinct arm (its jobs' repetitions folded), then a count."""
    arms: dict[str, list[tuple[str, ArmPlan]]] = {}
    for job, plan in planned:
        arms.setdefault(plan.signature, []).append((job, plan))
    lines = [f"dry run of study {study} (design {design}): nothing is started, no host is contacted", ""]
    for signature, jobs in arms.items():
        plan = jobs[0][1]
        lines.append(f"arm {arm_label(plan.factors, baseline)} (signature {signature}, {len(jobs)} job(s))")
        levels = ", ".join(f"{k}={v}" for k, v in sorted(plan.factors.items()))
        lines.append(f"  factor levels: {levels}")
        for role in ROLES:
            rp = plan.roles[role]
            line = command_line(rp.argv, redact_env(rp.env))
            lines.append(f"  # {role} on {rp.host.address} ({rp.host.transport})")
            lines.append(f"  {redact_text(line, plan.secrets)}")
        lines.append("")
    lines.append(f"{len(arms)} arm(s), {len(planned)} job(s)")
    return "\n".join(lines)
