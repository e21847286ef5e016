"""The house rules of the tree that no other test holds (issue 29): a README that stays user
documentation, a verl_core whose top level holds the kernels' packages and a few leaf utilities, and
no module that grew into two things, in any package or the tests (benchmarks aside: a benchmark is
one script, its figures' whole story)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 260
TOP_LEVEL_MAX_MODULES = 8  # loose modules beside verl_core's packages, __init__ not counted
MODULE_MAX_LINES = 460  # "~450": past it, a module holds two things
CAPPED = ("verl_core", "stages", "flows", "launcher", "browse", "tests")  # every package but benchmarks


def test_readme_is_short_and_opens_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (≤ {README_MAX_LINES})"
    head = "\n".join(lines[:8])
    assert "make quickstart" in head and "make test" in head


def test_verl_core_top_level_holds_few_loose_modules() -> None:
    loose = sorted(p.name for p in (ROOT / "verl_core").glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= TOP_LEVEL_MAX_MODULES, f"verl_core/ top level: {loose}"


def long_modules(root: Path, packages: tuple[str, ...]) -> dict[str, int]:
    """``{path: lines}`` of the modules under ``root/package`` over :data:`MODULE_MAX_LINES`."""
    return {
        str(p.relative_to(root)): n
        for package in packages
        for p in sorted((root / package).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MODULE_MAX_LINES
    }


def test_no_module_is_over_the_limit() -> None:
    long = long_modules(ROOT, CAPPED)
    assert not long, f"modules over {MODULE_MAX_LINES} lines: {long}"


def test_the_limit_finds_a_long_module(tmp_path: Path) -> None:
    (tmp_path / "flows" / "cli").mkdir(parents=True)
    (tmp_path / "flows" / "cli" / "long.py").write_text("x = 1\n" * (MODULE_MAX_LINES + 1))
    (tmp_path / "flows" / "short.py").write_text("x = 1\n" * MODULE_MAX_LINES)
    assert long_modules(tmp_path, CAPPED) == {"flows/cli/long.py": MODULE_MAX_LINES + 1}
