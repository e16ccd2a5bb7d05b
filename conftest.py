"""Repository-wide pytest hooks: one set of goldens, two machines.

* The chapters' .ipynb hold the outputs of an H200 run. `pytest --nbval book/` re-runs
  them. A cell tagged `gpu` prints something that depends on the GPU machine (a kernel's
  timing, a device name, an H200 measurement, or what its libraries compute: NVRTC's SASS,
  BLAS's summation order under a near-tie): without a GPU it still executes (the chapter
  takes its reference path, deciding with `cuda_build.have_gpu()`), but its output is not
  compared with the H200's.
* A cell tagged `nbval-measured` prints this run's measurements (timings, a plan, errors of
  the GPU's sum order): it is compared with its numbers masked (tests/measured_cells.py), so
  its rows, words, units and outputs must match on any Hopper GPU while its digits may not.
* A test marked `@pytest.mark.gpu` is skipped without a GPU.
* The notebook kernels nbval starts import `nanoqwen_lib` from this checkout, installed
  or not.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
GPU_CELL_TAG = "gpu"

# nbval starts each notebook's kernel as a child process with this environment and the
# notebook's folder as its working directory: put the checkout on its import path.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def _nbval_cell_tags(item) -> list[str] | None:
    """The metadata tags of an nbval notebook-cell item, or None for any other item."""
    try:
        from nbval.plugin import IPyNbCell
    except ImportError:
        return None
    if not isinstance(item, IPyNbCell):
        return None
    return list(item.cell.metadata.get("tags", []))


def shares_the_gpu(config) -> bool:
    """True for `--nbval` under pytest-xdist with more than one worker: chapters then run at once
    on one GPU. On the H200 that failed four speed checks (chapters 7, 9, 10, 11) that pass
    when each chapter has the GPU to itself."""
    n = getattr(config.option, "numprocesses", None)
    return bool(getattr(config.option, "nbval", False)) and isinstance(n, int) and n > 1


def pytest_report_header(config):
    """The machine the suite ran on, first: what was compared depends on it."""
    from nanoqwen_lib.gpu.hardware import gpu_status, hardware
    s = gpu_status()
    if s.usable:
        hw = hardware()
        line = f"nanoqwen: GPU {s.name}, planning for {hw.sms} SMs ({hw.source}): GPU tests run, every chapter cell compared"
        if shares_the_gpu(config):
            return [line, "!" * 20 + " nanoqwen: --nbval with -n: chapters share the GPU, so their speed checks (each "
                    "step against its peers, measured in the same run) can fail; run the chapters without -n"]
        return line
    line = f"nanoqwen: no usable GPU ({s.kind}: {s.reason}): GPU tests skip, cells tagged gpu run uncompared"
    return ["!" * 20 + " " + line] if s.kind in ("driver", "arch") else line


def pytest_collection_modifyitems(config, items):
    from nanoqwen_lib.gpu.hardware import gpu_status
    from tests.measured_cells import MEASURED_TAG, compare_measured

    for item in items:
        tags = _nbval_cell_tags(item)
        if tags is not None and MEASURED_TAG in tags:
            compare_measured(item)
    status = gpu_status()
    if status.usable:
        return  # everything runs and every output is compared (measured cells: masked)
    # A GPU that cannot run the kernels (another architecture, a driver this CuPy cannot use)
    # is said in the reason of every skip, so a suite that tested nothing does not look green.
    why = "needs a Hopper GPU (sm_90)" if status.kind == "none" else f"GPU unusable: {status.reason}"
    skip_gpu = pytest.mark.skip(reason=why)
    for item in items:
        tags = _nbval_cell_tags(item)
        if tags is not None:
            if GPU_CELL_TAG in tags:
                # nbval 0.11 reads options["check"] in IPyNbCell.runtest: the cell runs,
                # its outputs are not compared with the H200 goldens.
                item.options["check"] = False
        elif item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)
