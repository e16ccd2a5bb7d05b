"""Launchers of the kernel lab (kernels/lab/): the earlier and experimental versions of the
engine's kernels, each checked against the reference by tests/test_gpu_lab.py and timed by
tools/bench_*. No engine imports this package."""
