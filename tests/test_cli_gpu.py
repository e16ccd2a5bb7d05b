"""The CLI on machines whose GPU cannot run the kernels (CPU tests: the device is faked).

gpu.hardware.gpu_status() is replaced by the verdict (hardware.status_of) on a faked probe:
an A100 (sm_80), an L40S (sm_89), a B200 (sm_100), a driver CuPy cannot use, no GPU at all.
With the default backend, `generate` and `demo` say why on one stderr line and run the
reference; `--backend gpu`, `bench` and `validate` refuse in one line, exit 2, before any
GPU work (no backend built, nothing synthesized).
"""
from __future__ import annotations

import pytest

from nanoqwen_lib import cli
from nanoqwen_lib.cli import main
from nanoqwen_lib.format.packer import pack_checkpoint
from nanoqwen_lib.gpu import hardware

from .bad_inputs import micro_checkpoint

PROBES = {
    "sm_80": {"name": "NVIDIA A100-SXM4-80GB", "cc": (8, 0)},
    "sm_89": {"name": "NVIDIA L40S", "cc": (8, 9)},
    "sm_100": {"name": "NVIDIA B200", "cc": (10, 0)},
    "driver": {"error": "CUDARuntimeError: cudaErrorInsufficientDriver: CUDA driver version is insufficient "
                        "for CUDA runtime version", "status": 35, "driver_present": True,
               "cupy": "cupy 13.6.0, built for CUDA 13"},
    "none": {"error": "no CUDA device", "status": 100},
}
UNUSABLE = ["sm_80", "sm_89", "sm_100", "driver"]


@pytest.fixture(scope="module")
def micro_file(tmp_path_factory):
    """The synthetic MICRO checkpoint packed (decisive weights: its greedy tokens depend on the prompt)."""
    return pack_checkpoint(micro_checkpoint(), tmp_path_factory.mktemp("cli-gpu") / "micro.nanoqwen", progress=False)


@pytest.fixture
def fake_gpu(monkeypatch):
    """fake_gpu(kind) -> the GpuStatus every caller now sees; records the backends built."""
    built = []
    real_make = cli.make_backend
    monkeypatch.setattr(cli, "make_backend", lambda name, f: (built.append(name), real_make(name, f))[1])

    def fake(kind):
        status = hardware.status_of(PROBES[kind])
        monkeypatch.setattr(hardware, "gpu_status", lambda: status)
        return status
    fake.built = built
    return fake


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_the_faked_devices_are_what_they_say():
    assert [hardware.status_of(PROBES[k]).kind for k in PROBES] == ["arch", "arch", "arch", "driver", "none"]
    for k in UNUSABLE:
        s = hardware.status_of(PROBES[k])
        assert s.reason and "\n" not in s.reason and not s.usable


def _generate(micro_file, *extra, prompt="1,2"):
    return main(["generate", str(micro_file), "--prompt-ids", prompt, "--max-new-tokens", "4", "--ids",
                 "--ignore-eos", *extra])


@pytest.mark.parametrize("kind", UNUSABLE)
def test_generate_falls_back_to_the_reference_saying_why(micro_file, fake_gpu, capsys, kind):
    assert _generate(micro_file, "--backend", "reference") == 0
    want = capsys.readouterr()
    assert _generate(micro_file, "--backend", "reference", prompt="3,4") == 0
    assert want.err == "" and want.out.strip() and capsys.readouterr().out != want.out   # the check can fail
    status = fake_gpu(kind)
    assert _generate(micro_file) == 0
    got = capsys.readouterr()
    assert one_line(got.err) == f"nanoqwen: {status.reason}; using the reference backend"
    assert got.out == want.out
    assert fake_gpu.built == ["reference"] * 3


def test_no_gpu_at_all_uses_the_reference_silently(micro_file, fake_gpu, capsys):
    fake_gpu("none")
    assert _generate(micro_file) == 0
    assert capsys.readouterr().err == "" and fake_gpu.built == ["reference"]


@pytest.mark.parametrize("kind", UNUSABLE)
def test_backend_gpu_is_refused_in_one_line(micro_file, fake_gpu, capsys, kind):
    status = fake_gpu(kind)
    assert _generate(micro_file, "--backend", "gpu") == 2
    got = capsys.readouterr()
    assert one_line(got.err) == f"nanoqwen generate: error: --backend gpu: {status.reason}"
    assert got.out == "" and fake_gpu.built == []


def test_backend_gpu_without_any_gpu_names_what_is_needed(micro_file, fake_gpu, capsys):
    status = fake_gpu("none")
    assert _generate(micro_file, "--backend", "gpu") == 2
    assert one_line(capsys.readouterr().err) == (
        f"nanoqwen generate: error: <gpu>: --backend gpu: expected {status.needs}, found no CUDA device "
        "(use --backend reference)")
    assert fake_gpu.built == []


@pytest.mark.parametrize("kind", UNUSABLE + ["none"])
def test_demo_backend_gpu_refused_before_synthesizing(tmp_path, monkeypatch, fake_gpu, capsys, kind):
    cache = tmp_path / "cache"
    monkeypatch.setenv("NANOQWEN_CACHE", str(cache))
    status = fake_gpu(kind)
    assert main(["demo", "--backend", "gpu", "--max-new-tokens", "2"]) == 2
    got = capsys.readouterr()
    line = one_line(got.err)
    assert line.startswith("nanoqwen demo: error: ") and status.reason in line
    assert got.out == "" and not cache.exists()


@pytest.mark.parametrize("kind", ["sm_80", "driver"])
def test_demo_falls_back_to_the_reference_saying_why(fake_gpu, capsys, kind):
    """The whole demo (the tiny model, cached after the first run) on the reference, with
    the reason on one line before anything else."""
    status = fake_gpu(kind)
    assert main(["demo", "--max-new-tokens", "2"]) == 0
    got = capsys.readouterr()
    said = [ln for ln in got.err.splitlines() if ln.startswith("nanoqwen")]
    assert said == [f"nanoqwen: {status.reason}; using the reference backend"]
    assert "backend    reference" in got.out.splitlines()
    assert fake_gpu.built == ["reference"]


@pytest.mark.parametrize("verb", ["bench", "validate"])
@pytest.mark.parametrize("kind", UNUSABLE + ["none"])
def test_gpu_verbs_refuse_in_one_line(micro_file, fake_gpu, capsys, verb, kind):
    status = fake_gpu(kind)
    assert main([verb, str(micro_file)]) == 2
    got = capsys.readouterr()
    line = one_line(got.err)
    if kind == "none":
        assert line.startswith(f"nanoqwen {verb}: error: <gpu>: GPU: expected {status.needs}, "
                               f"found {status.reason} ("), line
    else:
        assert line == f"nanoqwen {verb}: error: GPU: {status.reason}"
    assert got.out == ""
