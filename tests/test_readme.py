"""The README's two commands are what CI and users run, and the test extra brings what they need."""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
INSTALL = "python3 -m pip install"


def _command_lines(path: Path) -> list[str]:
    """The lines of `path` that install and run something (the README's two commands)."""
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip().startswith(INSTALL)]


def _ci_lines() -> list[str]:
    return [ln.strip() for ln in (ROOT / ".ci/run").read_text().splitlines()
            if ln.strip() and not ln.strip().startswith("#")]


def test_readme_has_two_commands():
    readme = _command_lines(ROOT / "README.md")
    assert len(readme) == 2, f"README.md: expected 2 lines starting {INSTALL!r}, found {readme}"


def test_ci_runs_the_readme_commands_verbatim():
    """Both lines, character for character and in the README's order."""
    assert _command_lines(ROOT / ".ci/run") == _command_lines(ROOT / "README.md")


def test_ci_runs_them_in_a_new_virtual_environment():
    lines = _ci_lines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith(INSTALL))
    setup = lines[:first]
    assert any(re.match(r"python3 -m venv --clear ", ln) for ln in setup), setup
    assert any(re.match(r"\. .*bin/activate", ln) for ln in setup), setup
    assert any(ln.startswith("export NANOQWEN_CACHE=") for ln in setup), setup   # an empty cache
    # A failure early in the first line must fail CI (set -e does not see it).
    after_first = lines[first + 1:lines.index(_command_lines(ROOT / ".ci/run")[1])]
    assert any('exit "$rc"' in ln for ln in after_first), after_first
    # After the test command: its status kept, the repository checked unchanged, that status out.
    rest = lines[lines.index(_command_lines(ROOT / "README.md")[1]) + 1:]
    assert rest[0] == "rc=$?" and rest[-1] == 'exit "$rc"', rest
    assert any("git status --porcelain" in ln for ln in rest), rest


def test_ci_venv_and_readme_venv_are_git_ignored():
    """.ci/run's environment and the README's `.venv` never show up as files to commit."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    venv = re.search(r"^VENV=(\S+)", (ROOT / ".ci/run").read_text(), re.M).group(1)
    for folder in (venv, ".venv"):
        r = subprocess.run(["git", "check-ignore", "-q", f"{folder}/bin/python3"], cwd=ROOT)
        assert r.returncode == 0, f".gitignore: expected {folder}/ ignored, found it is not"


def test_readme_main_command_runs_demo_and_builds_book():
    main = _command_lines(ROOT / "README.md")[0]
    assert "nanoqwen_lib demo" in main and "jupyter-book build ." in main


def test_readme_test_command_installs_the_test_extra():
    test_cmd = _command_lines(ROOT / "README.md")[1]
    assert "test]" in test_cmd and "pytest --nbval" in test_cmd


# Markers pytest itself defines; every other marker needs a plugin in the test extra or an
# entry in pyproject's `markers` (--strict-markers fails at collection otherwise).
BUILTIN_MARKERS = {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings"}
PLUGIN_MARKERS = {"timeout": "pytest-timeout"}


def _markers_used() -> dict[str, list[str]]:
    used: dict[str, list[str]] = {}
    paths = list((ROOT / "tests").rglob("*.py")) + list((ROOT / "book").rglob("*.md")) \
        + list((ROOT / "book").rglob("*.py")) + [ROOT / "conftest.py"]
    for path in paths:
        for name in re.findall(r"pytest\.mark\.([A-Za-z_]\w*)", path.read_text()):
            used.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return used


def test_every_marker_has_its_plugin_or_registration():
    tomllib = pytest.importorskip("tomllib")          # Python 3.11+
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    registered = {m.split(":")[0].strip() for m in pyproject["tool"]["pytest"]["ini_options"]["markers"]}
    test_extra = [re.split(r"[<>=!~ ;\[]", req, maxsplit=1)[0].lower()
                  for req in pyproject["project"]["optional-dependencies"]["test"]]
    used = _markers_used()
    assert "timeout" in used and "gpu" in used       # the scan sees the markers the suite uses
    for name, where in sorted(used.items()):
        if name in BUILTIN_MARKERS or name in registered:
            continue
        plugin = PLUGIN_MARKERS.get(name)
        assert plugin is not None, (f"{where[0]}: marker {name!r}: expected one registered in "
                                    f"pyproject.toml [tool.pytest.ini_options] markers or a known "
                                    f"plugin's, found neither")
        assert plugin in test_extra, (f"pyproject.toml: the test extra: expected {plugin} "
                                      f"(marker {name!r}, used in {where[0]}), found {test_extra}")


def test_test_stack_is_pinned():
    """Each test-stack requirement has an upper bound or an exact version: a fresh install gets
    a version the suite is known to pass with."""
    tomllib = pytest.importorskip("tomllib")
    test_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    for name in ("pytest", "nbval", "pytest-timeout", "pytest-xdist", "hypothesis", "torch", "transformers"):
        req = next((r for r in test_extra if re.match(rf"{re.escape(name)}\s*[<>=!~]", r)), None)
        assert req is not None, f"pyproject.toml: the test extra: expected {name}, found {test_extra}"
        assert "==" in req or "<" in req, f"pyproject.toml: {name}: expected a pin or a range, found {req!r}"
