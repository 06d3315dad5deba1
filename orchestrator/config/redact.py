"""Secret redaction: env values whose names look like credentials never reach logs, MLflow or reports."""

from __future__ import annotations

import re
from collections.abc import Mapping

SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)
REDACTED = "***"


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of `env` with the values of secret-looking names replaced by ***."""
    return {name: (REDACTED if is_secret_name(name) else value) for name, value in env.items()}


def redact_text(text: str, env: Mapping[str, str]) -> str:
    """`text` with every secret value of `env` (at least 4 characters long) replaced by ***."""
    for name, value in env.items():
        if is_secret_name(name) and value and len(str(value)) >= 4:
            text = text.replace(str(value), REDACTED)
    return text
