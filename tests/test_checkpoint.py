"""Checkpoint.open on a synthetic tiny checkpoint. Every way a checkpoint can be wrong is a
case of tests/bad_inputs.py (run by tests/test_bad_inputs.py), built with the helpers here.

Broken variants are cheap: a fresh directory whose shards are symlinks to the cached
checkpoint's, with an edited config.json / index, or one small extra shard.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from nanoqwen_lib.synthetic.cache import synthetic_checkpoint
from nanoqwen_lib.format.checkpoint import INDEX, Checkpoint
from nanoqwen_lib.config import load
from nanoqwen_lib.errors import CheckpointError
from nanoqwen_lib.format.layout import hf_tensors
from nanoqwen_lib.format.safetensors_io import write_safetensors
from nanoqwen_lib.synthetic.checkpoint import synthesize

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


def test_tied_checkpoint_lm_head_as_transformers_loads_it(hd64_single_dir, tmp_path):
    """A tied config whose files store lm_head.weight, as transformers 5 loads it: equal to
    the embedding -> tied; different -> untied (transformers keeps both matrices); only
    lm_head.weight stored -> it is the embedding. Leftover rotary inv_freq buffers are ignored."""
    ckpt = Checkpoint.open(hd64_single_dir)
    embed = ckpt.tensor("model.embed_tokens.weight")
    d = tmp_path / "tied"
    d.mkdir()
    for f in hd64_single_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, d / f.name)
    (d / "main.safetensors").symlink_to(hd64_single_dir / "model.safetensors")
    main = {n: "main.safetensors" for n in hf_tensors(ckpt.dims)}

    def with_extra(tensors):
        write_safetensors(d / "extra.safetensors", tensors)
        wm = main | {n: "extra.safetensors" for n in tensors}
        (d / INDEX).write_text(json.dumps({"weight_map": wm}))
        return Checkpoint.open(d)

    inv_freq = np.ones(32, np.float32)
    same = with_extra({"lm_head.weight": embed, "model.layers.0.self_attn.rotary_emb.inv_freq": inv_freq})
    assert same.dims.tie_embeddings and same.names() == ckpt.names()
    other = embed[::-1].copy()
    diff = with_extra({"lm_head.weight": other})
    assert not diff.dims.tie_embeddings and diff.names() == ckpt.names() + ["lm_head.weight"]
    np.testing.assert_array_equal(diff.tensor("lm_head.weight"), other)
    np.testing.assert_array_equal(diff.tensor("model.embed_tokens.weight"), embed)
    d_only = tmp_path / "only_lm_head"
    d_only.mkdir()
    shutil.copy(d / "config.json", d_only / "config.json")
    write_safetensors(d_only / "model.safetensors", {"lm_head.weight": other} | {
        n: ckpt.tensor(n) for n in ckpt.names() if n != "model.embed_tokens.weight"})
    only = Checkpoint.open(d_only)
    assert only.dims.tie_embeddings and only.names() == ckpt.names()
    np.testing.assert_array_equal(only.tensor("model.embed_tokens.weight"), other)
    with pytest.raises(CheckpointError, match="lm_head.weight' shape"):
        with_extra({"lm_head.weight": np.zeros((2, 3), np.float32)})


def expect(exc, *parts, fn):
    with pytest.raises(exc) as e:
        fn()
    for p in parts:
        assert str(p) in str(e.value), (p, str(e.value))
    return str(e.value)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_inf_found_when_read_not_at_open(tiny_dir, tmp_path, bad):
    """The headers are fine, so open succeeds and other tensors read; the bad values are
    refused when their tensor is read (tests/bad_inputs.py has the same input through pack)."""
    from .bad_inputs import NORM, norm_shard   # bad_inputs imports this module: import late
    d = variant(tiny_dir, tmp_path)
    norm_shard(bad)(d)
    ckpt = Checkpoint.open(d)
    ckpt.tensor("model.layers.0.input_layernorm.weight")
    expect(CheckpointError, d / "norm.safetensors", repr(NORM), "2 NaN/Inf", "index [5]",
           fn=lambda: ckpt.tensor(NORM))
