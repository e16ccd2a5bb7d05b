"""The outside oracle: Hugging Face transformers' Qwen2 on the weights of a .nanoqwen file.

The reference model (nanoqwen_lib.model.reference) is our own reading of Qwen2; if it got a
convention wrong (rotate_half vs interleaved RoPE, which KV head a query head reads, where
the bias goes, the norm's epsilon) every kernel checked against it would inherit the
mistake. So the reference is itself checked against the implementation that real
checkpoints are trained and served with: transformers' Qwen2ForCausalLM, in float32, on the
CPU, given exactly the weights the reference uses (each INT4 projection dequantized to
codes * scale, every FP16 tensor widened to float32).

torch and transformers are imported inside the functions: they are test-time tools (the
`test` extra), never a dependency of the runtime.
"""
from __future__ import annotations

import warnings

import numpy as np

from nanoqwen_lib.errors import CheckpointError
from nanoqwen_lib.format.layout import hf_tensors, is_quantized
from nanoqwen_lib.format.hf_config import to_hf_config
from nanoqwen_lib.format.quant import dequantize_projection


def _transformers():
    """-> (transformers, its modeling_qwen2). transformers imports tqdm.auto, which warns
    on stderr in a notebook without ipywidgets: output that would differ between machines."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found")
        import transformers
        from transformers.models.qwen2 import modeling_qwen2
    return transformers, modeling_qwen2


def hf_state_from_packed(dims, tensors) -> dict:
    """Packed tensors (names of layout.packed_tensors, e.g. a .nanoqwen file's) -> the
    Hugging Face state dict of the same model: name -> torch float32, each projection
    `<p>.weight` [out, in] = its dequantized W exactly (INT4 or FP8: quant.dequantize_projection)."""
    import torch

    state = {}
    for name, shape in hf_tensors(dims).items():
        if is_quantized(name):
            base = name[: -len(".weight")]
            w = dequantize_projection(np.asarray(tensors[base + ".qweight"]),   # INT4 words or FP8 codes
                                      np.asarray(tensors[base + ".scales"]))
        else:
            w = np.asarray(tensors[name]).astype(np.float32)                 # fp16 -> fp32, exact
        if tuple(w.shape) != tuple(shape):
            raise CheckpointError("<packed tensors>", name, f"shape {tuple(shape)}", f"{tuple(w.shape)}")
        state[name] = torch.from_numpy(np.ascontiguousarray(w))
    return state


def qwen2_config(dims, hf_config: dict | None = None, **overrides):
    """transformers' Qwen2Config read from the checkpoint's own config.json (`hf_config`,
    e.g. NanoqwenFile.hf_config), so that a mis-read of ours shows up as a disagreement
    instead of being copied into the oracle. Only tensors with no checkpoint behind them
    (the synthetic models, whose config.json is hf_config.to_hf_config(dims) itself) fall back to
    the dims. The RoPE base is checked against the dims: the bug this guards against."""
    transformers, _ = _transformers()
    cfg = transformers.Qwen2Config.from_dict(dict(hf_config if hf_config is not None else to_hf_config(dims)),
                                             **overrides)
    if cfg.rope_parameters["rope_theta"] != dims.rope_theta:
        raise CheckpointError("config.json", "rope_parameters.rope_theta", f"{dims.rope_theta} (the packed file's)",
                              cfg.rope_parameters["rope_theta"], "transformers reads the config differently")
    return cfg


def hf_model(dims, state, hf_config: dict | None = None):
    """Qwen2ForCausalLM built from the checkpoint's config.json (`hf_config`: see
    qwen2_config) with the tensors of `state` (HF names -> torch float32), eager
    attention, in eval mode.

    Built on the meta device (no random init of two 152064-row matrices) and given our
    tensors with assign=True; RoPE's inverse frequencies are a non-persistent buffer, so
    the rotary module is rebuilt on the CPU. Every parameter must come from `state`.
    lm_head is tied to the embedding as transformers 5 loads a checkpoint: when the
    config ties them and `state` holds no separate lm_head.weight."""
    import torch

    transformers, hf_qwen2 = _transformers()

    cfg = qwen2_config(dims, hf_config, attn_implementation="eager")
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(cfg)
    result = model.load_state_dict(state, assign=True, strict=False)
    tie = cfg.tie_word_embeddings and "lm_head.weight" not in state
    tied_missing = ["lm_head.weight"] if tie else []
    if result.unexpected_keys or result.missing_keys != tied_missing:
        raise CheckpointError("<state dict>", "tensor names", f"the Qwen2 names (missing only {tied_missing})",
                              f"missing {result.missing_keys}, unexpected {result.unexpected_keys}")
    model.model.rotary_emb = hf_qwen2.Qwen2RotaryEmbedding(cfg)
    if tie:
        model.tie_weights()
        if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
            raise CheckpointError("Qwen2ForCausalLM", "lm_head.weight", "tied to model.embed_tokens.weight",
                                  "a separate tensor", "tie_weights() did not tie them")
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise CheckpointError("<state dict>", "tensors", "every parameter and buffer set",
                              f"{len(meta)} still on the meta device, first {meta[0]!r}")
    return model.eval()


def hf_model_from_packed(dims, tensors, hf_config: dict | None = None):
    """The oracle for a packed model: Qwen2ForCausalLM (float32, CPU) on its dequantized
    weights. tensors: names of layout.packed_tensors -> NumPy (e.g. NanoqwenFile's);
    hf_config: the checkpoint's config.json (NanoqwenFile.hf_config)."""
    return hf_model(dims, hf_state_from_packed(dims, tensors), hf_config)


def hf_logits(model, ids) -> np.ndarray:
    """ids [T] -> logits float32 [T, vocab] of one prefill (no KV cache, no sampling)."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(map(int, ids))]), use_cache=False)
    return out.logits[0].float().numpy()
