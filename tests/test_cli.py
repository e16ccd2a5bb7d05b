"""The CLI: user errors exit 2 with one line, never a traceback; every verb that takes a
file refuses a corrupted or truncated one."""
from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import nanoqwen_lib
from nanoqwen_lib.cli import main
from nanoqwen_lib.gpu.cuda_build import have_gpu
from nanoqwen_lib.format.weightfile import NanoqwenFile, write_nanoqwen

from .bad_inputs import micro_checkpoint
from .test_fileformat import MICRO, random_producer


def run_cli(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    return subprocess.run([sys.executable, "-m", "nanoqwen_lib", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)


def assert_user_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture(scope="module")
def micro_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("cli") / "micro.nanoqwen"
    write_nanoqwen(p, MICRO, random_producer(2))
    return p


def test_help_explains_every_verb():
    r = run_cli("--help")
    assert r.returncode == 0
    for verb in ("synth", "pack", "inspect", "generate", "bench", "validate", "demo"):
        assert verb in r.stdout
        h = run_cli(verb, "--help")
        assert h.returncode == 0 and "usage" in h.stdout


def test_inspect_prints_header_and_tensors(micro_file):
    r = run_cli("inspect", micro_file, "--verify")
    assert r.returncode == 0, r.stderr
    assert "NANOQWEN" in r.stdout and "model.layers.0.self_attn.q_proj.qweight" in r.stdout
    assert "verified" in r.stdout


@pytest.mark.parametrize("verb", ["inspect", "generate"])
@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "magic"])
def test_every_file_verb_refuses_a_damaged_file(tmp_path, micro_file, verb, damage):
    raw = bytearray(micro_file.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "flip_payload":
        raw[-200] ^= 0xFF
    else:
        raw[0:8] = b"GGUF\0\0\0\0"
    bad = tmp_path / "bad.nanoqwen"
    bad.write_bytes(bytes(raw))
    extra = ["--verify"] if verb == "inspect" else ["--prompt-ids", "1,2", "--backend", "reference"]
    r = run_cli(verb, bad, *extra)
    assert_user_error(r, str(bad), "expected", "found")


def test_missing_file_and_bad_flags():
    assert_user_error(run_cli("inspect", "/nonexistent.nanoqwen"), "/nonexistent.nanoqwen")
    assert_user_error(run_cli("generate"), "error")


@pytest.mark.parametrize("ids,found", [
    ("", "an empty item at position 1"),
    ("1,,2", "an empty item at position 2"),
    ("1,2,", "an empty item at position 3"),
    (",1", "an empty item at position 1"),
    ("1,x", "'x' at position 2"),
    ("1,-2", "'-2' at position 2"),
    ("-1", "'-1' at position 1"),
    ("1.5", "'1.5' at position 1"),
    ("1_000", "'1_000' at position 1"),
    ("1;2", "'1;2' at position 1"),
])
def test_prompt_ids_are_integers_separated_by_commas(micro_file, ids, found):
    """Every item of --prompt-ids is a non-negative integer: an empty one is refused, not
    skipped (whether or not the file exists: the syntax is checked first)."""
    for file in (micro_file, "/nonexistent.nanoqwen"):
        r = run_cli("generate", file, "--prompt-ids", ids, "--backend", "reference")
        assert_user_error(r, "--prompt-ids", "expected token ids (non-negative integers) separated by commas",
                          f"found {found} of {ids!r}")


def test_prompt_ids_parse_to_the_ids_given():
    from nanoqwen_lib.cli import build_parser
    for text, ids in ((" 5, 6 ,7", [5, 6, 7]), ("0", [0]), ("151644,9707,  151645 ", [151644, 9707, 151645])):
        assert build_parser().parse_args(["generate", "f.nanoqwen", "--prompt-ids", text]).prompt_ids == ids


@pytest.mark.parametrize("args,needle", [
    (["--prompt-ids", "1,999999"], "vocab"),
    (["--prompt-ids", f"1,{MICRO.vocab}"], f"[0, {MICRO.vocab})"),
    (["--prompt-ids", "1,2", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["--prompt-ids", "1,2", "--max-new-tokens", "99999999"], "fits"),
])
def test_generate_limits_refused_before_any_work(micro_file, args, needle):
    assert_user_error(run_cli("generate", micro_file, *args, "--backend", "reference"), needle)


def test_pack_creates_a_missing_output_directory(tmp_path):
    """Packing into a directory that does not exist yet is fine: it is created (packing
    *from* a missing directory is a user error: tests/bad_inputs.py)."""
    out = tmp_path / "new" / "deeper" / "m.nanoqwen"
    r = run_cli("pack", micro_checkpoint(), "-o", out, "--quiet")
    assert r.returncode == 0, r.stderr
    assert str(out) in r.stdout and NanoqwenFile.open(out).dims == MICRO
    assert os.listdir(out.parent) == ["m.nanoqwen"]


@pytest.mark.skipif(have_gpu(), reason="with a GPU, --backend gpu is a valid request")
def test_gpu_backend_without_a_gpu_is_a_user_error(micro_file):
    r = run_cli("generate", micro_file, "--prompt-ids", "1,2", "--backend", "gpu")
    assert_user_error(r, "GPU", "expected", "found")


def test_pack_killed_leaves_no_file(tmp_path):
    """SIGKILL in the middle of writing: the O_TMPFILE output never got a name."""
    code = (
        "import time, sys\n"
        "from nanoqwen_lib.format.weightfile import write_nanoqwen\n"
        "from tests.test_fileformat import MICRO, random_producer\n"
        "base = random_producer(0)\n"
        "def slow(n, d, s):\n"
        "    print('writing', flush=True); time.sleep(0.05); return base(n, d, s)\n"
        f"write_nanoqwen({str(tmp_path / 'k.nanoqwen')!r}, MICRO, slow)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert p.stdout.readline().startswith("writing")
    time.sleep(0.2)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("stages,needles", [
    ("graph,unit", ("expected each stage once, in that order (unit,layer,graph)", "found 'graph,unit'")),
    ("unit,unit", ("expected each stage once, in that order (unit,layer,graph)", "found 'unit,unit'")),
    ("speed", ("expected stages from unit, layer, graph", "found 'speed' in 'speed'")),
    ("unit,,graph", ("expected stages from unit, layer, graph", "found an empty stage in 'unit,,graph'")),
    ("", ("expected stages from unit, layer, graph", "found an empty stage in ''")),
])
def test_validate_refuses_stages_out_of_ladder_order(micro_file, stages, needles):
    assert_user_error(run_cli("validate", micro_file, "--stages", stages), "--stages", *needles)


def test_validate_help_lists_the_stages():
    from nanoqwen_lib.cli import LADDER
    from nanoqwen_lib.measure.validate import run_ladder
    import inspect
    assert LADDER == inspect.signature(run_ladder).parameters["stages"].default
    h = " ".join(run_cli("validate", "--help").stdout.split())
    assert f"--stages STAGES the stages to run, comma-separated, in ladder order: a subset of {','.join(LADDER)}" in h


# ----------------------------------------------------------------------------- version, help

def test_version_prints_the_one_version():
    """--version prints the installed package's version, which is nanoqwen_lib.__version__ and
    pyproject.toml's (static there, or taken from __version__)."""
    r = run_cli("--version")
    assert (r.returncode, r.stdout, r.stderr) == (0, f"nanoqwen {nanoqwen_lib.__version__}\n", "")
    tomllib = pytest.importorskip("tomllib")            # Python 3.11+
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    if "version" in project:          # a static version in pyproject.toml must be the same one
        assert project["version"] == nanoqwen_lib.__version__
    else:
        assert "version" in project["dynamic"]


def _internal_names() -> set[str]:
    """Every function and class name defined in nanoqwen_lib that reads as code, not as a word
    (benchmark_e2e, GpuBackend; not `tokenizer`)."""
    names = set()
    for f in Path(nanoqwen_lib.__file__).parent.rglob("*.py"):
        names |= {n.name for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return {n for n in names if "_" in n.strip("_") or re.search(r"[a-z][A-Z]", n)}


def test_every_verb_opens_its_help_with_a_description():
    """`nanoqwen VERB --help` opens (after the usage) with a sentence saying what the verb does,
    in words: no internal function name."""
    from nanoqwen_lib.cli import build_parser
    internal = _internal_names()
    sub = next(a for a in build_parser()._actions if a.dest == "verb")
    assert set(sub.choices) == {"synth", "pack", "inspect", "generate", "bench", "validate", "demo"}
    for verb, parser in sub.choices.items():
        assert parser.description and parser.description[0].isupper() and parser.description.endswith("."), verb
        words = set(re.findall(r"\w+", parser.description))
        assert not words & internal, (verb, words & internal)
        text = run_cli(verb, "--help").stdout
        first = text.split("\n\n")[1]                      # the paragraph after the usage
        assert "".join(first.split()) == "".join(parser.description.split()), verb   # wrapped anywhere


def test_pack_help_says_fp8_has_a_gpu_engine():
    h = " ".join(run_cli("pack", "--help").stdout.split())
    assert "reference backend only" not in h
    assert "fp8 (E4M3, one FP32 scale per output row; the GPU engine and the reference both run it)" in h


# ----------------------------------------------------------------------------- synth

def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("case", ["seed -1", "seed x", "seed 1.5", "dims 70b", "out file", "out under a file",
                                  "out not empty", "out not writable"])
def test_synth_refusals_leave_nothing_behind(tmp_path, case):
    """Every refusal of `nanoqwen synth`: one line naming the argument, what was expected and
    what was found, exit 2, and the file system as it was (no output folder, no parents)."""
    args = {"dims": "tiny", "seed": "0", "out": tmp_path / "new" / "ckpt"}
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    needles = {"seed -1": ("--seed", "expected a non-negative integer", "found -1"),
               "seed x": ("--seed", "expected a non-negative integer", "found 'x'"),
               "seed 1.5": ("--seed", "expected a non-negative integer", "found '1.5'"),
               "dims 70b": ("--dims", "expected one of 'tiny', 'tiny-hd64', '7b'", "found '70b'"),
               "out file": (f"{tmp_path / 'file'}: --out", "expected a new or empty directory",
                            "found an existing file"),
               "out under a file": ("--out", "expected a path under a directory",
                                    f"found {tmp_path / 'file'} is a file"),
               "out not empty": (f"{tmp_path / 'full'}: --out", "expected a new or empty directory",
                                 "found a directory with 1 entry (config.json)"),
               "out not writable": ("--out", "expected a writable location",
                                    f"found {tmp_path / 'locked'} is not writable")}[case]
    key, _, value = case.partition(" ")
    if key in ("seed", "dims"):
        args[key] = value
    else:
        args["out"] = {"out file": tmp_path / "file", "out under a file": tmp_path / "file" / "ckpt",
                       "out not empty": tmp_path / "full", "out not writable": tmp_path / "locked" / "a" / "ckpt"}[case]
    if case == "out not writable":
        (tmp_path / "locked").mkdir(mode=0o555)
        if os.access(tmp_path / "locked", os.W_OK):
            pytest.skip("running as root: every directory is writable")
    before = _tree(tmp_path)
    r = run_cli("synth", "--dims", args["dims"], "--seed", args["seed"], "--out", args["out"], "--quiet")
    assert_user_error(r, *needles)
    assert r.stdout == "" and _tree(tmp_path) == before


def test_synthesize_refuses_a_bad_seed_before_writing(tmp_path):
    from nanoqwen_lib.errors import LimitError
    from nanoqwen_lib.synthetic.checkpoint import synthesize
    for seed in (-1, 1.5, "3", True, None):
        with pytest.raises(LimitError, match=r"seed: expected a non-negative integer, found "):
            synthesize(MICRO, seed, tmp_path / "out", progress=False)
    assert _tree(tmp_path) == []


@pytest.fixture
def micro_synth(monkeypatch):
    """`nanoqwen synth` writing the MICRO dims whatever --dims says (seconds, not minutes)."""
    from nanoqwen_lib.synthetic import checkpoint
    real = checkpoint.synthesize
    monkeypatch.setattr(checkpoint, "synthesize", lambda dims, seed, out, **kw: real(MICRO, seed, out, **kw))
    return real


@pytest.mark.parametrize("existing", [False, True])
def test_synth_writes_a_new_or_empty_directory(tmp_path, micro_synth, capsys, existing):
    out = tmp_path / "a" / "b" / "ckpt"
    if existing:
        out.mkdir(parents=True)
    assert main(["synth", "--dims", "tiny", "--seed", "3", "--out", str(out), "--quiet"]) == 0
    assert capsys.readouterr().out == f"wrote synthetic tiny checkpoint (seed 3) to {out}\n"
    want = micro_synth(MICRO, 3, tmp_path / "want", progress=False)
    assert _tree(out) == _tree(want) and all((out / n).read_bytes() == (want / n).read_bytes() for n in _tree(want))
    assert os.listdir(out.parent) == ["ckpt"]                 # no temporary directory beside it
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_synth_failing_part_way_leaves_nothing_behind(tmp_path, monkeypatch, capsys, micro_synth, failure):
    """A failure after some shards are written (a full disk, Ctrl-C): the partial checkpoint
    and the parent directories synth created are removed; one line, exit 2 (130 for Ctrl-C)."""
    from nanoqwen_lib.synthetic import checkpoint
    real_write = checkpoint.write_shard
    written = []

    def write_then_fail(path, *a):
        if written:
            raise failure
        real_write(path, *a)
        written.append(path)
    monkeypatch.setattr(checkpoint, "write_shard", write_then_fail)
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "new" / "deeper" / "ckpt", tmp_path / "empty"):
        written.clear()
        rc = main(["synth", "--dims", "tiny", "--out", str(out), "--quiet"])
        err = capsys.readouterr().err.splitlines()
        assert written and not written[0].exists(), "the failure came after a shard was written"
        assert rc == (130 if isinstance(failure, KeyboardInterrupt) else 2) and len(err) == 1, err
        assert err[0] == ("nanoqwen synth: interrupted" if rc == 130 else
                          "nanoqwen synth: error: <arguments>: No space left on device")
        assert _tree(tmp_path) == ["empty"]


# ----------------------------------------------------------------------------- rough edges

def test_bare_command_prints_the_usage():
    r = run_cli()
    assert r.returncode == 2
    assert r.stderr.startswith("usage: nanoqwen") and "demo" in r.stderr, r.stderr
    assert "nanoqwen nanoqwen" not in r.stderr and "error" not in r.stderr


def test_top_level_parse_errors_name_the_command_once():
    r = run_cli("--bogus")
    assert_user_error(r, "nanoqwen: error")
    assert "nanoqwen nanoqwen" not in r.stderr


@pytest.mark.parametrize("args,needle", [
    pytest.param(["--backend", "gpu"], "GPU",
                 marks=pytest.mark.skipif(have_gpu(), reason="with a GPU, --backend gpu is valid")),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--max-new-tokens", "-3", "--backend", "reference"], "--max-new-tokens"),
])
def test_demo_refuses_before_synthesizing_anything(tmp_path, args, needle):
    cache = tmp_path / "cache"
    env = dict(os.environ, PYTHONPATH=os.getcwd(), NANOQWEN_CACHE=str(cache))
    r = subprocess.run([sys.executable, "-m", "nanoqwen_lib", "demo", *args],
                       capture_output=True, text=True, timeout=120, env=env)
    assert_user_error(r, needle, "expected", "found")
    assert r.stdout == ""          # not even the header: the error has its line to itself
    assert not cache.exists()      # nothing synthesized, nothing packed


def test_demo_says_the_weights_are_synthetic():
    """The demo (tiny model, cached after the first run) prints one line saying that the
    text is meaningless and how to run a real checkpoint, before the text."""
    r = run_cli("demo", "--max-new-tokens", "2", "--backend", "reference")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    note = [ln for ln in lines if "synthetic" in ln]
    assert len(note) == 1 and "meaningless" in note[0], r.stdout
    assert "nanoqwen pack" in note[0] and "nanoqwen generate" in note[0]
    assert lines.index(note[0]) < next(i for i, ln in enumerate(lines) if ln.startswith("output"))


@pytest.mark.parametrize("verb", ["inspect", "generate"])
def test_a_checkpoint_directory_is_told_to_pack_first(verb):
    ckpt = micro_checkpoint()
    extra = [] if verb == "inspect" else ["--prompt-ids", "1,2", "--backend", "reference"]
    r = run_cli(verb, ckpt, *extra)
    assert_user_error(r, str(ckpt), "checkpoint directory", f"nanoqwen pack {ckpt}", "expected a .nanoqwen file")


def test_a_plain_directory_is_not_called_a_missing_file(tmp_path):
    assert_user_error(run_cli("inspect", tmp_path), str(tmp_path), "found a directory")


def test_truncated_file_message_reads_the_right_way_round(tmp_path, micro_file):
    raw = micro_file.read_bytes()
    keep = len(raw) - 4096
    bad = tmp_path / "cut.nanoqwen"
    bad.write_bytes(raw[:keep])
    r = run_cli("inspect", bad)
    assert_user_error(r, "file_bytes", f"expected a file of {len(raw)} bytes", f"found {keep} bytes (the file's length)")


def test_progress_bar_names_the_final_directory_not_the_temporary_one(tmp_path, monkeypatch, capsys):
    from nanoqwen_lib.synthetic import cache, checkpoint
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path))
    monkeypatch.setattr(checkpoint, "synthesize_dims", lambda name: MICRO)
    out = cache.synthetic_checkpoint("micro-test", seed=3, progress=True)
    err = capsys.readouterr().err
    assert f"synth {out.name}" in err, err
    assert ".partial" not in err and out.is_dir()


def test_bench_passes_prefill_graphs_to_the_protocol(monkeypatch, capsys):
    """`nanoqwen bench --prefill-graphs 0` reaches benchmark_e2e (and GpuBackend through it);
    without the flag the engine's default (nanoqwen.yaml) applies (None). CPU: the GPU parts
    are replaced."""
    from nanoqwen_lib import cli
    from nanoqwen_lib.measure import bench
    from nanoqwen_lib.synthetic.packed import packed_synthetic
    seen = []
    monkeypatch.setattr(cli, "require_gpu", lambda *a: None)
    monkeypatch.setattr(bench, "benchmark_e2e", lambda f, *a, **kw: seen.append(kw) or {})
    monkeypatch.setattr(bench, "format_report", lambda r: "report")
    path = str(packed_synthetic("tiny"))
    for argv, want in ((["bench", path, "--prefill-graphs", "0"], 0), (["bench", path], None)):
        assert cli.main(argv) == 0
        assert seen[-1]["prefill_graphs"] == want
    assert capsys.readouterr().out.count("report") == 2
