"""Package doors tell what is there: the docstring of each package's ``__init__.py`` names every module
and subpackage of it (as a word: ``state``, ``:mod:`launcher.spmd```), so a reader who opens the door
sees every room, and a module added without a line at the door fails here (issue 42 item 3)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOORS = ("verl_core", "stages", "stages/floor", "flows", "launcher")


def _rooms(package: Path) -> set[str]:
    """The modules (``*.py`` but ``__init__``/``__main__``) and subpackages of ``package``."""
    modules = {p.stem for p in package.glob("*.py") if p.stem not in {"__init__", "__main__"}}
    return modules | {d.name for d in package.iterdir() if (d / "__init__.py").is_file()}


def _unnamed(package: Path) -> list[str]:
    """The rooms of ``package`` its door's docstring does not name."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    return sorted(r for r in _rooms(package) if not re.search(rf"(?<!\w){re.escape(r)}(?!\w)", doc))


def test_the_check_finds_a_room_missing_at_the_door(tmp_path: Path) -> None:
    pkg = tmp_path / "floor"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "sub" / "__init__.py").write_text("")
    for name in ("state", "parent", "model_card", "__main__"):
        (pkg / f"{name}.py").write_text("")
    (pkg / "__init__.py").write_text('"""The floor.\n\n    state   the state\n    sub     a package\n"""\n')
    # parent and model_card unnamed; "card" alone or "model" would not count for model_card
    assert _unnamed(pkg) == ["model_card", "parent"]
    (pkg / "__init__.py").write_text('"""state, sub, parent (:mod:`floor.model_card`)."""\n')
    assert _unnamed(pkg) == []


@pytest.mark.parametrize("door", DOORS)
def test_each_door_names_every_module_of_its_package(door: str) -> None:
    assert _rooms(ROOT / door), door
    assert _unnamed(ROOT / door) == [], f"{door}/__init__.py's docstring does not name these modules"
