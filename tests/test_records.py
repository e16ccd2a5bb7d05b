"""Records are today's or say they are not (nanoqwen_lib/measure/records.py).

* write/load: provenance written whole, checked without git, a changed file named.
* every record in book/data carries its provenance for what MEASURES says it measures.
* the stale ones are listed as a warning (refreshing them needs the GPU, so not a failure).
* every record-backed cell of the book (a cell that prints a record's banner) re-run here
  prints what its committed output says: a record whose numbers differ from what the book
  shows fails; a banner that differs only in its staleness warns.
"""
from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

from nanoqwen_lib.errors import NanoqwenError
from nanoqwen_lib.measure import records

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"


def _tree(tmp_path: Path) -> Path:
    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "a.cu").write_text("__global__ void a() {}\n")
    (tmp_path / "k" / "sub").mkdir()
    (tmp_path / "k" / "sub" / "b.cuh").write_text("#pragma once\n")
    (tmp_path / "m.py").write_text("x = 1\n")
    return tmp_path


def test_write_then_load_is_fresh_and_atomic(tmp_path):
    root = _tree(tmp_path)
    p = root / "r.json"
    records.write(p, {"ms": 1.5, "rows": [1, 2]}, ["k", "m.py"], root=root)
    assert [q.name for q in root.iterdir() if q.name.startswith(".")] == []   # no temporary left
    raw = json.loads(p.read_text())
    assert set(raw["provenance"]) == {"git_commit", "measures"}
    assert set(raw["provenance"]["measures"]) == {"k", "m.py"}
    assert all(len(h) == 64 for h in raw["provenance"]["measures"].values())
    r = records.load(p, root=root)
    assert r.data == {"ms": 1.5, "rows": [1, 2]} and r.fresh and r.changed == []
    assert r.banner() == f"record r.json: measured at {r.commit[:7]}; the code it measures is unchanged since"


@pytest.mark.parametrize("edit, changed", [
    (lambda root: (root / "k" / "a.cu").write_text("__global__ void a() { }\n"), ["k"]),
    (lambda root: (root / "k" / "sub" / "c.cuh").write_text(""), ["k"]),          # a new file in a folder
    (lambda root: (root / "k" / "sub" / "b.cuh").unlink(), ["k"]),                # a file gone
    (lambda root: (root / "k" / "sub" / "b.cuh").rename(root / "k" / "b.cuh"), ["k"]),   # moved
    (lambda root: (root / "m.py").write_text("x = 2\n"), ["m.py"]),
    (lambda root: (root / "m.py").unlink(), ["m.py"]),
])
def test_a_changed_path_makes_it_stale(tmp_path, edit, changed):
    root = _tree(tmp_path)
    p = root / "r.json"
    records.write(p, {"ms": 1.5}, ["k", "m.py"], root=root, commit=None)
    edit(root)
    r = records.load(p, root=root)
    assert r.changed == changed and not r.fresh
    assert r.banner() == f"record r.json: STALE: measured at {r.commit[:7]}; changed since: {', '.join(changed)}"


def test_a_yaml_file_measured_without_a_section(tmp_path):
    """"FILE (without a.b)": a change inside a.b (or to a comment) leaves the record fresh, a
    change anywhere else makes it stale; a key the file does not have is refused by name."""
    (tmp_path / "c.yaml").write_text("engine:\n  persistent: {reduce_ns: 800.0}\n  chunk: 512\ntuning: {a: 1}\n")
    spec = records.without("c.yaml", "engine.persistent")
    assert spec == "c.yaml (without engine.persistent)"
    p = tmp_path / "r.json"
    records.write(p, {"ms": 1.0}, [spec, "c.yaml"], root=tmp_path)
    (tmp_path / "c.yaml").write_text("# a comment\nengine:\n  persistent: {reduce_ns: 1000.0}\n  chunk: 512\ntuning: {a: 1}\n")
    assert records.load(p, root=tmp_path).changed == ["c.yaml"]            # the whole file changed, the rest did not
    (tmp_path / "c.yaml").write_text("engine:\n  persistent: {reduce_ns: 800.0}\n  chunk: 256\ntuning: {a: 1}\n")
    assert records.load(p, root=tmp_path).changed == [spec, "c.yaml"]
    with pytest.raises(NanoqwenError, match=r"c.yaml: engine.missing"):
        records.write(p, {"ms": 1.0}, [records.without("c.yaml", "engine.missing")], root=tmp_path)


def test_the_graph_step_records_do_not_measure_the_persistent_config():
    """bench-int4 and bench-fp8 (the kernel-per-op graph) measure the config without what only
    the persistent step reads; the persistent step's records measure all of it."""
    spec = records.without("nanoqwen_lib/nanoqwen.yaml", "engine.persistent", "tuning.decode_persistent")
    for name in ("bench-int4.json", "bench-fp8.json"):
        assert spec in records.MEASURES[name] and "nanoqwen_lib/nanoqwen.yaml" not in records.MEASURES[name]
    for name in ("persistent.json", "scoreboard.json", "persistent-variants.json"):
        assert "nanoqwen_lib/nanoqwen.yaml" in records.MEASURES[name] and spec not in records.MEASURES[name]
    assert records.digest(spec) is not None and records.digest(spec) != records.digest("nanoqwen_lib/nanoqwen.yaml")


