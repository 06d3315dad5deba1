"""MLflow tracking on a real sqlite store under tmp_path: child runs, statuses, parent hand-off, read-back."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from orchestrator.config.load import load_job
from orchestrator.report.pipeline import StudyCallback, open_parent_run
from orchestrator.tracking.layout import ARMS_VIEW, PARENT_ENV, PARENT_FILE, VIEW_TAG
from orchestrator.tracking.read import finished_runs, load_study, read_launch
from orchestrator.tracking.write import (
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    ArmTracker,
    artifact_location_for,
    parent_run_id,
)
from orchestrator.workload.results import BenchResult, LevelResult, Percentiles, SessionOutcome, StressSummary
from tests.conftest import job_and_plan

SECRET = "hf_s3cretvalue42"


@pytest.fixture
def cfg_for(compose_cfg, tmp_path):
    """cfg_for(*overrides): a job config with MLflow artifacts under tmp_path."""

    def make(*overrides: str):
        return compose_cfg(
            f"tracking.artifact_location={tmp_path}/artifacts",
            f"hydra.sweep.dir={tmp_path}/sweep",
            *overrides,
        )

    return make


def _parent(cfg) -> str | None:
    job = load_job(cfg)
    return parent_run_id(job.parent_run_id, job.sweep_dir)


def client_for(cfg) -> MlflowClient:
    return MlflowClient(tracking_uri=str(cfg.tracking.uri))


def write_stress(
    out: Path, corrupted: int, clean: int, errored: int = 0, planned: int | None = None
) -> StressSummary:
    """Per-session JSONL, summary.json and corrupted transcripts, as the stress run writes them."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "corrupted").mkdir(exist_ok=True)
    lines = []
    for i in range(corrupted + clean + errored):
        status = "corrupted" if i < corrupted else "clean" if i < corrupted + clean else "errored"
        outcome = SessionOutcome(
            session_id=f"s{i}",
            status=status,
            rounds=4,
            rounds_done=4 if status == "clean" else 1,
            error="HTTP 503" if status == "errored" else None,
        )
        lines.append(json.dumps(outcome.to_dict()))
        if status == "corrupted":
            (out / "corrupted" / f"s{i}.json").write_text(json.dumps({"session": f"s{i}", "raw": '{"broken'}))
    (out / "sessions.jsonl").write_text("\n".join(lines) + "\n")
    total = corrupted + clean + errored
    summary = StressSummary(
        sessions=total,
        clean=clean,
        corrupted=corrupted,
        errored=errored,
        planned=planned if planned is not None else total,
        by_detector={"malformed_json": corrupted},
    )
    (out / "summary.json").write_text(json.dumps(vars(summary)))
    return summary


def pct(v: float) -> Percentiles:
    return Percentiles(mean=v, p50=v, p90=v * 1.5, p99=v * 2)


def bench_result(speed: float = 1.0, warn: bool = False, levels=(1, 8)) -> BenchResult:
    out = []
    for c in levels:
        tokens = [64] * (4 * c)
        latency = [(1.0 + 0.01 * i % 3) / speed for i in range(4 * c)]
        out.append(
            LevelResult(
                concurrency=c,
                requests=4 * c,
                errors=0,
                missing_usage=0,
                duration_s=4.0,
                output_tokens=sum(tokens),
                output_tok_s=c * sum(tokens) / sum(latency),
                request_s=c / 1.0,
                ttft_s=pct(0.05),
                itl_s=pct(0.01),
                tpot_s=pct(0.012),
                achieved_concurrency=float(c),
                client_cpu_s=0.1,
                loop_lag_p99_s=0.001,
                warnings=["client: CPU saturated"] if warn else [],
                request_tokens=tokens,
                request_latency_s=latency,
            )
        )
    return BenchResult(levels=out)


