"""The differential oracle's judgement, pure: a turn under load against the same start's batch-1 reference.

What is compared (`compare`, documented in docs/symptoms.md):
- `auto` (the default): the generated tokens, as the server's logprobs name them, where both turns carry
  them for every token they generated (the usage block's completion_tokens, where the server sends one);
  else the text;
- `text`: the text always. The text of a turn is its content, then each tool call's name and arguments
  (never the call's id: a server draws a fresh one per response), compared word by word (a word with the
  whitespace before it), so a position reads in words.
The match is exact: one differing token is a divergence. The first differing position is recorded with
both tokens there ("" past the end of the shorter output).

A divergence within the first `early_tokens` positions of a turn is `diverged_early` (the outputs part at
once: a different first choice, a wrong prefix), later `diverged`; the two are families of their own
(detect.FAMILIES), counted apart as the tool-call families are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from orchestrator.workload.detect import Finding
from orchestrator.workload.results import StreamedTurn

COMPARE = ("auto", "text")
_WORD_RE = re.compile(r"\s*\S+|\s+$")
# what an artifact keeps of one output (the rest is cut, and says so)
MAX_KEPT_CHARS = 16_000


@dataclass(frozen=True)
class Difference:
    """Where a turn under load first parts from its reference."""

    position: int  # the first differing token (or word), from 0
    basis: str  # "tokens" | "text"
    reference: str  # the reference's token there ("" past its end)
    under_load: str  # the turn under load's token there

    def finding(self, early_tokens: int, round_index: int) -> Finding:
        detector = "diverged_early" if self.position < early_tokens else "diverged"
        unit = "token" if self.basis == "tokens" else "word"
        return Finding(
            detector,
            f"turn {round_index}: first difference at {unit} {self.position}: reference "
            f"{self.reference[:60]!r}, under load {self.under_load[:60]!r}",
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "basis": self.basis,
            "reference": self.reference,
            "under_load": self.under_load,
        }


def turn_text(turn: StreamedTurn) -> str:
    """The output compared on the text basis: content, then each call's name and arguments."""
    parts = [turn.content, *(f"\n[{c.name}] {c.arguments}" for c in turn.tool_calls)]
    return "".join(parts)


def words(text: str) -> list[str]:
    """Lossless: `''.join(words(t)) == t`."""
    return _WORD_RE.findall(text)


def complete_tokens(turn: StreamedTurn) -> list[str] | None:
    """The turn's tokens when its logprobs cover all it generated (per its usage, where sent), else None."""
    tokens = turn.tokens
    if tokens is None:
        return None
    generated = (turn.usage or {}).get("completion_tokens")
    return tokens if generated is None or generated == len(tokens) else None


def units(
    reference: StreamedTurn, under_load: StreamedTurn, compare: str
) -> tuple[str, list[str], list[str]]:
    """(basis, the reference's units, the turn under load's): tokens where both have them all, else words."""
    if compare == "auto":
        ref_tokens, load_tokens = complete_tokens(reference), complete_tokens(under_load)
        if ref_tokens is not None and load_tokens is not None:
            return "tokens", ref_tokens, load_tokens
    return "text", words(turn_text(reference)), words(turn_text(under_load))


def first_difference(
    reference: StreamedTurn, under_load: StreamedTurn, compare: str = "auto"
) -> Difference | None:
    """Where `under_load` first differs from `reference`, or None when they are the same."""
    basis, ref, load = units(reference, under_load, compare)
    for i, (a, b) in enumerate(zip(ref, load, strict=False)):
        if a != b:
            return Difference(i, basis, a, b)
    if len(ref) == len(load):
        return None
    at = min(len(ref), len(load))
    return Difference(at, basis, ref[at] if at < len(ref) else "", load[at] if at < len(load) else "")


def kept(text: str) -> str:
    """An output as an artifact keeps it: whole up to MAX_KEPT_CHARS, else cut with a note."""
    if len(text) <= MAX_KEPT_CHARS:
        return text
    return text[:MAX_KEPT_CHARS] + f"\n[... {len(text) - MAX_KEPT_CHARS} more characters not kept]"


def output_record(turn: StreamedTurn) -> dict[str, Any]:
    """One output of a divergence artifact, bounded: its text, its tokens where sent, how it ended."""
    tokens = turn.tokens
    return {
        "text": kept(turn_text(turn)),
        "tokens": tokens[:4000] if tokens is not None else None,
        "finish_reason": turn.finish_reason,
        "completion_tokens": turn.completion_tokens,
    }
