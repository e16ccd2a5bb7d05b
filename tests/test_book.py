"""The book's machinery, checked on a CPU without building it.

* every chapter is a jupytext pair book/NN-name.md + .ipynb whose cells agree;
* _toc.yml lists exactly the chapters that exist; _config.yml renders the committed
  outputs (no execution) and excludes the .md twins;
* every {literalinclude} points at code that exists;
* the committed .ipynb are one clean top-to-bottom run (the goldens nbval compares with);
* book/sanitize.cfg hides addresses, timings and temp paths, and nothing else;
* conftest.py: a `gpu`-tagged cell runs but is not compared without a GPU, an untagged one
  is compared, a `gpu`-marked test is skipped;
* chapter 0's plan of the book lists the numbered chapters of _toc.yml as they are;
* a number the prose quotes is glued from its cell (and the committed outputs carry it), or
  printed by a cell of the chapter, or its paragraph names its source.
(tests/test_book_build.py builds the book and checks the rendered HTML.)
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"
CHAPTER_RE = re.compile(r"^\d\d-[a-z0-9-]+$")
PAIRING = "ipynb,md:myst"


def chapter_stems() -> list[str]:
    """book/NN-name for every chapter file present, .md or .ipynb."""
    stems = {p.stem for p in BOOK.glob("[0-9][0-9]-*") if p.suffix in (".md", ".ipynb")}
    return sorted(stems)


def toc_files() -> list[str]:
    """Every `file:` of _toc.yml (root first), in order, parts and sections included."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]

    def walk(entries):
        for e in entries or []:
            if "file" in e:
                files.append(e["file"])
            walk(e.get("sections"))
            walk(e.get("chapters"))

    walk(toc.get("chapters"))
    for part in toc.get("parts", []):
        walk(part.get("chapters"))
    return files


def read_pair(stem: str):
    import jupytext

    md = jupytext.read(BOOK / f"{stem}.md")
    nb = nbformat.read(BOOK / f"{stem}.ipynb", as_version=4)
    return md, nb


def cell_view(cell) -> tuple:
    """What must agree between a chapter's .md and its .ipynb: type, source, nbval tags."""
    tags = tuple(cell.metadata.get("tags", [])) if cell.cell_type == "code" else ()
    return cell.cell_type, cell.source.strip(), tags


# ----------------------------------------------------------------------------- pairs, toc

# The pages that are not chapters (plain MyST, no notebook twin, not numbered).
MATTER = {"index", "preface", "architecture", "design", "glossary", "perflog"}
NOTEBOOK_PAGES = {"llama-cpp-profile"}   # unnumbered pages that execute (a jupytext pair, like a chapter)


def executed_stems() -> list[str]:
    """Every page that executes: the chapters, then the notebook pages beside them."""
    return chapter_stems() + sorted(NOTEBOOK_PAGES)


def test_chapter_names_are_nn_name():
    for p in BOOK.iterdir():
        if p.suffix in (".md", ".ipynb") and p.stem not in MATTER | NOTEBOOK_PAGES:
            assert CHAPTER_RE.match(p.stem), f"book/{p.name}: expected NN-name (lowercase, dashes)"
    for page in MATTER:
        assert (BOOK / f"{page}.md").exists() and not (BOOK / f"{page}.ipynb").exists(), f"book/{page}.md"
    for page in NOTEBOOK_PAGES:
        assert (BOOK / f"{page}.md").exists() and (BOOK / f"{page}.ipynb").exists(), f"book/{page}: a jupytext pair"


@pytest.mark.parametrize("stem", executed_stems())
def test_chapter_is_a_jupytext_pair(stem):
    for suffix in (".md", ".ipynb"):
        assert (BOOK / f"{stem}{suffix}").exists(), \
            f"book/{stem}{suffix}: expected the twin of book/{stem} (jupytext --sync book/{stem}.md)"
    md, nb = read_pair(stem)
    for where, meta in ((".md", md.metadata), (".ipynb", nb.metadata)):
        found = meta.get("jupytext", {}).get("formats")
        assert found == PAIRING, f"book/{stem}{where}: jupytext.formats expected {PAIRING!r}, found {found!r}"


