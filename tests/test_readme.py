"""The README's two commands are what CI and users run."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands():
    text = (ROOT / "README.md").read_text()
    return [ln.strip() for ln in text.splitlines() if ln.strip().startswith("python3 -m pip install")]


def test_ci_runs_the_readme_test_command():
    ci = [ln.strip() for ln in (ROOT / ".ci/run").read_text().splitlines()
          if ln.strip() and not ln.startswith("#") and not ln.startswith(("set ", "cd "))]
    assert ci == [_readme_commands()[1]]


def test_readme_main_command_runs_demo_and_builds_book():
    main = _readme_commands()[0]
    assert "nanoqwen_lib demo" in main and "jupyter-book build ." in main
