"""The study sweeper's own logic, pure: a job's checks, and problems collapsed across jobs. The designs
(which jobs run, round by round) are orchestrator/study/designs.py, which the rehearsal drives too.

A job is a list of `key=value` override strings.
"""

from orchestrator.study.designs import key_of, value_of

JOB_SEP = "\x00"  # between a problem and the overrides of the job it was found in


def arm_overrides(job: "list[str]") -> "tuple[str, ...]":
    """A job's overrides without its `repetition`: the same for every repetition of one arm."""
    return tuple(a for a in job if key_of(a) != "repetition")


def repetition_problems(job: "list[str]") -> "list[str]":
    """A repetition must be a whole number >= 0 (it seeds the workload and names the run)."""
    values = [value_of(a) for a in job if key_of(a) == "repetition"]
    return [f"repetition: {v!r} is not a whole number >= 0" for v in values if not v.isdigit()]


def collapse(problems: list[str], jobs: int) -> list[str]:
    """One line per distinct problem, saying which jobs have it (most sweeps repeat one mistake)."""
    where: dict[str, list[str]] = {}
    for problem in problems:
        message, _, job = problem.partition(JOB_SEP)
        where.setdefault(message, [])
        if job and job not in where[message]:
            where[message].append(job)
    lines = []
    for message, found in where.items():
        if not found or len(found) == jobs:
            lines.append(message if not found or jobs == 1 else f"{message} (every job)")
        else:
            lines.append(f"{message} (in {len(found)} of {jobs} jobs, e.g. [{found[0]}])")
    return sorted(lines)