def test_ignored_files_do_not_count(tmp_path):
    root = _tree(tmp_path)
    p = root / "r.json"
    records.write(p, {}, ["k"], root=root)
    (root / "k" / "__pycache__").mkdir()
    (root / "k" / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"\0")
    (root / "k" / ".a.cu.swp").write_bytes(b"\0")
    assert records.load(p, root=root).fresh


def test_load_calls_no_git(tmp_path, monkeypatch):
    root = _tree(tmp_path)
    p = root / "r.json"
    records.write(p, {}, ["k", "m.py"], root=root)

    def no(*a, **k):
        raise AssertionError("load() ran a process")
    monkeypatch.setattr(subprocess, "run", no)
    monkeypatch.setattr(subprocess, "Popen", no)
    assert records.load(p, root=root).fresh


@pytest.mark.parametrize("body, field", [
    ({"ms": 1.0}, "provenance"),
    ({"provenance": "x"}, "provenance"),
    ({"provenance": {"measures": {"m.py": "0" * 64}}}, "provenance.git_commit"),
    ({"provenance": {"git_commit": "abc1234", "measures": {}}}, "provenance.measures"),
])
def test_missing_provenance_names_file_and_field(tmp_path, body, field):
    p = tmp_path / "x.json"
    p.write_text(json.dumps(body))
    with pytest.raises(NanoqwenError) as e:
        records.load(p, root=tmp_path)
    assert e.value.file == "x.json" and e.value.field == field


def test_write_refuses_a_path_that_is_not_there(tmp_path):
    root = _tree(tmp_path)
    with pytest.raises(NanoqwenError, match="nope.cu: measures"):
        records.write(root / "r.json", {}, ["nope.cu"], root=root)
    assert not (root / "r.json").exists()


