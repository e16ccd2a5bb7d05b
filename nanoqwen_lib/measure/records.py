"""Records are today's or say they are not.

A record (a JSON file in book/data/ that a chapter quotes) carries its provenance: the commit
it was measured at and the SHA-256 of every file it measures (the kernels and modules whose
speed or outputs it holds). `load` hashes those files as they are now, so a record whose code
changed since says so in one line (`Record.banner()`), the first line a record-backed cell
prints. The comparison needs no git: it reads the files' bytes, so it holds in a copy of the
tree without history.

    write(path, data, measures)   the record, with "provenance", written whole (tmp + rename)
    load(path) -> Record          .data, .commit, .changed, .fresh, .banner()
    band(x, edges)                a value printed as the band it falls in ("1.2-1.4x")

A measured path is a file or a folder, relative to the repository. A folder's hash covers
its files in sorted order (path and bytes), leaving out what git ignores here: __pycache__,
*.pyc, *.egg-info, hidden files and folders. A YAML file can be measured less some of its
sections, "FILE (without a.b, c)" (`without`): its parsed content with those keys removed,
hashed as canonical JSON, so that a record of the graph step does not go stale when only the
persistent step's planning figures change (and the comments of the file never count).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import yaml

from nanoqwen_lib.errors import NanoqwenError

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "book" / "data"
FIELD = "provenance"


_WITHOUT_RE = re.compile(r"^(?P<file>\S+) \(without (?P<keys>[\w.]+(?:, [\w.]+)*)\)$")


def without(path: str, *keys: str) -> str:
    """The measured path "path (without k1, k2)": a YAML file less the sections named by
    dotted keys (each must exist, or the digest is refused)."""
    return f"{path} (without {', '.join(keys)})"


# What each record measures: the kernels and modules whose speed or outputs it holds (its
# writer passes the same list to write()). Shared pieces first.
_K_COMMON = ["kernels/common.cuh", "kernels/hopper.cuh", "kernels/argmax.cuh", "kernels/rowops.cuh"]
_CONFIG = "nanoqwen_lib/nanoqwen.yaml"
_PLAN = ["nanoqwen_lib/config.py", _CONFIG,                                # kernels' defines, protocol
         "nanoqwen_lib/gpu/hardware.py"]                                    # what the planners plan for
_GRAPH_CONFIG = without(_CONFIG, "engine.persistent", "tuning.decode_persistent")   # less what only the persistent step reads
_PLAN_GRAPH = [_GRAPH_CONFIG if p == _CONFIG else p for p in _PLAN]       # ... of a graph-step record
_GRAPH_STEP = ["kernels/decode_contract.cuh", "nanoqwen_lib/gpu/decode_contract.py",   # the step's host-device contract
               "kernels/gemv_int4.cu", "kernels/gemv_int4.cuh", "kernels/decode_ops.cu",
               "kernels/paged_attention.cu", "kernels/rope_append.cu", "kernels/lm_head.cu",
               "kernels/engine_step.cu", "nanoqwen_lib/gpu/engine.py", "nanoqwen_lib/gpu/layer.py",
               "nanoqwen_lib/gpu/ops_decode.py", "nanoqwen_lib/gpu/ops_gemv.py",
               "nanoqwen_lib/gpu/ops_attention.py", "nanoqwen_lib/gpu/projection.py"]
PERSISTENT = ["kernels/decode_persistent.cu", "kernels/decode",      # the entry and its pieces
    "kernels/stream3.cuh", "kernels/decode_contract.cuh", "nanoqwen_lib/gpu/decode_contract.py",
    "nanoqwen_lib/gpu/decode_knobs.py", "nanoqwen_lib/gpu/persistent.py"]
# ops_prefill's front door and the launchers of its three kernel files (one module each)
_OPS_PREFILL = ["nanoqwen_lib/gpu/ops_prefill.py", "nanoqwen_lib/gpu/ops_prefill_mma.py",
                "nanoqwen_lib/gpu/ops_prefill_wgmma.py", "nanoqwen_lib/gpu/ops_prefill_attention.py"]
# INT4's prefill: the RS form (the default), and the producer form and mma.sync beside it
_PREFILL_INT4 = ["kernels/prefill_rs.cu", "kernels/wgmma_rs_ops.cuh", "kernels/prefill_wgmma.cu",
                 "kernels/wgmma_ops.cuh", "kernels/prefill_gemm.cu", "kernels/prefill_attention.cu"] \
    + _OPS_PREFILL + ["nanoqwen_lib/gpu/ops_prefill_rs.py", "nanoqwen_lib/gpu/tensor_map.py"]
_FP8 = ["kernels/fp8.cu", "kernels/fp8.cuh", "nanoqwen_lib/gpu/ops_fp8.py"]
_BENCH = ["nanoqwen_lib/measure/bench.py", "nanoqwen_lib/measure/breakdown.py", "nanoqwen_lib/measure/timing.py"]
PEERS = ["nanoqwen_lib/measure/peers.py", "nanoqwen_lib/measure/peers_torch.py",
          "nanoqwen_lib/measure/peers_hf.py", "nanoqwen_lib/measure/peer_check.py"]

# `nanoqwen bench --json`, by what it ran
BENCH_INT4 = _K_COMMON + _PLAN_GRAPH + _GRAPH_STEP + _PREFILL_INT4 + _BENCH      # kernel-per-op graph decode


def _with_persistent(measures: list[str]) -> list[str]:
    """A graph-step list made a persistent-step one: the whole config, the persistent kernel."""
    out = [_CONFIG if p == _GRAPH_CONFIG else p for p in measures]
    return out + [p for p in PERSISTENT + ["nanoqwen_lib/measure/timeline.py"] if p not in out]


BENCH_PERSISTENT = _with_persistent(BENCH_INT4)
BENCH_FP8 = _K_COMMON + _PLAN_GRAPH + _GRAPH_STEP + _FP8 + ["kernels/prefill_attention.cu"] + _OPS_PREFILL + _BENCH
MEASURES = {   # book/data/<name> -> what it measures
    "persistent.json": BENCH_PERSISTENT,
    "persistent-variants.json": _K_COMMON + _PLAN + PERSISTENT + ["nanoqwen_lib/measure/timeline.py",
                                                                   "tools/bench_persistent.py"],
    "persistent-bounds-loader.json": _K_COMMON + _PLAN + PERSISTENT + ["nanoqwen_lib/measure/timeline.py",
                                                                        "tools/bench_persistent.py"],
    "bench-int4.json": BENCH_INT4,                    # bench --decode graph --breakdown: chapter 12's INT4 side
    "scoreboard.json": BENCH_PERSISTENT + PEERS,      # nanoqwen bench --peers with the default (persistent) step
    "bench-fp8.json": BENCH_FP8,
    "prefill-fp8.json": _K_COMMON + _FP8 + ["kernels/lab/wgmma_fp8.cu", "nanoqwen_lib/gpu/lab/fp8.py",
                                            "tools/bench_prefill.py"],
    "gemv-bulk.json": _K_COMMON + ["kernels/gemv_int4.cu", "kernels/gemv_int4.cuh", "kernels/lab/gemv_bulk.cu",
                                   "nanoqwen_lib/gpu/ops_gemv.py", "nanoqwen_lib/gpu/lab/gemv.py",
                                   "nanoqwen_lib/measure/timing.py", "tools/bench_gemv.py"],
    "llama-cpp.json": ["tools/llama_cpp_bench.py"],   # the peer's own code is llama.cpp's, pinned in the record
    "llama-cpp-profile.json": ["tools/llama_cpp_bench.py", "tools/llama_cpp_profile.py"],   # ncu over llama-bench
}
BANNER_PATHS = 6    # changed paths a banner names (Record.changed has them all)
ABSENT = "absent"   # a measured path that did not exist at the record's commit (migrated records only)


def measures_for_bench(decode: str = "graph", encoding: str = "int4", peers: bool = False) -> list[str]:
    """What a `nanoqwen bench --json` record measures: the decode step it ran ("graph" or
    "persistent"), the weights' encoding ("int4", "fp8"), and the peers when it ran them."""
    if encoding not in ("int4", "fp8") or decode not in ("graph", "persistent"):
        raise NanoqwenError("<arguments>", "bench measures", "decode graph|persistent, encoding int4|fp8",
                            f"decode {decode!r}, encoding {encoding!r}")
    out = BENCH_FP8 if encoding == "fp8" else BENCH_INT4
    if decode == "persistent":
        out = _with_persistent(out)
    return list(out) + (PEERS if peers else [])


