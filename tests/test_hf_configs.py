"""The config.json corpus (tests/hf_corpus.py): every real, derived and transformers-written
config is either read exactly as transformers reads it, or refused in one line naming the
file and the key; and the checkpoint's generation config and chat template are read by
transformers' rules. CPU, about a second."""
from __future__ import annotations

import json

import pytest

from nanoqwen_lib.errors import ConfigError

from . import hf_corpus as corpus

pytest.importorskip("transformers")
CASES = corpus.all_cases()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_config_read_as_transformers_reads_it_or_refused(case):
    got = corpus.nanoqwen_reading(case)
    if case.expect == corpus.COMPUTED:
        assert not isinstance(got, ConfigError), f"{case.name}: refused: {got}"
        theirs, extra = corpus.transformers_reading(case)
        assert not extra, f"{case.name}: transformers computes {extra}, nanoqwen accepted it"
        ours = {field: getattr(got, field) for field in corpus.MATH}
        assert ours == theirs
    else:
        assert isinstance(got, ConfigError), f"{case.name}: accepted, expected a refusal naming {case.expect!r}"
        msg = str(got)
        assert got.field == case.expect, msg
        assert "\n" not in msg and msg.startswith(f"{case.name}/config.json: {case.expect}: expected "), msg


def test_corpus_covers_the_issue():
    """Every family the corpus should hold is there, real where a real file was found."""
    real = {c.name for c in CASES if c.source == "real"}
    assert {"qwen2-0.5b", "qwen2.5-7b-instruct", "qwen2.5-7b-instruct-1m",
            "qwen2.5-1.5b-instruct-tf5", "qwen2.5-32b-gptq-int4"} <= real
    index = json.loads((corpus.DATA / "index.json").read_text())["files"]
    assert sorted(p.name for p in corpus.DATA.glob("*.json") if p.name != "index.json") == sorted(index)
    refused = {c.expect for c in CASES if c.expect != corpus.COMPUTED}
    assert {"rope_scaling.type", "rope_parameters.rope_type", "dual_chunk_attention_config", "quantization_config",
            "quantization", "compression_config", "use_sliding_window"} <= refused
    # The saves really are transformers 5's format: rope_parameters, no top-level rope_theta.
    save = next(c for c in CASES if c.name == "save_pretrained:theta-1e6").config
    assert save["rope_parameters"] == {"rope_theta": 1e6, "rope_type": "default"} and "rope_theta" not in save


def test_the_old_fallback_would_have_misread_transformers5():
    """The bug of issue 13: a transformers-5 save has no top-level rope_theta; reading
    theta from there gives 10000, transformers reads 1e6 from rope_parameters."""
    case = next(c for c in CASES if c.name == "qwen2.5-1.5b-instruct-tf5")
    assert "rope_theta" not in case.config
    assert corpus.nanoqwen_reading(case).rope_theta == corpus.transformers_reading(case)[0]["rope_theta"] == 1e6