@pytest.mark.parametrize("stem", executed_stems())
def test_chapter_md_and_ipynb_cells_agree(stem):
    md, nb = read_pair(stem)
    a, b = [cell_view(c) for c in md.cells], [cell_view(c) for c in nb.cells]
    for i, (x, y) in enumerate(zip(a, b)):
        assert x == y, (f"book/{stem}: cell {i} differs between .md and .ipynb "
                        f"(md: {x[0]} {x[1][:60]!r} tags {x[2]}; ipynb: {y[0]} {y[1][:60]!r} "
                        f"tags {y[2]}); run `jupytext --sync book/{stem}.md` and re-execute")
    assert len(a) == len(b), f"book/{stem}: expected {len(a)} cells in the .ipynb (as in the .md), found {len(b)}"


def numbered_chapters() -> list[str]:
    """The `file:` entries of _toc.yml's one numbered part: the chapters, 0, 1, 2, ..."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    numbered = [p for p in toc.get("parts", []) if p.get("numbered")]
    assert len(numbered) == 1, f"_toc.yml: expected one numbered part (the chapters), found {len(numbered)}"
    return [e["file"] for e in numbered[0]["chapters"]]


def test_toc_lists_exactly_the_chapters_that_exist():
    files = toc_files()
    assert files[0] == "book/index" and (ROOT / "book/index.md").exists()
    assert len(files) == len(set(files)), f"_toc.yml: a file listed twice: {files}"
    listed = numbered_chapters()
    matter = [f for f in files[1:] if f not in listed]
    want = sorted((MATTER | NOTEBOOK_PAGES) - {"index"})
    assert sorted(Path(f).name for f in matter) == want, \
        f"_toc.yml: front and back matter expected {want}, found {matter}"
    for f in listed:
        assert (ROOT / f"{f}.ipynb").exists(), f"_toc.yml: {f}: expected {f}.ipynb, found no such file"
    assert sorted(Path(f).name for f in listed) == chapter_stems(), \
        f"_toc.yml: chapters expected {chapter_stems()}, found {listed}"
    assert listed == sorted(listed), f"_toc.yml: chapters expected in NN order, found {listed}"
    numbers = [int(Path(f).name[:2]) for f in listed]
    assert numbers == list(range(len(listed))), \
        f"_toc.yml: chapter files expected numbered 00, 01, ... (the book counts from 0), found {numbers}"


def chapter_title(stem: str) -> str:
    md, _ = read_pair(stem)
    text = "\n".join(c.source for c in md.cells if c.cell_type == "markdown")
    return re.search(r"^# (.+)$", text, re.M)[1]


def test_plan_of_the_book_lists_every_chapter_in_order():
    """Chapter 0's plan is generated from _toc.yml; its committed output must be current."""
    _, nb = read_pair("00-path-of-a-token")
    plan = [c for c in nb.cells if c.cell_type == "code" and "def book_plan" in c.source]
    assert len(plan) == 1, "book/00-path-of-a-token: expected one cell defining book_plan"
    out = "".join(o.get("data", {}).get("text/plain", "") for o in plan[0].outputs)
    rows = [ln for ln in out.splitlines() if ln.strip()]
    expect = [f"{n:>2}  {chapter_title(Path(f).name)}: {read_pair(Path(f).name)[1].metadata['nanoqwen']['builds']}"
              for n, f in enumerate(numbered_chapters())]
    assert rows == expect, f"book/00-path-of-a-token.ipynb: the plan's output is stale (re-run the chapter)\n{out}"
    html = "".join(o.get("data", {}).get("text/html", "") for o in plan[0].outputs)
    for f in numbered_chapters():
        assert f'href="{Path(f).name}.html"' in html, f"the plan links {f}"


