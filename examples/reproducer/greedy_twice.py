"""A tiny differential reproducer: each session asks one greedy question twice; two answers that differ
are corrupted (a healthy server at temperature 0 answers alike). docs/reproducer.md shows both uses:
workload.call._target_=examples.reproducer.greedy_twice.check_session, or
workload.command=[python,examples/reproducer/greedy_twice.py] (one JSON line per session on stdout)."""

import json
import os
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed


def ask(url, model, prompt, timeout):
    messages = [{"role": "user", "content": prompt}]
    body = json.dumps({"model": model, "messages": messages, "max_tokens": 32, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)["choices"][0]["message"]["content"]


def check_session(url, session, settings=None):
    model = getattr(settings, "model", os.environ.get("HEISENHUNT_MODEL", "default"))
    prompt = f"In one sentence, what is special about the number {sum(map(ord, session)) % 1000}?"
    try:
        first, second = (ask(url, model, prompt, getattr(settings, "timeout_s", 60)) for _ in range(2))
    except Exception as e:  # a failed request is no verdict on the answers
        return {"outcome": "errored", "detail": repr(e)}
    return {"outcome": "corrupted", "detail": [first, second]} if first != second else "clean"


if __name__ == "__main__":
    env = os.environ
    ids = [f"s{env['HEISENHUNT_SEED']}-{i:05d}" for i in range(int(env["HEISENHUNT_SESSIONS"]))]
    with ThreadPoolExecutor(int(env["HEISENHUNT_CONCURRENCY"])) as pool:
        runs = {pool.submit(check_session, env["HEISENHUNT_URL"], s): s for s in ids}
        for done in as_completed(runs):
            result = done.result()
            outcome = {"outcome": result} if isinstance(result, str) else result
            print(json.dumps({"session": runs[done], **outcome}), flush=True)
