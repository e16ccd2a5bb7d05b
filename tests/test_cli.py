"""The CLI: user errors exit 2 with one line, never a traceback; every verb that takes a
file refuses a corrupted or truncated one."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

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
    assert_user_error(run_cli("synth", "--dims", "70b", "--out", "/tmp/x"), "dims")


@pytest.mark.parametrize("args,needle", [
    (["--prompt-ids", ""], "prompt"),
    (["--prompt-ids", "1,x"], "--prompt-ids"),
    (["--prompt-ids", "1,999999"], "vocab"),
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


def test_validate_refuses_stages_out_of_ladder_order(micro_file):
    assert_user_error(run_cli("validate", micro_file, "--stages", "graph,unit"), "--stages", "in that order")
    assert_user_error(run_cli("validate", micro_file, "--stages", "speed"), "--stages")


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
