"""What a checkpoint says about generation besides its weights: when to stop, how to chat.

    read_generation_eos(dir, vocab)   -> ((ids...), "generation_config.json") or None
    read_chat_template(dir)           -> (jinja source, "chat_template.jinja") or None
    render_chat(template, messages)   -> the prompt text, as transformers renders it

transformers' rules, followed here: generate stops at `generation_config.json`'s
`eos_token_id` (an id or a list), or, without that file, at config.json's; the chat
template is `chat_template.jinja` when present, else `tokenizer_config.json`'s
"chat_template" (a string, or a list of named templates of which "default" is used). A
checkpoint without them gets nanoqwen's defaults (nanoqwen.yaml's EOS ids, Qwen2.5's
template). The same parsers check the copies a .nanoqwen file carries (weightfile).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

from nanoqwen_lib.errors import CheckpointError

GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"


def parse_json_object(raw: bytes, source, what: str, error=CheckpointError) -> dict:
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(source, what, "valid UTF-8 JSON", str(e)) from None
    if not isinstance(obj, dict):
        raise error(source, what, "a JSON object", type(obj).__name__)
    return obj


def eos_ids_of(obj: dict, source, vocab: int, error=CheckpointError) -> tuple[int, ...] | None:
    """`eos_token_id` of a generation config or config.json: an id or a non-empty list of
    ids >= 0; None when absent or null. An id >= vocab is kept (transformers keeps it too:
    it can never be generated, so it never stops anything)."""
    eos = obj.get("eos_token_id")
    if eos is None:
        return None
    ids = eos if isinstance(eos, list) else [eos]
    ok = ids and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**32 for i in ids)
    if not ok:
        raise error(source, "eos_token_id", "a token id or a non-empty list of token ids (integers >= 0)",
                    json.dumps(eos)[:80])
    return tuple(ids)


def generation_eos(generation_config: bytes | None, config: bytes | None, source, vocab: int,
                   error=CheckpointError) -> tuple[tuple[int, ...], str] | None:
    """(EOS ids, where they came from) by transformers' rule, or None (nanoqwen's default)."""
    if generation_config is not None:
        ids = eos_ids_of(parse_json_object(generation_config, source, GENERATION_CONFIG, error),
                         f"{source} {GENERATION_CONFIG}", vocab, error)
        return None if ids is None else (ids, GENERATION_CONFIG)
    if config is not None:
        ids = eos_ids_of(parse_json_object(config, source, "config.json", error), f"{source} config.json",
                         vocab, error)
        return None if ids is None else (ids, "config.json")
    return None


def read_generation_eos(ckpt_dir, vocab: int) -> tuple[tuple[int, ...], str] | None:
    ckpt_dir = Path(ckpt_dir)
    gen, cfg = ckpt_dir / GENERATION_CONFIG, ckpt_dir / "config.json"
    return generation_eos(gen.read_bytes() if gen.is_file() else None,
                          cfg.read_bytes() if cfg.is_file() else None, ckpt_dir, vocab)


def read_chat_template(ckpt_dir) -> tuple[str, str] | None:
    """(template, the file it came from) or None; the template is compiled here, so a
    broken one is refused at pack time."""
    ckpt_dir = Path(ckpt_dir)
    jinja_path, tok_cfg_path = ckpt_dir / CHAT_TEMPLATE_FILE, ckpt_dir / TOKENIZER_CONFIG
    if jinja_path.is_file():
        try:
            text = jinja_path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointError(jinja_path, "chat template", "UTF-8 text", str(e)) from None
        check_chat_template(text, jinja_path)
        return text, CHAT_TEMPLATE_FILE
    if not tok_cfg_path.is_file():
        return None
    t = parse_json_object(tok_cfg_path.read_bytes(), tok_cfg_path, TOKENIZER_CONFIG).get("chat_template")
    if t is None:
        return None
    if isinstance(t, list):
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        if not isinstance(named.get("default"), str):
            raise CheckpointError(tok_cfg_path, "chat_template", "a string, or a list with a 'default' template",
                                  f"templates named {sorted(map(str, named))}")
        t = named["default"]
    if not isinstance(t, str):
        raise CheckpointError(tok_cfg_path, "chat_template", "a string", type(t).__name__)
    check_chat_template(t, tok_cfg_path)
    return t, TOKENIZER_CONFIG


def check_chat_template(text: str, source, error=CheckpointError) -> None:
    import jinja2
    try:
        _compiled(text)
    except jinja2.TemplateError as e:
        raise error(source, "chat_template", "a Jinja template", f"{type(e).__name__}: {e}"[:120]) from None


@functools.lru_cache(maxsize=4)
def _compiled(text: str):
    """The template compiled as transformers compiles chat templates: a sandboxed Jinja2
    environment with trim_blocks, lstrip_blocks, loop controls, a `tojson` that does not
    escape HTML, and `raise_exception` / `strftime_now`."""
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(text)


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True, source="chat template") -> str:
    """The prompt text of `messages` under a checkpoint's chat template (no tools)."""
    import jinja2

    from nanoqwen_lib.errors import LimitError
    try:
        return _compiled(template).render(messages=messages, tools=None, documents=None,
                                          add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as e:
        raise LimitError(source, "chat template", "a template that renders these messages", str(e)[:120]) from None
