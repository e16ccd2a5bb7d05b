"""The `nanoqwen` command: synth, pack, inspect, generate, bench, validate, demo.

User errors (bad arguments, bad files, requests that do not fit) exit with status 2 and one
line naming the file, the field, the expected and the found value; never a traceback.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from nanoqwen_lib.errors import LimitError, NanoqwenError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, status 2 (argparse's own convention)
        words = self.prog.split()
        who = " ".join(["nanoqwen", *words[1:]])   # "nanoqwen" or "nanoqwen VERB"
        self.exit(2, f"{who}: error: {_house_format(message)} (see --help)\n")



def version() -> str:
    """The installed package's version (its metadata, built from pyproject.toml; the package's
    __version__ is the same one, tests/test_cli.py checks)."""
    from importlib import metadata
    try:
        return metadata.version("nanoqwen")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e . in the checkout)"


def make_backend(name: str, nq_file):
    if name == "reference":
        from nanoqwen_lib.model.generate import ReferenceBackend
        return ReferenceBackend(nq_file)
    if name == "gpu":
        require_gpu_backend()
        from nanoqwen_lib.gpu.engine import GpuBackend
        return GpuBackend(nq_file)
    raise LimitError("<arguments>", "--backend", "reference or gpu", repr(name))


def require_gpu(field: str, hint: str | None = None) -> None:
    """Refuse GPU work, in one line and before any kernel is built, on a machine whose GPU
    cannot run the kernels: none at all (names what is needed), or one that is not Hopper or
    whose driver CuPy cannot use (gpu.hardware's reason: which GPU, what is needed)."""
    from nanoqwen_lib.gpu import hardware
    status = hardware.gpu_status()
    if status.kind == "none":
        raise LimitError("<gpu>", field, status.needs, status.reason, hint)
    if not status.usable:
        raise hardware.UnsupportedGpu(field, status)


def require_gpu_backend() -> None:
    """Refuse --backend gpu on a machine whose GPU cannot run the kernels (before any work)."""
    require_gpu("--backend gpu", "use --backend reference")


def resolve_backend(requested: str | None) -> str:
    """The backend to run. --backend as given (gpu refused in one line where the GPU cannot
    run the kernels); by default the GPU when it can, else the reference, saying so on one
    stderr line when a GPU is there but unusable (not Hopper, or a driver CuPy cannot use)."""
    if requested == "reference":
        return requested
    if requested == "gpu":
        require_gpu_backend()
        return requested
    from nanoqwen_lib.gpu import hardware
    status = hardware.gpu_status()
    if status.usable:
        return "gpu"
    if status.kind in ("arch", "driver"):
        print(f"nanoqwen: {status.reason}; using the reference backend", file=sys.stderr, flush=True)
    return "reference"


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
    """--prompt-ids: token ids (non-negative integers) separated by commas, spaces allowed
    around them; an empty item ("1,,2", a trailing comma) is refused, not skipped."""
    items = text.split(",")
    for k, item in enumerate(items):
        if not re.fullmatch(r"\s*[0-9]+\s*", item):
            what = "an empty item" if not item.strip() else repr(item.strip())
            raise argparse.ArgumentTypeError(f"expected token ids (non-negative integers) separated by commas, "
                                             f"found {what} at position {k + 1} of {text!r}")
    return [int(t) for t in items]


def _int_at_least(low: int, what: str):
    """An argparse type: an integer >= low, refused as 'expected <what>, found ...'."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, found {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"expected {what}, found {v}")
        return v
    return parse


_positive = _int_at_least(1, "a positive integer")
_nonneg = _int_at_least(0, "a non-negative integer")


def _check_writable_parent(path: Path, flag: str) -> None:
    """The nearest existing ancestor of path is a directory this process may write into."""
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise LimitError(path, flag, "a path under a directory", f"{parent} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise LimitError(path, flag, "a writable location", f"{parent} is not writable")


def _check_output_dir(path: Path, flag: str) -> None:
    """Refuse an output directory that cannot be written, or that holds something already
    (a checkpoint is never written over, nor mixed with other files), before any work."""
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise LimitError(path, flag, "a new or empty directory", "an existing file")
        entries = sorted(os.listdir(path))
        if entries:
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise LimitError(path, flag, "a new or empty directory",
                             f"a directory with {len(entries)} {'entry' if len(entries) == 1 else 'entries'} "
                             f"({shown})")
    _check_writable_parent(path, flag)


def cmd_synth(a) -> int:
    """Write into a temporary directory beside --out, renamed to --out when complete: a
    refusal or a failure part-way (an error, Ctrl-C) leaves nothing behind, not even the
    parent directories it created."""
    from nanoqwen_lib.config import load
    from nanoqwen_lib.synthetic.checkpoint import check_seed, synthesize
    dims = load().model(a.dims)
    check_seed(a.seed, "--seed")
    out = a.out.absolute()
    _check_output_dir(out, "--out")
    top = out.parent                      # the highest directory this command creates
    while not top.parent.exists():
        top = top.parent
    created, tmp = (None if top.exists() else top), None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
        synthesize(dims, a.seed, tmp, progress=not a.quiet, label=out.name)
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)         # a directory's usual mode, not mkdtemp's 0700
        os.replace(tmp, out)              # onto a missing or empty directory
        created = None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
    print(f"wrote synthetic {a.dims} checkpoint (seed {a.seed}) to {a.out}")
    return 0


def _check_output_file(path: Path, flag: str) -> None:
    """Refuse an output path that cannot become a file, before any work."""
    if path.is_dir():
        raise LimitError(path, flag, "a file path", "an existing directory")
    _check_writable_parent(path, flag)


def cmd_pack(a) -> int:
    from nanoqwen_lib.format.packer import pack_checkpoint
    if a.layout == "stream" and a.weights != "int4":
        raise LimitError("<arguments>", "--layout", f"split with --weights {a.weights} (stream is INT4 only)",
                         a.layout)
    _check_output_file(a.output, "--output")
    out = pack_checkpoint(a.checkpoint, a.output, progress=not a.quiet, weights=a.weights, layout=a.layout)
    print(f"wrote {out} ({out.stat().st_size / 1e9:.3f} GB)")
    return 0


LADDER = ("unit", "layer", "graph")      # measure.validate.run_ladder's stages, in order


def _stages(text: str) -> list[str]:
    """--stages: a comma-separated subset of the ladder, in ladder order."""
    stages = [x.strip() for x in text.split(",")]
    unknown = [x for x in stages if x not in LADDER]
    if unknown:
        found = "an empty stage" if not unknown[0] else repr(unknown[0])
        raise argparse.ArgumentTypeError(f"expected stages from {', '.join(LADDER)} (comma-separated, in that "
                                         f"order), found {found} in {text!r}")
    if stages != sorted(stages, key=LADDER.index) or len(set(stages)) != len(stages):
        raise argparse.ArgumentTypeError(f"expected each stage once, in that order ({','.join(LADDER)}), "
                                         f"found {text!r}")
    return stages


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
        prompt = a.prompt_ids       # checked against the model's vocab below
    else:
        text = chat_prompt(f, tok, a.prompt) if a.chat else a.prompt
        prompt = tok.encode(text)
    check_request(f.dims, prompt, a.max_new_tokens)  # before any backend (GPU) work
    backend = make_backend(resolve_backend(a.backend), f)
    ids = generate_ids(backend, prompt, a.max_new_tokens, eos_ids=() if a.ignore_eos else eos_ids(f, tok))
    if a.ids:
        print(" ".join(str(t) for t in ids))
    else:
        stream_text(tok, ids, lambda s: (sys.stdout.write(s), sys.stdout.flush()))
        print()
    return 0


DEMO_PROMPT = "def quicksort(xs):"
DEMO_NOTE = ("the weights are synthetic (random), so the text below is meaningless; for a real model: "
             "nanoqwen pack CHECKPOINT_DIR -o model.nanoqwen && nanoqwen generate model.nanoqwen --prompt ...")


def cmd_demo(a) -> int:
    """The embedded default, end to end: synthesize tiny, pack it, generate with it."""
    from nanoqwen_lib.config import load
    from nanoqwen_lib.format.tokenizer import QwenTokenizer
    from nanoqwen_lib.model.generate import check_request
    from nanoqwen_lib.synthetic.packed import packed_synthetic
    # Every refusal comes before the synthesis and packing (seconds of CPU, a file in the cache).
    check_request(load().model("tiny"), QwenTokenizer.default().encode(DEMO_PROMPT), a.max_new_tokens)
    backend = resolve_backend(a.backend)
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
    from nanoqwen_lib.measure.bench import benchmark_e2e, format_report
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    f = NanoqwenFile.open(a.file, verify_payload=not a.no_verify)
    require_gpu("GPU", "bench times the GPU engine")
    r = benchmark_e2e(f, a.prompt_tokens, a.gen_tokens, a.warmup,
                      progress=lambda m: print(f"[bench] {m}", file=sys.stderr, flush=True),
                      prefill=a.prefill, breakdown=a.breakdown, prefill_gemm=a.prefill_gemm,
                      decode=a.decode, baseline=not a.no_baseline, prefill_graphs=a.prefill_graphs)
    if a.peers:
        from nanoqwen_lib.measure.peers import run_peers
        r["peers"] = run_peers(f, r, progress=lambda m: print(f"[peers] {m}", file=sys.stderr, flush=True),
                               llama_cpp_json=a.llama_cpp)
    print(format_report(r))
    if a.json:
        from nanoqwen_lib.measure import records
        persistent = r["protocol"]["decode"].startswith("one persistent kernel")
        records.write(a.json, r, records.measures_for_bench("persistent" if persistent else "graph",
                                                            f.encoding, peers=bool(a.peers)))
        print(f"wrote {a.json} (with its provenance: the commit and the digests of the code it measures)")
    return 0


def cmd_validate(a) -> int:
    import json
    from nanoqwen_lib.measure.validate import run_ladder
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    f = NanoqwenFile.open(a.file, verify_payload=not a.no_verify)
    require_gpu("GPU", "the ladder checks the GPU kernels")
    r = run_ladder(f, a.prompts, a.gen_tokens, stages=a.stages, reference_batch=a.reference_batch,
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
    p.add_argument("--version", action="version", version=f"nanoqwen {version()}",
                   help="print the version and exit")
    sub = p.add_subparsers(dest="verb", required=True, parser_class=_Parser)

    def verb(name, summary, description=None):
        """A verb: `summary` in `nanoqwen --help`, and (with `description`) opening `nanoqwen VERB --help`."""
        return sub.add_parser(name, help=summary, description=f"{summary[0].upper()}{summary[1:]}."
                              + (f" {description}" if description else ""))

    s = verb("synth", "write a synthetic checkpoint in the exact Hugging Face layout",
             "Random bf16 weights from a seed (the same seed gives the same bytes), sharded safetensors, "
             "config.json, generation_config.json and the Qwen2 tokenizer files.")
    s.add_argument("--dims", required=True, choices=["tiny", "tiny-hd64", "7b"], help="model dims from nanoqwen.yaml")
    s.add_argument("--seed", type=_nonneg, default=0,
                   help="random seed, a non-negative integer (same seed, same weights)")
    s.add_argument("--out", required=True, type=Path,
                   help="output directory: a new one (missing parents are created) or an empty one")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(fn=cmd_synth)

    s = verb("pack", "quantize a Hugging Face checkpoint into a .nanoqwen file",
             "Reads config.json, the safetensors shards and the tokenizer of a Qwen2 / Qwen2.5 checkpoint, "
             "validates them, and writes one file atomically.")
    s.add_argument("checkpoint", type=Path, help="checkpoint directory (config.json, *.safetensors)")
    s.add_argument("-o", "--output", required=True, type=Path, help="the .nanoqwen file to write")
    s.add_argument("--weights", choices=["int4", "fp8"], default="int4",
                   help="encoding of the seven projections: int4 (group 128, the default; the GPU engine "
                        "reads it) or fp8 (E4M3, one FP32 scale per output row; the GPU engine and the "
                        "reference both run it)")
    s.add_argument("--layout", choices=["split", "stream"], default="split",
                   help="storage of the projections: split (codes and scales in two tensors, layout 1 for int4, "
                        "the default) or stream (int4 only: layout 3, one lane-fragment stream per projection, "
                        "what the streaming decode GEMV reads)")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(fn=cmd_pack)

    s = verb("inspect", "validate a .nanoqwen file and print its header and tensors")
    s.add_argument("file", type=Path, help="a .nanoqwen file")
    s.add_argument("--verify", action="store_true", help="also check every payload's CRC32")
    s.add_argument("--header-only", action="store_true", help="print the header, not the tensor table")
    s.set_defaults(fn=cmd_inspect)

    s = verb("generate", "greedy generation from a .nanoqwen file",
             "On the GPU engine when this machine has a usable Hopper GPU, else on the NumPy reference.")
    s.add_argument("file", type=Path, help="a .nanoqwen file")
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text (tokenized with the file's Qwen tokenizer)")
    g.add_argument("--prompt-ids", type=_ids, help="prompt token ids, comma-separated (each below the model's vocab)")
    s.add_argument("--chat", action="store_true",
                   help="wrap --prompt in the file's chat template (the checkpoint's own, else Qwen2.5's)")
    s.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    s.add_argument("--backend", choices=["reference", "gpu"],
                   help="default: gpu when this machine's GPU can run the kernels (Hopper, sm_90), else reference")
    s.add_argument("--ids", action="store_true", help="print generated token ids on one line, not text")
    s.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    s.add_argument("--no-verify", action="store_true", help="skip the payload CRC32 check at load (faster)")
    s.set_defaults(fn=cmd_generate)

    s = verb("bench", "time the GPU engine end to end: TTFT, ITL, tokens/s, MBU (GPU)",
             "Untimed warm-up requests, then the timed one (default: nanoqwen.yaml's benchmark protocol, a "
             "512-token prompt and 128 generated tokens), with the prefill and decode step chosen below; "
             "optionally the ITL breakdown and the peers on the same machine.")
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
    s.add_argument("--prefill-gemm", choices=["rs", "wgmma", "mma"], default=None,
                   help="the tensor-core prefill's GEMMs (default: nanoqwen.yaml engine.prefill_gemm: rs for "
                        "INT4, wgmma for FP8); rs: wgmma's RS form, the weight converted in registers (INT4 "
                        "only); wgmma: the producer form, dequantized into shared memory; mma: the earlier "
                        "mma.sync kernels, for comparison")
    s.add_argument("--prefill-graphs", type=int, default=None, metavar="N",
                   help="prompt-chunk shapes the engine keeps as CUDA graphs (default: nanoqwen.yaml "
                        "engine.prefill_graphs; 0: every prefill eager, each launch from Python)")
    s.add_argument("--decode", choices=["persistent", "graph"], default=None,
                   help="the decode step (default: nanoqwen.yaml engine.decode): one persistent kernel a token, "
                        "or the kernel-per-op CUDA graph")
    s.add_argument("--no-baseline", action="store_true",
                   help="with the persistent step: skip timing the kernel-per-op graph beside it")
    s.add_argument("--json", type=Path, help="write all results, GPU name, clocks and git commit here")
    s.add_argument("--no-verify", action="store_true", help="skip the payload CRC32 check at load")
    s.set_defaults(fn=cmd_bench)

    s = verb("validate", "the correctness ladder: unit, layer, graph (GPU); stops at the first failure",
             "unit: each kernel against the reference op (the GPU tests); layer: one decoder block against "
             "the reference; graph: the engine's greedy tokens against the reference model's "
             "(nanoqwen.yaml's validation prompts and thresholds).")
    s.add_argument("file", type=Path, help="a .nanoqwen file")
    s.add_argument("--stages", type=_stages, default=list(LADDER),
                   help=f"the stages to run, comma-separated, in ladder order: a subset of {','.join(LADDER)} "
                        f"(default: all)")
    s.add_argument("--prompts", type=_positive, default=None, help="graph stage prompts (default: nanoqwen.yaml, 100)")
    s.add_argument("--gen-tokens", type=_positive, default=None, help="graph stage tokens per prompt (default 128)")
    s.add_argument("--no-verify", action="store_true", help="skip the payload CRC32 check at load")
    s.add_argument("--json", type=Path, default=None,
                   help="also write everything, per-step logit errors included, to this file")
    s.add_argument("--reference-batch", type=_positive, default=1,
                   help="graph stage: decode this many prompts at once in the reference (much faster on the "
                        "7B; sums in another order than 1, the default the near-tie line was measured with)")
    s.set_defaults(fn=cmd_validate)

    s = verb("demo", "synthesize the tiny model, pack it and generate with it",
             "The files are cached ($NANOQWEN_CACHE, else ~/.cache/nanoqwen); the weights are random, so "
             "the text is meaningless.")
    s.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate (default 16)")
    s.add_argument("--backend", choices=["reference", "gpu"],
                   help="default: gpu when this machine's GPU can run the kernels (Hopper, sm_90), else reference")
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
