"""Preflight and provenance, run through the local transport and over real SSH (loopback sshd)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SshServer

from orchestrator.remote import LocalTransport, Transport, make_transport
from orchestrator.run.preflight import (
    FlagError,
    HostIdentity,
    PreflightError,
    flag_error_from_argparse,
    git_provenance,
    gpu_memory_used,
    host_identity,
    host_provenance,
    parse_gpu_memory,
    run_probe,
    sglang_version,
    split_launch,
    validate_sglang_flags,
)

HOSTENV = str(Path(__file__).parent / "hostenv")
SGLANG_0523 = "sglang_0_5_23_flags:add_cli_args"
SIM_PARSER = "orchestrator.sim.args:build_parser"


@pytest.fixture(params=["local", pytest.param("ssh", marks=pytest.mark.ssh)])
def host(request: pytest.FixtureRequest) -> Transport:
    if request.param == "local":
        t: Transport = LocalTransport()
    else:
        server: SshServer = request.getfixturevalue("sshd")
        t = make_transport(server.host_cfg())
    with t:
        yield t


def validate_0523(t: Transport, argv: list[str]) -> None:
    validate_sglang_flags(t, sys.executable, argv, parser=SGLANG_0523, env={"PYTHONPATH": HOSTENV})


# --- flags ----------------------------------------------------------------------------------------------

LAUNCH = [
    "python",
    "-m",
    "sglang.launch_server",
    "--model-path",
    "/models/dsv4",
    "--disaggregation-mode",
    "decode",
    "--port",
    "30001",
]


def test_0523_refuses_the_old_cuda_graph_max_bs_as_ambiguous(host: Transport) -> None:
    with pytest.raises(FlagError) as caught:
        validate_0523(host, [*LAUNCH, "--cuda-graph-max-bs", "32"])
    err = caught.value
    assert err.flag == "--cuda-graph-max-bs"
    assert "ambiguous" in str(err) and "--cuda-graph-max-bs-decode" in str(err)
    assert "--cuda-graph-max-bs-prefill" in str(err) and host.host in str(err)


def test_valid_0523_flags_pass(host: Transport) -> None:
    validate_0523(
        host,
        [
            *LAUNCH,
            "--cuda-graph-max-bs-decode",
            "32",
            "--enable-hicache",
            "--kv-cache-dtype=fp8_e4m3",
            "--tool-call-parser",
            "deepseekv4",
        ],
    )


@pytest.mark.parametrize(
    ("extra", "flag", "words"),
    [
        (["--no-such-flag"], "--no-such-flag", "does not know"),
        (["--kv-cache-dtype", "fp16"], "--kv-cache-dtype", "invalid choice"),
        # a unique prefix: argparse would silently take it for --cuda-graph-max-bs-decode
        (["--cuda-graph-max-bs-dec", "8"], "--cuda-graph-max-bs-dec", "not a full sglang flag"),
        (["--port", "not-a-number"], "--port", "invalid int"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(
    host: Transport, extra: list[str], flag: str, words: str
) -> None:
    with pytest.raises(FlagError, match=words) as caught:
        validate_0523(host, [*LAUNCH, *extra])
    assert caught.value.flag == flag


def test_missing_required_flag_is_refused() -> None:
    with pytest.raises(FlagError, match=r"required.*--model-path"):
        validate_0523(LocalTransport(), ["--port", "30000"])


def test_host_without_sglang_is_skipped_with_a_note(
    host: Transport, caplog: pytest.LogCaptureFixture
) -> None:
    if sglang_version(host, sys.executable) is not None:
        pytest.skip("sglang is installed here")
    with caplog.at_level(logging.INFO, logger="orchestrator.run.preflight"):
        validate_sglang_flags(host, sys.executable, [*LAUNCH, "--cuda-graph-max-bs", "32"])
    assert any(
        "not installed" in r.getMessage() and "not validated" in r.getMessage() for r in caplog.records
    )


def test_non_sglang_commands_are_not_validated(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="orchestrator.run.preflight"):
        validate_sglang_flags(
            LocalTransport(),
            "/no/such/python",
            ["python", "-m", "sglang_router.launch_router", "--pd-disaggregation"],
        )
    assert any("not an sglang server" in r.getMessage() for r in caplog.records)


def test_the_simulated_servers_own_parser_can_validate(host: Transport) -> None:
    sim = [
        "python",
        "-m",
        "orchestrator.sim.server",
        "--model-path",
        "m",
        "--disaggregation-mode",
        "prefill",
        "--cuda-graph-max-bs-decode",
        "32",
    ]
    parsed = validate_sglang_flags(host, sys.executable, sim, parser=SIM_PARSER)
    assert parsed["--cuda-graph-max-bs-decode"] == ("cuda_graph_max_bs_decode", 32)
    # 0.5.9's spelling, which real 0.5.23 refuses as ambiguous: the sim refuses it too
    with pytest.raises(FlagError) as caught:
        validate_sglang_flags(host, sys.executable, [*sim, "--cuda-graph-max-bs", "8"], parser=SIM_PARSER)
    assert caught.value.flag == "--cuda-graph-max-bs"


def test_broken_sglang_install_is_an_error_not_a_skip(tmp_path: Path) -> None:
    # sglang present but its parser fails to import (e.g. torch missing): say so, do not skip
    pkg = tmp_path / "brokenglang"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import torch_that_is_not_installed\n")
    with pytest.raises(PreflightError, match="torch_that_is_not_installed"):
        validate_sglang_flags(
            LocalTransport(),
            sys.executable,
            ["--x"],
            parser="brokenglang.args:add",
            env={"PYTHONPATH": str(tmp_path)},
        )


def test_split_launch() -> None:
    assert split_launch(["python", "-m", "sglang.launch_server", "--a", "1"]) == (
        "sglang.launch_server",
        ["--a", "1"],
    )
    assert split_launch(["/opt/launch.sh", "--a", "1"]) == (None, ["--a", "1"])
    assert split_launch(["--a"]) == (None, ["--a"])
    assert split_launch(["/bin/true"]) == (None, [])


def test_argparse_messages_become_flag_errors() -> None:
    err = flag_error_from_argparse(
        "h", "ambiguous option: --cuda-graph-max-bs=8 could match --x-decode, --x-prefill"
    )
    assert err.flag == "--cuda-graph-max-bs" and "--x-decode, --x-prefill" in str(err)
    assert flag_error_from_argparse("h", "unrecognized arguments: --foo 3").flag == "--foo"
    assert (
        flag_error_from_argparse("h", "argument --tp-size/--tp: invalid int value: 'x'").flag == "--tp-size"
    )


# --- versions, git, GPUs ---------------------------------------------------------------------------------


def _fake_host_python(tmp_path: Path, version: str) -> str:
    """An interpreter wrapper whose site has sglang's package metadata (as a venv with sglang has)."""
    site = tmp_path / "site"
    dist = site / f"sglang-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def test_sglang_version(host: Transport, tmp_path: Path) -> None:
    assert sglang_version(host, _fake_host_python(tmp_path, "0.5.23")) == "0.5.23"
    with pytest.raises(PreflightError, match="not found"):
        sglang_version(host, str(tmp_path / "no-python"))


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.mark.skipif(not shutil.which("git"), reason="git not installed")
def test_git_provenance_sha_and_dirty_state(host: Transport, tmp_path: Path) -> None:
    repo = tmp_path / "sglang-checkout"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "f.py").write_text("x = 1\n")
    _git(repo, "add", "f.py")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    head = _git(repo, "rev-parse", "HEAD").strip()
    assert git_provenance(host, str(repo)) == {"sha": head, "dirty": False}
    (repo / "f.py").write_text("x = 2\n")
    assert git_provenance(host, str(repo)) == {"sha": head, "dirty": True}
    with pytest.raises(PreflightError, match="not-a-repo"):
        git_provenance(host, str(tmp_path / "not-a-repo"))


