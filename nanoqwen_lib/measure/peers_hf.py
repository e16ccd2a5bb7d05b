"""transformers FP16, twice: as a default user runs it and at its fastest honest setting.

Both rows are Qwen2ForCausalLM on our INT4 weights dequantized and rounded to FP16 (built
by model.oracle.hf_model, so every tensor is checked to be ours), SDPA attention, greedy
`generate`, batch 1:

* eager:    `generate` with transformers' default dynamic cache: what a user gets;
* compiled: `generation_config.cache_implementation = "static"` with a CompileConfig
            (fullgraph, mode "reduce-overhead"): transformers then compiles the decode
            step's forward and replays it as CUDA graphs, the prefill staying eager. This
            is transformers' own fast path; it compiles only on CUDA (on the CPU the same
            code path runs uncompiled, which is what the CPU test exercises).

Protocol: the whole request once as warm-up (every KV length the timed runs see has been
seen, so no attention backend builds a plan mid-run), then `runs` timed requests; a
logits processor records a CUDA event at every step (TTFT = start to the first event,
ITL = between consecutive events); per run the ITL median, reported as the median over
runs. The check (measure.peer_check) runs the model's forward step by step with its
dynamic cache, teacher-forced; each row's free-running `generate` stream is compared with
the reference's greedy stream beside it.
"""
from __future__ import annotations

import numpy as np


def hf_fp16_model(nq_file, device, xp=np):
    """The transformers model on `device`: FP16 parameters (our dequantized INT4 weights,
    rounded once), RoPE's inverse frequencies left in FP32, SDPA attention."""
    import torch

    from nanoqwen_lib.format.layout import hf_tensors, is_quantized
    from nanoqwen_lib.format.quant import dequantize_projection
    from nanoqwen_lib.model.oracle import hf_model
    t, state = nq_file.model_tensors(), {}
    for name in hf_tensors(nq_file.dims):
        if is_quantized(name):
            base = name[: -len(".weight")]
            w = dequantize_projection(xp.asarray(t[base + ".qweight"]), xp.asarray(t[base + ".scales"]), xp=xp)
        else:
            w = xp.asarray(t[name])
        w = w.astype(xp.float16)
        state[name] = torch.from_dlpack(w) if xp is not np else torch.from_numpy(np.ascontiguousarray(w))
    model = hf_model(nq_file.dims, state, nq_file.hf_config)   # the file's own config.json; state's dtype
    model = model.to(device)                            # no dtype change: inv_freq stays FP32
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("sdpa")
    else:
        model.config._attn_implementation = "sdpa"
    return model.eval()


class HfPeer:
    """The model's forward step by step (peer_check's protocol), with its dynamic cache."""

    def __init__(self, model):
        import torch
        self.torch, self.model = torch, model
        self.dev = next(model.parameters()).device

    def _run(self, ids):
        with self.torch.inference_mode():
            out = self.model(input_ids=self.torch.tensor([ids], device=self.dev), past_key_values=self.cache,
                             use_cache=True)
        self.cache = out.past_key_values
        return out.logits[0, -1].float().cpu().numpy()

    def prefill(self, ids):
        self.cache = None
        return self._run(list(ids))

    def step(self, token):
        return self._run([int(token)])


def generation_settings(compiled: bool):
    """-> (GenerationConfig kwargs, how): the static cache and the compile config for the
    compiled row, transformers' defaults for the eager one."""
    from transformers import CompileConfig
    if compiled:
        return ({"cache_implementation": "static",
                 "compile_config": CompileConfig(fullgraph=True, mode="reduce-overhead")},
                "transformers generate, FP16, SDPA, static cache, decode forward compiled by transformers "
                "(CompileConfig fullgraph, reduce-overhead: CUDA graphs), prefill eager")
    return {}, "transformers generate, FP16, SDPA, dynamic cache, eager: the default user"


def step_event_processor(torch):
    """A logits processor that records a CUDA event each time generate has a step's logits."""
    from transformers import LogitsProcessor

    class StepEvents(LogitsProcessor):
        def __init__(self):
            self.events = []

        def __call__(self, input_ids, scores):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.events.append(e)
            return scores
    return StepEvents()


def hf_generate(model, prompt, gen_tokens: int, compiled: bool, timed: bool):
    """One greedy request -> (new token ids, TTFT ms or None, per-step ITL ms list or None)."""
    import torch
    from transformers import GenerationConfig, LogitsProcessorList
    extra, _ = generation_settings(compiled)
    cfg = GenerationConfig(max_new_tokens=gen_tokens, min_new_tokens=gen_tokens, do_sample=False,
                           pad_token_id=0, eos_token_id=None, **extra)
    dev = next(model.parameters()).device
    ids = torch.tensor([list(prompt)], device=dev)
    procs = LogitsProcessorList()
    rec = None
    if timed:
        rec = step_event_processor(torch)
        procs.append(rec)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg, logits_processor=procs)
    toks = out[0, len(prompt):].tolist()
    if not timed:
        return toks, None, None
    torch.cuda.synchronize()
    ev = rec.events
    return toks, start.elapsed_time(ev[0]), [ev[i].elapsed_time(ev[i + 1]) for i in range(len(ev) - 1)]


def free_running_prefix(got, want) -> int:
    """Tokens identical before the first difference."""
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def hf_rows(nq_file, prompt, gen_tokens: int, warmup: int, runs: int, check, ours_tokens=None) -> dict:
    """Both rows on CUDA: the check once (the model is the same), then each row timed."""
    import cupy as cp
    import torch
    import transformers
    model = hf_fp16_model(nq_file, "cuda", xp=cp)
    agreement = check(HfPeer(model))
    rows = {}
    for name, compiled in (("hf_fp16_compiled", True), ("hf_fp16_eager", False)):
        try:
            for _ in range(warmup):
                hf_generate(model, prompt, gen_tokens, compiled, timed=False)
            res = [hf_generate(model, prompt, gen_tokens, compiled, timed=True) for _ in range(runs)]
            itl = [float(np.median(r[2])) for r in res]
            row = {"how": generation_settings(compiled)[1] + f"; warm-up {warmup} whole requests, median of {runs} runs, "
                          "ITL from CUDA events recorded by a logits processor at each step",
                   "version": f"transformers {transformers.__version__}, torch {torch.__version__}",
                   "ttft_ms": float(np.median([r[1] for r in res])), "itl_ms": float(np.median(itl)),
                   "itl_ms_per_run": itl, "tokens": res[-1][0], "agreement": agreement}
            if ours_tokens is not None:
                row["free_running_vs_nanoqwen"] = free_running_prefix(res[-1][0], ours_tokens)
            rows[name] = row
        except Exception as e:  # reported: the other row may still run
            rows[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
    del model
    torch.cuda.empty_cache()
    return rows
