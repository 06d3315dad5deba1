"""The package as a wheel installs it: the wings, the shipped conf/ and experiments/ (symlinks in the repo,
real files in a wheel) and the Hydra plugins (the study sweeper) are found without this checkout.

The wheel is built from this tree and unpacked into a folder of its own; the command runs with `python
-S`, so no `.pth` file is read and the editable install of this checkout cannot answer in its place, and
with site-packages on PYTHONPATH for the dependencies only."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.xdist_group("wheel")  # one build, on one worker


@pytest.fixture(scope="module")
def unpacked_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # built from a copy of what the wheel packs (links kept as links), so the build writes nothing here
    source = out / "source"
    source.mkdir()
    for part in ("pyproject.toml", "README.md", "orchestrator", "hydra_plugins", "conf", "experiments"):
        if (ROOT / part).is_dir():
            skip = shutil.ignore_patterns("__pycache__")
            shutil.copytree(ROOT / part, source / part, symlinks=True, ignore=skip)
        else:
            shutil.copy2(ROOT / part, source / part)
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)]
    subprocess.run(build, check=True, capture_output=True, timeout=240)
    (wheel,) = out.glob("heisenhunt-*.whl")
    site = out / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    return site


def run_installed(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]])
    return subprocess.run(
        [sys.executable, "-S", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_wheel_holds_the_wings_and_real_config_files(unpacked_wheel):
    for wing in ("config", "run", "study", "tracking", "report", "workload", "analysis", "remote", "sim"):
        assert (unpacked_wheel / "orchestrator" / wing / "__init__.py").is_file(), wing
    for shipped in (
        "orchestrator/conf/config.yaml",
        "orchestrator/conf/workload/reproducer.yaml",
        "orchestrator/studies/experiment/dsv4_corruption.yaml",
        "orchestrator/workload/reproducer.schema.json",  # a reproducer's lines are checked against it
    ):
        path = unpacked_wheel / shipped
        assert path.is_file() and not path.is_symlink(), shipped
    assert (unpacked_wheel / "hydra_plugins" / "heisenhunt_sweeper" / "study_sweeper.py").is_file()


def test_the_installed_command_runs_from_the_wheel_and_finds_its_sweeper(unpacked_wheel, tmp_path):
    where = run_installed(unpacked_wheel, tmp_path, "-c", "import orchestrator.arm as a; print(a.__file__)")
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(unpacked_wheel), where.stdout

    helped = run_installed(unpacked_wheel, tmp_path, "-m", "orchestrator", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "dsv4_corruption" in helped.stdout

    # a dry run goes through Hydra's plugin discovery: the study sweeper lists the study's arms
    dry = run_installed(
        unpacked_wheel,
        tmp_path,
        "-m",
        "orchestrator",
        "-m",
        "+experiment=dsv4_corruption",
        "dry_run=true",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "5 arm(s), 20 job(s)" in dry.stdout, dry.stdout[-2000:]
