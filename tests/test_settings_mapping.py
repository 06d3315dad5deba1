"""One mapping from a job's config and from the CLI to the workload's settings (workload/fill.py): every
StressSettings / BenchConfig field is filled by name from the schema's section or the CLI's dest, or named
here as what the caller gives or leaves at its default. A field added to one side only fails here."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from orchestrator.arm import StressThenBench
from orchestrator.config.schema import BenchConf, StressConf
from orchestrator.workload import bench, stress
from orchestrator.workload.bench import BenchConfig
from orchestrator.workload.stress import StressSettings
from tests.conftest import plan_of

# what the arm computes itself (the rest of the job's section flows through by name)
ARM_GIVES_STRESS = {"url", "out_dir", "model", "progress"}  # progress: off under the sweep's display
ARM_GIVES_BENCH = {"url", "model", "concurrency_levels"}  # the schema's `concurrency` is the levels
# settings a job's config does not carry: the arm runs with their defaults
JOB_LEAVES_STRESS = {"keep_transcripts", "watch_interval_s"}
# the workload fields only a reproducer takes (workload=reproducer: workload/reproducer.py)
REPRODUCER_ONLY = {"call", "command"}
JOB_LEAVES_BENCH = {"requests_per_level", "duration_s", "seed", "thresholds"}
# the schema's bench fields that say whether and where the sweep runs, not how
BENCH_SCHEMA_ONLY = {"enabled", "repetitions", "concurrency"}
# settings the CLI has no flag for
CLI_LEAVES_STRESS = {"watch_interval_s"}
CLI_LEAVES_BENCH = {"thresholds"}


def names(cls: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def same(a: Any, b: Any) -> bool:
    """Equal, a config's list and a setting's tuple alike."""
    return (tuple(a) if isinstance(a, list) else a) == (tuple(b) if isinstance(b, list) else b)


def test_every_stress_setting_is_the_job_configs_or_named_by_the_arm():
    assert names(StressConf) - REPRODUCER_ONLY <= names(StressSettings), (
        "a workload field the stress run never sees"
    )
    assert names(StressSettings) - names(StressConf) == ARM_GIVES_STRESS | JOB_LEAVES_STRESS


def test_every_bench_setting_is_the_job_configs_or_named_by_the_arm():
    assert names(BenchConf) - BENCH_SCHEMA_ONLY <= names(BenchConfig), "a bench field the sweep never sees"
    assert names(BenchConfig) - names(BenchConf) == ARM_GIVES_BENCH | JOB_LEAVES_BENCH


def test_fill_takes_each_field_by_name_given_values_first_and_reads_nothing_else():
    source = SimpleNamespace(sessions=3, rounds=2, tool_choice="plan", unrelated="x")
    settings = stress.stress_settings(source, url="u", out_dir="o", rounds=5)
    assert (settings.sessions, settings.rounds, settings.tool_choice) == (3, 5, "plan")
    assert settings.out_dir == Path("o") and settings.seed == StressSettings.seed  # absent: the default
    with pytest.raises(TypeError):
        stress.stress_settings(source, url="u", out_dir="o", no_such_field=1)


class _Recorder:
    def log_stress(self, summary: Any, out_dir: Path) -> None:
        pass

    def log_bench(self, result: Any, out_dir: Path) -> None:
        pass


class _Alive:
    def dead_role(self) -> None:
        return None

    def check_alive(self, during: str) -> None:
        pass


def test_the_arms_workload_and_bench_sections_flow_into_the_settings(compose_cfg, monkeypatch, tmp_path):
    overrides = (
        "workload.sessions=7",
        "workload.rounds=3",
        "workload.concurrency=2",
        "workload.seed=5",
        "workload.timeout_s=33",
        "workload.count=[structural]",
        "workload.tool_choice=plan",
        "bench.concurrency=[1,2]",
        "bench.requests_per_worker=3",
        "bench.input_len=11",
        "bench.output_len=13",
        "bench.warmup_requests=1",
        "bench.timeout_s=44",
    )
    plan = plan_of(compose_cfg(*overrides))
    seen: dict[str, Any] = {}
    monkeypatch.setattr(
        "orchestrator.arm.decode_load_monitor", lambda plan: SimpleNamespace(stop=lambda: None)
    )
    monkeypatch.setattr("orchestrator.arm.log_decode_load", lambda tracker, load, out_dir: None)
    monkeypatch.setattr(
        stress,
        "run_stress_sync",
        lambda settings, server_gone=None, on_outcome=None, on_phase=None: seen.update(s=settings),
    )
    monkeypatch.setattr(bench, "run_bench_sync", lambda config, out_dir: seen.update(b=config))

    StressThenBench(0).measure(plan, _Alive(), _Recorder(), tmp_path)

    settings, config = seen["s"], seen["b"]
    for name in names(StressConf) - REPRODUCER_ONLY:
        assert same(getattr(settings, name), getattr(plan.workload, name)), name
    for name in names(BenchConf) - BENCH_SCHEMA_ONLY:
        assert same(getattr(config, name), getattr(plan.bench, name)), name
    assert (settings.url, settings.model, settings.out_dir) == (
        plan.router_url,
        plan.served_model,
        tmp_path / "stress",
    )
    assert (config.url, config.model, config.concurrency_levels) == (
        plan.router_url,
        plan.served_model,
        (1, 2),
    )


def dests(parser: Any) -> set[str]:
    return {action.dest for action in parser._actions} - {"help"}


def test_the_stress_cli_sets_each_setting_by_its_field_name():
    assert dests(stress.argument_parser()) == names(StressSettings) - CLI_LEAVES_STRESS
    argv = "--url u --out o --sessions 3 --rounds 2 --model m --seed 9 --concurrency 2 --timeout 5"
    argv += " --max-tokens 7 --count structural --tool-choice plan --keep-transcripts --quiet"
    settings = stress.stress_settings(stress.argument_parser().parse_args(argv.split()))
    assert settings == StressSettings(
        url="u",
        out_dir=Path("o"),
        sessions=3,
        rounds=2,
        model="m",
        seed=9,
        concurrency=2,
        timeout_s=5.0,
        max_tokens=7,
        count=("structural",),
        tool_choice="plan",
        keep_transcripts=True,
        progress=False,
    )
    defaults = stress.stress_settings(stress.argument_parser().parse_args(["--url", "u", "--out", "o"]))
    assert defaults == StressSettings(url="u", out_dir=Path("o"))


def test_the_bench_cli_sets_each_setting_by_its_field_name():
    assert dests(bench.argument_parser()) - {"out"} == names(BenchConfig) - CLI_LEAVES_BENCH
    argv = "--url u --out o --concurrency 1,4 --duration 2.5 --rounds 3 --input-len 9 --output-len 8"
    argv += " --model m --warmup 1 --timeout 7 --seed 4"
    config = bench.bench_config(bench.argument_parser().parse_args(argv.split()))
    assert config == BenchConfig(
        url="u",
        concurrency_levels=(1, 4),
        duration_s=2.5,
        requests_per_worker=3,
        input_len=9,
        output_len=8,
        model="m",
        warmup_requests=1,
        timeout_s=7.0,
        seed=4,
    )
    by_count = ["--url", "u", "--out", "o", "--requests", "64"]
    config = bench.bench_config(bench.argument_parser().parse_args(by_count))
    assert config == BenchConfig(url="u", requests_per_level=64)
