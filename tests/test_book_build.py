"""The rendered book, built once (`jupyter-book build`, execution off: about ten seconds)
and read as a browser gets it: numbered chapters, math served from the book itself,
every reference resolved, the plan of the book and the glossary in place, outputs that
scroll rather than clip."""
from __future__ import annotations

import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("jupyter_book", reason="the book extra is not installed")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(html directory, build log) of a fresh nitpicky build of the whole book."""
    out = tmp_path_factory.mktemp("book")
    run = subprocess.run([sys.executable, "-c", "from jupyter_book.cli.main import main; main()", "build", str(ROOT), "--path-output", str(out),
                          "-n", "--keep-going"], capture_output=True, text=True, timeout=600)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    return out / "_build" / "html", log


def pages(html_dir: Path) -> list[Path]:
    return sorted((html_dir / "book").glob("*.html"))


def chapters() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    part = next(p for p in toc["parts"] if p.get("numbered"))
    return [Path(e["file"]).name for e in part["chapters"]]


class _Text(HTMLParser):
    """The text of a page outside math, code and scripts (what a reader sees as prose)."""
    SKIP = {"script", "style", "pre", "code", "math"}

    def __init__(self):
        super().__init__()
        self.depth, self.skip_stack, self.parts = 0, [], []

    def handle_starttag(self, tag, attrs):
        cls = dict(attrs).get("class") or ""
        skip = tag in self.SKIP or "math" in cls.split()
        self.skip_stack.append(skip)
        self.depth += skip

    def handle_endtag(self, tag):
        if self.skip_stack:
            self.depth -= self.skip_stack.pop()

    def handle_data(self, data):
        if not self.depth:
            self.parts.append(data)


def prose(page: Path) -> str:
    p = _Text()
    p.feed(page.read_text())
    return "".join(p.parts)


def test_build_has_no_warnings(built):
    """-n: an undefined label, term, document or numref target is a warning; so is a bad
    heading level or a missing include."""
    _, log = built
    warnings = [ln for ln in log.splitlines() if "WARNING" in ln or "ERROR" in ln]
    assert not warnings, "\n".join(warnings[:20])


def test_chapters_are_numbered_from_zero(built):
    html_dir, _ = built
    for n, stem in enumerate(chapters()):
        page = (html_dir / "book" / f"{stem}.html").read_text()
        numbered = re.findall(r'<h1><span class="section-number">(\d+)\. </span>', page)
        assert numbered == [str(n)], f"{stem}: expected the title numbered {n}, found {numbered}"
        # the sidebar numbers every chapter too
        for m, other in enumerate(chapters()):
            if other != stem:
                assert re.search(rf'href="{other}.html">{m}\. ', page), f"{stem}: sidebar entry {m} ({other})"
                break


def test_numbered_references_read_chapter_n(built):
    html_dir, _ = built
    refs = []
    for page in pages(html_dir):
        refs += re.findall(r'class="std std-numref">([^<]*)<', page.read_text())
    assert refs, "no {numref} in the book"
    for r in refs:
        assert re.fullmatch(r"Chapter \d+", r), f"a numref renders as {r!r}"
    for page in pages(html_dir):
        text = prose(page)
        assert not re.search(r"Chapter [A-Z][a-z]", text), f"{page.name}: 'Chapter <title>' (a {{ref}} after 'Chapter')"


def test_math_is_served_from_the_book(built):
    """Every page with math loads MathJax from the book's own _static, never a CDN, and the
    script is there: the formulas render offline."""
    html_dir, _ = built
    with_math = 0
    for page in [html_dir / "index.html", *pages(html_dir)]:
        text = page.read_text()
        srcs = re.findall(r'<script[^>]*src="([^"]*)"', text)
        assert not [s for s in srcs if s.startswith(("http:", "https:", "//"))], f"{page.name}: a remote script"
        if 'class="math' in text:
            with_math += 1
            mj = [s for s in srcs if "mathjax" in s.lower()]
            assert mj, f"{page.name}: math but no MathJax script"
            for s in mj:
                assert "_static/mathjax/" in s, f"{page.name}: MathJax from {s}"
                assert (page.parent / s.split("?")[0]).resolve().is_file(), f"{page.name}: {s} not in the build"
    assert with_math >= 5, f"expected math on several pages, found {with_math}"


def test_no_math_left_unparsed(built):
    """Dollar math that MyST did not parse would reach the reader as raw LaTeX."""
    html_dir, _ = built
    for page in pages(html_dir):
        text = prose(page)
        for raw in ("$$", "\\(", "\\[", "\\frac", "\\sum", "\\mathrm"):
            assert raw not in text, f"{page.name}: raw {raw!r} in the prose: {text[text.index(raw) - 80:][:160]!r}"


def test_plan_of_the_book_links_every_chapter(built):
    html_dir, _ = built
    page = (html_dir / "book" / f"{chapters()[0]}.html").read_text()
    plan = page[page.index('id="sec-plan"'):]
    for stem in chapters():
        assert f'href="{stem}.html"' in plan, f"the plan of the book does not link {stem}"


def test_front_and_back_matter(built):
    html_dir, _ = built
    for name in ("preface", "architecture", "design", "glossary", "perflog"):
        assert (html_dir / "book" / f"{name}.html").is_file(), name
    perflog = prose(html_dir / "book" / "perflog.html")
    first = next(ln for ln in (ROOT / "PERFLOG.md").read_text().splitlines() if ln.startswith("## "))
    assert first[3:].split("(")[0].strip()[:30] in perflog, "PERFLOG.md is not included in the book"
    glossary = (html_dir / "book" / "glossary.html").read_text()
    terms = re.findall(r'<dt id="term-([^"]+)"', glossary)
    linked = set()
    for page in pages(html_dir):
        linked |= set(re.findall(r'href="glossary.html#term-([^"]+)"', page.read_text()))
    unused = sorted(set(terms) - linked)
    assert not unused, f"glossary terms no page links: {unused}"


def test_outputs_scroll_instead_of_clipping(built):
    """Wide printed outputs and output tables get a horizontal scroll bar; code wraps."""
    html_dir, _ = built
    css = (html_dir / "_static" / "nanoqwen.css").read_text()
    rules = dict(re.findall(r"([^{}]+)\{([^}]*)\}", re.sub(r"/\*.*?\*/", "", css, flags=re.S)))
    rules = {" ".join(k.split()): v for k, v in rules.items()}

    def rule(selector_part):
        return next(v for k, v in rules.items() if selector_part in k)

    assert "overflow-x: auto" in rule("div.cell_output pre")
    assert "overflow-x: auto" in rule("div.output.text_html")
    assert "pre-wrap" in rule("div.highlight pre")
    for page in pages(html_dir):
        assert "_static/nanoqwen.css" in page.read_text(), f"{page.name}: the book's CSS is not linked"


def test_kernel_build_metadata_is_not_shown(built):
    """The `// nq-variants:` header lines (hundreds of characters of build metadata) stay in
    the kernel files and out of the book; the rest of the header is shown."""
    html_dir, _ = built
    assert "nq-variants" in (ROOT / "kernels" / "gemv_int4.cu").read_text()
    for page in pages(html_dir):
        assert "nq-variants" not in page.read_text(), page.name
    assert "NQ_GEMV_FOLD" in (html_dir / "book" / "04-int4-gemv.html").read_text()
