"""End to end on the CPU: checkpoints written by transformers' own save_pretrained (tied and
untied, RoPE theta 1e6 and 1e4, head_dim 64 and 128; small random models in bf16) pack,
and `nanoqwen generate`'s path (ReferenceBackend, generate_ids) produces the same greedy
tokens as transformers' generate on the same quantized weights, up to the first near-tie.
transformers' model is built from the packed file's own config.json, so a mis-read of
ours (the RoPE base of a transformers-5 config, a tied head) shows up here. Also: the
checkpoint's generation config and chat template reach the file and are used."""
from __future__ import annotations

import json

import numpy as np
import pytest

from nanoqwen_lib.config import load
from nanoqwen_lib.format.hf_meta import render_chat
from nanoqwen_lib.format.packer import pack_checkpoint
from nanoqwen_lib.format.safetensors_io import read_header, write_safetensors
from nanoqwen_lib.format.tokenizer import chat_template_jinja
from nanoqwen_lib.format.weightfile import NanoqwenFile
from nanoqwen_lib.model.generate import ReferenceBackend, generate_ids

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from nanoqwen_lib.model.oracle import hf_model_from_packed  # noqa: E402

# (head_dim, tied, theta): every combination the issue names, on two small shapes that
# pass nanoqwen's checks (hidden a multiple of 128, GQA 5..8).
SHAPES = {128: dict(hidden_size=640, num_attention_heads=5), 64: dict(hidden_size=512, num_attention_heads=8)}
CASES = [(hd, tied, theta) for hd in (128, 64) for tied in (False, True) for theta in (1e6, 1e4)]
PROMPT_LEN, NEW = 9, 10
EOS = [17, 18]


def random_qwen2(head_dim, tied, theta, seed):
    """A Qwen2ForCausalLM of transformers' own making, with weights scaled so that every
    sublayer matters and the logits are confident (top-2 gaps far above FP16 noise)."""
    cfg = transformers.Qwen2Config(
        architectures=["Qwen2ForCausalLM"], intermediate_size=768, num_hidden_layers=2, num_key_value_heads=1,
        vocab_size=2048, max_position_embeddings=4096, rope_theta=theta, tie_word_embeddings=tied,
        eos_token_id=EOS, bos_token_id=EOS[0], **SHAPES[head_dim])
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg)
    gains = {"q_proj": 1.5, "k_proj": 1.5, "o_proj": 4.0, "down_proj": 4.0}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif "embed_tokens" in name or name == "lm_head.weight":
                p.copy_(torch.randn_like(p) * (1.0 if not tied and "embed" in name else 8.0 / p.shape[1] ** 0.5))
            else:
                gain = gains.get(name.split(".")[-2], 1.0)
                p.copy_(torch.randn_like(p) * gain / p.shape[1] ** 0.5)
    return model.to(torch.bfloat16)


def first_near_tie(scores) -> int:
    gaps = [float(torch.topk(s[0], 2).values.diff().abs()) for s in scores]
    return next((i for i, g in enumerate(gaps) if g <= load().validation.near_tie_logit_gap), len(gaps))


def oracle_greedy(f, prompt):
    """transformers' generate on the packed file's dequantized weights, built from the
    file's config.json: (tokens, index of the first near-tie step)."""
    model = hf_model_from_packed(f.dims, f.model_tensors(), f.hf_config)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), first_near_tie(out.scores)


def ours_greedy(f, prompt):
    return list(generate_ids(ReferenceBackend(f), prompt, NEW, eos_ids=()))


@pytest.mark.parametrize("head_dim,tied,theta", CASES, ids=[f"hd{h}-{'tied' if t else 'untied'}-theta{th:g}"
                                                          for h, t, th in CASES])
def test_transformers_save_packs_and_generates_like_transformers(tmp_path, head_dim, tied, theta):
    model = random_qwen2(head_dim, tied, theta, seed=head_dim + 2 * tied + int(theta == 1e4))
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert "rope_theta" not in cfg and cfg["rope_parameters"]["rope_theta"] == theta   # transformers 5's form
    (ckpt / "chat_template.jinja").write_text(chat_template_jinja())
    f = NanoqwenFile.open(pack_checkpoint(ckpt, tmp_path / "m.nanoqwen", progress=False))
    assert (f.dims.rope_theta, f.dims.head_dim, f.dims.tie_embeddings) == (theta, head_dim, tied)
    assert f.hf_config == cfg and f.generation_eos == (tuple(EOS), "generation_config.json")
    assert f.chat_template == chat_template_jinja()
    judged = 0
    for seed in range(3):
        prompt = np.random.default_rng([head_dim, seed]).integers(0, 2048, PROMPT_LEN).tolist()
        theirs, tie = oracle_greedy(f, prompt)
        mine = ours_greedy(f, prompt)
        assert mine[:tie] == theirs[:tie], (mine, theirs, tie)
        judged += tie
    assert judged >= NEW, f"near-ties too early to judge anything: {judged} steps compared"