def measures_for(path) -> list[str]:
    """What the record book/data/<name> measures (MEASURES), refused for an unknown name."""
    name = Path(path).name
    if name not in MEASURES:
        raise NanoqwenError(str(path), "record name", "one of " + ", ".join(sorted(MEASURES)), name)
    return list(MEASURES[name])


def _skipped(name: str) -> bool:
    return name.startswith(".") or name == "__pycache__" or name.endswith((".pyc", ".egg-info"))


def _folder_files(folder: Path) -> list[str]:
    """The files under folder (posix paths relative to it, sorted), without ignored ones."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not _skipped(d)]
        for f in filenames:
            if not _skipped(f):
                out.append((Path(dirpath) / f).relative_to(folder).as_posix())
    return sorted(out)


def _folder_digest(entries: Sequence[tuple[str, bytes]]) -> str:
    h = hashlib.sha256()
    for rel, blob in sorted(entries):
        h.update(rel.encode() + b"\0" + hashlib.sha256(blob).hexdigest().encode() + b"\n")
    return h.hexdigest()


def _rel(p, root: Path) -> str:
    p = Path(p)
    if p.is_absolute():
        try:
            p = p.resolve().relative_to(root.resolve())
        except ValueError:
            raise NanoqwenError(str(p), "measures", f"a path inside the repository {root}", str(p)) from None
    return p.as_posix()


def _sections_digest(where: str, blob: bytes, keys: str) -> str:
    """SHA-256 of a YAML file's content (blob) less the dotted keys ("a.b, c"), as canonical JSON."""
    doc = yaml.safe_load(blob)
    for key in keys.split(", "):
        node, parts = doc, key.split(".")
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or parts[-1] not in node:
            raise NanoqwenError(where, key, "a section of the file (a record measures the file without it)", "no such key")
        del node[parts[-1]]
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def digest(path: str, root: Path = REPO) -> str | None:
    """SHA-256 of a measured path as it is now (a file's bytes, a folder's files, or a YAML
    file's content less some sections: `without`), or None where it does not exist."""
    if m := _WITHOUT_RE.match(path):
        f = root / m["file"]
        return _sections_digest(m["file"], f.read_bytes(), m["keys"]) if f.is_file() else None
    p = root / path
    if p.is_file():
        return hashlib.sha256(p.read_bytes()).hexdigest()
    if p.is_dir():
        return _folder_digest([(rel, (p / rel).read_bytes()) for rel in _folder_files(p)])
    return None


