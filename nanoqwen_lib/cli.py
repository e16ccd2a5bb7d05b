"""The `nanoqwen` command: synth, pack, inspect, generate, bench, validate, demo.

User errors (bad arguments, bad files, requests that do not fit) exit with status 2 and one
line naming the file, the field, the expected and the found value; never a traceback.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from nanoqwen_lib.errors import LimitError, NanoqwenError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, status 2 (argparse's own convention)
        words = self.prog.split()
        who = " ".join(["nanoqwen", *words[1:]])   # "nanoqwen" or "nanoqwen VERB"
        self.exit(2, f"{who}: error: {_house_format(message)} (see --help)\n")



def make_backend(name: str, nq_file):
    if name == "reference":
        from nanoqwen_lib.model.generate import ReferenceBackend
        return ReferenceBackend(nq_file)
    if name == "gpu":
        require_gpu_backend()
        from nanoqwen_lib.gpu.engine import GpuBackend
        return GpuBackend(nq_file)
    raise LimitError("<arguments>", "--backend", "reference or gpu", repr(name))


def require_gpu_backend() -> None:
    """Refuse --backend gpu on a machine without a usable CUDA GPU (before any work)."""
    from nanoqwen_lib.gpu.cuda_build import have_gpu
    if not have_gpu():
        raise LimitError("<arguments>", "--backend", "a CUDA GPU for --backend gpu",
                         "none (CuPy sees no usable device)", "use --backend reference")


def _house_format(message: str) -> str:
    """argparse's wording -> '<arguments>: FIELD: expected X, found Y'."""
    m = re.match(r"argument (\S+?): invalid choice: (.+?) \(choose from (.+)\)$", message)
    if m:
        return f"<arguments>: {m[1]}: expected one of {m[3]}, found {m[2]}"
    m = re.match(r"argument (\S+?): invalid (\w+) value: (.+)$", message)
    if m:
        kind = {"int": "an integer", "float": "a number"}.get(m[2], f"a {m[2]}")
        return f"<arguments>: {m[1]}: expected {kind}, found {m[3]}"
    m = re.match(r"argument (\S+?): (expected .+)$", message)
    if m:
        return f"<arguments>: {m[1]}: {m[2]}"
    return f"<arguments>: {message}"


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise LimitError("<arguments>", "--prompt-ids", "comma-separated integers", repr(text)) from None


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {v}")
    return v


def _nonneg(text: str) -> int:
    return 0 if text.strip() == "0" else _positive(text)


def cmd_synth(a) -> int:
    from nanoqwen_lib.config import load
    from nanoqwen_lib.synthetic.checkpoint import synthesize
    dims = load().model(a.dims)
    if a.out.exists() and not a.out.is_dir():
        raise LimitError(a.out, "--out", "a directory (new, or existing)", "an existing file")
    out = synthesize(dims, a.seed, a.out, progress=not a.quiet)
    print(f"wrote synthetic {a.dims} checkpoint (seed {a.seed}) to {out}")
    return 0


