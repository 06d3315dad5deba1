"""Shell words (pure): the one place env vars and argv become a POSIX shell line.

Remote commands, detached server launches and the report's "configuration to deploy" all print the same
`env NAME=value ... argv` shape, every word quoted with `shlex`, env names checked against one pattern.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence

ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


def env_assignments(env: Mapping[str, str]) -> list[str]:
    """`NAME=value` words for `env`, names validated, every value shell-quoted."""
    words = []
    for name, value in env.items():
        if not ENV_NAME.match(name):
            raise ValueError(f"invalid environment variable name {name!r}: must match {ENV_NAME.pattern}")
        words.append(f"{name}={shlex.quote(str(value))}")
    return words


def command_line(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """`env NAME=value ... argv` (or the bare argv when there is no env), ready for `sh -c`."""
    quoted = shlex.join(argv)
    assignments = " ".join(env_assignments(dict(sorted((env or {}).items()))))
    return f"env {assignments} {quoted}" if assignments else quoted
