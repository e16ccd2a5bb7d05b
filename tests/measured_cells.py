"""Chapter cells tagged `nbval-measured`: compared with this run's measurements masked.

A cell that prints a timing table, a plan or an error of the GPU's sum order cannot match its
H200 golden digit for digit on another run or another Hopper GPU, but everything else in it
must: which rows and columns the table has, every word, unit and label, how many outputs
(figures, glued values) the cell makes, and that it ran at all. `conftest.py` gives such a
cell this comparison instead of nbval's exact one; `nbval-ignore-output` (nothing compared)
stays for the few cells whose very shape depends on the machine.

What is masked, in the fresh output and the golden alike, after book/sanitize.cfg:
- every number that does not belong to a name (`1.77`, `-4.9`, `3.1e-04`, `57%` keeps its
  `%`; `H200`, `sm_90`, `fp16`, `p10`, `x28` are names and stay),
- hexadecimal offsets, ISO timestamps and commit hashes,
- runs of spaces (a column is as wide as its widest number),
- the values of glued records (myst-nb `glue`): they are the numbers the prose quotes, taken
  from what the cell prints.
"""
from __future__ import annotations

import copy
import re

MEASURED_TAG = "nbval-measured"
GLUE_MIME = "application/papermill.record/"
GLUED = "<glued value>"

_MASKS = [
    (re.compile(r"\b\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d)?"), "TIMESTAMP"),
    (re.compile(r"\b(commit:? )[0-9a-f]{7,40}\b"), r"\1COMMIT"),
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "0x#"),
    # a number not glued to a name before it: digits, a fraction, an exponent
    (re.compile(r"(?<![A-Za-z_0-9.])[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"), "#"),
    (re.compile(r"[ \t]+"), " "),
    (re.compile(r" +$", re.MULTILINE), ""),
]


def mask_measured(text):
    """`text` with this run's measurements masked (a non-string is returned as it is)."""
    if not isinstance(text, str):
        return text
    for regex, replace in _MASKS:
        text = regex.sub(replace, text)
    return text


def mask_glue(outputs):
    """A copy of a cell's outputs whose glued values are masked whole."""
    outputs = copy.deepcopy(outputs)
    for out in outputs:
        for mime in list(out.get("data", {})):
            if mime.startswith(GLUE_MIME):
                out["data"][mime] = GLUED
    return outputs


def compare_measured(item):
    """Give an nbval cell item the measured comparison (nbval 0.11: `sanitize` and
    `compare_outputs` are the methods it calls on the item)."""
    from nbval.plugin import IPyNbCell

    def sanitize(s):
        return mask_measured(IPyNbCell.sanitize(item, s))

    def compare_outputs(test, ref, skip_compare=None):
        return IPyNbCell.compare_outputs(item, mask_glue(test), mask_glue(ref), skip_compare)

    item.sanitize = sanitize
    item.compare_outputs = compare_outputs
