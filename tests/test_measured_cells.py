"""Cells tagged `nbval-measured`: their numbers are masked, everything else is compared; the
few `nbval-ignore-output` cells left say why (tests/measured_cells.py, conftest.py)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from tests.measured_cells import GLUE_MIME, MEASURED_TAG, mask_glue, mask_measured
from tests.test_book import _notebook   # a scratch notebook: (source, stored stdout, tags) per cell

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"
IGNORE_TAG = "nbval-ignore-output"
MAX_IGNORED = 2          # cells whose very shape depends on the machine


@pytest.mark.parametrize("a, b", [
    ("qkv GEMV + bias    8.541     8.26   1035   22.3%", "qkv GEMV + bias    8.541    12.01    735  15.9%"),
    ("graph ITL 2.3143 ms (p10 2.3076, p90 2.3180)", "graph ITL 2.4 ms (p10 2.3, p90 12.5)"),
    ("layer 27 K   relative error 2.0e-03", "layer 27 K   relative error 3.5e-04"),
    ("end -7.33 -4.90", "end 0.58 12.1"),
    ("commit 1f97a96b05; 2026-12-02T06:26:09Z", "commit 8c73286d11; 2027-01-15T23:59:01Z"),
    ("Read access at paged_attention_split_buggy+0xb20", "Read access at paged_attention_split_buggy+0x2050"),
    ("<Figure size 800x411.769 with 1 Axes>", "<Figure size 900x411.769 with 1 Axes>"),
])
def test_the_numbers_of_a_run_are_masked(a, b):
    assert mask_measured(a) == mask_measured(b)


@pytest.mark.parametrize("a, b", [
    ("qkv GEMV + bias 8.54 us", "o_proj GEMV + bias 8.54 us"),          # another row
    ("ITL 1.77 ms", "ITL 1.77 us"),                                      # another unit
    ("wrong 0, hung 0 of 8", "wrong 0, hung 0 of 8; timed out"),         # another word
    ("fp16 relative error 1e-3", "fp32 relative error 1e-3"),           # a name's digits stay
    ("57%", "57"),                                                       # a percentage stays one
    ("a\nb", "a\nb\nc"),                                                 # another line
    ("sm_90 NVIDIA H200", "sm_80 NVIDIA H200"),
])
def test_what_is_not_a_measurement_is_compared(a, b):
    assert mask_measured(a) != mask_measured(b)


def test_glued_values_are_masked_whole():
    out = [nbformat.v4.new_output("display_data", data={GLUE_MIME + "text/plain": "'`qkv` and `down`'"}),
           nbformat.v4.new_output("stream", name="stdout", text="x 1.2\n")]
    masked = mask_glue(out)
    assert masked[0]["data"][GLUE_MIME + "text/plain"] != out[0]["data"][GLUE_MIME + "text/plain"]
    assert masked[1] == out[1] and out[0]["data"][GLUE_MIME + "text/plain"] == "'`qkv` and `down`'"  # a copy


def _chapter_cells():
    for md in sorted(BOOK.glob("[0-9][0-9]-*.md")):
        nb = nbformat.read(md.with_suffix(".ipynb"), as_version=4)
        for i, c in enumerate(nb.cells):
            if c.cell_type == "code":
                yield md.stem, i, c


def test_every_masked_or_ignored_cell_says_why():
    for stem, i, c in _chapter_cells():
        tags = c.metadata.get("tags", [])
        for tag in (MEASURED_TAG, IGNORE_TAG):
            if tag in tags:
                first = c.source.splitlines()[0] if c.source else ""
                assert re.match(rf"# {tag}: \S.{{10,}}", first), \
                    f"{stem} cell {i}: tagged {tag}, its first line must be '# {tag}: <why>', not {first!r}"
        assert not (MEASURED_TAG in tags and IGNORE_TAG in tags), f"{stem} cell {i}: both tags"


def test_only_a_handful_of_cells_are_not_compared():
    ignored = [(stem, i) for stem, i, c in _chapter_cells() if IGNORE_TAG in c.metadata.get("tags", [])]
    assert len(ignored) <= MAX_IGNORED, f"{len(ignored)} cells tagged {IGNORE_TAG}: {ignored}"


def test_a_measured_golden_masks_to_a_fixed_shape():
    """Each measured cell's committed text, masked, still names what it measures: a cell whose
    every character is a number (nothing would be compared) is a mistake."""
    for stem, i, c in _chapter_cells():
        if MEASURED_TAG not in c.metadata.get("tags", []):
            continue
        text = "".join(o.get("text", "") for o in c.outputs)
        if text:
            assert re.search(r"[A-Za-z]{3}", mask_measured(text)), f"{stem} cell {i}: nothing but numbers"


def test_conftest_compares_measured_cells_with_numbers_masked(tmp_path):
    """The real conftest.py, in a child pytest with nbval, on cells that run on any machine."""
    (tmp_path / "conftest.py").write_text((ROOT / "conftest.py").read_text())
    m = [MEASURED_TAG]
    nbformat.write(_notebook([
        ("print('ITL', 1.0 + 0.77, 'ms')", "ITL 2.31 ms\n", m),         # another run's number: passes
        ("print('ITL', 1.77, 'us')", "ITL 1.77 ms\n", m),               # another unit: fails
        ("print('ITL  ', 1.77)", "ITL 1.77\n", m),                      # column widths: passes
        ("print('ITL', 1.77)", "ITL 2.31\n", []),                       # not tagged: exact, fails
    ]), tmp_path / "cells.ipynb")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "pytest", "--nbval", "-v", "-p", "no:cacheprovider", "cells.ipynb"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    for cell, verdict in enumerate(("PASSED", "FAILED", "PASSED", "FAILED")):
        assert re.search(rf"cells(\.|::)ipynb::Cell {cell} {verdict}", out), f"cell {cell}: {verdict}\n{out[-3000:]}"
