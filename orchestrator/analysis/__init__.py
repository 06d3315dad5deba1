"""Study analysis (pure): tracked runs -> arms -> verdicts per hypothesis -> the report's facts.

The logic is in `study` (`analyse`, and the questions it asks: arms, hypotheses, throughput, the fix to
deploy, the headline); this package re-exports the names its callers use. See `study`'s module doc for
the method, and `result` for the typed result it returns.
"""

from orchestrator.analysis.runs import LevelSample, RunRecord, run_used
from orchestrator.analysis.study import (
    VERDICTS,
    HypothesisSpec,
    StudySpec,
    analyse,
)
from orchestrator.config.plan import BASELINE_LABEL, arm_label

__all__ = [
    "BASELINE_LABEL",
    "VERDICTS",
    "HypothesisSpec",
    "LevelSample",
    "RunRecord",
    "StudySpec",
    "analyse",
    "arm_label",
    "run_used",
]
