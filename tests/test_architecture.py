"""The library's floors (book/architecture.md): a module imports only from lower floors or
from its own package, never a private name of another module, and the floors' packages are
exactly the ones listed. Read from the source with `ast`, so lazy imports inside functions
count too."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "nanoqwen_lib"

# package (or top-level module) -> floor; a higher floor may import a lower one.
FLOORS = {"errors": 0, "config": 1, "format": 2, "model": 3, "synthetic": 3, "gpu": 4, "measure": 5,
          "cli": 6, "__main__": 7, "__init__": 7}


def unit_of(module: str) -> str:
    """nanoqwen_lib.gpu.engine -> gpu; nanoqwen_lib.config -> config."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        out[".".join(rel.parts).removesuffix(".__init__")] = path
    return out


def imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names) for every import of nanoqwen_lib in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nanoqwen_lib"):
            out.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}:{node.lineno}: relative import; the library imports absolutely")
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names if a.name.startswith("nanoqwen_lib")]
    return out


def test_every_package_has_a_floor():
    units = {unit_of(m) for m in modules()}
    assert units == set(FLOORS), f"packages without a floor: {units - set(FLOORS)}; gone: {set(FLOORS) - units}"


@pytest.mark.parametrize("module", sorted(modules()))
def test_imports_go_down_the_floors(module):
    here = unit_of(module)
    known = modules()
    for line, target, names in imports(known[module]):
        full = [target] if not names else [f"{target}.{n}" if f"{target}.{n}" in known else target for n in names]
        for t in full:
            there = unit_of(t)
            where = f"{known[module].relative_to(PKG.parent)}:{line} imports {t}"
            assert there == here or FLOORS[there] < FLOORS[here], f"{where}: floor {FLOORS[there]} is not below {FLOORS[here]}"
        private = [n for n in names if n.startswith("_") and target != module]
        assert not private, f"{known[module].relative_to(PKG.parent)}:{line} imports private {private} from {target}"


@pytest.mark.parametrize("module", sorted(m for m in modules() if not m.startswith("nanoqwen_lib.gpu.lab")))
def test_the_library_never_imports_the_lab(module):
    """The lab (nanoqwen_lib.gpu.lab: earlier and experimental kernels' launchers) is for the
    tools, the tests and the chapters that tell a kernel's history; the runtime runs without it."""
    for line, target, names in imports(modules()[module]):
        full = [target] + [f"{target}.{n}" for n in names]
        assert not any(t == "nanoqwen_lib.gpu.lab" or t.startswith("nanoqwen_lib.gpu.lab.") for t in full), \
            f"{module}:{line} imports the lab ({target})"
