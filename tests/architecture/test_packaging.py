"""What `pip install .` ships (the Docker images install the project this way, not editable):
every module and data file of the project's packages, subpackages included. A package left
out of pyproject.toml works in an editable checkout and fails only in the images."""

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_every_module_and_data_file(tmp_path):
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    top_level = {package.split(".")[0] for package in pyproject["packages"]}
    source = tmp_path / "source"  # a copy: setuptools would reuse the checkout's build/ folder
    for package in top_level:
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", source)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(source)], check=True, timeout=300)
    (wheel,) = tmp_path.glob("pagedserve-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    expected = {str(path.relative_to(ROOT)) for package in top_level
                for path in (ROOT / package).rglob("*.py") if "__pycache__" not in path.parts}
    for package, patterns in pyproject["package-data"].items():
        for pattern in patterns:
            expected |= {str(path.relative_to(ROOT)) for path in (ROOT / package).glob(pattern)}
    assert expected - shipped == set(), "pip install . leaves these out: list the packages in pyproject.toml"


def test_the_image_copies_every_top_level_package():
    """compose/Dockerfile copies the sources package by package before `pip install .`: a
    package pyproject.toml ships but the Dockerfile leaves out fails only in the images."""
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    top_level = {package.split(".")[0] for package in packages}
    copied = set(re.findall(r"^COPY (\w+) \1$", (ROOT / "compose" / "Dockerfile").read_text(), re.MULTILINE))
    assert copied == top_level
