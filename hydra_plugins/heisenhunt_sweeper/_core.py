"""The study sweeper's logic, pure: designs as lists of jobs, and problems collapsed across jobs.

A job is a list of `key=value` override strings. Nothing here needs Hydra running: the plugin class
(study_sweeper.py) parses the command line into `choices` and hands them in.
"""

import itertools
from collections import OrderedDict

from hydra.errors import HydraException

FACTOR_PREFIX = "factor/"
JOB_SEP = "\x00"  # between a problem and the overrides of the job it was found in
DESIGNS = ("factorial", "ofat", "sequential", "ddmin")


def _value(assignment: str) -> str:
    return assignment.split("=", 1)[1]


def ofat_jobs(choices: "OrderedDict[str, list[str]]", baseline: dict[str, str]) -> list[list[str]]:
    """Baseline plus one-factor-at-a-time deviations, times the product of the non-factor keys.
    `choices`: key -> its values as `key=value` strings, in command-line order."""
    # a factor pinned to one level (e.g. on the command line) is a constant of the sweep, not an arm
    factor_keys = [k for k in choices if k.lstrip("+~").startswith(FACTOR_PREFIX) and len(choices[k]) > 1]
    other_keys = [k for k in choices if k not in factor_keys]
    base: dict[str, str] = {}
    for key in factor_keys:
        name = key.lstrip("+~")[len(FACTOR_PREFIX) :]
        levels = [_value(a) for a in choices[key]]
        wanted = baseline.get(name)
        if wanted is None:
            raise HydraException(
                f"design=ofat sweeps {key} over {levels} but study.baseline.{name} is not set; "
                f"set it to one of {levels}"
            )
        wanted = str(wanted)
        if wanted not in levels:
            raise HydraException(
                f"study.baseline.{name}={wanted!r} is not among the swept levels {levels} of {key}"
            )
        base[key] = f"{key}={wanted}"
    arms = [dict(base)]
    for key in factor_keys:
        for assignment in choices[key]:
            if assignment != base[key]:
                arms.append({**base, key: assignment})
    jobs = []
    for arm in arms:
        for rest in itertools.product(*(choices[k] for k in other_keys)):
            jobs.append(list(arm.values()) + list(rest))
    return jobs


def _key(assignment: str) -> str:
    return assignment.split("=", 1)[0].lstrip("+~")


def arm_overrides(job: "list[str]") -> "tuple[str, ...]":
    """A job's overrides without its `repetition`: the same for every repetition of one arm."""
    return tuple(a for a in job if _key(a) != "repetition")


def job_repetition(job: "list[str]", default: int) -> int:
    """The repetition a job runs (its `repetition=` override, else the config's)."""
    values = [_value(a) for a in job if _key(a) == "repetition" and _value(a).isdigit()]
    return int(values[-1]) if values else default


def repetition_problems(job: "list[str]") -> "list[str]":
    """A repetition must be a whole number >= 0 (it seeds the workload and names the run)."""
    values = [_value(a) for a in job if _key(a) == "repetition"]
    return [f"repetition: {v!r} is not a whole number >= 0" for v in values if not v.isdigit()]


def batches(jobs: list[list[str]], max_batch_size: "int | None") -> list[list[list[str]]]:
    size = max_batch_size or len(jobs) or 1
    return [jobs[i : i + size] for i in range(0, len(jobs), size)]


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


def job_levels(job: "list[str]") -> "dict[str, str]":
    """The factor levels a job's overrides choose (`factor/<name>=<level>`)."""
    return {_key(a)[len(FACTOR_PREFIX) :]: _value(a) for a in job if _key(a).startswith(FACTOR_PREFIX)}


def round_jobs(
    arms: "dict[str, list[str]]", labels: "list[str]", repetition: int, bench: "set[str]", bench_on: bool
) -> "list[list[str]]":
    """One sequential round: each arm's overrides at this repetition, the throughput sweep on the arms
    chosen for it (and only those: `bench.repetitions=null` lets `bench.enabled` alone decide)."""
    return [
        [
            *arms[label],
            f"repetition={repetition}",
            f"bench.enabled={str(bench_on and label in bench).lower()}",
            "bench.repetitions=null",
        ]
        for label in labels
    ]


def ddmin_job(base: "list[str]", subset: "list[str]", repetition: int, bench: bool) -> "list[str]":
    """One job of a ddmin study: the good configuration's overrides, the differences it applies, its
    repetition, and the throughput sweep only where the search wants it."""
    return [
        *base,
        f"ddmin_subset=[{','.join(subset)}]",
        f"repetition={repetition}",
        f"bench.enabled={str(bench).lower()}",
        "bench.repetitions=null",
    ]


def ddmin_base(choices: "OrderedDict[str, list[str]]") -> "list[str]":
    """The overrides every ddmin job shares: the command line's, each with one value. A ddmin study
    searches its differences; a swept key (a factor over several levels) is refused."""
    swept = [k for k, v in choices.items() if len(v) > 1 and k.lstrip("+~") != "repetition"]
    if swept:
        raise HydraException(
            f"design=ddmin searches study.ddmin.differences; it sweeps nothing else, but {swept} "
            f"have several values: give each one value (the good configuration's)"
        )
    return [v[-1] for k, v in choices.items() if k.lstrip("+~") not in ("repetition", "ddmin_subset")]