def digest_at(commit: str, path: str, root: Path = REPO) -> str | None:
    """The same digest for the path as committed at `commit` (git show / ls-tree): for
    giving an older record its provenance. The only function here that calls git."""
    def git(*args) -> bytes:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, check=True).stdout
    m = _WITHOUT_RE.match(path)
    target = m["file"] if m else path
    kind = subprocess.run(["git", "cat-file", "-t", f"{commit}:{target}"], cwd=root, capture_output=True,
                          text=True).stdout.strip()
    if m:
        return _sections_digest(f"{target} at {commit}", git("show", f"{commit}:{target}"), m["keys"]) \
            if kind == "blob" else None
    if kind == "blob":
        return hashlib.sha256(git("show", f"{commit}:{path}")).hexdigest()
    if kind == "tree":
        names = git("ls-tree", "-r", "--name-only", "-z", commit, "--", path).decode().split("\0")
        entries = []
        for name in filter(None, names):
            rel = Path(name).relative_to(path).as_posix()
            if any(_skipped(part) for part in Path(rel).parts):
                continue
            entries.append((rel, git("show", f"{commit}:{name}")))
        return _folder_digest(entries)
    return None


def _earlier_names(rel: str) -> list[str]:
    """rel, then where it lived before the package was split into gpu/, measure/ and lab/."""
    names = [rel]
    for new, old in (("nanoqwen_lib/gpu/lab/", "nanoqwen_lib/lab_"), ("nanoqwen_lib/gpu/", "nanoqwen_lib/"),
                     ("nanoqwen_lib/measure/", "nanoqwen_lib/"), ("kernels/lab/", "kernels/")):
        if rel.startswith(new):
            names.append(old + rel[len(new):])
    return names


def head_commit(root: Path = REPO) -> str:
    """The commit measured: NANOQWEN_GIT_COMMIT when set (a tree without .git, as on the
    device machine), else git's HEAD, else "unknown"."""
    if os.environ.get("NANOQWEN_GIT_COMMIT"):
        return os.environ["NANOQWEN_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=root,
                              timeout=10).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def provenance(measures: Sequence[str], commit: str | None = None, root: Path = REPO) -> dict:
    """{"git_commit", "measures": path -> digest}: of the files as they are now, or, with
    commit, as they were at that commit. A path that does not exist is refused."""
    if isinstance(measures, (str, Path)):
        measures = [measures]
    out = {}
    for m in measures:
        rel = _rel(m, root)
        if commit is None:
            d = digest(rel, root)
        else:   # the file at that commit, where it lived then; ABSENT where it did not exist yet
            d = next((x for x in (digest_at(commit, n, root) for n in _earlier_names(rel)) if x is not None), ABSENT)
        if d is None:
            raise NanoqwenError(rel, "measures", f"a file or folder of the repository{' at ' + commit if commit else ''}",
                                "no such path")
        out[rel] = d
    if not out:
        raise NanoqwenError("<arguments>", "measures", "at least one path the record measures", "none")
    return {"git_commit": commit or head_commit(root), "measures": out}