def test_digest_at_a_commit_equals_digest_of_that_tree():
    """The migration's hashes (git show at a commit) are the ones load() computes from
    the same bytes: HEAD's tracked files, compared where the work tree is clean."""
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "kernels", "nanoqwen_lib/errors.py"], cwd=ROOT,
                           capture_output=True, text=True).stdout
    if dirty.strip():
        pytest.skip("kernels/ or errors.py differ from HEAD here: " + dirty.splitlines()[0])
    for path in ("kernels", "nanoqwen_lib/errors.py"):
        assert records.digest_at("HEAD", path) == records.digest(path)
    if not subprocess.run(["git", "status", "--porcelain", "--", "nanoqwen_lib/nanoqwen.yaml"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip():
        spec = records.without("nanoqwen_lib/nanoqwen.yaml", "engine.persistent")
        assert records.digest_at("HEAD", spec) == records.digest(spec)


def test_band():
    edges = (1.0, 1.2, 1.4)
    assert [records.band(x, edges) for x in (0.99, 1.0, 1.19, 1.2, 1.39, 1.4, 7)] == \
        ["< 1x", "1-1.2x", "1-1.2x", "1.2-1.4x", "1.2-1.4x", ">= 1.4x", ">= 1.4x"]
    assert records.band(55, (50, 60), unit="%") == "50-60%"
    for bad in ((), (1.0, 1.0), (2.0, 1.0)):
        with pytest.raises(NanoqwenError, match="band edges"):
            records.band(1.0, bad)
    with pytest.raises(NanoqwenError, match="NaN"):
        records.band(float("nan"), edges)


# ---------------------------------------------------------------- the records of book/data

RECORDS = sorted(records.DATA.glob("*.json"))


def test_every_record_is_known():
    assert {p.name for p in RECORDS} == set(records.MEASURES), "a record without an entry in records.MEASURES"


@pytest.mark.parametrize("path", RECORDS, ids=lambda p: p.name)
def test_record_has_provenance_for_what_it_measures(path):
    r = records.load(path)
    assert set(r.measures) == set(records.measures_for(path)), \
        f"{path.name}: provenance measures differ from records.MEASURES (written by another list?)"
    assert all(h == records.ABSENT or len(h) == 64 for h in r.measures.values())


def test_stale_records_are_listed():
    """A warning, not a failure: refreshing a record needs the GPU run that wrote it."""
    stale = [r for r in map(records.load, RECORDS) if not r.fresh]
    for r in stale:
        warnings.warn(f"{r.banner()} (rerun its writer on the GPU)", UserWarning)


def test_fresh_copy_without_git_agrees(tmp_path):
    """load() in a copy of the tree without .git (an exported tarball) finds the same."""
    paths = {p for r in map(records.load, RECORDS) for p in r.measures}
    for p in paths | {"book/data"}:
        src = ROOT / p
        if src.is_dir():
            shutil.copytree(src, tmp_path / p, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif src.is_file():
            (tmp_path / p).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, tmp_path / p)
    for path in RECORDS:
        here, there = records.load(path), records.load(tmp_path / "book" / "data" / path.name, root=tmp_path)
        assert (there.changed, there.banner()) == (here.changed, here.banner())


# ---------------------------------------------------------------- record-backed cells

def _record_cells():
    for nb_path in sorted(BOOK.glob("*.ipynb")):      # the chapters and the pages beside them
        nb = json.loads(nb_path.read_text())
        for i, cell in enumerate(nb["cells"]):
            src = "".join(cell["source"]) if cell["cell_type"] == "code" else ""
            if ".banner()" in src:
                yield pytest.param(nb_path, i, cell, id=f"{nb_path.stem}[{i}]")


RECORD_CELLS = list(_record_cells())


def test_record_backed_cells_found():
    """Chapters 4, 7, 9, 10, 11 and 12 and the llama.cpp profile page quote records; each of
    those cells prints a banner."""
    pages = {p.values[0].stem for p in RECORD_CELLS}
    assert {p[:2] for p in pages} >= {"07", "09", "12"} and "llama-cpp-profile" in pages, sorted(pages)


def _run_cell(src: str):
    """The cell's source alone (a record-backed cell imports what it uses), its stdout and
    glued values (name -> repr, as the notebook stores them)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import myst_nb
    glued = {}
    orig_glue, orig_show = myst_nb.glue, plt.show
    myst_nb.glue = lambda name, value, display=True: glued.__setitem__(name, repr(value))
    plt.show = lambda *a, **k: None
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(src, "<cell>", "exec"), {"__name__": "__cell__"})
    finally:
        myst_nb.glue, plt.show = orig_glue, orig_show
        plt.close("all")
    return out.getvalue(), glued


def _committed(cell):
    text = "".join("".join(o["text"]) for o in cell["outputs"]
                   if o["output_type"] == "stream" and o.get("name") == "stdout")
    glued = {o["metadata"]["scrapbook"]["name"]: o["data"]["application/papermill.record/text/plain"]
             for o in cell["outputs"] if o["output_type"] == "display_data" and "scrapbook" in o.get("metadata", {})}
    return text, glued


@pytest.mark.parametrize("nb_path, index, cell", RECORD_CELLS)
def test_record_backed_cell_prints_its_record(nb_path, index, cell):
    src = "".join(cell["source"])
    try:
        text, glued = _run_cell(src)
    except NameError as e:
        pytest.fail(f"{nb_path.name} cell {index}: a record-backed cell must import what it uses ({e})")
    want_text, want_glued = _committed(cell)
    banners, rest = _split_banners(text)
    want_banners, want_rest = _split_banners(want_text)
    assert banners, f"{nb_path.name} cell {index}: the record's banner is not the first line"
    assert (rest, glued) == (want_rest, want_glued), \
        f"{nb_path.name} cell {index}: the record's numbers differ from what the book shows"
    assert len(banners) == len(want_banners), f"{nb_path.name} cell {index}: {want_banners} -> {banners}"
    for now, shown in zip(banners, want_banners):
        if now == shown:
            continue
        assert "STALE" in shown or "STALE" not in now, \
            f"{nb_path.name} cell {index}: the book says {shown!r}, but {now!r}: re-execute the cell (CPU)"
        warnings.warn(f"{nb_path.name} cell {index}: the committed output shows {shown!r}, the record now "
                      f"says {now!r}: re-execute the cell (CPU) so the book shows it", UserWarning)


def _split_banners(text: str):
    lines = text.splitlines(keepends=True)
    n = next((i for i, line in enumerate(lines) if not line.startswith("record book/data/")), len(lines))
    return [line.rstrip("\n") for line in lines[:n]], "".join(lines[n:])


def test_banner_names_a_few_changed_paths_and_counts_the_rest(tmp_path):
    names = [f"f{i}.py" for i in range(records.BANNER_PATHS + 3)]
    for n in names:
        (tmp_path / n).write_text("a")
    p = tmp_path / "r.json"
    records.write(p, {}, names, root=tmp_path)
    for n in names:
        (tmp_path / n).write_text("b")
    r = records.load(p, root=tmp_path)
    assert r.changed == names
    assert r.banner().endswith(f"{', '.join(names[:records.BANNER_PATHS])} and 3 more of the {len(names)} paths it measures")


def test_bench_measures_match_the_records_they_write():
    """`nanoqwen bench --json` (cli) names what it measured; the committed records agree."""
    assert records.measures_for_bench("persistent") == records.MEASURES["persistent.json"]
    assert records.measures_for_bench("persistent", "int4", peers=True) == records.MEASURES["scoreboard.json"]
    assert records.measures_for_bench("graph", "int4") == records.MEASURES["bench-int4.json"]
    assert records.measures_for_bench("graph", "fp8") == records.MEASURES["bench-fp8.json"]
    with pytest.raises(NanoqwenError, match="bench measures"):
        records.measures_for_bench("eager")
