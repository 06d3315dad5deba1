"""The configs and the simulator held to the real sglang package (0.5.23, installed without its CUDA stack
by scripts/sglang-cpu.sh): its own ServerArgs parser, its env registry and its source, through the same
engine probe the preflight runs on a server host. CI installs it and sets HEISENHUNT_REQUIRE_REAL_SGLANG=1,
so these never skip there.

- every shipped deployment (the simulated ones too, as if launched for real) and every factor level and
  ddmin difference: flags accepted, spelled in full and not deprecated; every SGLANG_* name read by the
  build, or declared in its file as read only by other builds (and then truly unread by this one);
- the simulator's snapshot of the names sglang reads is the package's own;
- the dsv4 study on real sglang is refused before anything starts, naming the variable, its factor, level,
  file, host and version; a user's misspelled variable is refused the same way.
"""

from __future__ import annotations

import os
from pathlib import Path

from orchestrator.config.schema import SERVER_ROLES
from orchestrator.remote.local import LocalTransport
from orchestrator.run.preflight import SGLANG_PARSER, check_arms, engine_env_names, run_probe, split_launch
from orchestrator.sim import envs as sim_envs
from tests.conftest import REAL_SGLANG_VERSION, plan_of, preflight_only, typo_level, typo_refusal

REPO = Path(__file__).resolve().parents[1]
DEPLOYMENTS = sorted(p.stem for p in (REPO / "conf" / "deployment").glob("*.yaml"))
LEVELS = sorted((p.parent.name, p.stem) for p in (REPO / "conf" / "factor").glob("*/*.yaml"))
# the factors the primary config selects a level of; any other is added with `+`
SELECTED = {"capture", "index_k", "multi_stream", "hicache"}


def _probe(python: str, plans_roles, **extra):
    request = {
        "parser": SGLANG_PARSER,
        "registry": None,
        "argvs": [split_launch(plan.roles[role].argv)[1] for plan, role in plans_roles],
        "env": sorted({n for plan, role in plans_roles for n in engine_env_names(plan.roles[role].env)}),
        **extra,
    }
    return run_probe(LocalTransport(), python, request)


def test_every_shipped_deployment_and_level_is_what_the_real_sglang_accepts(real_sglang_python, compose_cfg):
    plans = []
    for deployment in DEPLOYMENTS:
        plans.append((f"deployment={deployment}", plan_of(compose_cfg(f"deployment={deployment}"))))
        for factor, level in LEVELS:
            label = f"deployment={deployment} factor/{factor}={level}"
            add = "" if factor in SELECTED else "+"
            cfg = compose_cfg(f"deployment={deployment}", f"{add}factor/{factor}={level}")
            plans.append((label, plan_of(cfg)))
    # every ddmin difference of the shipped experiments, all applied at once
    ddmin = compose_cfg("+experiment=ddmin_serve_script")
    ids = ",".join(d.id for d in ddmin.study.ddmin.differences)
    bad = compose_cfg("+experiment=ddmin_serve_script", f"ddmin_subset=[{ids}]")
    plans.append(("ddmin_serve_script, all differences", plan_of(bad)))
    items = [(label, plan, role) for label, plan in plans for role in SERVER_ROLES]
    answer = _probe(real_sglang_python, [(plan, role) for _, plan, role in items])
    assert answer["sglang"] == REAL_SGLANG_VERSION and answer["parser"] == "ok"

    wrong: list[str] = []
    declared_unread: set[str] = set()
    for (label, plan, role), verdict in zip(items, answer["argvs"], strict=True):
        where = f"{label} ({role})"
        if verdict["status"] != "ok":
            wrong.append(f"{where}: refused: {verdict['detail']}")
            continue
        wrong += [f"{where}: {w} abbreviates {m}" for w, m in verdict["abbreviated"].items()]
        wrong += [f"{where}: {flag} is deprecated" for flag in verdict["deprecated"]]
        for name in engine_env_names(plan.roles[role].env):
            read_in = answer["env"][name]["read_in"]
            if name in plan.env_read_by:
                declared_unread.add(name)
                if read_in:  # the file says stock sglang does not read it: that must stay true
                    wrong.append(
                        f"{where}: {name} is declared unread (read_by) but sglang reads it in {read_in}"
                    )
            elif not read_in:
                wrong.append(f"{where}: {name} is read nowhere in sglang {answer['sglang']}")
    assert not wrong, "\n".join(wrong)
    # the one variable real sglang does not read is the index-key one, and its files say so
    assert declared_unread == {"SGLANG_DSV4_BF16_INDEX_K"}


def test_the_simulators_list_of_names_sglang_reads_is_the_real_packages(real_sglang_python):
    answer = run_probe(
        LocalTransport(), real_sglang_python, {"parser": SGLANG_PARSER, "argvs": [], "list_known": True}
    )
    real = set(answer["env_known"])
    if os.environ.get("HEISENHUNT_WRITE_SNAPSHOTS") == "1":
        path = sim_envs.SGLANG_ENV_NAMES_FILE
        header = [line for line in path.read_text().splitlines() if line.startswith("#")]
        path.write_text("\n".join([*header, *sorted(real)]) + "\n")
    assert set(sim_envs.SGLANG_ENV_NAMES) == real, (
        f"missing {sorted(real - sim_envs.SGLANG_ENV_NAMES)[:10]}, "
        f"extra {sorted(sim_envs.SGLANG_ENV_NAMES - real)[:10]}: HEISENHUNT_WRITE_SNAPSHOTS=1 rewrites it"
    )
    # the sim reads one name real sglang does not: the patched build's index-key switch it models
    assert set(sim_envs.ENV_VARS) - real == {"SGLANG_DSV4_BF16_INDEX_K"}


