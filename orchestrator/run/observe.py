"""Facts parsed from SGLang server logs (pure): readiness, captured vs eager decode batches, PD failures.

Matches the log shapes of sglang 0.5.9 through 0.5.23 (see shared SGLANG.md), tolerantly: lines are
prefixed with `[date time DPx TPy]`, and "Decode batch" has been printed with and without a comma.
"""

from __future__ import annotations

import re

from orchestrator.workload.results import LogFacts

READY = re.compile(r"The server is fired up and ready to roll!")
CAPTURE = re.compile(r"Capture (target decode CUDA graph|cuda graph) begin", re.IGNORECASE)
DECODE_BATCH = re.compile(r"Decode batch\b.*?cuda graph:\s*(True|False)")
BOOTSTRAP_FAILURE = re.compile(
    r"Decode handshake failed|Prefill bootstrap failed|timed out after .*KVPoll\.Bootstrapping"
    r"|Lost connection with prefill instance|bootstrap_room mismatch"
)


def parse_decode_log(text: str) -> LogFacts:
    facts = LogFacts()
    for line in text.splitlines():
        if READY.search(line):
            facts.ready = True
        elif CAPTURE.search(line):
            facts.graph_capture_seen = True
        elif batch := DECODE_BATCH.search(line):
            if batch.group(1) == "True":
                facts.capture_batches += 1
            else:
                facts.eager_batches += 1
        elif BOOTSTRAP_FAILURE.search(line):
            facts.bootstrap_failures += 1
    return facts