def test_config_renders_committed_outputs_and_excludes_md_twins():
    # Sphinx's own pattern matcher (the `book` extra); absent on a bare GPU image.
    Matcher = pytest.importorskip("sphinx.util.matching").Matcher
    cfg = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert cfg["execute"]["execute_notebooks"] == "off", "_config.yml: execute.execute_notebooks"
    assert cfg["only_build_toc_files"] is True, "_config.yml: only_build_toc_files"
    excluded = Matcher(cfg["exclude_patterns"])
    for stem in executed_stems():
        assert excluded(f"book/{stem}.md"), f"_config.yml: exclude_patterns must exclude book/{stem}.md"
        assert not excluded(f"book/{stem}.ipynb"), f"_config.yml: exclude_patterns excludes book/{stem}.ipynb"
    assert not excluded("book/index.md"), "_config.yml: exclude_patterns excludes book/index.md"


def test_jupytext_toml_pairs_ipynb_with_myst():
    text = (ROOT / "jupytext.toml").read_text()
    assert re.search(r'^formats\s*=\s*"ipynb,md:myst"\s*$', text, re.M), "jupytext.toml: formats"


# ----------------------------------------------------------------------------- literalinclude

LITERALINCLUDE_RE = re.compile(r"```\{literalinclude\}\s+(\S+)\n((?::[\w-]+:.*\n)*)```")


def literalincludes():
    for src in sorted(BOOK.glob("*.md")):
        for m in LITERALINCLUDE_RE.finditer(src.read_text()):
            opts = dict(re.findall(r":([\w-]+):\s*(.*)", m.group(2)))
            yield pytest.param(src, m.group(1), opts, id=f"{src.name}:{m.group(1)}:{opts.get('pyobject', '')}")


def python_objects(path: Path) -> set[str]:
    """Dotted names of the functions and classes (and their methods) of a module."""
    names = set()

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(prefix + child.name)
                visit(child, prefix + child.name + ".")

    visit(ast.parse(path.read_text()), "")
    return names


@pytest.mark.parametrize("src,target,opts", list(literalincludes()))
def test_literalinclude_targets_exist(src, target, opts):
    path = ROOT / target.lstrip("/") if target.startswith("/") else src.parent / target
    assert path.exists(), f"{src.relative_to(ROOT)}: literalinclude {target}: expected a file, found none"
    if "pyobject" in opts:
        assert opts["pyobject"] in python_objects(path), \
            f"{src.relative_to(ROOT)}: :pyobject: {opts['pyobject']} expected in {target}, not found"
    text = path.read_text()
    for key in ("start-after", "end-before"):
        if key in opts:
            assert opts[key] in text, f"{src.relative_to(ROOT)}: :{key}: {opts[key]!r} not in {target}"


def test_chapters_show_library_code():
    """At least the two chapters of this piece include real library code, not copies."""
    found = {param.values[0].name for param in literalincludes()}
    assert {"00-path-of-a-token.md", "02-int4-packing.md"} <= found


# ----------------------------------------------------------------------------- goldens

