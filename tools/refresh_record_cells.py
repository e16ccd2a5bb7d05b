"""Re-execute the chapters' record-backed cells (those that print a record's banner) after a
record in book/data changed, each alone in a fresh kernel, and store their outputs in place.

A record-backed cell imports what it uses and reads only its record (tests/test_records.py
checks both), so its output depends on the record, not on the cells before it or on the
machine: a CPU can refresh it. The other cells' outputs and every execution count stay as
they are.

    python tools/refresh_record_cells.py [book/NN-chapter.ipynb ...]   # default: every notebook of the book
    python tools/refresh_record_cells.py --figures book/NN-chapter.ipynb  # also a cell whose figure alone differs
                                                                           # (its plotting code changed)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"


def record_cells(nb) -> list[int]:
    return [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and ".banner()" in c.source]


def _text(outputs) -> list:
    """Outputs without their images (a figure drawn from the same record differs only in the
    renderer's bytes)."""
    return [{k: ({m: v for m, v in o[k].items() if not m.startswith("image/")} if k == "data" else o[k])
             for k in o if k != "metadata"} for o in outputs]


def refresh(path: Path, figures: bool = False) -> int:
    """Re-execute path's record-backed cells; write the notebook (temporary file, then a
    rename) if any output changed (with figures, also where only a figure did). Returns how
    many cells changed."""
    nb = nbformat.read(path, as_version=4)
    changed = 0
    for i in record_cells(nb):
        cell = nb.cells[i]
        one = nbformat.v4.new_notebook(metadata=nb.metadata)
        one.cells = [nbformat.v4.new_code_cell(cell.source)]
        NotebookClient(one, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
        outputs = one.cells[0].outputs
        for o in outputs:
            if "execution_count" in o:
                o["execution_count"] = cell.execution_count
        if any(o.output_type == "error" for o in outputs):
            raise SystemExit(f"{path.name} cell {i}: raised {next(o for o in outputs if o.output_type == 'error').ename}")
        if _text(outputs) != _text(cell.outputs) or (figures and outputs != cell.outputs):
            # (without figures, a figure alone re-rendered here is kept as it was)
            cell.outputs = outputs
            changed += 1
            print(f"{path.relative_to(ROOT)} cell {i}: refreshed")
    if changed:
        tmp = path.with_name(f".{path.name}.tmp")
        nbformat.write(nb, tmp)
        tmp.replace(path)
    return changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", type=Path)
    ap.add_argument("--figures", action="store_true", help="also replace a cell whose figure alone differs")
    a = ap.parse_args(argv)
    paths = a.notebooks or sorted(BOOK.glob("*.ipynb"))   # the chapters and the pages beside them
    n = sum(refresh(p.resolve(), a.figures) for p in paths)
    print(f"{n} record-backed cells refreshed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