def write(path, data: dict, measures: Sequence[str], *, root: Path = REPO, commit: str | None = None) -> Path:
    """Write data plus its provenance (HEAD, and the digest of each measured path now) to
    path as JSON, whole or not at all (a temporary file beside it, then a rename). commit:
    migrating a record measured earlier (the digests are then those at that commit)."""
    path = Path(path)
    body = {k: v for k, v in data.items() if k != FIELD}
    body[FIELD] = provenance(measures, commit=commit, root=root)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(body, indent=2, default=str) + "\n")
    tmp.replace(path)
    return path


@dataclass
class Record:
    path: str                      # as the banner names it (repository-relative where it can)
    data: dict                     # the record without its provenance
    commit: str                    # the commit it was measured at
    measures: dict                 # path -> digest at that commit
    changed: list = field(default_factory=list)   # measured paths whose bytes differ now

    @property
    def fresh(self) -> bool:
        return not self.changed

    def banner(self) -> str:
        head = f"record {self.path}: "
        if self.fresh:
            return head + f"measured at {self.commit[:7]}; the code it measures is unchanged since"
        shown = ", ".join(self.changed[:BANNER_PATHS])
        more = len(self.changed) - BANNER_PATHS
        return head + f"STALE: measured at {self.commit[:7]}; changed since: {shown}" + (
            f" and {more} more of the {len(self.measures)} paths it measures" if more > 0 else "")


def load(path, *, root: Path = REPO) -> Record:
    """The record at path with its provenance checked against the files now. A record
    without provenance (or without its commit or measures) is refused, naming the file
    and the field."""
    path = Path(path)
    try:
        name = path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        name = str(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise NanoqwenError(name, "(file)", "a record", "no such file") from None
    except json.JSONDecodeError as e:
        raise NanoqwenError(name, "(file)", "JSON", f"{e.msg} at line {e.lineno}") from None
    prov = raw.get(FIELD) if isinstance(raw, dict) else None
    if not isinstance(prov, dict):
        raise NanoqwenError(name, FIELD, "the record's provenance {git_commit, measures} (records.write)",
                            "missing" if prov is None else type(prov).__name__)
    commit, measures = prov.get("git_commit"), prov.get("measures")
    if not isinstance(commit, str) or not commit:
        raise NanoqwenError(name, f"{FIELD}.git_commit", "the commit measured", repr(commit))
    if not isinstance(measures, dict) or not measures:
        raise NanoqwenError(name, f"{FIELD}.measures", "path -> sha256 of what the record measures", repr(measures))
    changed = [p for p, h in measures.items() if (digest(p, root) or ABSENT) != h]
    return Record(name, {k: v for k, v in raw.items() if k != FIELD}, commit, dict(measures), changed)


def band(x: float, edges: Sequence[float], unit: str = "x", fmt: str = "g") -> str:
    """x printed as the band of sorted `edges` it falls in: "1.2-1.4x", "< 1x", ">= 2x"
    (a band holds across runs and GPUs where the raw value does not). A lower edge belongs
    to its band."""
    edges = list(edges)
    if not edges or any(b <= a for a, b in zip(edges, edges[1:])):
        raise NanoqwenError("<arguments>", "band edges", "at least one edge, strictly increasing", repr(edges))
    if x != x:
        raise NanoqwenError("<arguments>", "band value", "a number", "NaN")
    f = lambda e: format(e, fmt)
    if x < edges[0]:
        return f"< {f(edges[0])}{unit}"
    for lo, hi in zip(edges, edges[1:]):
        if x < hi:
            return f"{f(lo)}-{f(hi)}{unit}"
    return f">= {f(edges[-1])}{unit}"


def all_records(data: Path = DATA, root: Path = REPO) -> list[Record]:
    """Every record in book/data, loaded (refused where one lacks provenance)."""
    return [load(p, root=root) for p in sorted(Path(data).glob("*.json"))]
