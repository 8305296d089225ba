"""What an install needs: every third-party module the package imports when its modules load is installed by
pyproject.toml's dependencies (or theirs), or, for the modules of an extra (Ray Serve's app, the benchmarks),
by that extra. The test extras install much more, so the suite alone would never notice one missing: numpy,
imported by the harvest package that `import model` loads, once was."""

from __future__ import annotations

import ast
import importlib.metadata
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parents[1]
OURS = {"model", "server", "gpt2_scripts"}  # not `scripts`: installed, that folder is gpt2_scripts
EXTRA_OF = {"server/ray_app.py": "ray", "scripts/bench*.py": "bench"}  # modules only an extra's users load


def installed_by(requirements: list[str], extra: str = "") -> set[str]:
    """The distributions `requirements` install (those of `extra` among them), with theirs, by name."""
    todo = [Requirement(r) for r in requirements]
    found: set[str] = set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in found or (req.marker is not None and not req.marker.evaluate({"extra": extra})):
            continue
        found.add(name)
        todo += [Requirement(r) for r in importlib.metadata.requires(req.name) or []]  # (without their extras)
    return found


def imported_on_load(path: Path) -> set[str]:
    """The top-level names of the third-party modules `path` imports as it loads (its module-level imports;
    those inside functions load with the feature that needs them)."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            names |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return names - OURS - set(sys.stdlib_module_names)


def test_every_module_imported_on_load_is_installed_by_the_dependencies() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    owners = importlib.metadata.packages_distributions()
    missing = []
    sources = [p for folder in ("model", "server", "scripts") for p in sorted((ROOT / folder).rglob("*.py"))]
    for path in sources:
        where = path.relative_to(ROOT).as_posix()
        extra = next((e for pattern, e in EXTRA_OF.items() if fnmatch(where, pattern)), "")
        available = installed_by(project["dependencies"] + (extras[extra] if extra else []), extra)
        for name in sorted(imported_on_load(path)):
            distributions = {canonicalize_name(d) for d in owners.get(name, [name])}
            if not distributions & available:
                missing.append(f"{where} imports {name} ({', '.join(sorted(distributions))})")
    assert not missing, "imported as these modules load, but not installed by their dependencies: " + "; ".join(missing)
    assert imported_on_load(ROOT / "server" / "ray_app.py") >= {"ray"}  # (what the extras are for is seen)


def test_every_package_folder_is_in_the_wheel() -> None:
    """pyproject.toml lists the packages by hand (the editable install the suite runs on would not notice one
    missing from a wheel): every folder of model/, server/ and scripts/ holding Python, and the viewer's files."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"])
    folders = {
        path.parent.relative_to(ROOT).as_posix().replace("/", ".").replace("scripts", "gpt2_scripts", 1)
        for folder in ("model", "server", "scripts")
        for path in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert folders | {"server.static"} == listed
