"""Synthetic checkpoints: exact HF layout, determinism, the weight recipe, and that the result
is decisive (checked with Hugging Face transformers running the checkpoint). Also cache.py."""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from nanoqwen_lib.synthetic import cache, checkpoint as synth
from nanoqwen_lib.format.checkpoint import INDEX, Checkpoint
from nanoqwen_lib.config import load
from nanoqwen_lib.format.layout import hf_tensors
from nanoqwen_lib.format.hf_config import to_hf_config
from nanoqwen_lib.synthetic.checkpoint import (CHUNK_ELEMS, row_chunks, write_shard, generate_chunk, plan_shards,
                                synthesize_dims, tensor_recipe)
from nanoqwen_lib.format.tokenizer import QwenTokenizer, hf_tokenizer_files

TINY = synthesize_dims("tiny")


@pytest.fixture(scope="session")
def tiny_dir():
    return cache.synthetic_checkpoint("tiny", seed=0, progress=False)


def test_exact_hf_layout(tiny_dir):
    st_torch = pytest.importorskip("safetensors.torch")
    assert json.loads((tiny_dir / "config.json").read_text()) == to_hf_config(TINY)
    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    assert gen["bos_token_id"] == 151643 and gen["eos_token_id"] == [151645, 151643] and gen["do_sample"] is False
    index = json.loads((tiny_dir / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    n = len(shards)
    assert n >= 2 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"]) == set(hf_tensors(TINY))
    assert index["metadata"]["total_size"] == sum(2 * math.prod(s) for s in hf_tensors(TINY).values())
    for shard in shards:                      # the real library agrees on names, dtype, shapes
        with st_torch.safe_open(str(tiny_dir / shard), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                assert index["weight_map"][name] == shard
                t = f.get_slice(name)
                assert t.get_dtype() == "BF16" and tuple(t.get_shape()) == hf_tensors(TINY)[name]
    for name, blob in hf_tokenizer_files(QwenTokenizer.default()).items():
        assert (tiny_dir / name).read_bytes() == blob, name
    assert not [p for p in tiny_dir.iterdir() if p.name.endswith(".tmp")]


def test_deterministic_and_independent_of_threads(tiny_dir, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm
    shards = plan_shards(TINY)
    k = min(range(len(shards)), key=lambda i: sum(math.prod(s) for s in shards[i].values()))
    name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
    with ThreadPoolExecutor(1) as pool, tqdm(disable=True) as bar:   # one worker, window 1
        write_shard(tmp_path / name, shards[k], TINY, 0, pool, 1, bar)
    assert (tmp_path / name).read_bytes() == (tiny_dir / name).read_bytes()
    a = generate_chunk("model.norm.weight", TINY, 0, (TINY.hidden,), 0, 0, TINY.hidden)
    b = generate_chunk("model.norm.weight", TINY, 1, (TINY.hidden,), 0, 0, TINY.hidden)
    c = generate_chunk("model.layers.0.input_layernorm.weight", TINY, 0, (TINY.hidden,), 0, 0, TINY.hidden)
    assert (a != b).mean() > 0.5 and (a != c).mean() > 0.5            # seed and name both matter


def test_recipe_statistics(tiny_dir):
    ckpt = Checkpoint.open(tiny_dir)
    n_tok = synth.tokenizer_vocab()
    for name in ckpt.names():
        w = ckpt.tensor(name)
        mean, std, _ = tensor_recipe(name, TINY)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            np.testing.assert_allclose(w[n_tok:].std(), std * synth.PAD_ROW_SCALE, rtol=0.02)
            w = w[:n_tok]
        np.testing.assert_allclose(w.mean(), mean, atol=4 * std / math.sqrt(w.size) + 1e-3, err_msg=name)
        np.testing.assert_allclose(w.std(), std, rtol=0.02 + 3 / math.sqrt(w.size), err_msg=name)


def test_tied_final_norm_has_random_signs():
    hd64 = synthesize_dims("tiny-hd64")
    w = generate_chunk("model.norm.weight", hd64, 0, (hd64.hidden,), 0, 0, hd64.hidden)
    w = (w.astype(np.uint32) << 16).view(np.float32)
    assert 0.4 < (w < 0).mean() < 0.6 and np.allclose(np.abs(w).mean(), 1.0, atol=0.02)


def test_7b_plan_streams_in_bounded_memory():
    dims = synthesize_dims("7b")
    shards = plan_shards(dims)
    sizes = [2 * sum(math.prod(s) for s in sh.values()) for sh in shards]
    assert len(shards) == 4 and max(sizes) <= synth.MAX_SHARD_BYTES
    assert sum(sizes) == sum(2 * math.prod(s) for s in hf_tensors(dims).values())   # 15.2 GB
    for name, shape in hf_tensors(dims).items():   # no chunk larger than CHUNK_ELEMS values
        chunks = row_chunks(shape)
        assert chunks[0][0] == 0 and chunks[-1][1] == shape[0]
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
        assert max((r1 - r0) * math.prod(shape[1:]) for r0, r1 in chunks) <= max(CHUNK_ELEMS, shape[-1])


@pytest.mark.parametrize("dims_name", ["tiny", "tiny-hd64"])
def test_transformers_runs_it_and_it_is_decisive(dims_name):
    """HF's own Qwen2 loads every tensor, and its logits have the spread the recipe promises
    (for tied embeddings too, where the final norm's random signs stop self-prediction)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ckpt_dir = cache.synthetic_checkpoint(dims_name, seed=0, progress=False)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(ckpt_dir), dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 151643, (4, 48), generator=g)
    ids[:, -1] = 9707                                   # same last token, different contexts
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    logits = out.logits.double()
    std = logits.std(-1)
    assert 7.0 < std.mean().item() < 9.0
    top2 = logits.topk(2, -1).values
    gap = (top2[..., 0] - top2[..., 1]).flatten()
    near = (gap < load().validation.near_tie_logit_gap).double().mean().item()
    assert gap.median().item() > 0.8 and near < 0.08, (gap.median().item(), near)
    assert (logits.argmax(-1) < synth.tokenizer_vocab()).all()       # never a padded id
    assert (logits.argmax(-1)[:, :-1] != ids[:, :-1]).all()            # no echo of the input
    s_e = tensor_recipe("model.embed_tokens.weight", synthesize_dims(dims_name))[1]
    for h in out.hidden_states[:-1]:                     # residual stream stays O(embedding rms)
        assert 0.7 * s_e < h.pow(2).mean().sqrt().item() < 2.0 * s_e
    assert len(set(logits[:, -1].argmax(-1).tolist())) >= 2          # context changes the answer


def test_cache_dir_and_atomic_creation(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path / "c"))
    assert cache.cache_dir() == tmp_path / "c" and (tmp_path / "c").is_dir()
    assert re.fullmatch(r"synth-tiny-seed7-r\d+", cache.synthetic_checkpoint_path("tiny", 7).name)

    def interrupted(dims, seed, out_dir, **kw):
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(synth, "synthesize", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cache.synthetic_checkpoint("tiny", 7, progress=False)
    # nothing half-made left (the lock file stays: cache.exclusive never unlinks it, which
    # would let a waiter and a newcomer hold two different locks)
    assert [p for p in (tmp_path / "c").iterdir() if not p.name.endswith(".lock")] == []

    def quick(dims, seed, out_dir, **kw):
        (out_dir / "config.json").write_text(json.dumps(to_hf_config(dims)))
        return out_dir

    monkeypatch.setattr(synth, "synthesize", quick)
    d = cache.synthetic_checkpoint("tiny", 7, progress=False)
    assert d == cache.synthetic_checkpoint_path("tiny", 7) and (d / "config.json").is_file()
    monkeypatch.setattr(synth, "synthesize", interrupted)             # cached: not called again
    assert cache.synthetic_checkpoint("tiny", 7) == d