@pytest.mark.parametrize("stem", executed_stems())
def test_golden_is_one_clean_run(stem):
    """The committed outputs come from one top-to-bottom execution; errors only where tagged."""
    nb = nbformat.read(BOOK / f"{stem}.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    counts = [c.execution_count for c in code]
    assert counts == list(range(1, len(code) + 1)), \
        f"book/{stem}.ipynb: execution counts expected 1..{len(code)}, found {counts} (jupyter execute --inplace)"
    for i, c in enumerate(code):
        raised = any(o.output_type == "error" for o in c.outputs)
        tagged = "raises-exception" in c.metadata.get("tags", [])
        assert raised == tagged, (f"book/{stem}.ipynb: code cell {i} "
                                  f"{'raised' if raised else 'did not raise'} but is "
                                  f"{'' if tagged else 'not '}tagged raises-exception")


def test_goldens_carry_no_local_paths():
    for nb_path in sorted(BOOK.glob("*.ipynb")):
        text = nb_path.read_text()
        for bad in ("/home/", "/Users/"):
            assert bad not in text, f"{nb_path.relative_to(ROOT)}: a local path {bad}... in the outputs"


# ----------------------------------------------------------------------------- sanitize

def sanitize(text: str) -> str:
    from nbval.plugin import get_sanitize_patterns

    raw = (BOOK / "sanitize.cfg").read_bytes()
    raw.decode("ascii")  # nbval opens it with the locale's encoding: keep it ASCII
    for regex, replace in get_sanitize_patterns(raw.decode()):
        text = re.sub(regex, replace, text)
    return text


@pytest.mark.parametrize("before,after", [
    ("<Foo object at 0x7f3a2c1d5e90>", "<Foo object at 0xADDRESS>"),
    ("CPU times: user 1.2 ms, sys: 0 ns, total: 1.2 ms", "CPU times: TIME"),
    ("Wall time: 2.5 s", "Wall time: TIME"),
    ("12.3 ms \u00b1 45.6 \u00b5s per loop (mean \u00b1 std. dev. of 7 runs, 100 loops each)",
     "TIME per loop"),
    ("10/10 [00:01<00:00, 9.87it/s]", "10/10 [TQDM]"),
    ("wrote /tmp/tmpk2j3/model.nanoqwen", "wrote TMPPATH"),
    ("packing took 3.2 s", "packing took TIME"),
])
def test_sanitize_hides_what_varies(before, after):
    assert sanitize(before) == after


@pytest.mark.parametrize("stable", [
    "packed word  = 0x2CF37509",
    "decode floor      0.997 ms per token = 1003 tokens/s",
    "prefill floor (compute) 8.53 ms at 790 TFLOP/s",
])
def test_sanitize_keeps_what_is_compared(stable):
    assert sanitize(stable) == stable


# ----------------------------------------------------------------------------- conftest

def _notebook(cells):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for source, stored, tags in cells:
        c = nbformat.v4.new_code_cell(source, metadata={"tags": tags} if tags else {})
        c.execution_count = 1
        c.outputs = [nbformat.v4.new_output("stream", name="stdout", text=stored)]
        nb.cells.append(c)
    return nb


def test_conftest_gpu_cells_and_gpu_tests(tmp_path):
    """Run the real conftest.py on a scratch notebook with nbval in a child pytest."""
    from nanoqwen_lib.gpu.cuda_build import have_gpu

    (tmp_path / "conftest.py").write_text((ROOT / "conftest.py").read_text())
    nbformat.write(_notebook([("print('cpu')", "h200\n", ["gpu"]),   # differs, tagged gpu
                              ("print(1 + 1)", "2\n", [])]), tmp_path / "good.ipynb")
    nbformat.write(_notebook([("print(1 + 1)", "3\n", [])]), tmp_path / "bad.ipynb")
    (tmp_path / "test_marks.py").write_text(
        "import pytest\n\n@pytest.mark.gpu\ndef test_needs_gpu():\n    pass\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval", "-v", "-p", "no:cacheprovider",
         "-o", "markers=gpu: needs a GPU", "good.ipynb", "bad.ipynb", "test_marks.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    gpu = have_gpu()
    expect = {  # nbval 0.11 names a cell item "good::ipynb::Cell 0" in -v output
        r"good(\.|::)ipynb::Cell 0": "FAILED" if gpu else "PASSED",  # compared only on a GPU
        r"good(\.|::)ipynb::Cell 1": "PASSED",
        r"bad(\.|::)ipynb::Cell 0": "FAILED",                        # untagged: compared
        r"test_marks\.py::test_needs_gpu": "PASSED" if gpu else "SKIPPED",
    }
    for item, verdict in expect.items():
        assert re.search(rf"{item} {verdict}", out), f"{item}: expected {verdict}\n{out[-3000:]}"


# ----------------------------------------------------------------------------- prose numbers

GLUE_ROLE_RE = re.compile(r"\{glue(?::\w+)?\}`([^`]+)`")
GLUE_CALL_RE = re.compile(r"""\bglue\(\s*["']([^"']+)["']""")
RECORD_MIME = "application/papermill.record/"


def chapter_outputs_text(nb) -> str:
    text = []
    for c in nb.cells:
        if c.cell_type == "code":
            for o in c.outputs:
                text.append(o.get("text", ""))
                for mime, data in o.get("data", {}).items():
                    if mime.startswith("text/") or mime.startswith(RECORD_MIME):
                        text.append(data if isinstance(data, str) else "".join(data))
    return "\n".join(text)


@pytest.mark.parametrize("stem", executed_stems())
def test_glued_numbers_have_their_cell(stem):
    """Every {glue:text}`key` of the prose is glued by a code cell of its chapter, and the
    committed outputs carry it (after the chapter's last execution)."""
    md, nb = read_pair(stem)
    prose = "\n".join(c.source for c in md.cells if c.cell_type == "markdown")
    used = set(GLUE_ROLE_RE.findall(prose))
    glued_by = {}
    for c in nb.cells:
        if c.cell_type == "code":
            for key in GLUE_CALL_RE.findall(c.source):
                glued_by[key] = c
    for key in sorted(used):
        assert key in glued_by, f"book/{stem}: the prose uses glue key {key!r}, no cell glues it"
        cell = glued_by[key]
        records = [o for o in cell.outputs if any(m.startswith(RECORD_MIME) for m in o.get("data", {}))]
        keys = {o.get("metadata", {}).get("scrapbook", {}).get("name") for o in records}
        assert key in keys, (f"book/{stem}.ipynb: glue key {key!r} is not in the committed outputs of its cell "
                             f"(re-execute the chapter: the outputs are older than the cell)")


# A number with a unit, as a reader reads it: the number (a range "290-380" is one), then
# its unit as a token. "x" must touch the number ("1.7x"); "times" reads as "x".
UNIT_RE = r"(?:TFLOP/s|GB/s|TB/s|GB|KiB|MiB|ms|us|\u00b5s|%|x(?![\w-])|times\b|SMs?\b|tokens?\b)"
NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?"
PROSE_NUMBER_RE = re.compile(rf"(?<![\w.,/^-])~?({NUMBER}(?:[-\u2013]{NUMBER})?)(\s?)({UNIT_RE})")
TEXT_NUMBER_RE = re.compile(rf"(?<![\w.])({NUMBER})(\s?)({UNIT_RE})")
LABEL_RE = re.compile(r"^\(((?:ch|sec)-[\w-]+)\)=", re.M)
REF_RE = re.compile(r"\{(?:numref|ref)\}`(?:[^<`]*<)?((?:ch|sec)-[\w-]+)>?`")
RECORD_RE = re.compile(r"book/data/([\w.-]+\.json)")


def _unit(u: str, space: str = "") -> str:
    u = {"\u00b5s": "us", "times": "x", "SM": "SMs", "token": "tokens"}.get(u, u)
    return "x" if u == "x" and not space else u if u != "x" else "x?"   # "3 x 5" is a product, not a ratio


def _value(text: str) -> float:
    return float(text.replace(",", ""))


def _decimals(text: str) -> int:
    return len(text.split(".")[1]) if "." in text else 0


class Source:
    """Numbers with their units in a text (outputs, the performance log), each as (unit,
    value, decimals): a number counts only with its unit beside it (a table whose header
    carries the unit does not hold its rows' numbers); or a record's numbers (no units,
    matched by value)."""

    def __init__(self, text: str = "", values: list | None = None):
        self.pairs = set()
        for m in TEXT_NUMBER_RE.finditer(text):
            self.pairs.add((_unit(m.group(3), m.group(2)), _value(m.group(1)), _decimals(m.group(1))))
        self.values = values or []     # a record's numbers: no units, matched by value

    def has(self, number: str, unit: str) -> bool:
        want, d = _value(number), _decimals(number)
        close = lambda v, dv: dv >= d and abs(round(v, d) - want) < 1e-9  # noqa: E731  (printed as precisely, then rounded)
        if any(u == unit and close(v, dv) for u, v, dv in self.pairs):
            return True
        scale = 100 if unit == "%" else 1
        return any(abs(round(v * scale, d) - want) < 1e-9 for v in self.values)


def _record_values(path: Path) -> list[float]:
    import json
    out = []

    def walk(x):
        if isinstance(x, bool):
            return
        if isinstance(x, (int, float)):
            out.append(float(x))
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(json.loads(path.read_text()))
    return out


def _labels() -> dict:
    """ch-/sec- label -> the stem of the chapter (or page) that defines it."""
    out = {}
    for md in BOOK.glob("*.md"):
        for label in LABEL_RE.findall(md.read_text()):
            out[label] = md.stem
    return out


def _outputs(stem: str) -> str:
    nb_path = BOOK / f"{stem}.ipynb"
    return chapter_outputs_text(nbformat.read(nb_path, as_version=4)) if nb_path.exists() else ""


def prose_numbers(stem: str):
    """(paragraph, number, unit) for every number with a unit in the chapter's prose, code,
    math, glue roles and directive blocks left out."""
    md, _ = read_pair(stem)
    for c in md.cells:
        if c.cell_type != "markdown":
            continue
        src = re.sub(r"```.*?```", "", c.source, flags=re.S)
        for para in re.split(r"\n\s*\n", src):
            text = re.sub(r"\{[\w:-]+\}`[^`]*`|`[^`]*`|\$\$.*?\$\$|\$[^$]*\$", " ", para, flags=re.S)
            for m in PROSE_NUMBER_RE.finditer(text):
                unit = _unit(m.group(3), m.group(2))
                if unit == "x?":
                    continue
                yield para, m.group(1), unit


def paragraph_sources(para: str, labels: dict) -> list[tuple[str, Source]]:
    """The sources a paragraph names that this test can read: records of book/data, the
    performance log, and the chapters its {ref}/{numref} point at (their outputs)."""
    out = []
    for name in RECORD_RE.findall(para):
        path = BOOK / "data" / name
        if path.exists():
            out.append((f"book/data/{name}", Source(values=_record_values(path))))
    if "PERFLOG" in para or "book-perflog" in para:
        out.append(("PERFLOG.md", Source((ROOT / "PERFLOG.md").read_text())))
    for label in REF_RE.findall(para):
        if label in labels:
            out.append((f"book/{labels[label]} (outputs)", Source(_outputs(labels[label]))))
    return out


def _check(number: str, unit: str, own: Source, sources) -> bool:
    parts = re.split(r"[-\u2013]", number) if re.search(r"\d[-\u2013]\d", number) else [number]
    return all(own.has(n, unit) or any(s.has(n, unit) for _, s in sources) for n in parts)


# Prose numbers no cell prints and no readable source holds, known and kept, each with why:
# (chapter stem, number, unit) -> reason.
PROSE_ALLOWED = {
    ("00-path-of-a-token", "8", "tokens"): "exercise: a batch size to try",
    ("01-weight-file", "0.5", "GB"): "the tiny file's size, roughly (chapter 12 prints 560.7 MB)",
    ("03-reference-model", "15", "GB"): "the real checkpoint's download, outside the book",
    ("04-int4-gemv", "80-90", "%"): "the prediction the H200 contradicted, not a measurement",
    ("05-paged-kv-cache", "15", "tokens"): "arithmetic: a 16-token page wastes at most 15",
    ("05-paged-kv-cache", "49", "tokens"): "the example length the chapter builds, named in the text",
    ("05-paged-kv-cache", "32", "tokens"): "exercise: a page size to try",
    ("06-paged-attention", "132", "SMs"): "the H200's SM count (datasheet; nanoqwen.yaml hardware)",
    ("06-paged-attention", "4", "KiB"): "a page's K or V slice of one head: 16 x 128 x 2 bytes",
    ("06-paged-attention", "4", "tokens"): "a lane's share of a page, from the kernel's layout",
    ("06-paged-attention", "32768", "tokens"): "a context of the chapter's CONTEXTS, printed as 'ctx 32768'",
    ("06-paged-attention", "60", "MiB"): "the H200's L2 (the attention bench's protocol)",
    ("06-paged-attention", "2", "KiB"): "K+V of one token and layer: 2 x 4 x 128 x 2 bytes",
    ("06-paged-attention", "228", "KiB"): "exercise: the SM's shared memory (datasheet)",
    ("06-paged-attention", "16", "tokens"): "exercise: the m16n8k16 shape",
    ("07-decoder-layer", "1.09", "GB"): "lm_head's bytes (the bytes table prints 1,089,994,752)",
    ("07-decoder-layer", "8192", "tokens"): "exercise: a context to try",
    ("08-prefill", "4.5", "GB"): "a decode token's bytes, rounded (chapter 12 prints 4.488 GB per token)",
    ("08-prefill", "64", "tokens"): "a tile's rows, from the kernel's layout",
    ("08-prefill", "600", "tokens"): "a test's prompt length (tests/test_gpu_engine.py)",
    ("08-prefill", "1100", "tokens"): "a test's prompt length (tests/test_gpu_engine.py)",
    ("09-cuda-graphs", "119", "ms"): "the original runtime's H100 figure (src-article)",
    ("09-cuda-graphs", "17", "ms"): "the original runtime's H100 figure (src-article)",
    ("10-no-bubbles", "33", "KiB"): "arithmetic on the kernel's ring (16 warps x 2 blocks)",
    ("10-no-bubbles", "16", "tokens"): "the attention split's minimum (nanoqwen.yaml NQ_PD_ATTN_MIN_TOKENS)",
    ("10-no-bubbles", "116", "KiB"): "arithmetic: the partials of 32 slices",
    ("10-no-bubbles", "32", "tokens"): "the lane path's slice limit, from the kernel",
    ("10-no-bubbles", "56", "KiB"): "arithmetic: fp32 slices of x on the 7B",
    ("10-no-bubbles", "7", "KiB"): "arithmetic: x on the 7B (3584 x 2 bytes)",
    ("10-no-bubbles", "130", "tokens"): "the GPU tests' stream length (tests/test_gpu_persistent.py)",
    ("11-scoreboard", "3.35", "TB/s"): "the H100's HBM3 (src-nvidia datasheet)",
    ("11-scoreboard", "4.8", "TB/s"): "the H200's nominal bandwidth (datasheet)",
}


@pytest.mark.parametrize("stem", executed_stems())
def test_prose_numbers_come_from_outputs_or_their_source(stem):
    """A number with a unit in the prose (ms, us, GB, GB/s, TB/s, TFLOP/s, %, x, SMs, KiB,
    MiB, tokens) is printed by a cell of its chapter or held by a source its paragraph names
    (a record in book/data, PERFLOG.md, or the outputs of a chapter it refers to), matched
    as a number with its unit (rounded as the prose rounds it), not as a substring."""
    labels = _labels()
    own = Source(_outputs(stem))
    bad = []
    for para, number, unit in prose_numbers(stem):
        if (stem, number, unit) in PROSE_ALLOWED:
            continue
        if not _check(number, unit, own, paragraph_sources(para, labels)):
            bad.append(f"{number} {unit}")
    assert not bad, (f"book/{stem}: prose numbers found in no output of the chapter and no source their "
                     f"paragraph names (glue them, or cite where they come from): {bad}")


def test_prose_allow_list_is_current():
    """Every allowed number is still in its chapter's prose and still unmatched."""
    labels = _labels()
    for (stem, number, unit), reason in PROSE_ALLOWED.items():
        assert reason, (stem, number, unit)
        found = [para for para, n, u in prose_numbers(stem) if (n, u) == (number, unit)]
        assert found, f"book/{stem}: allowed prose number {number} {unit} is no longer in the prose: drop it"
        assert any(not _check(number, unit, Source(_outputs(stem)), paragraph_sources(p, labels)) for p in found), \
            f"book/{stem}: allowed prose number {number} {unit} is now matched: drop it from PROSE_ALLOWED"


@pytest.mark.parametrize("text, number, unit, found", [
    ("ITL 1.771 ms", "1.77", "ms", True),          # printed more precisely, rounded as the prose rounds
    ("ITL 1.771 ms", "1.8", "ms", True),
    ("ITL 11.77 ms", "1.77", "ms", False),         # a substring is not the number
    ("ITL 1.77 us", "1.77", "ms", False),          # another unit
    ("ITL 1.7 ms", "1.77", "ms", False),           # less precise than the prose
    ("gate_up 0.760 0.432 57% 0.328", "57", "%", True),
    ("floor 35.4 us at 32768 tokens", "32768", "tokens", True),
    ("1.37x faster", "1.37", "x", True),
    ("1.37 x 2", "1.37", "x", False),
])
def test_prose_number_matching(text, number, unit, found):
    assert Source(text).has(number, unit) is found
