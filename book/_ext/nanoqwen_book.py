"""Sphinx-side pieces of the book (a local extension, `_config.yml` sphinx.local_extensions).

* Chapters are numbered from 0, as their files are (book/00-path-of-a-token is chapter 0):
  Sphinx counts a numbered toctree from 1, so after it has assigned the section numbers
  every number's first component is lowered by one. The sidebar, the page titles and
  `{numref}` ("Chapter %s", numfig_format) then agree with the prose and the file names.
* A kernel's `// nq-variants: ...` header line is build metadata (the compile-time variants
  the NVRTC tests build), one line of several hundred characters: the book's literal
  includes of kernels/ leave it out; the file keeps it.
"""
from __future__ import annotations

import re

from docutils import nodes

CHAPTER_OFFSET = -1   # Sphinx's first chapter is 1; the book's is 0


def _shift(number):
    if number:
        number[0] += CHAPTER_OFFSET


def _shift_env(env) -> None:
    """Lower the first component of every section number Sphinx assigned."""
    for docname, secnums in env.toc_secnumbers.items():
        env.toc_secnumbers[docname] = {
            anchor: None if n is None else (n[0] + CHAPTER_OFFSET, *n[1:]) for anchor, n in secnums.items()}
    seen = set()   # a title node and its toc reference share one list: shift each list once
    for docname in env.toc_secnumbers:
        for node in env.tocs[docname].findall(nodes.reference):
            number = node.get("secnumber")
            if number and id(number) not in seen:
                seen.add(id(number))
                _shift(number)
        title = env.titles.get(docname)
        number = title.get("secnumber") if title is not None else None
        if number and id(number) not in seen:
            seen.add(id(number))
            _shift(number)


def _wrap_section_numbering(app) -> None:
    try:   # jupyter-book's collector: it renumbers after Sphinx's (numbering styles)
        from sphinx_external_toc.collectors import TocTreeCollectorWithStyles as Collector
    except ImportError:
        from sphinx.environment.collectors.toctree import TocTreeCollector as Collector

    assign = Collector.assign_section_numbers   # the last word on the numbers
    if getattr(assign, "_nanoqwen_zero_based", False):
        return

    def assign_section_numbers(self, env):
        changed = assign(self, env)
        _shift_env(env)
        return changed

    assign_section_numbers._nanoqwen_zero_based = True
    Collector.assign_section_numbers = assign_section_numbers


BUILD_METADATA_LINE = re.compile(r"^// nq-variants:.*\n?", re.M)


def _drop_build_metadata(app, doctree) -> None:
    """Remove `// nq-variants:` lines from literal includes of kernel sources."""
    for block in doctree.findall(nodes.literal_block):
        source = str(block.get("source") or "")
        if not source.endswith((".cu", ".cuh")):
            continue
        text = block.astext()
        kept = BUILD_METADATA_LINE.sub("", text)
        if kept != text:
            block.children = [nodes.Text(kept)]
            block.rawsource = kept


def setup(app):
    app.connect("doctree-read", _drop_build_metadata)
    # builder-inited runs after every extension's setup(), so this wraps whichever
    # assign_section_numbers is installed by then.
    app.connect("builder-inited", _wrap_section_numbering)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
