"""Ad-hoc studies (pure): a sweep typed on the command line, without `+experiment=`, is its own study.

`python -m orchestrator -m factor/multi_stream=on,off factor/capture=graph,eager` must not land in the
default `quick` study (one hypothesis, its report folder, its earlier runs): it gets a study named after
the swept factors, the primary config's levels as baseline, and one hypothesis per swept factor (one per
level other than the baseline's). The study callback (for the parent run) and the sweeper (for every
job) derive it with these same functions, from the same command line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from orchestrator.config.schema import Hypothesis, StudyConf

FACTOR_PREFIX = "factor/"


def swept_factors(choices: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """{factor: [levels]} of the command line's `factor/<name>=a,b` sweeps (`choices`: key -> values)."""
    out = {}
    for key, values in choices.items():
        name = key.lstrip("+~")
        if name.startswith(FACTOR_PREFIX) and len(values) > 1:
            out[name[len(FACTOR_PREFIX) :]] = [str(v) for v in values]
    return out


def adhoc_study(
    swept: Mapping[str, Sequence[str]],
    default_levels: Mapping[str, str],
    name: str | None = None,
    command_line: str = "",
) -> StudyConf | None:
    """The study of a command-line sweep over `swept` factors (None when no factor is swept)."""
    if not swept:
        return None
    baseline = {str(k): str(v) for k, v in default_levels.items()}
    hypotheses = []
    for factor, levels in swept.items():
        base = baseline.get(factor) if baseline.get(factor) in levels else levels[0]
        baseline[factor] = base
        treatments = [level for level in levels if level != base]
        for level in treatments:
            hypotheses.append(
                Hypothesis(
                    id=f"H-{factor}" if len(treatments) == 1 else f"H-{factor}-{level}",
                    factor=factor,
                    statement=f"Corruption changes with {factor} ({base} to {level}).",
                    baseline=base,
                    treatment=level,
                )
            )
    return StudyConf(
        name=name or "sweep-" + "-".join(sorted(swept)),
        description=f"Ad-hoc sweep from the command line: {command_line}".strip(),
        baseline=baseline,
        hypotheses=hypotheses,
    )


def _quoted(value: str) -> str:
    """A Hydra override string value, quoted (the grammar's single-quoted string, quotes escaped)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def study_overrides(study: StudyConf) -> list[str]:
    """Overrides that make every job of the sweep run under `study`."""
    baseline = ",".join(f"{k}:{_quoted(v)}" for k, v in sorted(study.baseline.items()))
    hypotheses = ",".join(
        "{"
        + ",".join(
            f"{key}:{_quoted(getattr(h, key))}"
            for key in ("id", "factor", "statement", "baseline", "treatment")
        )
        + "}"
        for h in study.hypotheses
    )
    return [
        f"study.name={_quoted(study.name)}",
        f"study.description={_quoted(study.description)}",
        f"study.baseline={{{baseline}}}",
        f"study.hypotheses=[{hypotheses}]",
    ]
