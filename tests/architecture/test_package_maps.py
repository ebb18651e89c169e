"""Every package's map lists its modules: each module and sub-package of a package that
pyproject.toml ships is named in the package's `__init__.py` docstring (as `name.py`,
`name/`, `` `name` `` or `package.name`) or in docs/architecture.md (as
`folder/name.py`, `folder/name/` or `package.name` anywhere; for a top-level package, as
`name.py` or `name/` in its row of the "Packages" table). A module nobody can find from
the map is one a reader cannot place."""

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]


def package_entries(folder: Path) -> list[str]:
    """The modules (`name.py`) and sub-packages (`name/`) of the package in `folder`."""
    modules = [p.name for p in folder.glob("*.py") if p.name != "__init__.py"]
    subpackages = [p.parent.name + "/" for p in folder.glob("*/__init__.py")]
    return sorted(modules + subpackages)


def architecture_row(architecture: str, package: str) -> str:
    """The "Packages" table row of a top-level package ("" for a sub-package, or none)."""
    if "." in package:
        return ""
    found = re.search(rf"^\| `{re.escape(package)}` \|.*$", architecture, re.M)
    return found.group(0) if found else ""


def unmapped(package: str, entries: list[str], docstring: str, architecture: str) -> list[str]:
    """The entries of `package` that neither its docstring nor docs/architecture.md names."""
    folder = package.replace(".", "/")
    row = architecture_row(architecture, package)
    missing = []
    for entry in entries:
        stem = entry.removesuffix(".py").removesuffix("/")
        dotted = rf"{re.escape(package)}\.{re.escape(stem)}(?!\w)"
        in_docstring = re.search(rf"(?<![\w.]){re.escape(entry)}|`{re.escape(stem)}`|{dotted}", docstring)
        in_architecture = (f"{folder}/{entry}" in architecture or re.search(dotted, architecture)
                           or re.search(rf"(?<![\w./]){re.escape(entry)}", row))
        if not (in_docstring or in_architecture):
            missing.append(entry)
    return missing


def test_the_map_check_sees_a_module_left_out():
    architecture = ("| `pkg` | things | `a.py` (A), `sub/` |\n"
                    "| `other` | more | `c.py` |\n"
                    "See `pkg/e.py` and `pkg.f`.\n")
    entries = ["a.py", "b.py", "c.py", "d.py", "e.py", "f.py", "g.py", "sub/", "sub2/"]
    docstring = "    d.py   D\n    `g`    G, named by its stem\n    calls and sub2 in prose"
    assert unmapped("pkg", entries, docstring, architecture) == ["b.py", "c.py", "sub2/"]
    # A sub-package's modules count in docs/architecture.md only by their path or dotted name.
    assert unmapped("pkg.sub", ["a.py", "h.py"], "", architecture + "`pkg/sub/h.py`") == ["a.py"]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_is_on_its_package_map(package):
    folder = ROOT / package.replace(".", "/")
    init = folder / "__init__.py"
    docstring = (ast.get_docstring(ast.parse(init.read_text())) or "") if init.exists() else ""
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    missing = unmapped(package, package_entries(folder), docstring, architecture)
    assert not missing, (f"{package}: {', '.join(missing)} named neither in {folder.relative_to(ROOT)}/__init__.py's "
                         f"docstring nor in docs/architecture.md: add a line saying what each owns")
