"""tools/llama_cpp_profile.py: ncu's raw CSV read, two runs differenced into one token."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _tool():
    sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location("llama_cpp_profile", TOOLS / "llama_cpp_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
        '"Grid Size","Device","CC","gpu__time_duration.sum"\n')


def _csv(launches, unit="nsecond"):
    rows = [HEAD, '"","","","","","","","","","","",' + f'"{unit}"\n']
    for i, (name, t) in enumerate(launches):
        rows.append(f'"{i}","1","llama-bench","h","{name}","1","7","(128, 1, 1)","(64, 1, 1)","0","9.0","{t}"\n')
    return "".join(rows)


def _launches(rng, tokens, once):
    """`once` set-up kernels, then `tokens` tokens of the same kernel sequence (random times)."""
    seq = [("void mul_mat_vec_q<(ggml_type)12, 1>(const void *, const void *, float *)", 1),
           ("quantize_q8_1", 1), ("rms_norm_f32<1024>", 2), ("flash_attn_ext_vec", 1)]
    out = [("init_tensor", float(rng.integers(100, 900))) for _ in range(once)]
    for _ in range(tokens):
        for _layer in range(3):
            for name, n in seq:
                out += [(name, float(rng.integers(500, 9000))) for _ in range(n)]
    return out


def test_base_name_drops_templates_and_parameters():
    t = _tool()
    assert t.base_name("void mul_mat_vec_q<(ggml_type)12, 1>(const void *, float *)") == "void mul_mat_vec_q"
    assert t.base_name("ggml_cuda::k_bin_bcast<op_add>") == "k_bin_bcast"
    assert t.base_name("quantize_q8_1") == "quantize_q8_1"


def test_raw_csv_reads_units_and_every_row():
    t = _tool()
    rng = np.random.default_rng()
    launches = _launches(rng, 2, 3)
    got = t.parse_raw_csv(_csv(launches))
    assert len(got) == len(launches)
    assert [ns for _, ns in got] == [ns for _, ns in launches]
    us = t.parse_raw_csv(_csv([("k", 2.5)], unit="usecond"))
    assert us == [("k", 2500.0)]


def test_raw_csv_errors_name_the_file_and_what_is_missing():
    t = _tool()
    with pytest.raises(ValueError, match=r"x\.csv: no header with 'Kernel Name' and 'gpu__time_duration.sum'"):
        t.parse_raw_csv('"ID","Kernel Name"\n"0","k"\n', "x.csv")
    bad = _csv([("k", 1.0)]).replace('"1.0"', '"n/a"')
    with pytest.raises(ValueError, match=r"y\.csv: row 3: expected a kernel name and a duration"):
        t.parse_raw_csv(bad, "y.csv")


def test_difference_of_two_runs_is_one_token_of_work():
    t = _tool()
    rng = np.random.default_rng()
    short, long = _launches(rng, 2, 5), _launches(rng, 6, 5)
    d = t.per_unit(t.parse_raw_csv(_csv(short)), t.parse_raw_csv(_csv(long)), 4)
    assert d["launches"] == pytest.approx(3 * 5)                 # 3 layers x 5 launches
    want = (sum(ns for _, ns in long) - sum(ns for _, ns in short)) / 4 / 1e3
    assert d["gpu_us"] == pytest.approx(want, abs=1e-2)
    by = {r["kernel"]: r for r in d["kernels"]}
    assert by["rms_norm_f32"]["launches"] == 6 and by["init_tensor"]["launches"] == 0
    assert [r["us"] for r in d["kernels"]] == sorted((r["us"] for r in d["kernels"]), reverse=True)


def test_kernels_past_the_top_are_summed_as_other():
    t = _tool()
    short = [(f"k{i}", 10.0) for i in range(t.TOP + 3)]
    long = short + [(f"k{i}", 1000.0 * (i + 1)) for i in range(t.TOP + 3)]
    d = t.per_unit(short, long, 1)
    assert len(d["kernels"]) == t.TOP + 1 and d["kernels"][-1]["kernel"] == "other (3 kernels)"
    assert d["kernels"][-1]["us"] == pytest.approx(1.0 + 2.0 + 3.0)
    assert d["launches"] == t.TOP + 3


def test_summarize_reads_the_pairs_and_refuses_an_empty_folder(tmp_path):
    t = _tool()
    rng = np.random.default_rng()
    with pytest.raises(SystemExit, match="no <quant>-<run>-<short|long>.csv pairs"):
        t.summarize(tmp_path)
    (tmp_path / "Q4_0-decode-short.csv").write_text(_csv(_launches(rng, 2, 1)))
    (tmp_path / "Q4_0-decode-long.csv").write_text(_csv(_launches(rng, 6, 1)))
    (tmp_path / "Q4_K_M-prefill-short.csv").write_text(_csv(_launches(rng, 2, 1)))   # no pair: left out
    body = t.summarize(tmp_path)
    assert set(body["quants"]) == {"Q4_0"} and body["quants"]["Q4_0"]["decode"]["per"] == "token"
