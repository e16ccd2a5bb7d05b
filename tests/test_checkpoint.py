"""Checkpoint.open on a synthetic tiny checkpoint, and every way a checkpoint can be wrong.

Broken variants are cheap: a fresh directory whose shards are symlinks to the cached
checkpoint's, with an edited config.json / index, or one small extra shard.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from nanoqwen_lib.cache import synthetic_checkpoint
from nanoqwen_lib.checkpoint import INDEX, Checkpoint
from nanoqwen_lib.config import load
from nanoqwen_lib.errors import CheckpointError, ConfigError
from nanoqwen_lib.layout import hf_tensors
from nanoqwen_lib.safetensors_io import write_safetensors
from nanoqwen_lib.synth import synthesize

TINY = load().model("tiny")


@pytest.fixture(scope="session")
def tiny_dir():
    return synthetic_checkpoint("tiny", seed=0, progress=False)


@pytest.fixture(scope="session")
def hd64_single_dir(tmp_path_factory):
    """tiny-hd64 (tied) as one model.safetensors with no index, plus a stray lm_head.weight."""
    d = tmp_path_factory.mktemp("hd64")
    synthesize(load().model("tiny-hd64"), 3, d, shard_bytes=10**12, progress=False)
    (d / "model-00001-of-00001.safetensors").rename(d / "model.safetensors")
    (d / INDEX).unlink()
    return d


def variant(tiny_dir, tmp_path):
    """A writable copy of the checkpoint: json files copied, shards symlinked."""
    d = tmp_path / "ckpt"
    d.mkdir()
    for f in tiny_dir.iterdir():
        if f.suffix == ".safetensors":
            (d / f.name).symlink_to(f)
        else:
            shutil.copy(f, d / f.name)
    return d


def edit_json(path, fn):
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


def remap(d, name, shard):
    edit_json(d / INDEX, lambda ix: ix["weight_map"].__setitem__(name, shard))


def test_open_reads_every_tensor(tiny_dir):
    st_torch = pytest.importorskip("safetensors.torch")
    ckpt = Checkpoint.open(tiny_dir)
    assert ckpt.dims == TINY and ckpt.dir == tiny_dir
    assert ckpt.names() == list(hf_tensors(TINY))
    assert ckpt.tokenizer_json_path() == tiny_dir / "tokenizer.json"
    index = json.loads((tiny_dir / INDEX).read_text())["weight_map"]
    by_shard = {}
    for name in ckpt.names():
        by_shard.setdefault(index[name], []).append(name)
    for shard, names in by_shard.items():  # every element of every tensor vs the real library
        ref = st_torch.load_file(str(tiny_dir / shard))
        for name in names:
            got = ckpt.tensor(name)
            assert got.dtype == np.float32 and got.shape == hf_tensors(TINY)[name]
            want = ref[name].float().numpy()
            if not np.array_equal(got, want):   # (np.testing's version is 25x slower here)
                bad = np.argwhere(got != want)
                pytest.fail(f"{name}: {len(bad)} elements differ, first at {bad[0].tolist()}")


def test_single_file_tied_checkpoint(hd64_single_dir):
    ckpt = Checkpoint.open(hd64_single_dir)
    assert ckpt.dims == load().model("tiny-hd64") and "lm_head.weight" not in ckpt.names()
    assert ckpt.file_of("model.norm.weight").name == "model.safetensors"
    # a tied checkpoint that still stores lm_head.weight is tolerated (and ignored)
    write_safetensors(hd64_single_dir / "extra.safetensors", {"lm_head.weight": np.zeros((2, 3), np.float32)})
    (hd64_single_dir / "model.safetensors").rename(hd64_single_dir / "main.safetensors")
    wm = {n: "main.safetensors" for n in hf_tensors(ckpt.dims)} | {"lm_head.weight": "extra.safetensors"}
    (hd64_single_dir / INDEX).write_text(json.dumps({"weight_map": wm}))
    assert Checkpoint.open(hd64_single_dir).names() == ckpt.names()


def expect(exc, *parts, fn):
    with pytest.raises(exc) as e:
        fn()
    for p in parts:
        assert str(p) in str(e.value), (p, str(e.value))
    return str(e.value)


def test_missing_shard(tiny_dir, tmp_path):
    d = variant(tiny_dir, tmp_path)
    remap(d, "model.norm.weight", "model-00009-of-00009.safetensors")
    expect(CheckpointError, d / INDEX, "'model.norm.weight'", "model-00009-of-00009.safetensors", "does not exist",
           fn=lambda: Checkpoint.open(d))


def test_index_names_tensor_no_shard_has(tiny_dir, tmp_path):
    d = variant(tiny_dir, tmp_path)
    index = json.loads((d / INDEX).read_text())["weight_map"]
    other = next(s for s in sorted(set(index.values())) if s != index["model.norm.weight"])
    remap(d, "model.norm.weight", other)
    expect(CheckpointError, d / other, "'model.norm.weight'", "absent", fn=lambda: Checkpoint.open(d))


def test_tensor_missing_from_index(tiny_dir, tmp_path):
    d = variant(tiny_dir, tmp_path)
    edit_json(d / INDEX, lambda ix: ix["weight_map"].pop("lm_head.weight"))
    expect(CheckpointError, d / INDEX, "'lm_head.weight'", "missing", fn=lambda: Checkpoint.open(d))


def test_wrong_dtype_i32(tiny_dir, tmp_path):
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    d = variant(tiny_dir, tmp_path)
    st_torch.save_file({"model.norm.weight": torch.zeros(TINY.hidden, dtype=torch.int32)}, str(d / "bad.safetensors"))
    remap(d, "model.norm.weight", "bad.safetensors")
    expect(CheckpointError, d / "bad.safetensors", "'model.norm.weight' dtype", "I32", fn=lambda: Checkpoint.open(d))


def test_shape_disagrees_with_config(tiny_dir, tmp_path):
    d = variant(tiny_dir, tmp_path)
    edit_json(d / "config.json", lambda c: c.__setitem__("intermediate_size", 2560))
    expect(CheckpointError, "'model.layers.0.mlp.gate_proj.weight' shape", "[2560, 896]", "[2432, 896]",
           "config.json", ".safetensors", fn=lambda: Checkpoint.open(d))


def test_unexpected_tensor(tiny_dir, tmp_path):
    d = variant(tiny_dir, tmp_path)
    write_safetensors(d / "lora.safetensors", {"model.layers.0.self_attn.q_proj.lora_A": np.zeros((8, 896), np.float32)})
    remap(d, "model.layers.0.self_attn.q_proj.lora_A", "lora.safetensors")
    expect(CheckpointError, d / INDEX, "'model.layers.0.self_attn.q_proj.lora_A'", "unexpected",
           fn=lambda: Checkpoint.open(d))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_inf_named_with_count_and_index(tiny_dir, tmp_path, bad):
    d = variant(tiny_dir, tmp_path)
    w = np.ones(TINY.hidden, np.float32)
    w[[5, 700]] = bad
    write_safetensors(d / "nan.safetensors", {"model.norm.weight": w}, dtype="F32")
    remap(d, "model.norm.weight", "nan.safetensors")
    ckpt = Checkpoint.open(d)                       # headers are fine: found when read
    ckpt.tensor("model.layers.0.input_layernorm.weight")
    expect(CheckpointError, d / "nan.safetensors", "'model.norm.weight'", "2 NaN/Inf", "index [5]",
           fn=lambda: ckpt.tensor("model.norm.weight"))


def test_truncated_shard(tiny_dir, tmp_path):
    d = variant(tiny_dir, tmp_path)
    index = json.loads((d / INDEX).read_text())["weight_map"]
    shard = index["model.norm.weight"]
    data = (tiny_dir / shard).read_bytes()
    (d / shard).unlink()
    (d / shard).write_bytes(data[: len(data) // 2])
    msg = expect(CheckpointError, d / shard, "truncated", fn=lambda: Checkpoint.open(d))
    assert "tensor '" in msg


@pytest.mark.parametrize("edit,field", [
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "architectures"),
    ({"hidden_size": 672, "num_attention_heads": 7, "num_key_value_heads": 1, "head_dim": 96}, "head_dim"),
    ({"hidden_size": 960, "num_attention_heads": 15, "num_key_value_heads": 3, "head_dim": 64}, "hidden_size"),
    ({"num_key_value_heads": 7}, "num_attention_heads / num_key_value_heads"),
])
def test_unsupported_config(tiny_dir, tmp_path, edit, field):
    d = variant(tiny_dir, tmp_path)
    edit_json(d / "config.json", lambda c: c.update(edit))
    expect(ConfigError, d / "config.json", field, fn=lambda: Checkpoint.open(d))


def test_not_a_checkpoint(tmp_path):
    expect(CheckpointError, tmp_path / "nope", fn=lambda: Checkpoint.open(tmp_path / "nope"))
    (tmp_path / "config.json").write_text(json.dumps(TINY.to_hf_config()))
    expect(CheckpointError, tmp_path, "model.safetensors", "neither", fn=lambda: Checkpoint.open(tmp_path))