def test_child_runs_share_param_keys_and_carry_arm_tags(cfg_for, tmp_path):
    runs = {}
    for overrides in ((), ("factor/multi_stream=off",)):
        cfg = cfg_for(*overrides)
        job, plan = job_and_plan(cfg)
        with ArmTracker.start(job.tracking, job.study, plan, 1, "parent123") as tracker:
            tracker.log_provenance("decode", {"git_sha": "abc123", "dirty": False})
            tracker.log_startup({"prefill": 1.5, "decode": 2.0})
        runs[plan.signature] = client_for(cfg).get_run(tracker.run_id)
    base, off = sorted(runs.values(), key=lambda r: r.data.params["factor.multi_stream"] == "off")
    factor_keys = {k for k in base.data.params if k.startswith("factor.")}
    assert factor_keys == {k for k in off.data.params if k.startswith("factor.")}
    assert {"factor.capture", "factor.index_k", "factor.multi_stream", "factor.hicache"} <= factor_keys
    assert off.data.params["factor.multi_stream"] == "off" and base.data.params["factor.multi_stream"] == "on"
    assert off.data.params["env.decode.SGLANG_OPT_USE_MULTI_STREAM_OVERLAP"] == "0"
    assert base.data.params["env.decode.SGLANG_OPT_USE_MULTI_STREAM_OVERLAP"] == "1"
    # every level of a factor sets the same names here, so the compare view lines up every param
    assert set(base.data.params) == set(off.data.params)
    for run in (base, off):
        assert run.info.status == "FINISHED"
        assert run.data.tags["mlflow.parentRunId"] == "parent123"
        assert run.data.tags["repetition"] == "1"
        assert run.data.tags["signature"] in runs and "signature" not in run.data.params
        assert run.data.tags["provenance.decode.git_sha"] == "abc123"
        assert run.data.metrics["startup_s.decode"] == 2.0
        assert "workload.sessions" in run.data.params and "bench.concurrency" in run.data.params
        # one-line params only: the launch command words are an artifact
        assert not any(
            "\n" in v or k.startswith(("argv.", "flags.", "origin.")) for k, v in run.data.params.items()
        )
        launch = read_launch(client_for(cfg), run.info.run_id, tmp_path / run.info.run_id)
        assert "--disaggregation-mode" in launch["decode"]["argv"]
        assert launch["decode"]["origin"]["env SGLANG_OPT_USE_MULTI_STREAM_OVERLAP"].startswith("factor.")
    assert base.data.tags["arm"] == "baseline" and off.data.tags["arm"] == "multi_stream=off"
    assert (base.info.run_name, off.info.run_name) == ("baseline #1", "multi_stream=off #1")
    exp = client_for(cfg).get_experiment(base.info.experiment_id)
    assert exp.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND  # opens on its runs, not the GenAI overview
    view = json.loads(json.loads(exp.tags[VIEW_TAG + ARMS_VIEW])["state"])
    assert "params.`factor.multi_stream`" in view["selectedColumns"]
    assert "metrics.`arm.rate`" in view["selectedColumns"]
    assert view["groupBy"]["groupByKeys"] == [{"mode": "tag", "groupByData": "arm"}]