def test_parse_gpu_memory() -> None:
    assert parse_gpu_memory("1024\n 81559\n\n") == [1024, 81559]
    assert parse_gpu_memory("17 MiB\n") == [17]
    with pytest.raises(PreflightError):
        parse_gpu_memory("[N/A]\n")


def test_gpu_memory_none_without_nvidia_smi(host: Transport) -> None:
    used = gpu_memory_used(host, nvidia_smi="heisenhunt-no-such-nvidia-smi")
    assert used is None


def test_gpu_memory_from_nvidia_smi(host: Transport, tmp_path: Path) -> None:
    # a stand-in nvidia-smi (GPUs are the one thing faked): checks the query it is given
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        '#!/bin/sh\n[ "$1 $2" = "--query-gpu=memory.used --format=csv,noheader,nounits" ] '
        '|| { echo "bad args: $*" >&2; exit 9; }\nprintf "3\\n81000\\n"\n'
    )
    smi.chmod(0o755)
    assert gpu_memory_used(host, nvidia_smi=str(smi)) == [3, 81000]
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2; exit 9\n")
    with pytest.raises(PreflightError, match="NVIDIA-SMI has failed"):
        gpu_memory_used(host, nvidia_smi=str(smi))


@pytest.mark.skipif(not shutil.which("nvidia-smi"), reason="no nvidia-smi on this machine")
def test_gpu_memory_on_a_real_gpu_host() -> None:
    used = gpu_memory_used(LocalTransport())
    count = len(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.splitlines())
    assert used is not None and len(used) == count and all(v >= 0 for v in used)


def test_host_provenance(host: Transport, tmp_path: Path) -> None:
    prov = host_provenance(host, _fake_host_python(tmp_path, "0.5.23"))
    assert prov.sglang_version == "0.5.23"
    assert prov.python_version == ".".join(map(str, sys.version_info[:3]))
    assert prov.hostname == subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip()
    assert prov.checkout_sha is None
    params = prov.as_params("prefill")
    assert params["prefill.sglang_version"] == "0.5.23" and "prefill.gpu_memory_used_mib" in params


def test_the_engine_probe_tells_the_hosts_identity_so_an_arm_asks_once(
    host: Transport, tmp_path: Path
) -> None:
    """The arm's provenance comes from its engine probe's answer (the same interpreter start): what the
    separate identity start would say, and with it given no interpreter is started for provenance."""
    python = _fake_host_python(tmp_path, "0.5.23")
    answer = run_probe(host, python, {"parser": "no_such_engine.args:parser", "argvs": []})
    identity = HostIdentity.from_probe(answer)
    assert identity == host_identity(host, python)
    assert identity.sglang_version == "0.5.23"
    # an interpreter that is not there: only the separate start would find out
    gone = str(tmp_path / "no-python")
    assert host_provenance(host, gone, identity=identity).hostname == identity.hostname
    with pytest.raises(PreflightError, match="not found"):
        host_provenance(host, gone)
