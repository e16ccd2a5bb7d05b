"""Every bad input we know of, as data: what a user can hand nanoqwen, and what it must answer.

A Case builds its bad input in a temporary directory, `op = case.make(tmp)`, and returns
the operation a user would run on it: open the .nanoqwen file, pack the checkpoint, check
the request, run the CLI verb in a subprocess. `op()` must raise `case.error` with a
message that names the file (or "<arguments>") and `case.field`, and says what was
expected and what was found. tests/test_bad_inputs.py runs every case; the appendix
(book/13-appendix-bad-inputs.md) prints the table of them.

A case whose input is not yet refused cleanly says so in `bug` (what happens instead): its
test is a strict xfail, so the fix turns it into a failure that asks for the note to go.
`message_gap` marks a clean refusal whose message is not in the house format (argparse's
own words, or no file named).
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from nanoqwen_lib.format.checkpoint import INDEX
from nanoqwen_lib.errors import CheckpointError, ConfigError, FormatError, LimitError, NanoqwenError
from nanoqwen_lib.format.fileformat import FMT, TOKENIZER_BLOB, align_up, plan_layout
from nanoqwen_lib.cli import make_backend
from nanoqwen_lib.model.generate import check_request
from nanoqwen_lib.format.packer import pack_checkpoint
from nanoqwen_lib.format.safetensors_io import write_safetensors
from nanoqwen_lib.synthetic.checkpoint import synthesize
from nanoqwen_lib.format.weightfile import NanoqwenFile, write_nanoqwen

from .test_checkpoint import edit_json, remap, variant
from .test_fileformat import MICRO, _rewrite, random_producer, stream_producer

ROOT = Path(__file__).resolve().parent.parent
FILE, CHECKPOINT, REQUEST, CLI = ".nanoqwen file", "checkpoint", "request / limits", "CLI"
CATEGORIES = (FILE, CHECKPOINT, REQUEST, CLI)
PACKED = "packed.nanoqwen"     # where checkpoint cases pack to
TOKENIZER = b'{"model": {}}'   # an optional blob, so the file has a non-model entry too
ENTRIES, _, FILE_BYTES = plan_layout(MICRO, len(TOKENIZER))  # the layout of micro_file_bytes()
AT = {e.name: i for i, e in enumerate(ENTRIES)}           # directory index of each tensor
# The same model in layout 3 (each projection one `.stream`): micro_file_bytes(stream=True)
STREAM_ENTRIES, _, _ = plan_layout(MICRO, len(TOKENIZER), storage="stream")
AT_STREAM = {e.name: i for i, e in enumerate(STREAM_ENTRIES)}
Q_STREAM = "model.layers.0.self_attn.q_proj.stream"
LN, LN2 = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"
NORM, Q_PROJ, K_PROJ = ("model.norm.weight", "model.layers.0.self_attn.q_proj.qweight",
                        "model.layers.0.self_attn.k_proj.qweight")


@dataclass(frozen=True)
class Case:
    """One bad input: how to build it, what to run on it, and what the answer must be."""
    category: str
    input: str                                    # the bad input, in one line
    make: Callable[[Path], Callable[[], object]]  # builds it under tmp -> the operation
    error: type[Exception]                        # what the operation must raise
    field: str                                    # text the message must contain
    also: tuple[str, ...] = ()                    # more text it must contain
    bug: str | None = None          # not refused cleanly yet: what happens instead
    message_gap: str | None = None  # refused cleanly, but not in the house format: how


class CliRefusal(Exception):
    """A `nanoqwen` run that exited non-zero; the message is stderr's last line."""

    def __init__(self, status: int, stderr: str):
        self.status, self.stderr = status, stderr
        lines = [ln for ln in stderr.splitlines() if ln.strip()]
        super().__init__(lines[-1] if lines else f"exit {status}, nothing on stderr")