def _preflight(tmp_path: Path, python: str, *overrides: str):
    """preflight_only with sglang_dsv4, both server roles on the real sglang's python."""
    pythons = [f"++cluster.hosts.prefill.python={python}", f"++cluster.hosts.decode.python={python}"]
    return preflight_only(tmp_path, "deployment=sglang_dsv4", *pythons, *overrides)


def test_the_dsv4_study_on_real_sglang_is_refused_naming_the_unread_variable(real_sglang_python, tmp_path):
    proc = _preflight(tmp_path, real_sglang_python, "+experiment=dsv4_corruption")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    refusal = next(line for line in out.splitlines() if "SGLANG_DSV4_BF16_INDEX_K is read nowhere" in line)
    assert f"(sglang {REAL_SGLANG_VERSION} for {real_sglang_python})" in refusal and "on 127.0.0.1" in refusal
    assert "factor.index_k (level bf16)" in refusal or "factor.index_k (level fp8)" in refusal
    assert "conf/factor/index_k/" in refusal and "sglang.srt.environ's" in refusal
    assert "wrongly exonerated" in refusal and "+experiment=dsv4_stock" in refusal
    assert "Nearest names this build reads: SGLANG_" in refusal
    # the template's transfer backend is not installed with sglang: said now, not minutes into a start
    assert "transfer backend nixl" in out and "import nixl._api" in out


def test_the_stock_study_passes_the_real_parser_and_registry(real_sglang_python, tmp_path):
    """dsv4_stock sets nothing stock sglang ignores: its only refusal here is the backend, not installed."""
    proc = _preflight(tmp_path, real_sglang_python, "+experiment=dsv4_stock")
    out = proc.stdout + proc.stderr
    assert "transfer backend nixl" in out, out[-3000:]
    assert "read nowhere" not in out and "sglang refuses" not in out and "does not know" not in out


def test_a_users_misspelled_variable_is_refused_with_the_name_it_meant(real_sglang_python, tmp_path):
    searchpath, path = typo_level(tmp_path)
    proc = _preflight(
        tmp_path, real_sglang_python, searchpath, "factor/multi_stream=on,typo", "factor/index_k=stock"
    )
    assert "Fix the name" in typo_refusal(proc, path)


def test_flags_and_version_against_the_real_parser(real_sglang_python, compose_cfg):
    def plan(*overrides: str):
        return plan_of(
            compose_cfg(
                "deployment=sglang_dsv4",
                "factor/index_k=stock",
                f"++cluster.hosts.prefill.python={real_sglang_python}",
                f"++cluster.hosts.decode.python={real_sglang_python}",
                "++deployment.roles.prefill.flags={--disaggregation-transfer-backend: fake}",
                "++deployment.roles.decode.flags={--disaggregation-transfer-backend: fake}",
                *overrides,
            )
        )

    plans = [
        plan(),
        # 0.5.9's spelling: ambiguous in 0.5.23, named with the key that set it
        plan("++deployment.roles.decode.flags={--cuda-graph-max-bs: 16}"),
        plan("++deployment.roles.decode.flags={--reasoning-parser: deepseek-v5}"),
        plan("deployment.sglang_version='==0.5.17'"),
    ]
    local = LocalTransport()
    found = check_arms(plans, {"prefill": local, "decode": local}).problems  # one probe for the four arms
    problems = [[message for index, message in found if index == i] for i in range(len(plans))]
    assert problems[0] == []
    (ambiguous,) = problems[1]
    assert "--cuda-graph-max-bs-decode" in ambiguous and "deployment.roles.decode.flags" in ambiguous
    (parser,) = problems[2]
    assert "--reasoning-parser" in parser and "deepseek-v4" in parser
    assert len(problems[3]) == 2 and all("sglang==0.5.17" in p and "not 0.5.23" in p for p in problems[3])


def test_the_probe_says_what_each_factor_flag_means_on_the_real_server(real_sglang_python, compose_cfg):
    """What the running server's /server_info must then show (preflight.confirm_server_args)."""
    plan = plan_of(compose_cfg("deployment=sglang_dsv4", "factor/capture=eager", "factor/hicache=on"))
    answer = _probe(real_sglang_python, [(plan, "prefill"), (plan, "decode")])
    prefill, decode = (verdict["parsed"] for verdict in answer["argvs"])
    assert decode["--disable-decode-cuda-graph"] == ["disable_decode_cuda_graph", True]
    assert prefill["--enable-hierarchical-cache"] == ["enable_hierarchical_cache", True]
    assert prefill["--hicache-ratio"] == ["hicache_ratio", 2.0]
    assert decode["--reasoning-parser"] == ["reasoning_parser", "deepseek-v4"]


def test_the_sglang_version_is_stated_once_in_three_places():
    """The template's sglang_version, the `sglang` extra's pin and scripts/sglang-cpu.sh agree."""
    import tomllib

    import yaml

    deployment = yaml.safe_load((REPO / "conf" / "deployment" / "sglang_dsv4.yaml").read_text())
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["sglang"]
    script = (REPO / "scripts" / "sglang-cpu.sh").read_text()
    assert deployment["sglang_version"] == f"=={REAL_SGLANG_VERSION}"
    assert extra == [f"sglang=={REAL_SGLANG_VERSION}"]
    assert f"\nSGLANG_VERSION={REAL_SGLANG_VERSION}\n" in script
