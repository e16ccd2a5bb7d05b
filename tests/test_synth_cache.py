"""The artifact cache under concurrency (pytest-xdist workers asking for the same file):
`cache.build_once` builds once, every caller gets the complete file, and a concurrent
winner of the rename is accepted. CPU only: cheap stand-in builds, real processes."""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

from nanoqwen_lib.synthetic import cache


def _build(path: Path) -> None:
    """A build that takes a while and records who ran it; written to a temp name, renamed."""
    with open(path.parent / "builds.log", "a") as log:
        log.write(f"{os.getpid()}\n")
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    payload = os.urandom(1 << 16)
    tmp.write_bytes(payload)
    time.sleep(0.3)
    os.replace(tmp, path)


def _worker(path: str, start, results) -> None:
    start.wait()
    got = cache.build_once(Path(path), _build)
    results.put((os.getpid(), len(got.read_bytes())))


def test_build_once_across_processes(tmp_path):
    target = tmp_path / "artifact.bin"
    ctx = mp.get_context("fork")
    start, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(target), start, results)) for _ in range(4)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    sizes = [results.get(timeout=5)[1] for _ in procs]
    assert sizes == [1 << 16] * 4, sizes                     # every caller saw the whole file
    builders = (tmp_path / "builds.log").read_text().split()
    assert len(builders) == 1, builders                      # built once
    assert not list(tmp_path.glob(".artifact.bin.tmp-*"))    # no temp file left behind


def test_build_once_skips_an_existing_artifact(tmp_path):
    target = tmp_path / "artifact.bin"
    target.write_bytes(b"done")
    assert cache.build_once(target, lambda p: (_ for _ in ()).throw(AssertionError("rebuilt"))) == target
    assert target.read_bytes() == b"done"


def test_synthetic_checkpoint_accepts_a_concurrent_winner(tmp_path, monkeypatch):
    """Another process renamed its copy into place first: ours is dropped, theirs is used."""
    from nanoqwen_lib.synthetic import checkpoint
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path))
    final = cache.synthetic_checkpoint_path("tiny")

    def racing_synthesize(dims, seed, out, progress=True, label=None):
        (Path(out) / "mine").write_text("ours")
        final.mkdir()                                        # the other process wins the rename
        (final / "theirs").write_text("theirs")

    monkeypatch.setattr(checkpoint, "synthesize", racing_synthesize)
    got = cache.synthetic_checkpoint("tiny")
    assert got == final and (final / "theirs").read_text() == "theirs" and not (final / "mine").exists()
    assert not list(tmp_path.glob("*.partial"))              # our temp dir is gone