def test_tied_config_with_a_different_lm_head_is_untied_as_in_transformers(tmp_path):
    """transformers 5 (found by experiment with the installed version) does not tie a
    tied config's embedding to a stored lm_head.weight that differs from it; nanoqwen
    packs that lm_head too, and generates what transformers generates."""
    ckpt = tmp_path / "ckpt"
    random_qwen2(64, True, 1e6, seed=7).save_pretrained(ckpt)
    shard = ckpt / "model.safetensors"
    tensors, _, _ = read_header(shard)
    from nanoqwen_lib.format.safetensors_io import load_tensor
    state = {n: load_tensor(shard, n) for n in tensors}
    head = np.random.default_rng(8).standard_normal(state["model.embed_tokens.weight"].shape).astype(np.float32)
    state["lm_head.weight"] = head * np.float32(8.0 / head.shape[1] ** 0.5)
    write_safetensors(shard, state, metadata={"format": "pt"})
    hf = transformers.Qwen2ForCausalLM.from_pretrained(ckpt)
    assert hf.config.tie_word_embeddings and not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)
    f = NanoqwenFile.open(pack_checkpoint(ckpt, tmp_path / "m.nanoqwen", progress=False))
    assert f.hf_config["tie_word_embeddings"] and not f.dims.tie_embeddings and "lm_head.weight" in f.tensors
    prompt = list(range(40, 40 + PROMPT_LEN))
    theirs, tie = oracle_greedy(f, prompt)
    assert tie >= 3 and ours_greedy(f, prompt)[:tie] == theirs[:tie]
    untied_head = hf_model_from_packed(f.dims, f.model_tensors(), f.hf_config).lm_head.weight
    np.testing.assert_array_equal(untied_head.detach().numpy(), f.tensors["lm_head.weight"].astype(np.float32))


def test_chat_template_renders_as_transformers_renders_it():
    from transformers.utils.chat_template_utils import render_jinja_template
    template = chat_template_jinja()
    for messages in ([{"role": "user", "content": "def f(x):"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ß <&> 漢字"},
                      {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]):
        for gen in (True, False):
            theirs = render_jinja_template([messages], chat_template=template, add_generation_prompt=gen)[0][0]
            assert render_chat(template, messages, gen) == theirs


def test_files_without_the_metadata_use_the_defaults(tmp_path):
    """A checkpoint with no generation_config.json and no eos in config.json, and no chat
    template: the file carries none, and generate falls back to nanoqwen's defaults."""
    from nanoqwen_lib.cli import chat_prompt, eos_ids
    from nanoqwen_lib.format.tokenizer import QwenTokenizer
    ckpt = tmp_path / "ckpt"
    model = random_qwen2(128, False, 1e6, seed=3)
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    model.save_pretrained(ckpt)
    (ckpt / "generation_config.json").unlink()
    f = NanoqwenFile.open(pack_checkpoint(ckpt, tmp_path / "m.nanoqwen", progress=False))
    tok = QwenTokenizer.default()
    assert f.generation_eos is None and eos_ids(f, tok) == tuple(load().tokenizer.eos_ids)
    assert f.chat_template is None and chat_prompt(f, tok, "hi") == tok.apply_chat_template([{"role": "user",
                                                                                              "content": "hi"}])
    assert f.hf_config["eos_token_id"] is None


def test_generate_stops_at_the_checkpoints_eos_and_inspect_says_so(tmp_path, capsys):
    """`nanoqwen generate` stops at generation_config.json's eos_token_id (not nanoqwen's
    default ids), and `nanoqwen inspect` names where the EOS ids and template come from."""
    from nanoqwen_lib.cli import main
    ckpt = tmp_path / "ckpt"
    random_qwen2(128, False, 1e6, seed=11).save_pretrained(ckpt)
    free = tmp_path / "free.nanoqwen"
    pack_checkpoint(ckpt, free, progress=False)
    prompt = "5,6,7,8,9"
    assert main(["generate", str(free), "--prompt-ids", prompt, "--max-new-tokens", "8", "--ids",
                 "--ignore-eos", "--backend", "reference"]) == 0
    run = [int(t) for t in capsys.readouterr().out.split()]
    stop = next(t for t in run[2:] if t not in run[:2])          # a token first seen at step >= 2
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop, 2047]}))
    (ckpt / "chat_template.jinja").write_text(chat_template_jinja())
    stopping = tmp_path / "stopping.nanoqwen"
    pack_checkpoint(ckpt, stopping, progress=False)
    assert main(["generate", str(stopping), "--prompt-ids", prompt, "--max-new-tokens", "8", "--ids",
                 "--backend", "reference"]) == 0
    assert [int(t) for t in capsys.readouterr().out.split()] == run[:run.index(stop) + 1]
    assert main(["inspect", str(stopping), "--header-only"]) == 0
    out = capsys.readouterr().out
    assert f"eos_ids      [{stop}, 2047] (the checkpoint's generation_config.json)" in out
    assert "chat         the checkpoint's template" in out and "config.json  carried" in out
    assert main(["inspect", str(free), "--header-only"]) == 0
    assert "(the checkpoint's generation_config.json)" in capsys.readouterr().out   # save_pretrained wrote one