def _check_output_file(path: Path, flag: str) -> None:
    """Refuse an output path that cannot become a file, before any work."""
    if path.is_dir():
        raise LimitError(path, flag, "a file path", "an existing directory")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise LimitError(path, flag, "a path under a directory", f"{parent} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise LimitError(path, flag, "a writable location", f"{parent} is not writable")


def cmd_pack(a) -> int:
    from nanoqwen_lib.format.packer import pack_checkpoint
    if a.layout == "stream" and a.weights != "int4":
        raise LimitError("<arguments>", "--layout", f"split with --weights {a.weights} (stream is INT4 only)",
                         a.layout)
    _check_output_file(a.output, "--output")
    out = pack_checkpoint(a.checkpoint, a.output, progress=not a.quiet, weights=a.weights, layout=a.layout)
    print(f"wrote {out} ({out.stat().st_size / 1e9:.3f} GB)")
    return 0


def cmd_inspect(a) -> int:
    from nanoqwen_lib.format.inspect_file import describe
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    f = NanoqwenFile.open(a.file, verify_payload=a.verify)
    print(describe(f, tensors=not a.header_only))
    return 0


def _load_tokenizer(nq_file):
    from nanoqwen_lib.format.tokenizer import QwenTokenizer
    blob = nq_file.tokenizer_json
    if not blob:
        return QwenTokenizer.default()
    try:
        return QwenTokenizer.from_tokenizer_json(blob)
    except NanoqwenError as e:
        raise type(e)(nq_file.path, f"tensor 'tokenizer.json': {e.field}", e.expected, e.found) from None


def eos_ids(nq_file, tok) -> tuple[int, ...]:
    """The checkpoint's own EOS ids (generation_config.json, else config.json) when the file
    carries them, else the tokenizer's defaults (nanoqwen.yaml)."""
    carried = nq_file.generation_eos
    return carried[0] if carried else tuple(tok.eos_ids)


def chat_prompt(nq_file, tok, text: str) -> str:
    """One user turn under the checkpoint's own chat template when the file carries one,
    else the built-in Qwen2.5 template."""
    from nanoqwen_lib.format.hf_meta import render_chat
    messages = [{"role": "user", "content": text}]
    template = nq_file.chat_template
    if template is None:
        return tok.apply_chat_template(messages)
    return render_chat(template, messages, source=nq_file.path)


def cmd_generate(a) -> int:
    from nanoqwen_lib.model.generate import check_request, generate_ids, stream_text
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    f = NanoqwenFile.open(a.file, verify_payload=not a.no_verify)
    tok = _load_tokenizer(f)
    if a.prompt_ids is not None:
        prompt = _ids(a.prompt_ids)
    else:
        text = chat_prompt(f, tok, a.prompt) if a.chat else a.prompt
        prompt = tok.encode(text)
    check_request(f.dims, prompt, a.max_new_tokens)  # before any backend (GPU) work
    backend_name = a.backend or _default_backend()
    backend = make_backend(backend_name, f)
    ids = generate_ids(backend, prompt, a.max_new_tokens, eos_ids=() if a.ignore_eos else eos_ids(f, tok))
    if a.ids:
        print(" ".join(str(t) for t in ids))
    else:
        stream_text(tok, ids, lambda s: (sys.stdout.write(s), sys.stdout.flush()))
        print()
    return 0


def _default_backend() -> str:
    from nanoqwen_lib.gpu.cuda_build import have_gpu
    return "gpu" if have_gpu() else "reference"


DEMO_PROMPT = "def quicksort(xs):"
DEMO_NOTE = ("the weights are synthetic (random), so the text below is meaningless; for a real model: "
             "nanoqwen pack CHECKPOINT_DIR -o model.nanoqwen && nanoqwen generate model.nanoqwen --prompt ...")


def cmd_demo(a) -> int:
    """The embedded default, end to end: synthesize tiny, pack it, generate with it."""
    from nanoqwen_lib.config import load
    from nanoqwen_lib.format.tokenizer import QwenTokenizer
    from nanoqwen_lib.model.generate import check_request
    from nanoqwen_lib.synthetic.packed import packed_synthetic
    backend = a.backend or _default_backend()
    # Every refusal comes before the synthesis and packing (seconds of CPU, a file in the cache).
    check_request(load().model("tiny"), QwenTokenizer.default().encode(DEMO_PROMPT), a.max_new_tokens)
    if backend == "gpu":
        require_gpu_backend()
    out = packed_synthetic("tiny", seed=0, progress=True)
    print(f"file       {out} ({out.stat().st_size / 1e6:.1f} MB)\nbackend    {backend}\n"
          f"note       {DEMO_NOTE}")
    from nanoqwen_lib.format.inspect_file import generation_settings
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    for line in generation_settings(NanoqwenFile.open(out, verify_payload=False)):
        print(line)
    ns = argparse.Namespace(file=out, prompt=DEMO_PROMPT, prompt_ids=None, chat=False,
                            max_new_tokens=a.max_new_tokens, backend=backend, ids=False,
                            ignore_eos=True, no_verify=False)
    print(f"prompt     {DEMO_PROMPT!r}\noutput     ", end="", flush=True)
    try:
        return cmd_generate(ns)
    except BaseException:
        print(flush=True)   # a late error starts its own line, not the end of "output"
        raise


def cmd_bench(a) -> int:
    from nanoqwen_lib.measure.bench import benchmark_e2e, format_report, write_json
    from nanoqwen_lib.gpu.cuda_build import have_gpu
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    f = NanoqwenFile.open(a.file, verify_payload=not a.no_verify)
    if not have_gpu():
        raise LimitError(a.file, "GPU", "a CUDA GPU for benchmark_e2e", "none (cupy sees no device)")
    r = benchmark_e2e(f, a.prompt_tokens, a.gen_tokens, a.warmup,
                      progress=lambda m: print(f"[bench] {m}", file=sys.stderr, flush=True),
                      prefill=a.prefill, breakdown=a.breakdown, prefill_gemm=a.prefill_gemm,
                      decode=a.decode, baseline=not a.no_baseline)
    if a.peers:
        from nanoqwen_lib.measure.peers import run_peers
        r["peers"] = run_peers(f, r, progress=lambda m: print(f"[peers] {m}", file=sys.stderr, flush=True),
                               llama_cpp_json=a.llama_cpp)
    print(format_report(r))
    if a.json:
        write_json(r, a.json)
        print(f"wrote {a.json}")
    return 0


def cmd_validate(a) -> int:
    import json
    from nanoqwen_lib.gpu.cuda_build import have_gpu
    from nanoqwen_lib.measure.validate import run_ladder
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    ladder = ("unit", "layer", "graph")
    stages = [x.strip() for x in a.stages.split(",") if x.strip()]
    if not stages or any(x not in ladder for x in stages) or stages != sorted(stages, key=ladder.index):
        raise LimitError("<arguments>", "--stages", "a subset of unit,layer,graph in that order", repr(a.stages))
    f = NanoqwenFile.open(a.file, verify_payload=not a.no_verify)
    if not have_gpu():
        raise LimitError(a.file, "GPU", "a CUDA GPU (the ladder checks the GPU kernels)", "none")
    r = run_ladder(f, a.prompts, a.gen_tokens, stages=stages, reference_batch=a.reference_batch,
                   progress=lambda m: print(f"[validate] {m}", file=sys.stderr, flush=True))
    if a.json:
        from nanoqwen_lib.measure.bench import write_json
        write_json(r, a.json)
    per_step = ("first_divergence", "mismatches", "logit_err", "gap_err")   # in --json only
    brief = lambda d: {k: brief(v) if isinstance(v, dict) else v for k, v in d.items() if k not in per_step}  # noqa: E731
    print(json.dumps(brief(r)))
    return 0 if all(v["passed"] for v in r.values()) else 1


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="nanoqwen", description="An INT4 Qwen2.5 inference runtime for Hopper, built in a book.")
    sub = p.add_subparsers(dest="verb", required=True, parser_class=_Parser)

    s = sub.add_parser("synth", help="write a synthetic checkpoint in the exact Hugging Face layout")
    s.add_argument("--dims", required=True, choices=["tiny", "tiny-hd64", "7b"], help="model dims from nanoqwen.yaml")
    s.add_argument("--seed", type=int, default=0, help="random seed (same seed, same weights)")
    s.add_argument("--out", required=True, type=Path, help="output directory")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(fn=cmd_synth)

    s = sub.add_parser("pack", help="quantize a Hugging Face checkpoint into a .nanoqwen file")
    s.add_argument("checkpoint", type=Path, help="checkpoint directory (config.json, *.safetensors)")
    s.add_argument("-o", "--output", required=True, type=Path, help="the .nanoqwen file to write")
    s.add_argument("--weights", choices=["int4", "fp8"], default="int4",
                   help="encoding of the seven projections: int4 (group 128, the default; the GPU engine "
                        "reads it) or fp8 (E4M3, one FP32 scale per output row; reference backend only so far)")
    s.add_argument("--layout", choices=["split", "stream"], default="split",
                   help="storage of the projections: split (codes and scales in two tensors, layout 1 for int4, "
                        "the default) or stream (int4 only: layout 3, one lane-fragment stream per projection, "
                        "what the streaming decode GEMV reads)")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(fn=cmd_pack)

    s = sub.add_parser("inspect", help="validate a .nanoqwen file and print its header and tensors")
    s.add_argument("file", type=Path, help="a .nanoqwen file")
    s.add_argument("--verify", action="store_true", help="also check every payload's CRC32")
    s.add_argument("--header-only", action="store_true", help="print the header, not the tensor table")
    s.set_defaults(fn=cmd_inspect)

    s = sub.add_parser("generate", help="greedy generation from a .nanoqwen file")
    s.add_argument("file", type=Path, help="a .nanoqwen file")
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text (tokenized with the file's Qwen tokenizer)")
    g.add_argument("--prompt-ids", help="prompt token ids, comma-separated")
    s.add_argument("--chat", action="store_true",
                   help="wrap --prompt in the file's chat template (the checkpoint's own, else Qwen2.5's)")
    s.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    s.add_argument("--backend", choices=["reference", "gpu"], help="default: gpu when one is present")
    s.add_argument("--ids", action="store_true", help="print generated token ids on one line, not text")
    s.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    s.add_argument("--no-verify", action="store_true", help="skip the payload CRC32 check at load (faster)")
    s.set_defaults(fn=cmd_generate)

    s = sub.add_parser("bench", help="benchmark_e2e: TTFT, ITL, tokens/s, MBU (GPU)")
    s.add_argument("file", type=Path, help="a .nanoqwen file")
    s.add_argument("--warmup", type=_nonneg, default=None, help="untimed warm-up requests (default: nanoqwen.yaml)")
    s.add_argument("--prompt-tokens", type=_positive, default=None, help="prompt length (default 512)")
    s.add_argument("--gen-tokens", type=_positive, default=None, help="generated tokens (default 128)")
    s.add_argument("--peers", action="store_true",
                   help="also check and time the peers: torch INT4 tinygemm, transformers FP16 (compiled and eager), "
                        "dequantize + cuBLAS prefill (needs torch, transformers)")
    s.add_argument("--llama-cpp", type=Path, default=None,
                   help="with --peers: the JSON of tools/llama_cpp_bench.py run on this machine, merged as rows")
    s.add_argument("--breakdown", action="store_true",
                   help="also the ITL breakdown: each region of a decode token, eager and graph kernel_gap")
    s.add_argument("--prefill", choices=["tensor-core", "token-by-token"], default="tensor-core",
                   help="prefill to time (default tensor-core; token-by-token is the simple baseline)")
    s.add_argument("--prefill-gemm", choices=["wgmma", "mma"], default=None,
                   help="the tensor-core prefill's GEMMs (default: nanoqwen.yaml engine.prefill_gemm; "
                        "mma is the earlier mma.sync kernel, for comparison)")
    s.add_argument("--decode", choices=["persistent", "graph"], default=None,
                   help="the decode step (default: nanoqwen.yaml engine.decode): one persistent kernel a token, "
                        "or the kernel-per-op CUDA graph")
    s.add_argument("--no-baseline", action="store_true",
                   help="with the persistent step: skip timing the kernel-per-op graph beside it")
    s.add_argument("--json", type=Path, help="write all results, GPU name, clocks and git commit here")
    s.add_argument("--no-verify", action="store_true", help="skip the payload CRC32 check at load")
    s.set_defaults(fn=cmd_bench)

    s = sub.add_parser("validate", help="the correctness ladder: unit, layer, graph (GPU); stops at the first failure")
    s.add_argument("file", type=Path, help="a .nanoqwen file")
    s.add_argument("--stages", default="unit,layer,graph", help="comma-separated subset, in ladder order")
    s.add_argument("--prompts", type=_positive, default=None, help="graph stage prompts (default: nanoqwen.yaml, 100)")
    s.add_argument("--gen-tokens", type=_positive, default=None, help="graph stage tokens per prompt (default 128)")
    s.add_argument("--no-verify", action="store_true", help="skip the payload CRC32 check at load")
    s.add_argument("--json", type=Path, default=None,
                   help="also write everything, per-step logit errors included, to this file")
    s.add_argument("--reference-batch", type=_positive, default=1,
                   help="graph stage: decode this many prompts at once in the reference (much faster on the "
                        "7B; sums in another order than 1, the default the near-tie line was measured with)")
    s.set_defaults(fn=cmd_validate)

    s = sub.add_parser("demo", help="synthesize the tiny model, pack it and generate with it")
    s.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate (default 16)")
    s.add_argument("--backend", choices=["reference", "gpu"], help="default: gpu when one is present")
    s.set_defaults(fn=cmd_demo)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):   # bare `nanoqwen`: the usage, not an error
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except NanoqwenError as e:
        print(f"nanoqwen {args.verb}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path the system refuses (permissions, full disk, ...): one line too
        print(f"nanoqwen {args.verb}: error: {e.filename or '<arguments>'}: {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"nanoqwen {args.verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