def test_artifacts_go_beside_the_sqlite_store_whatever_the_working_directory(
    compose_cfg, tmp_path, monkeypatch
):
    """MLflow's own default put them in ./mlruns of the process's directory (this suite filled the
    repository's checkout with them); an explicit tracking.artifact_location still wins."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    job, plan = job_and_plan(compose_cfg(f"hydra.sweep.dir={tmp_path}/sweep"))  # no artifact_location
    with ArmTracker.start(job.tracking, job.study, plan, 0, None) as tracker:
        note = tmp_path / "note.txt"
        note.write_text("kept")
        tracker.log_artifact(note)
    experiment = MlflowClient(job.tracking.uri).get_experiment_by_name(job.study.name)
    assert experiment.artifact_location == str(tmp_path / "mlruns")
    assert list((tmp_path / "mlruns").rglob("note.txt")) and not (elsewhere / "mlruns").exists()
    chosen = dataclasses.replace(job.tracking, artifact_location=str(tmp_path / "chosen"))
    assert artifact_location_for(chosen) == str(tmp_path / "chosen")
    assert artifact_location_for(dataclasses.replace(job.tracking, uri="http://127.0.0.1:5000")) is None


def test_failed_and_killed_statuses(cfg_for):
    cfg = cfg_for()
    job, plan = job_and_plan(cfg)
    client = client_for(cfg)

    with (
        pytest.raises(RuntimeError, match="boom"),
        ArmTracker.start(job.tracking, job.study, plan, 0, None) as crashed,
    ):
        raise RuntimeError("boom")
    run = client.get_run(crashed.run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["failure_reason"] == "RuntimeError: boom"
    failure = Path(client.download_artifacts(crashed.run_id, "failure/failure.txt"))
    assert "Traceback" in failure.read_text()

    with pytest.raises(KeyboardInterrupt), ArmTracker.start(job.tracking, job.study, plan, 1, None) as killed:
        raise KeyboardInterrupt
    assert client.get_run(killed.run_id).info.status == "KILLED"

    with ArmTracker.start(job.tracking, job.study, plan, 2, None) as failed:
        failed.fail("decode did not become healthy within 600 s", "line 1\nCUDA error: out of memory\n")
        failed.log_startup({"decode": 600.0})  # still logs after fail(); the status stays FAILED
    run = client.get_run(failed.run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["failure_reason"].startswith("decode did not become healthy")
    text = Path(client.download_artifacts(failed.run_id, "failure/failure.txt")).read_text()
    assert "CUDA error: out of memory" in text

    with ArmTracker.start(job.tracking, job.study, plan, 3, None) as ok:
        pass
    assert client.get_run(ok.run_id).info.status == "FINISHED"
    assert finished_runs(str(cfg.tracking.uri), str(cfg.study.name)) == {(plan.signature, 3)}
    assert finished_runs(str(cfg.tracking.uri), "no-such-study") == set()


def test_an_interrupt_while_the_run_is_created_ends_it_killed(cfg_for, monkeypatch):
    """The fault campaign's seed 600203567: a SIGINT inside MLflow's create_run, after the store had the
    run, escaped with no tracker to end it (RUNNING until the next sweep). Here the store has the run when
    SIGINT arrives, and create_run still has work to do."""
    import signal
    import time

    cfg = cfg_for()
    job, plan = job_and_plan(cfg)
    client = client_for(cfg)
    real = MlflowClient.create_run

    def interrupted_after_the_store_has_it(self, *args, **kwargs):
        run = real(self, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)  # the rest of create_run: the interrupt lands here
        return run

    monkeypatch.setattr(MlflowClient, "create_run", interrupted_after_the_store_has_it)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            ArmTracker.start(job.tracking, job.study, plan, 0, None)
    finally:
        signal.signal(signal.SIGINT, previous)
    runs = client.search_runs([client.get_experiment_by_name(str(cfg.study.name)).experiment_id])
    assert [r.info.status for r in runs] == ["KILLED"]


def test_a_second_interrupt_while_an_interrupted_run_is_ended_does_not_leave_it_running(cfg_for, monkeypatch):
    """The fault campaign's seed 404285457: a double SIGINT; the second came while the first's run was
    being ended, and cut that short (RUNNING until the next sweep)."""
    import signal
    import time

    cfg = cfg_for()
    job, plan = job_and_plan(cfg)
    client = client_for(cfg)
    real = MlflowClient.set_terminated

    def second_interrupt_first(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)  # the second Ctrl-C lands while the run is being ended
        return real(self, *args, **kwargs)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with (
            pytest.raises(KeyboardInterrupt),
            ArmTracker.start(job.tracking, job.study, plan, 0, None) as tracker,
        ):
            monkeypatch.setattr(MlflowClient, "set_terminated", second_interrupt_first)
            raise KeyboardInterrupt  # the first
    finally:
        signal.signal(signal.SIGINT, previous)
    assert client.get_run(tracker.run_id).info.status == "KILLED"


@pytest.mark.parametrize("first_at", ["create_run", "log_tags"])
def test_a_double_interrupt_before_the_arm_takes_its_run_over_ends_it_killed(
    cfg_for, monkeypatch, tmp_path, first_at
):
    """The fault campaign's seeds 404285457 and 407295012 (`sigint_twice` in preflight): the first SIGINT
    came as the job created its run or wrote its tags, and the second while the first was still on its
    way to the code that ends the run, which it never reached (RUNNING until the next sweep ended it
    FAILED as orphaned). Here the second comes before the run is ended; it must wait."""
    import signal
    import time

    from orchestrator.__main__ import Interrupted, run_on_cluster
    from orchestrator.arm import prepare

    cfg = cfg_for()
    job = load_job(cfg)
    client = client_for(cfg)
    created: list[str] = []
    real_create, real_exit = MlflowClient.create_run, ArmTracker.__exit__

    def interrupt_in_create_run(self, *args, **kwargs):
        run = real_create(self, *args, **kwargs)
        created.append(run.info.run_id)
        os.kill(os.getpid(), signal.SIGINT)
        return run

    def interrupt_in_log_tags(self, tags):
        created.append(self.run_id)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # the first lands here

    def second_before_the_end(self, *exc):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)  # the second lands here, before the run is ended
        return real_exit(self, *exc)

    if first_at == "create_run":
        monkeypatch.setattr(MlflowClient, "create_run", interrupt_in_create_run)
    else:
        monkeypatch.setattr(ArmTracker, "log_tags", interrupt_in_log_tags)
    monkeypatch.setattr(ArmTracker, "__exit__", second_before_the_end)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt) as stopped:  # (not pytest's own stop, if it fails)
            run_on_cluster(job, prepare(job, set()), cfg, tmp_path / "job")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert [client.get_run(run_id).info.status for run_id in created] == ["KILLED"]
    assert isinstance(stopped.value, Interrupted)  # the line saying what was kept


def test_a_signal_during_a_store_write_is_raised_once_the_write_is_whole(cfg_for, monkeypatch):
    """An interrupt inside a sqlite commit left the connection mid-transaction, and every later write of
    the process failed "database is locked" (fault campaign): a signal during a tracker's store call waits
    until the call returns, then is raised. Over HTTP calls are not held (a server that is down must not
    make Ctrl-C wait out the client's retries)."""
    import signal
    import time

    from orchestrator.tracking.write import tracker_client

    cfg = cfg_for()
    job, plan = job_and_plan(cfg)
    tracker = ArmTracker.start(job.tracking, job.study, plan, 0, None)
    real = MlflowClient.log_batch

    def interrupted_midway(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)  # the signal lands in the middle of the write
        return real(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", interrupted_midway)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            tracker.log_tags({"written": "whole"})
    finally:
        signal.signal(signal.SIGINT, previous)
    assert client_for(cfg).get_run(tracker.run_id).data.tags["written"] == "whole"
    assert type(tracker_client("http://127.0.0.1:5000")) is MlflowClient


def test_an_interrupted_run_that_cannot_be_ended_still_stops_the_sweep(cfg_for, monkeypatch):
    """A store error while an interrupted run was ended replaced the KeyboardInterrupt, and the sweep went
    on to its next arm (fault campaign, the store locked): the interrupt goes on, the error is logged."""
    from mlflow.exceptions import MlflowException

    cfg = cfg_for()
    job, plan = job_and_plan(cfg)

    def locked(self, *args, **kwargs):
        raise MlflowException("(sqlite3.OperationalError) database is locked")

    with pytest.raises(KeyboardInterrupt), ArmTracker.start(job.tracking, job.study, plan, 0, None):
        monkeypatch.setattr(MlflowClient, "set_terminated", locked)
        raise KeyboardInterrupt


def test_secrets_are_redacted_in_params_tags_and_artifacts(cfg_for, tmp_path):
    cfg = cfg_for(f"+deployment.roles.decode.env.HF_TOKEN={SECRET}")
    job, plan = job_and_plan(cfg)
    log_file = tmp_path / "decode.log"
    log_file.write_text(f"starting with token {SECRET}\nready\n")
    with ArmTracker.start(job.tracking, job.study, plan, 0, None) as tracker:
        tracker.log_artifact(log_file, "server_logs")
        tracker.fail(f"auth failed for {SECRET}", f"tail {SECRET}")
    client = client_for(cfg)
    run = client.get_run(tracker.run_id)
    assert run.data.params["env.decode.HF_TOKEN"] == "***"
    dumped = json.dumps([run.data.params, run.data.tags])
    assert SECRET not in dumped
    logged = Path(client.download_artifacts(tracker.run_id, "server_logs/decode.log")).read_text()
    assert SECRET not in logged and "starting with token ***" in logged
    failure = Path(client.download_artifacts(tracker.run_id, "failure/failure.txt")).read_text()
    assert SECRET not in failure and "tail ***" in failure


def test_interrupted_stress_keeps_partial_outcomes(cfg_for, tmp_path):
    cfg = cfg_for()
    job, plan = job_and_plan(cfg)
    summary = write_stress(tmp_path / "stress", corrupted=3, clean=20, errored=2, planned=60)
    with (
        pytest.raises(KeyboardInterrupt),
        ArmTracker.start(job.tracking, job.study, plan, 0, None) as tracker,
    ):
        tracker.log_startup({"decode": 2.0})
        tracker.log_stress(summary, tmp_path / "stress")
        raise KeyboardInterrupt
    client = client_for(cfg)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "KILLED"
    assert run.data.tags["outcomes"] == "partial"
    m = run.data.metrics
    assert (m["arm.corrupted"], m["sessions_clean"], m["sessions_errored"], m["sessions_planned"]) == (
        3,
        20,
        2,
        60,
    )
    assert m["arm.sessions"] == 23 and m["arm.rate"] == 0.1304  # 3/23 to 4 significant digits
    # the outcome sorts first and is logged first (the compare view's chart plots a run's first metric)
    assert sorted(m)[:3] == ["arm.corrupted", "arm.rate", "arm.rate_ci_high"]
    assert next(iter(m)) == "arm.rate" and m["startup_s.decode"] == 2.0
    names = {a.path for a in client.list_artifacts(tracker.run_id, "stress")}
    assert {"stress/sessions.jsonl", "stress/summary.json", "stress/corrupted"} <= names
    assert len(client.list_artifacts(tracker.run_id, "stress/corrupted")) == 3
    jsonl = Path(client.download_artifacts(tracker.run_id, "stress/sessions.jsonl")).read_text().splitlines()
    assert len(jsonl) == 25 and SessionOutcome.from_dict(json.loads(jsonl[0])).status == "corrupted"


def test_bench_metrics_and_read_back(cfg_for, tmp_path):
    cfg = cfg_for()
    job, plan = job_and_plan(cfg)
    callback = StudyCallback()
    callback.on_multirun_start(cfg)
    try:
        with ArmTracker.start(job.tracking, job.study, plan, 0, callback.run_id) as tracker:
            summary = write_stress(tmp_path / "s", 2, 58)
            summary.by_family = {"structural": 2, "plan_drift": 7}
            tracker.log_stress(summary, tmp_path / "s")
            tracker.log_bench(bench_result(warn=True), None)
    finally:
        callback._ended = True  # no report here; keep the parent open
        callback._restore_env()
    run = client_for(cfg).get_run(tracker.run_id)
    assert run.data.tags["client_bound"] == "true"
    assert "client: CPU saturated" in run.data.tags["bench_warnings"]
    assert run.data.metrics["tok_s.c8"] == pytest.approx(bench_result().levels[1].output_tok_s)
    assert run.data.metrics["ttft_p99_s.c1"] == pytest.approx(0.1)
    spec, context, records = load_study(str(cfg.tracking.uri), str(cfg.study.name))
    assert spec.name == cfg.study.name and [h.id for h in spec.hypotheses] == ["H-multistream"]
    assert context["parent_run_id"] == callback.run_id
    (rec,) = records
    assert (rec.status, rec.outcomes, rec.corrupted, rec.clean, rec.client_bound) == (
        "FINISHED",
        "complete",
        2,
        58,
        True,
    )
    assert [lv.concurrency for lv in rec.bench] == [1, 8]
    assert len(rec.bench[1].request_tokens) == 32 and rec.bench[1].tok_s == pytest.approx(
        run.data.metrics["tok_s.c8"]
    )
    assert rec.factors["multi_stream"] == "on"
    # every family is logged, counted or noted beside; the run's workload says which count
    assert rec.families == {"structural": 2, "plan_drift": 7} and rec.missing_usage == 0
    assert rec.conditions["workload.count"] == "structural,plan_drift"
    assert rec.config["decode"]["env"]["SGLANG_OPT_USE_MULTI_STREAM_OVERLAP"] == "1"
    assert "--cuda-graph-max-bs-decode" in rec.config["decode"]["flags"]


def test_parent_run_id_is_handed_over_by_file_and_env(cfg_for, monkeypatch):
    monkeypatch.delenv(PARENT_ENV, raising=False)
    cfg = cfg_for()
    callback = StudyCallback()
    callback.on_multirun_start(cfg)
    try:
        sweep_file = Path(str(cfg.hydra.sweep.dir)) / PARENT_FILE
        # nothing is opened before the sweeper accepts the sweep (a refused one leaves no run behind)
        assert not sweep_file.exists() and PARENT_ENV not in os.environ
        opened = open_parent_run()  # what the sweeper does once its first batch passed every check
        assert opened == callback.run_id and open_parent_run() == opened  # once
        assert sweep_file.read_text().strip() == callback.run_id
        assert _parent(cfg) == callback.run_id  # from the env var
        monkeypatch.delenv(PARENT_ENV)
        assert _parent(cfg) == callback.run_id  # from the file, as a launcher in another process sees it
        cfg.parent_run_id = "explicit"
        assert _parent(cfg) == "explicit"
        cfg.parent_run_id = None
        parent = client_for(cfg).get_run(callback.run_id)
        assert parent.info.status == "RUNNING"
        assert parent.data.tags["heisenhunt.kind"] == "study"
        assert parent.data.tags["sweep_dir"] == str(cfg.hydra.sweep.dir)
        assert "factor/multi_stream" not in json.loads(parent.data.tags["overrides"])
    finally:
        callback._abandoned()  # what the exit hook does when a sweep dies before on_multirun_end
        callback._restore_env()
    assert client_for(cfg).get_run(callback.run_id).info.status == "KILLED"
    assert PARENT_ENV not in os.environ
    # no sweep, no env, no explicit id: a job run on its own has no parent
    cfg.hydra.sweep.dir = "/nonexistent/sweep"
    assert _parent(cfg) is None


def _sweep(cfg_for, tmp_path, name: str, arms, *overrides: str) -> StudyCallback:
    """One sweep: its parent run (the callback), and arm runs `(extra overrides, corrupted, clean, rep)`."""
    cfg = cfg_for(f"hydra.sweep.dir={tmp_path}/{name}", *overrides)
    callback = StudyCallback()
    callback.on_multirun_start(cfg)
    try:
        for extra, corrupted, clean, rep in arms:
            job, plan = job_and_plan(cfg_for(f"hydra.sweep.dir={tmp_path}/{name}", *overrides, *extra))
            with ArmTracker.start(job.tracking, job.study, plan, rep, callback.run_id) as tracker:
                out = tmp_path / name / f"{len(extra)}-{rep}"
                tracker.log_stress(write_stress(out, corrupted, clean), out)
    finally:
        callback._ended = True  # no report here
        callback._restore_env()
    return callback


def test_a_report_counts_its_own_sweep_not_an_earlier_one_with_another_workload(cfg_for, tmp_path):
    off = ("factor/multi_stream=off",)
    _sweep(
        cfg_for,
        tmp_path,
        "old",
        [((), 30, 30, 0), (off, 20, 40, 0)],
        "workload.sessions=60",
        "workload.rounds=2",
    )
    new = _sweep(cfg_for, tmp_path, "new", [((), 9, 51, 0), (off, 0, 60, 0)])
    cfg = cfg_for()
    spec, context, runs = load_study(str(cfg.tracking.uri), str(cfg.study.name))
    assert context["parent_run_id"] == new.run_id and "of sweep" in context["pooled"]
    assert sorted((r.corrupted, r.clean) for r in runs) == [(0, 60), (9, 51)]
    # asked to pool: the earlier sweep's runs come in, but as other arms (another workload's conditions)
    _, pooled_context, pooled = load_study(str(cfg.tracking.uri), str(cfg.study.name), pool_sweeps=True)
    assert len(pooled) == 4 and "asked for" in pooled_context["pooled"]
    from tests.conftest import report_json

    report = report_json(spec, pooled, pooled_context, conditions=pooled_context["conditions"])
    [h] = report["hypotheses"]
    assert h["baseline_counts"] == [9, 60] and h["treatment_counts"] == [0, 60]
    assert len(report["arms"]) == 4  # same factor levels, two workloads: four arms


def test_a_resumed_sweep_counts_the_earlier_finished_runs_it_skipped(cfg_for, tmp_path):
    off = ("factor/multi_stream=off",)
    first = _sweep(cfg_for, tmp_path, "first", [((), 9, 51, 0), (off, 0, 60, 0)])
    client = client_for(cfg_for())
    base_signature = next(
        r.data.tags["signature"]
        for r in client.search_runs([client.get_experiment_by_name("quick").experiment_id])
        if r.data.tags.get("arm") == "baseline"
    )
    second = _sweep(cfg_for, tmp_path, "second", [(off, 0, 60, 1)], "resume=true")
    from orchestrator.tracking.write import record_planned

    record_planned(str(cfg_for().tracking.uri), second.run_id, [(base_signature, 0)])
    _, context, runs = load_study(str(cfg_for().tracking.uri), "quick")
    # this sweep's run, and the baseline run resumed from the first sweep; not the first sweep's other run
    assert sorted((r.repetition, r.corrupted) for r in runs) == [(0, 9), (1, 0)]
    assert "resumed" in context["pooled"] and first.run_id != second.run_id


def test_a_store_busy_for_a_while_is_waited_for_and_any_other_error_raised_at_once():
    """The fault campaign's seed 173879092: the sqlite store locked (by another writer) while the study's
    report was built made the sweep exit 1 with no report. The report is built again while the store
    answers "database is locked", up to the patience."""
    from sqlalchemy.exc import OperationalError

    from orchestrator.tracking.layout import retry_store

    now = [0.0]
    answers = [OperationalError("SELECT 1", {}, Exception("database is locked"))] * 3 + ["report"]

    def build():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert (
        retry_store(
            build, patience_s=60, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s)
        )
        == "report"
    )
    assert now[0] == 3.0
    # past its patience, the store's error is raised
    answers[:] = [OperationalError("SELECT 1", {}, Exception("database is locked"))] * 100
    with pytest.raises(OperationalError):
        retry_store(build, patience_s=5, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    # any other error: at once, no wait
    calls = []

    def broken():
        calls.append(1)
        raise ValueError("no such study")

    with pytest.raises(ValueError):
        retry_store(broken, sleep=lambda s: pytest.fail("waited on an error that is not the store's"))
    assert calls == [1]


def test_the_first_client_of_a_process_waits_for_a_store_locked_past_sqlites_busy_timeout(tmp_path):
    """The fault campaign's seed 173879092 again, at its real place: a resumed sweep's first client opens
    the store (MLflow checks its tables) while another writer holds the lock for longer than sqlite's
    5 s busy timeout. The open is waited for, as every other use of a busy store is."""
    import sqlite3
    import threading
    import time

    from orchestrator.tracking.layout import make_client

    db = tmp_path / "busy.db"  # a store this process has never opened (MLflow caches a store per URI)
    sqlite3.connect(db).close()
    locked, held_s = threading.Event(), 6.5

    def hold_the_lock():
        conn = sqlite3.connect(db, isolation_level=None)
        conn.execute("BEGIN EXCLUSIVE")
        locked.set()
        time.sleep(held_s)
        conn.execute("ROLLBACK")
        conn.close()

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    locked.wait()
    start = time.monotonic()
    client = make_client(f"sqlite:///{db}")
    waited = time.monotonic() - start
    holder.join()
    assert waited > 5.0  # it did meet the lock past sqlite's own wait
    assert client.search_experiments()  # and the store it opened works ("Default")
