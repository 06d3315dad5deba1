"""MLflow's own UI, as a user meets it: a real `mlflow server` on loopback over a sqlite store under tmp_path,
driven by a real headless Chromium (Debian's `chromium`, through Playwright; never a downloaded browser).

What must be true on the first screen (1280x800, no scrolling) of
- the compare view of two arm runs: both factor levels and both corruption rates;
- the experiment's arms view (tracking.arms_view_url): both run names, whole.

`HEISENHUNT_WRITE_DOCS=1 python -m pytest tests/test_mlflow_ui.py` also writes docs/mlflow-compare.png.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient

from orchestrator.config.load import CONF_DIR
from orchestrator.tracking.layout import NOTE_TAG
from orchestrator.tracking.write import ArmTracker, arms_view_url, end_study_run, start_study_run
from orchestrator.workload.results import StressSummary
from tests.conftest import free_port, job_and_plan, local_cluster_overrides, seed_mlflow_store

# one worker runs the module (--dist loadgroup): one MLflow server and one Chromium for its tests
pytestmark = pytest.mark.xdist_group("mlflow_ui")

CHROMIUM = Path("/usr/bin/chromium")
DOCS_SCREENSHOT = Path(__file__).resolve().parents[1] / "docs" / "mlflow-compare.png"
VIEWPORT = {"width": 1280, "height": 800}
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# baseline 9/60 corrupted, multi_stream=off 1/60: the chart labels the rates 0.15000 and 0.01667, the
# runs table shows 0.15 and 0.01667
ARMS = {(): (9, 51), ("factor/multi_stream=off",): (1, 59)}

no_chromium = pytest.mark.skipif(not CHROMIUM.is_file(), reason="needs Debian's chromium (/usr/bin/chromium)")
no_playwright = pytest.mark.skipif(
    importlib.util.find_spec("playwright") is None, reason="needs playwright (pip install -e '.[test]')"
)

# Text nodes equal to each wanted string that are wholly visible: inside the viewport and inside every
# clipping ancestor (a scrolled pane, a cell cut with an ellipsis), none of them hidden.
FULLY_VISIBLE_JS = """
(texts) => {
  const out = Object.fromEntries(texts.map((t) => [t, 0]));
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  while (walker.nextNode()) {
    const node = walker.currentNode, text = node.textContent.trim();
    if (!Object.prototype.hasOwnProperty.call(out, text)) continue;
    const range = document.createRange();
    range.selectNodeContents(node);
    const r = range.getBoundingClientRect();
    if (!(r.width > 0 && r.height > 0)) continue;
    let box = {left: 0, top: 0, right: window.innerWidth, bottom: window.innerHeight}, shown = true;
    for (let el = node.parentElement; el && shown; el = el.parentElement) {
      const st = getComputedStyle(el);
      shown = st.visibility !== "hidden" && st.display !== "none" && st.opacity !== "0";
      if (st.overflowX !== "visible" || st.overflowY !== "visible") {
        const c = el.getBoundingClientRect();
        box = {left: Math.max(box.left, c.left), top: Math.max(box.top, c.top),
               right: Math.min(box.right, c.right), bottom: Math.min(box.bottom, c.bottom)};
      }
    }
    if (shown && r.left >= box.left - 1 && r.top >= box.top - 1 && r.right <= box.right + 1
        && r.bottom <= box.bottom + 1) out[text] += 1;
  }
  return out;
}
"""


def stress(corrupted: int, clean: int) -> StressSummary:
    n = corrupted + clean
    return StressSummary(sessions=n, clean=clean, corrupted=corrupted, errored=0, planned=n)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mlflow_ui")


@pytest.fixture(scope="module")
def study_store(store_dir):
    """A parent run and two arm runs (baseline, multi_stream=off) made by ArmTracker, as a sweep makes
    them: startup logged before the outcome. Returns (tracking uri, experiment id, {run name: run id},
    parent run id). One store (and one server) for the module: the server takes ~15 s to start."""
    base = [
        *local_cluster_overrides(store_dir),
        f"tracking.uri={seed_mlflow_store(store_dir / 'mlflow.db')}",
        f"tracking.artifact_location={store_dir}/artifacts",
        f"report.dir={store_dir}/reports",
        f"hydra.sweep.dir={store_dir}/sweep",
    ]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        jobs = {
            extra: job_and_plan(compose("config", [*base, *extra], return_hydra_config=True))
            for extra in ARMS
        }
    job, _ = jobs[()]
    parent = start_study_run(job.tracking, job.study, store_dir / "2026-12-01_09-30-00", "ofat", [])
    runs = {}
    for extra, (corrupted, clean) in ARMS.items():
        job, plan = jobs[extra]
        with ArmTracker.start(job.tracking, job.study, plan, 0, parent) as tracker:
            tracker.log_startup({"prefill": 1.5, "decode": 2.5, "router": 0.4})
            tracker.log_stress(stress(corrupted, clean), None)
        runs[MlflowClient(job.tracking.uri).get_run(tracker.run_id).info.run_name] = tracker.run_id
    end_study_run(job.tracking.uri, parent, [], headline="multi_stream: implicated")
    exp_id = MlflowClient(job.tracking.uri).get_run(parent).info.experiment_id
    return job.tracking.uri, exp_id, runs, parent


@pytest.fixture(scope="module")
def mlflow_ui(study_store, store_dir) -> Iterator[str]:
    """`mlflow server` on a free loopback port over the study's store; yields its base URL."""
    uri, tmp_path = study_store[0], store_dir
    port = free_port()
    # no job execution: MLflow's server would start huey job consumers (for its GenAI jobs) that polled
    # through ~25 s of CPU in a suite run; the UI needs none of it
    env = os.environ | {
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "true",
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri]
    cmd += ["--default-artifact-root", str(tmp_path / "served"), "--host", "127.0.0.1", "--port", str(port)]
    log = (tmp_path / "mlflow-server.log").open("w")
    server = subprocess.Popen([*cmd, "--workers", "1"], stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not come up: {(tmp_path / 'mlflow-server.log').read_text()}")
            time.sleep(0.5)
        yield base
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


@pytest.fixture
def page(tmp_path):
    """A page of a fresh headless Chromium profile, at 1280x800."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=str(CHROMIUM),
            args=CHROMIUM_ARGS,
            headless=True,
            viewport=VIEWPORT,
        )
        try:
            yield context.new_page()
        finally:
            context.close()


def wait_until_visible(page, texts: list[str], timeout_s: float = 60) -> dict[str, int]:
    """How many fully visible copies of each text the page shows, once it shows every one (or at timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = page.evaluate(FULLY_VISIBLE_JS, texts)
        if all(seen.values()) or time.monotonic() > deadline:
            return seen
        page.wait_for_timeout(500)


@no_chromium
@no_playwright
def test_compare_view_shows_both_levels_and_both_rates_on_the_first_screen(
    study_store, mlflow_ui, page, tmp_path
):
    _, exp_id, runs, _ = study_store
    assert set(runs) == {"baseline #0", "multi_stream=off #0"}  # short and whole
    ids = json.dumps(list(runs.values())).replace(" ", "")
    page.goto(f'{mlflow_ui}/#/compare-runs?runs={ids}&experiments=["{exp_id}"]&workflowType=machine_learning')
    wanted = ["on", "off", "0.15000", "0.01667", "arm.rate", "factor.multi_stream"]
    seen = wait_until_visible(page, wanted)
    page.screenshot(path=str(tmp_path / "mlflow-compare.png"))
    if os.environ.get("HEISENHUNT_WRITE_DOCS"):
        shutil.copyfile(tmp_path / "mlflow-compare.png", DOCS_SCREENSHOT)
    assert all(seen.values()), f"not on the first screen: {[t for t, n in seen.items() if not n]}"


@no_chromium
@no_playwright
def test_arms_view_lists_each_arm_run_whole_with_its_rate(study_store, mlflow_ui, page):
    _, exp_id, runs, _ = study_store
    page.goto(arms_view_url(mlflow_ui, exp_id))
    seen = wait_until_visible(page, [*runs, "arm.rate", "0.15", "0.01667"])
    assert all(seen.values()), f"not on the first screen: {[t for t, n in seen.items() if not n]}"


def test_the_parent_runs_description_leads_with_the_report_headline(study_store):
    uri, _, _, parent = study_store
    note = MlflowClient(uri).get_run(parent).data.tags[NOTE_TAG]
    assert note.startswith("multi_stream: implicated\n\n") and len(note) > len("multi_stream: implicated\n\n")
