"""Where generated artifacts live: $NANOQWEN_CACHE or ~/.cache/nanoqwen, never the repo.

`synthetic_checkpoint("tiny")` is what tests and chapters call: the first call writes the
checkpoint into a temporary directory next to its final place and renames it when
complete, so an interrupted run leaves nothing that looks finished; later calls (and other
processes) just reuse it. Processes that want the same artifact at once (pytest-xdist
workers) take turns on a lock file beside it (`build_once`): one builds, the others wait
and then find it; a concurrent winner of the rename is still accepted.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    d = Path(os.environ.get("NANOQWEN_CACHE") or Path.home() / ".cache" / "nanoqwen").expanduser()
    d.mkdir(parents=True, exist_ok=True)
    return d


@contextlib.contextmanager
def exclusive(path: Path):
    """Hold an exclusive lock on `path`'s lock file (.<name>.lock beside it) for the block:
    one process at a time, across processes (flock; released if the holder dies)."""
    lock = path.parent / f".{path.name}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def build_once(path: Path, build) -> Path:
    """`path` if it exists, else `build(path)` (which must create it atomically: a temp
    name, then a rename) under `exclusive(path)`, so concurrent callers build it once."""
    if path.exists():
        return path
    with exclusive(path):
        if not path.exists():       # another process may have built it while we waited
            build(path)
    return path


def synthetic_checkpoint_path(dims_name: str, seed: int = 0) -> Path:
    """The directory synthetic_checkpoint uses (keyed on the recipe version, so a changed
    recipe never serves stale weights)."""
    from nanoqwen_lib.synthetic.checkpoint import RECIPE_VERSION
    return cache_dir() / f"synth-{dims_name}-seed{seed}-r{RECIPE_VERSION}"


def synthetic_checkpoint(dims_name: str, seed: int = 0, progress: bool = True) -> Path:
    """A synthetic Hugging Face checkpoint of the named dims, created once and cached."""
    from nanoqwen_lib.synthetic.checkpoint import check_seed, synthesize, synthesize_dims
    check_seed(seed)                   # a bad seed or an unknown name fails here, before any work
    final = synthetic_checkpoint_path(dims_name, seed)
    if final.is_dir():
        return final
    dims = synthesize_dims(dims_name)

    def build(final: Path) -> None:
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent))
        try:
            synthesize(dims, seed, tmp, progress=progress, label=final.name)
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir():  # a real failure, not another process finishing first
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    return build_once(final, build)