def run_cli(cwd: Path, *args: str) -> str:
    """`python -m nanoqwen_lib ARGS` from this checkout; its stdout, or CliRefusal."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-m", "nanoqwen_lib", *args], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise CliRefusal(r.returncode, r.stderr)
    return r.stdout


def outcome(case: Case, tmp: Path) -> tuple[str, str]:
    """Run one case: (what happened, the message); the temp dir shows as $TMP, a pid as PID."""
    op = case.make(tmp)
    try:
        op()
    except CliRefusal as e:
        what, msg = f"exit {e.status}" + (", traceback" if "Traceback" in e.stderr else ""), str(e)
    except NanoqwenError as e:
        what, msg = type(e).__name__, str(e)
    except Exception as e:  # noqa: BLE001 -- not a clean refusal: the table must show it
        mod = type(e).__module__
        what, msg = f"{'' if mod == 'builtins' else mod + '.'}{type(e).__name__} (uncaught)", str(e)
    else:
        what, msg = "accepted", ""
    return what, re.sub(r"(\.link|\.tmp)-\d+", r"\1-PID", msg.replace(str(tmp), "$TMP"))


# ----------------------------------------------------------------------------- sources

@functools.lru_cache(maxsize=3)
def micro_file_bytes(tokenizer_json: bytes | None = TOKENIZER, stream: bool = False) -> bytes:
    """A valid MICRO .nanoqwen file (random payloads, an optional tokenizer blob; with
    `stream`, the projections in layout 3), made once."""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "micro.nanoqwen"
        write_nanoqwen(p, MICRO, (stream_producer if stream else random_producer)(1), tokenizer_json=tokenizer_json,
                       storage="stream" if stream else "split")
        return p.read_bytes()


@functools.lru_cache(maxsize=1)
def micro_checkpoint() -> Path:
    """A synthetic MICRO checkpoint in the Hugging Face layout, made once per process."""
    d = Path(tempfile.mkdtemp(prefix="nanoqwen-micro-ckpt-"))
    atexit.register(shutil.rmtree, d, True)
    return synthesize(MICRO, 0, d / "ckpt", progress=False)


# ----------------------------------------------------------------------------- .nanoqwen files

def header(fix_crcs=True, **patch):
    return lambda p: _rewrite(p, header_patch=patch, fix_crcs=fix_crcs)


def entry(tensor, **patch):
    return lambda p: _rewrite(p, dir_patch={AT[tensor]: patch})


def stream_entry(tensor, **patch):
    """entry() for the layout-3 file (stream_file_case)."""
    return lambda p: _rewrite(p, dir_patch={AT_STREAM[tensor]: patch})


def cut_to(n):
    return lambda p: os.truncate(p, n if n >= 0 else p.stat().st_size + n)


def append(n):
    def damage(p):
        with open(p, "ab") as f:
            f.write(bytes(n))
    return damage


def flip(offset):
    def damage(p):
        raw = bytearray(p.read_bytes())
        raw[offset] ^= 0x01
        p.write_bytes(bytes(raw))
    return damage


def drop_entry(name):
    """Remove a directory entry (payload left in place) and re-seal: a tensor gone missing."""
    def damage(p):
        raw = bytearray(p.read_bytes())
        i, e, n = AT[name], FMT.dir_entry_bytes, len(ENTRIES)
        d0 = FMT.header_bytes
        raw[d0 + i * e:d0 + n * e] = raw[d0 + (i + 1) * e:d0 + n * e] + bytes(e)
        p.write_bytes(bytes(raw))
        _rewrite(p, header_patch={"n_tensors": n - 1, "dir_bytes": (n - 1) * e,
                                  "data_offset": align_up(d0 + (n - 1) * e)})
    return damage


def file_case(input, damage, field, *also, stream=False, **kw) -> Case:
    def make(tmp):
        path = tmp / "bad.nanoqwen"
        path.write_bytes(micro_file_bytes(stream=stream))
        damage(path)
        return lambda: NanoqwenFile.open(path)
    return Case(FILE, input, make, FormatError, field, also, **kw)


def stream_file_case(input, damage, field, *also, **kw) -> Case:
    """A case on the layout-3 file (`nanoqwen pack --layout stream`); its input says so."""
    return file_case(f"layout 3 file: {input}", damage, field, *also, stream=True, **kw)


def tensor_field(name, field):
    return f"tensor {name!r}: {field}"


FILE_CASES = [
    file_case("no such file", lambda p: p.unlink(), "path"),
    file_case("magic b'GGUF\\x03\\x00\\x00\\x00' (another format)", header(magic=b"GGUF\3\0\0\0"), "magic"),
    file_case("version 2 (a newer nanoqwen)", header(version=2), "version"),
    file_case("layout_id 9 (an unknown weight layout)", header(layout_id=9), "layout_id"),
    file_case("layout_id 2 (FP8) on an INT4 file, header re-sealed", header(layout_id=2),
              tensor_field("model.layers.0.self_attn.q_proj.qweight", "dtype"), "uint8", "uint32"),
    file_case("group_size 64", header(group_size=64), "group_size"),
    file_case("alignment 64", header(alignment=64), "alignment"),
    file_case("rope_theta changed, header CRC not updated", header(False, rope_theta=10.0), "header_crc32"),
    file_case("one directory byte changed, CRC not updated", flip(FMT.header_bytes + 3), "dir_crc32"),
    *[file_case(f"truncated to {n} bytes", cut_to(n), "file length") for n in (0, 100, 255)],
    file_case("truncated to 1000 bytes", cut_to(1000), "file_bytes"),
    file_case("last 128 bytes cut off", cut_to(-128), "file_bytes"),
    file_case("128 bytes appended", append(128), "file_bytes"),
    file_case("file_bytes 12345 (header re-sealed)", header(file_bytes=12345), "file_bytes"),
    file_case("dir_offset 512", header(dir_offset=512), "dir_offset"),
    file_case("n_tensors 3", header(n_tensors=3), "dir_bytes", "n_tensors"),
    file_case("data_offset 4 MiB", header(data_offset=4 << 20), "data_offset"),
    file_case("tie_embeddings 7", header(tie_embeddings=7), "tie_embeddings"),
    file_case("flags 1 (a feature this build lacks)", header(flags=1), "flags"),
    file_case("num_heads 0 in the header", header(num_heads=0), "header num_heads"),
    file_case("num_heads 6: q_proj no longer matches", header(num_heads=6), tensor_field(Q_PROJ, "shape"),
              "header"),
    file_case("head_dim 96 in the header", header(head_dim=96), "header head_dim"),
    file_case("hidden 900 in the header", header(hidden=900), "header hidden_size"),
    file_case("a payload offset not a multiple of 128", entry(LN, offset=ENTRIES[AT[LN]].offset + 64),
              tensor_field(LN, "offset"), "a multiple of 128"),
    file_case("a payload offset inside the directory", entry(LN, offset=128), tensor_field(LN, "offset"),
              "data_offset"),
    file_case("two payloads at one offset", entry(LN2, offset=ENTRIES[AT[LN]].offset), tensor_field(LN2, "offset"),
              "payloads overlap"),
    file_case("a payload running past the end", entry(K_PROJ, offset=FILE_BYTES - 128),
              tensor_field(K_PROJ, "end")),
    file_case("a tensor with a wrong shape", entry(LN, shape0=7), tensor_field(LN, "shape")),
    file_case("an FP16 tensor stored as uint32", entry(LN, dtype=2), tensor_field(LN, "dtype"),
              "float16", "uint32"),
    file_case("an unknown dtype code 9", entry(LN, dtype=9), tensor_field(LN, "dtype")),
    file_case("ndim 3", entry(LN, ndim=3), tensor_field(LN, "ndim")),
    file_case("nbytes 8", entry(LN, nbytes=8), tensor_field(LN, "nbytes")),
    file_case("a tensor name used twice", entry(LN2, name=LN.encode()), tensor_field(LN, "name"), "duplicate"),
    file_case("a name that is not UTF-8", entry(LN, name=b"\xff\xfe"), f"directory[{AT[LN]}].name"),
    file_case("lm_head.weight dropped from the directory", drop_entry("lm_head.weight"), "tensors",
              "missing", "lm_head.weight"),
    file_case("a tensor renamed", entry(LN, name=b"model.layers.0.bogus.weight"), "tensors", "missing", LN),
    file_case("an unexpected tensor", entry(TOKENIZER_BLOB, name=b"model.layers.0.bogus.weight"), "tensors",
              "unexpected", "bogus"),
    file_case("one bit of a payload flipped", flip(ENTRIES[AT[K_PROJ]].offset + 17),
              tensor_field(K_PROJ, "crc32")),
    file_case("layout_id 3 (INT4 stream) on a layout 1 file, header re-sealed", header(layout_id=3),
              "n_tensors", "layout 3 (int4, stream)"),
    stream_file_case("layout_id 1, header re-sealed", header(layout_id=1), "n_tensors", "layout 1 (int4, split)"),
    stream_file_case("layout_id 2 (FP8), header re-sealed", header(layout_id=2), "n_tensors", "layout 2 (fp8, split)"),
    stream_file_case("layout_id 9", header(layout_id=9), "layout_id", "3 (int4, stream)"),
    stream_file_case("q_proj.stream one block short (shape and nbytes)",
                     stream_entry(Q_STREAM, shape0=STREAM_ENTRIES[AT_STREAM[Q_STREAM]].shape[0] - 1056,
                                  nbytes=STREAM_ENTRIES[AT_STREAM[Q_STREAM]].nbytes - 1056),
                     tensor_field(Q_STREAM, "shape"), f"({STREAM_ENTRIES[AT_STREAM[Q_STREAM]].shape[0]},)"),
    stream_file_case("q_proj.stream stored as uint32", stream_entry(Q_STREAM, dtype=2),
                     tensor_field(Q_STREAM, "dtype"), "uint8", "uint32"),
    stream_file_case("q_proj.stream renamed q_proj.qweight", stream_entry(Q_STREAM, name=Q_PROJ.encode()),
                     "tensors", "missing", Q_STREAM),
    stream_file_case("one bit of q_proj.stream flipped", flip(STREAM_ENTRIES[AT_STREAM[Q_STREAM]].offset + 1030),
                     tensor_field(Q_STREAM, "crc32")),
]


# ----------------------------------------------------------------------------- checkpoints

def config(**fields):
    return lambda d: edit_json(d / "config.json", lambda c: c.update(fields))


def shard_of(d, name):
    return json.loads((d / INDEX).read_text())["weight_map"][name]


def other_shard(d):
    shards = sorted(set(json.loads((d / INDEX).read_text())["weight_map"].values()))
    remap(d, NORM, next(s for s in shards if s != shard_of(d, NORM)))


def norm_shard(fill, dtype="F32"):
    """model.norm.weight replaced by a shard of its own: values 1, `fill` at [5] and [700]."""
    def edit(d):
        w = np.ones(MICRO.hidden, np.float32)
        w[[5, 700]] = fill
        write_safetensors(d / "norm.safetensors", {NORM: w}, dtype=dtype)
        remap(d, NORM, "norm.safetensors")
    return edit


def i32_norm(d):
    from safetensors.numpy import save_file
    save_file({NORM: np.zeros(MICRO.hidden, np.int32)}, str(d / "i32.safetensors"))
    remap(d, NORM, "i32.safetensors")


def lora(d):
    name = "model.layers.0.self_attn.q_proj.lora_A"
    write_safetensors(d / "lora.safetensors", {name: np.zeros((8, MICRO.hidden), np.float32)})
    remap(d, name, "lora.safetensors")


def truncate_shard(d):
    shard = d / shard_of(d, NORM)
    data = shard.read_bytes()
    shard.unlink()
    shard.write_bytes(data[: len(data) // 2])


def no_weights(d):
    for f in d.glob("*.safetensors*"):
        f.unlink()


def ckpt_case(input, edit, error, field, *also, **kw) -> Case:
    def make(tmp):
        d = variant(micro_checkpoint(), tmp)  # tmp/ckpt: json files copied, shards symlinked
        edit(d)
        return lambda: pack_checkpoint(d, tmp / PACKED, progress=False)
    return Case(CHECKPOINT, input, make, error, field, also, **kw)


CE, CF = CheckpointError, ConfigError
CHECKPOINT_CASES = [
    ckpt_case("no such directory", shutil.rmtree, CE, "checkpoint directory"),
    ckpt_case("no config.json", lambda d: (d / "config.json").unlink(), CE, "config.json", "missing"),
    ckpt_case("config.json is not JSON", lambda d: (d / "config.json").write_text("{"), CE, "valid JSON"),
    ckpt_case("no weights at all", no_weights, CE, "weights", "model.safetensors", "neither"),
    ckpt_case("a Llama checkpoint", config(architectures=["LlamaForCausalLM"], model_type="llama"),
              CF, "architectures"),
    ckpt_case("head_dim 96", config(hidden_size=672, num_attention_heads=7, num_key_value_heads=1, head_dim=96),
              CF, "head_dim"),
    ckpt_case("hidden_size 960, not a multiple of 128",
              config(hidden_size=960, num_attention_heads=15, num_key_value_heads=3, head_dim=64),
              CF, "hidden_size"),
    ckpt_case("GQA ratio 3 (6 heads, 2 KV heads)",
              config(hidden_size=768, num_attention_heads=6, num_key_value_heads=2),
              CF, "num_attention_heads / num_key_value_heads", "6/2"),
    ckpt_case("GQA ratio 1 (7 KV heads)", config(num_key_value_heads=7),
              CF, "num_attention_heads / num_key_value_heads"),
    ckpt_case("index names a shard that does not exist",
              lambda d: remap(d, NORM, "model-00009-of-00009.safetensors"),
              CE, f"weight_map[{NORM!r}]", "model-00009-of-00009.safetensors", "does not exist"),
    ckpt_case("index names a tensor its shard lacks", other_shard, CE, repr(NORM), "absent"),
    ckpt_case("lm_head.weight missing from the index",
              lambda d: edit_json(d / INDEX, lambda ix: ix["weight_map"].pop("lm_head.weight")),
              CE, "'lm_head.weight'", "missing"),
    ckpt_case("an extra LoRA tensor", lora, CE, "'model.layers.0.self_attn.q_proj.lora_A'", "unexpected"),
    ckpt_case("a tensor stored as I32", i32_norm, CE, f"{NORM!r} dtype", "I32"),
    ckpt_case("intermediate_size 2560 in config.json, 2432 in the shards", config(intermediate_size=2560),
              CE, "'model.layers.0.mlp.gate_proj.weight' shape", "[2560, 896]", "[2432, 896]", "config.json"),
    ckpt_case("NaN weights", norm_shard(np.nan), CE, repr(NORM), "2 NaN/Inf", "index [5]"),
    ckpt_case("Inf weights", norm_shard(np.inf), CE, repr(NORM), "2 NaN/Inf", "index [5]"),
    ckpt_case("a weight beyond FP16's range (1e6, stored F32)", norm_shard(1e6), CE, repr(NORM), "FP16 range"),
    ckpt_case("a shard truncated to half", truncate_shard, CE, "truncated", "tensor '"),
    ckpt_case("max_position_embeddings 0", config(max_position_embeddings=0), CF, "max_position_embeddings"),
    ckpt_case("rms_norm_eps 2.0", config(rms_norm_eps=2.0), CF, "rms_norm_eps"),
    ckpt_case("max_position_embeddings 2**40", config(max_position_embeddings=2**40),
              CF, "max_position_embeddings"),
    ckpt_case("rope_theta null", config(rope_theta=None), CF, "rope_theta"),
    ckpt_case('tie_word_embeddings "no" (a string)', config(tie_word_embeddings="no"), CF, "tie_word_embeddings"),
    # What a real config.json can say that nanoqwen does not compute (chapter 1's table of
    # the config corpus, tests/hf_corpus.py, has each with the file it was seen in).
    ckpt_case("RoPE scaling: yarn in rope_parameters (transformers 5)",
              config(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                      "original_max_position_embeddings": 32768}),
              CF, "rope_parameters.rope_type", "'yarn'"),
    ckpt_case("RoPE scaling: linear in a legacy rope_scaling", config(rope_scaling={"type": "linear", "factor": 2.0}),
              CF, "rope_scaling.type", "'linear'"),
    ckpt_case("Dual Chunk Attention (the -1M models)",
              config(dual_chunk_attention_config={"chunk_size": 262144, "local_size": 8192,
                                                  "original_max_position_embeddings": 262144}),
              CF, "dual_chunk_attention_config"),
    ckpt_case("an AWQ export (quantization_config)",
              config(quantization_config={"quant_method": "awq", "bits": 4, "group_size": 128,
                                          "zero_point": True, "version": "gemm"}),
              CF, "quantization_config", "awq"),
    ckpt_case("an MLX export (quantization)", config(quantization={"group_size": 64, "bits": 4}),
              CF, "quantization", "pre-quantized"),
    ckpt_case("a compressed-tensors export (compression_config)",
              config(compression_config={"quant_method": "compressed-tensors", "format": "float-quantized"}),
              CF, "compression_config"),
    ckpt_case("a sliding-attention layer in layer_types", config(layer_types=["sliding_attention"]),
              CF, "layer_types[0]", "'sliding_attention'"),
    ckpt_case("use_sliding_window with sliding layers",
              config(use_sliding_window=True, sliding_window=4096, max_window_layers=0),
              CF, "use_sliding_window", "sliding layers 0..0"),
    ckpt_case('hidden_act "gelu"', config(hidden_act="gelu"), CF, "hidden_act", "'gelu'"),
    ckpt_case("partial RoPE (partial_rotary_factor 0.5)", config(partial_rotary_factor=0.5),
              CF, "partial_rotary_factor"),
    ckpt_case('generation_config.json: eos_token_id "</s>" (a string)',
              lambda d: (d / "generation_config.json").write_text('{"eos_token_id": "</s>"}'),
              CE, "eos_token_id", "generation_config.json"),
    ckpt_case("a chat template that is not Jinja",
              lambda d: (d / "chat_template.jinja").write_text("{% if messages %}"),
              CE, "chat_template", "chat_template.jinja"),
]


# ----------------------------------------------------------------------------- requests

def request_case(input, ids, n, field, *also, max_tokens=None) -> Case:
    return Case(REQUEST, input, lambda tmp: lambda: check_request(MICRO, ids, n, max_tokens),
                LimitError, field, also)


REQUEST_CASES = [
    request_case("an empty prompt", [], 8, "prompt", "empty"),
    request_case(f"token id {MICRO.vocab} (vocab {MICRO.vocab})", [1, MICRO.vocab], 8, "prompt ids",
                 f"[0, {MICRO.vocab})", f"found {MICRO.vocab}"),
    request_case("token id -1", [1, -1, 2], 8, "prompt ids", "found -1"),
    request_case(f"30000 prompt tokens + 3000 new (max_position {MICRO.max_position})",
                 [7] * 30000, 3000, "prompt + --max-new-tokens", f"<= {MICRO.max_position}", "33000"),
    request_case("200 tokens where the KV pool holds 128", [7] * 190, 10, "prompt + --max-new-tokens", "<= 128",
                 max_tokens=128),
    request_case("max_new_tokens 0", [1, 2], 0, "--max-new-tokens", ">= 1"),
    request_case("max_new_tokens -3", [1, 2], -3, "--max-new-tokens", "found -3"),
    Case(REQUEST, "backend 'cuda'", lambda tmp: lambda: make_backend("cuda", None), LimitError, "--backend",
         ("reference or gpu",)),
]


# ----------------------------------------------------------------------------- the CLI

def cli_case(args: str, field, *also, setup=None, **kw) -> Case:
    """`args` as a user types them, run in tmp, which holds a valid model.nanoqwen (no
    tokenizer blob: the default Qwen tokenizer) and a badtok.nanoqwen (a blob that is not
    a tokenizer); {tmp} is tmp."""
    def make(tmp):
        (tmp / "model.nanoqwen").write_bytes(micro_file_bytes(None))
        (tmp / "badtok.nanoqwen").write_bytes(micro_file_bytes())
        if setup:
            setup(tmp)
        argv = [a.format(tmp=tmp) for a in args.split()]
        return lambda: run_cli(tmp, *argv)
    return Case(CLI, "nanoqwen " + args.replace("{tmp}/", ""), make, CliRefusal, field, also, **kw)


CLI_CASES = [
    cli_case("synth --dims 70b --out {tmp}/out", "--dims", "'70b'"),
    cli_case("synth --dims tiny --out {tmp}/model.nanoqwen --quiet", "--out"),
    cli_case("pack {tmp}/missing -o {tmp}/m.nanoqwen", "checkpoint directory"),
    cli_case("pack {tmp}/ckpt -o {tmp}/outdir --quiet", "--output",
             setup=lambda tmp: (variant(micro_checkpoint(), tmp), (tmp / "outdir").mkdir())),
    cli_case("pack {tmp}/ckpt -o {tmp}/model.nanoqwen/m.nanoqwen --quiet", "--output",
             setup=lambda tmp: variant(micro_checkpoint(), tmp)),
    cli_case("pack {tmp}/ckpt -o {tmp}/m.nanoqwen --weights fp4", "--weights", "'fp4'"),
    cli_case("pack {tmp}/ckpt -o {tmp}/m.nanoqwen --layout tiles", "--layout", "'tiles'"),
    cli_case("pack {tmp}/ckpt -o {tmp}/m.nanoqwen --weights fp8 --layout stream", "--layout", "INT4 only"),
    cli_case("inspect {tmp}/missing.nanoqwen", "path"),
    cli_case("generate {tmp}/missing.nanoqwen --prompt-ids 1,2", "path"),
    cli_case("generate {tmp}/model.nanoqwen --prompt-ids 1,2 --max-new-tokens abc", "--max-new-tokens", "'abc'"),
    cli_case("generate {tmp}/model.nanoqwen --prompt= --backend reference", "prompt", "empty"),
    cli_case("generate {tmp}/badtok.nanoqwen --prompt hi --backend reference", "model.type", "BPE"),
    cli_case("bench {tmp}/missing.nanoqwen", "path"),
    cli_case("bench {tmp}/model.nanoqwen --prompt-tokens 0", "--prompt-tokens", "found 0"),
    cli_case("demo --max-new-tokens abc", "--max-new-tokens", "'abc'"),
    cli_case("demo --max-new-tokens 0", "--max-new-tokens", ">= 1", "found 0"),
    cli_case("inspect {tmp}/ckpt", "path", "a checkpoint directory", "nanoqwen pack",
             setup=lambda tmp: variant(micro_checkpoint(), tmp)),
    cli_case("generate {tmp}/ckpt --prompt-ids 1,2", "path", "a checkpoint directory", "nanoqwen pack",
             setup=lambda tmp: variant(micro_checkpoint(), tmp)),
]

CASES: list[Case] = FILE_CASES + CHECKPOINT_CASES + REQUEST_CASES + CLI_CASES
