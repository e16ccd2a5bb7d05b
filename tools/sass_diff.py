"""Did the code the GPU runs change since a commit? Compares, on the CPU, the SASS of every
kernel in each kernels/*.cu that differs from REV (or includes a header that does), built
for sm_90 exactly as the runtime builds it, for the configurations the 7B engine launches.

    python tools/sass_diff.py REV              # the configurations the 7B engine launches
    python tools/sass_diff.py --variants REV   # ... and every lab build on a kernel's variants line

Label numbers and internal call names are normalized (they shift when other kernels are
added to a module). Exit status 0 when every compared kernel is identical, 1 otherwise.
A kernel that exists only in the working tree is listed as new, not as a difference. The
use: a GPU run verified REV; a later commit that leaves the engine's SASS identical has
not changed what that run verified.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def configs(module: str, variants: bool = False) -> list[dict]:
    """The -D sets the 7B engine builds a module with, spelled out in full (this tree's
    nanoqwen.yaml `tuning:`, so that a REV whose kernels held #ifndef defaults builds the same
    configuration): every module's knobs at their defaults, and for the INT4 GEMV every
    tuned-table entry and the fallback; the prefill GEMM at both tile heights it launches.
    With variants, also each set on the module's variants line over the defaults (a knob REV
    does not know reaches its build as a define it never reads)."""
    from nanoqwen_lib import config
    from nanoqwen_lib.gpu import cuda_build
    base = config.tuning_defines()
    tuning = config.load().tuning
    if module == "gemv_int4":
        g = tuning["gemv_int4"]
        out = [base, {**base, **g.fallback}] + [{**base, **s.defines} for s in g.shapes]
    elif module == "prefill_gemm":
        from nanoqwen_lib.gpu import ops_prefill
        out = [{**base, "NQ_PG_BM": bm} for bm in ops_prefill.GEMM_BM_CHOICES]
    else:
        out = [base]
    if variants:
        out += [{**base, **{k: int(v) for k, v in s.items()}} for s in cuda_build.kernel_variants(module)]
    return [dict(t) for t in {tuple(sorted(c.items())) for c in out}]


def dump(modules: list[str], config_source: dict) -> dict:
    """{module|config|kernel: [normalized instructions]} of this checkout (sys.path[0])."""
    from nanoqwen_lib import config
    from nanoqwen_lib.gpu import cuda_build
    dims = config.load().model("7b")
    out = {}
    for module in modules:
        for cfg in config_source[module]:
            text = cuda_build.sass(module, dims, {k: str(v) for k, v in cfg.items()})
            for m in re.finditer(r"\.text\.(\w+):\n(.*?)(?=\n\s*\.section|\n\s*//-+ \.|\Z)", text, re.S):
                ins = [re.sub(r"__internal_\d+_", "__internal_",
                              re.sub(r"\.L_x_\d+", ".L", re.sub(r"/\*[0-9a-f]{4,}\*/", "", line))).strip()
                       for line in m.group(2).splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", line)]
                out[f"{module}|{json.dumps(cfg, sort_keys=True)}|{m.group(1)}"] = ins
    return out


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--dump":          # run inside REV's checkout
        sys.path.insert(0, str(Path.cwd()))
        args = json.loads(Path(sys.argv[2]).read_text())
        Path(sys.argv[3]).write_text(json.dumps(dump(args["modules"], args["configs"])))
        return 0
    with_variants = "--variants" in sys.argv[1:]
    rev = [a for a in sys.argv[1:] if a != "--variants"][0]
    changed = subprocess.run(["git", "diff", "--name-only", rev, "--", "kernels"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    sys.path.insert(0, str(ROOT))
    from nanoqwen_lib.gpu import cuda_build
    changed_paths = {(ROOT / p).resolve() for p in changed}
    # the engine's kernel files only (kernels/*.cu; the lab's kernels/lab/ is not run by an engine)
    # whose file, or a kernels/ header it includes (directly or not), differs from REV
    modules = sorted(f.stem for f in (ROOT / "kernels").glob("*.cu")
                     if {p.resolve() for p in cuda_build.kernel_files(f.stem)} & changed_paths)
    if not modules:
        print(f"no kernel source differs from {rev}")
        return 0
    cfgs = {m: configs(m, with_variants) for m in modules}
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "rev"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), rev], cwd=ROOT, check=True)
        try:
            (Path(tmp) / "args.json").write_text(json.dumps({"modules": modules, "configs": cfgs}))
            subprocess.run([sys.executable, str(ROOT / "tools" / "sass_diff.py"), "--dump",
                            str(Path(tmp) / "args.json"), str(Path(tmp) / "old.json")], cwd=tree, check=True,
                           env={"PYTHONPATH": str(tree), **{k: v for k, v in __import__("os").environ.items()
                                                             if k != "PYTHONPATH"}})
            old = json.loads((Path(tmp) / "old.json").read_text())
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=True)
    new = dump(modules, cfgs)
    differ = 0
    from nanoqwen_lib import config
    base = config.tuning_defines()

    def label(key: str) -> str:          # module|the knobs off their defaults|kernel
        module, cfg, kernel = key.split("|")
        off = {k: v for k, v in json.loads(cfg).items() if base.get(k) != v}
        return f"{module}|{json.dumps(off, sort_keys=True) if off else 'defaults'}|{kernel}"

    for key in sorted(new):
        if key not in old:
            print(f"new        {label(key)}")
        elif old[key] == new[key]:
            print(f"identical  {label(key)}  ({len(new[key])} instructions)")
        else:
            differ += 1
            print(f"DIFFERENT  {label(key)}  ({len(old[key])} -> {len(new[key])} instructions)")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
