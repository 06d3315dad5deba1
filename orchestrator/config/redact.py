"""Secret redaction: env values whose names look like credentials never reach logs, MLflow or reports."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)
REDACTED = "***"


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


def redact_argv(argv: Sequence[object]) -> list[str]:
    """A copy of `argv` with the value of each secret-looking flag replaced by *** (`--token X` and
    `--token=X` alike): a reproducer's command line is recorded, its credentials never."""
    out: list[str] = []
    for word in map(str, argv):
        flag, eq, _ = word.partition("=")
        if out and out[-1].startswith("-") and "=" not in out[-1] and is_secret_name(out[-1]):
            out.append(REDACTED)
        elif eq and flag.startswith("-") and is_secret_name(flag):
            out.append(f"{flag}={REDACTED}")
        else:
            out.append(word)
    return out


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of `env` with the values of secret-looking names replaced by ***."""
    return {name: (REDACTED if is_secret_name(name) else value) for name, value in env.items()}


def redact_text(text: str, env: Mapping[str, str]) -> str:
    """`text` with every secret value of `env` (at least 4 characters long) replaced by ***."""
    for name, value in env.items():
        if is_secret_name(name) and value and len(str(value)) >= 4:
            text = text.replace(str(value), REDACTED)
    return text
