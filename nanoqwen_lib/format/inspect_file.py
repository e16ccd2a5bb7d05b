"""`nanoqwen inspect`: the header and tensor table of a validated file, as text."""
from __future__ import annotations

from nanoqwen_lib.config import load
from nanoqwen_lib.format import stream_layout as sl
from nanoqwen_lib.format.fileformat import HEADER_FIELDS


def generation_settings(f) -> list[str]:
    """Which EOS ids and chat template generate uses for this file, and where they come from."""
    carried = f.generation_eos
    if carried:
        eos = f"eos_ids      {list(carried[0])} (the checkpoint's {carried[1]})"
    else:
        eos = f"eos_ids      {list(load().tokenizer.eos_ids)} (default: nanoqwen.yaml tokenizer.eos_ids)"
    t = f.chat_template
    chat = (f"chat         the checkpoint's template ({len(t):,} characters)" if t is not None
            else "chat         default: Qwen2.5's template (built in)")
    cfg = f"config.json  {'carried' if f.hf_config is not None else 'not carried (packed from dims only)'}"
    return [eos, chat, cfg]


def weight_layout(f) -> list[str]:
    """The projections' layout: its id, encoding, storage, and the tensors that hold each."""
    lid = f.header.layout_id
    if f.storage == "stream":
        held = (f"one uint8 <proj>.stream each ({sl.BLOCK_BYTES}-byte blocks of {sl.TILE_ROWS} rows x "
                f"{sl.GROUP} inputs; read back as layout {load().format.layout_id}'s qweight + scales)")
    else:
        held = "<proj>.qweight + <proj>.scales"
    return [f"layout       {lid}: {f.encoding}, {f.storage} storage",
            f"projections  {held}"]


def describe(f, tensors: bool = True) -> str:
    h = f.header.fields
    lines = [f"{f.path}  ({h['file_bytes']:,} bytes, payload CRCs "
             f"{'verified' if f.payload_verified else 'not checked'})", "", "header:"]
    for name, _, meaning in HEADER_FIELDS:
        v = h[name]
        v = v.decode() if isinstance(v, bytes) else (f"{v:#010x}" if name.endswith("crc32") else v)
        lines.append(f"  {name:<16} {str(v):<14} {meaning}")
    lines += ["", "weights:"] + [f"  {line}" for line in weight_layout(f)]
    lines += ["", "generation:"] + [f"  {line}" for line in generation_settings(f)]
    if tensors:
        lines += ["", f"tensors ({len(f.entries)}):",
                  f"  {'name':<52} {'dtype':<7} {'shape':<16} {'offset':>14} {'bytes':>12}  crc32"]
        for e in f.entries:
            lines.append(f"  {e.name:<52} {e.dtype.name:<7} {str(e.shape):<16} {e.offset:>14,} "
                         f"{e.nbytes:>12,}  {e.crc32:#010x}")
    return "\n".join(lines)
