"""The headline figures the landing page, the preface and the README quote come from one
record: chapter 11's scoreboard (book/data/scoreboard.json), through
nanoqwen_lib.measure.headlines (markers `<!-- headline:KEY -->VALUE<!-- /headline -->`).

* every marker of those pages holds exactly the record's figure;
* the pages carry the markers they must (the ITL, the TTFT, the ratio to llama.cpp);
* no other number with a unit stands in the landing page, and in the preface only where its
  paragraph names its source (the article, annotated-llm-runtime, a datasheet): a headline figure typed in by hand
  is the next stale claim;
* the record timed today's default decode step (nanoqwen.yaml engine.decode), so that every
  ratio in it is against the engine as it is;
* the machinery itself: a record 5% off fails the pages, `rewrite` puts the record back.

After chapter 11 has rewritten the record on a GPU (NANOQWEN_WRITE_RECORDS=1),
`python3 -m nanoqwen_lib.measure.headlines --write` rewrites the markers' values.
"""
from __future__ import annotations

import copy
import json
import re

import pytest

from nanoqwen_lib.errors import NanoqwenError
from nanoqwen_lib.measure import headlines

ROOT = headlines.REPO
RECORD = json.loads(headlines.RECORD.read_text())
FIGS = headlines.figures(RECORD)
FIX = "python3 -m nanoqwen_lib.measure.headlines --write"

# What each page must quote (README: once it carries markers at all).
REQUIRED = {
    "book/index.md": {"itl_ms", "ttft_ms", "vs_llama_cpp_q4_k_m"},
    "book/preface.md": {"vs_llama_cpp_q4_k_m", "vs_llama_cpp_q4_0"},
    "README.md": {"itl_ms", "ttft_ms", "vs_llama_cpp_q4_k_m", "vs_llama_cpp_q4_0"},
}
NUMBER_WITH_UNIT = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:ms|us|µs|TB/s|GB/s|GHz|TFLOP/s|%|x\b)")
SOURCE_WORDS = ("article", "datasheet", "annotated-llm-runtime")   # the outside sources that quote figures


def page(name: str) -> str:
    return (ROOT / name).read_text()


@pytest.mark.parametrize("name", headlines.PAGES)
def test_page_quotes_the_record(name):
    text = page(name)
    marks = headlines.quoted(text)
    if name == "README.md" and not marks:
        pytest.skip("README.md has no headline markers yet (its figures are not checked until it does)")
    missing = REQUIRED[name] - {k for k, _ in marks}
    assert not missing, f"{name}: expected headline markers for {sorted(missing)} (measure/headlines.py FIGURES)"
    for key, value in marks:
        assert key in FIGS, (f"{name}: headline:{key}: expected one of {sorted(FIGS)} "
                             f"(the figures book/data/scoreboard.json gives), found an unknown key")
        assert value == FIGS[key], (f"{name}: headline:{key} says {value!r}, book/data/scoreboard.json gives "
                                    f"{FIGS[key]!r}: run `{FIX}`")


def _bare_numbers(text: str) -> list[tuple[str, str]]:
    """(number, its paragraph) for every number with a unit outside a headline marker, a code
    span or a role."""
    text = headlines.MARKER_RE.sub("", text)
    out = []
    for para in re.split(r"\n\s*\n", text):
        clean = re.sub(r"\{[\w:-]+\}`[^`]*`|`[^`]*`|\$[^$]*\$|<!--.*?-->", "", para, flags=re.S)
        out += [(m.group(0), para) for m in NUMBER_WITH_UNIT.finditer(clean)]
    return out


def test_landing_page_has_no_hand_typed_figures():
    bare = [n for n, _ in _bare_numbers(page("book/index.md"))]
    assert not bare, f"book/index.md: figures outside a headline marker: {bare} (quote them from the record)"


def test_preface_figures_name_their_source():
    bare = [n for n, para in _bare_numbers(page("book/preface.md")) if not any(w in para for w in SOURCE_WORDS)]
    assert not bare, (f"book/preface.md: figures outside a headline marker whose paragraph names no source "
                      f"({', '.join(SOURCE_WORDS)}): {bare}")


def test_record_timed_todays_default_step():
    """The scoreboard's ratios are against the engine only if its run timed the default step."""
    got, want = headlines.decode_step(RECORD), headlines.default_step()
    assert got == want, (f"book/data/scoreboard.json: protocol.decode expected the default decode step "
                         f"({want}: {headlines.DECODE_NAMES.get(want)!r}), found {RECORD['protocol'].get('decode')!r}: "
                         f"re-run chapter 11 on the GPU with NANOQWEN_WRITE_RECORDS=1, then `{FIX}`")


# ------------------------------------------------------------------------- the machinery

def test_a_record_five_percent_off_fails_the_pages():
    off = copy.deepcopy(RECORD)
    off["itl_ms"]["median"] *= 1.05
    figs = headlines.figures(off)
    assert figs["itl_ms"] != FIGS["itl_ms"]
    quoted = dict(headlines.quoted(page("book/index.md")))
    assert quoted["itl_ms"] != figs["itl_ms"], "a 5% change of the ITL must change what the pages must say"
    for key in ("vs_llama_cpp_q4_k_m", "vs_llama_cpp_q4_0"):
        assert figs[key] != FIGS[key], f"{key}: a ratio must follow our ITL"


def test_rewrite_puts_the_record_back():
    text = "a <!-- headline:itl_ms -->9.99<!-- /headline --> ms step, <!-- headline:ttft_ms -->1<!-- /headline --> ms"
    out = headlines.rewrite(text, FIGS)
    assert headlines.quoted(out) == [("itl_ms", FIGS["itl_ms"]), ("ttft_ms", FIGS["ttft_ms"])]
    assert headlines.rewrite(out, FIGS) == out
    with pytest.raises(NanoqwenError, match="headline:nope"):
        headlines.rewrite("<!-- headline:nope -->1<!-- /headline -->", FIGS)


def test_figures_need_our_own_numbers_and_skip_peers_that_disagree():
    broken = copy.deepcopy(RECORD)
    del broken["itl_ms"]
    with pytest.raises(NanoqwenError, match="itl_ms.median"):
        headlines.figures(broken)
    wrong = copy.deepcopy(RECORD)
    wrong["peers"]["llama_cpp_Q4_0"]["agreement"]["agrees"] = False
    assert "vs_llama_cpp_q4_0" not in headlines.figures(wrong)
    assert "vs_llama_cpp_q4_k_m" in headlines.figures(wrong)


@pytest.mark.parametrize("name, step", [
    ("one persistent kernel per token (CUDA graph)", "persistent"),
    ("CUDA graphs (a kernel per op)", "graph"),
    ("CUDA graphs", "graph"),
])
def test_decode_step_names(name, step):
    assert headlines.decode_step({"protocol": {"decode": name}}) == step
