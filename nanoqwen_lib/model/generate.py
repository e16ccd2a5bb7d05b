"""Greedy generation on a chosen backend: prompt checks, the token loop, streaming.

The backends share one protocol: `prefill(ids) -> next_token` and `decode(token) ->
next_token`. `reference` is nanoqwen_lib.model.reference on NumPy (or CuPy); `gpu` is the engine
of the GPU chapters. Every limit is checked before any work, with what fits.
"""
from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from nanoqwen_lib.config import ModelDims
from nanoqwen_lib.errors import LimitError


def check_request(dims: ModelDims, prompt_ids: list[int], max_new_tokens: int,
                  max_tokens: int | None = None, source="<arguments>") -> None:
    """Refuse an empty prompt, ids outside the vocab and requests that cannot fit."""
    if not prompt_ids:
        raise LimitError(source, "prompt", "at least one token", "an empty prompt")
    bad = [t for t in prompt_ids if not 0 <= int(t) < dims.vocab]
    if bad:
        raise LimitError(source, "prompt ids", f"ids in the vocab [0, {dims.vocab})", f"{bad[0]} ({len(bad)} out of range)")
    if max_new_tokens < 1:
        raise LimitError(source, "--max-new-tokens", ">= 1", max_new_tokens)
    limit = dims.max_position if max_tokens is None else min(max_tokens, dims.max_position)
    need = len(prompt_ids) + max_new_tokens
    if need > limit:
        raise LimitError(source, "prompt + --max-new-tokens", f"<= {limit} tokens (what fits)",
                         f"{len(prompt_ids)} + {max_new_tokens} = {need}")


class ReferenceBackend:
    """nanoqwen_lib.model.reference behind the backend protocol (NumPy on the CPU)."""

    name = "reference"

    def __init__(self, nq_file, xp=np):
        from nanoqwen_lib.model.reference import ReferenceModel
        self.dims = nq_file.dims
        self.model = ReferenceModel(nq_file.dims, nq_file.model_tensors(), xp=xp)
        self.cache = None
        self.max_tokens = None

    def prefill(self, ids: list[int]) -> int:
        logits, self.cache = self.model.prefill(ids)
        return int(logits[-1].argmax())

    def decode(self, token: int) -> int:
        return int(self.model.decode(token, self.cache).argmax())




def generate_ids(backend, prompt_ids: list[int], max_new_tokens: int,
                 eos_ids: tuple[int, ...] = ()) -> Iterator[int]:
    """Greedy: yield each new token id as soon as it is known; stop at EOS or the budget."""
    check_request(backend.dims, prompt_ids, max_new_tokens, backend.max_tokens)
    tok = backend.prefill(list(prompt_ids))
    for i in range(max_new_tokens):
        yield tok
        if tok in eos_ids or i + 1 == max_new_tokens:
            return
        tok = backend.decode(tok)


def stream_text(tokenizer, ids: Iterator[int], write: Callable[[str], None]) -> list[int]:
    """Decode ids to text incrementally (whole UTF-8 characters only) and write it."""
    from nanoqwen_lib.format.tokenizer import StreamDecoder
    dec, out = StreamDecoder(tokenizer), []
    for t in ids:
        out.append(t)
        text = dec.feed(t)
        if text:
            write(text)
    tail = dec.flush()
    if tail:
        write(tail)
    return out
