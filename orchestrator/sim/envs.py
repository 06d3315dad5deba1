"""The `SGLANG_*` environment variables the simulated server reads, parsed the way SGLang parses them.

SGLang's `EnvBool` lower-cases the value and accepts true/1/yes/y and false/0/no/n; anything else (the
empty string too) logs a warning and keeps the default. `EnvInt`/`EnvFloat` keep the default when the
value does not parse. Only the variables listed in `ENV_VARS` are read: they are also the only `env.*`
keys a fault model may put in a rule's conditions.

`READ_NAMES` is the sim's env registry for the preflight (`env_registry` of the sim deployments): the
names above, and every name real sglang reads (`SGLANG_ENV_NAMES`, written from the sglang 0.5.23 package
into sglang_env_names.txt and checked against it in CI), which the sim accepts without modelling them. A
name in neither is refused before a start, as on a real host.

Pure: `effective_env(environ)` returns the values and the warnings; the caller logs the warnings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_TRUE = {"true", "1", "yes", "y"}
_FALSE = {"false", "0", "no", "n"}


@dataclass(frozen=True)
class EnvSpec:
    kind: type  # bool, int or float
    default: Any
    doc: str


ENV_VARS: dict[str, EnvSpec] = {
    # DeepSeek-V4: keep the sparse-attention index keys in bf16 (else fp8). Default assumed off (fp8).
    "SGLANG_DSV4_BF16_INDEX_K": EnvSpec(bool, False, "index keys in bf16 (else fp8)"),
    # DeepSeek-V4: overlap work on a second CUDA stream; only runs inside captured graphs.
    "SGLANG_OPT_USE_MULTI_STREAM_OVERLAP": EnvSpec(bool, True, "multi-stream overlap in captured graphs"),
    # PD hand-off timeouts (seconds, modelled time: multiplied by the sim's time scale).
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": EnvSpec(int, 300, "decode: handshake with the prefill, s"),
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": EnvSpec(int, 300, "decode: KV arrival after handshake, s"),
    "SGLANG_HEALTH_CHECK_TIMEOUT": EnvSpec(int, 20, "/health: 1-token generate must finish within, s"),
    # /server_info includes the process's SGLANG_* environment when set.
    "SGLANG_EXPOSE_OWN_ENV_VARS": EnvSpec(bool, False, "expose own env in /server_info"),
}


SGLANG_ENV_NAMES_FILE = Path(__file__).with_name("sglang_env_names.txt")


def read_names_file(path: Path) -> frozenset[str]:
    """The names in a snapshot file (one per line, `#` comments)."""
    lines = path.read_text().splitlines()
    return frozenset(line.strip() for line in lines if line.strip() and not line.startswith("#"))


SGLANG_ENV_NAMES = read_names_file(SGLANG_ENV_NAMES_FILE)
READ_NAMES = frozenset(ENV_VARS) | SGLANG_ENV_NAMES


def parse_env_bool(raw: str | None, default: bool) -> tuple[bool, str | None]:
    """SGLang's EnvBool: (value, warning or None)."""
    if raw is None:
        return default, None
    value = raw.strip().lower()
    if value in _TRUE:
        return True, None
    if value in _FALSE:
        return False, None
    return (
        default,
        f"invalid boolean value {raw!r}; expected one of true/1/yes/y/false/0/no/n; using default {default}",
    )


def parse_env_value(name: str, raw: str | None) -> tuple[Any, str | None]:
    """Parse one known variable: (value, warning or None). Unset gives the default."""
    spec = ENV_VARS[name]
    if spec.kind is bool:
        value, warning = parse_env_bool(raw, spec.default)
    elif raw is None:
        return spec.default, None
    else:
        try:
            value, warning = spec.kind(raw.strip()), None
        except ValueError:
            value = spec.default
            warning = f"invalid {spec.kind.__name__} value {raw!r}; using default {spec.default}"
    return value, (f"{name}: {warning}" if warning else None)


def effective_env(environ: Mapping[str, str]) -> tuple[dict[str, Any], list[str]]:
    """The parsed value of every known variable, and one warning per value that did not parse."""
    values: dict[str, Any] = {}
    warnings: list[str] = []
    for name in ENV_VARS:
        values[name], warning = parse_env_value(name, environ.get(name))
        if warning:
            warnings.append(warning)
    return values, warnings
