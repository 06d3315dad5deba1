"""Settings filled by field name: the one mapping from a job's config section or the CLI's arguments to
the workload's settings (stress.stress_settings, bench.bench_config).

A source names its values as the settings do (a config schema's dataclass, an argparse Namespace whose
dests are the field names), so a new setting is added in one place and flows through every caller; only
the values a caller computes are given explicitly. workload imports nothing of the config: the names
are the contract (tests/test_settings_mapping.py holds both sides to it).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, TypeVar

T = TypeVar("T")


def fill(cls: type[T], source: object, **given: Any) -> T:
    """An instance of the dataclass `cls`: each field as `given`, else `source`'s attribute of that name,
    else the field's default. Attributes of `source` that are no field of `cls` are not read."""
    names = [f.name for f in fields(cls) if f.init]  # type: ignore[arg-type]
    taken = {name: getattr(source, name) for name in names if name not in given and hasattr(source, name)}
    return cls(**taken, **given)
