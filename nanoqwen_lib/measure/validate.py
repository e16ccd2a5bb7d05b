"""The correctness ladder, in order; each stage gates the next.

    unit   each kernel against the reference op    (tests/test_gpu_gemv.py, _attention, _prefill)
    layer  one decoder block against the reference (tests/test_gpu_engine.py -k layer)
    graph  greedy tokens of the engine (graph replay) against the reference model on CuPy:
           `graph_prompts` prompts x `graph_gen_tokens` tokens (nanoqwen.yaml), at least
           `token_match_min` identical, divergences at near-ties counted apart. The
           teacher-forced pass (`teacher_forced`: every step is fed the reference's token,
           so one divergence costs one token) runs first, in lockstep with the reference,
           and measures the engine's logit error; the stage also fails if its p99.9 exceeds
           `logit_err_max`, so the near-tie line only ever covers rounding noise. The
           teacher-forced match is reported beside, not gating.

The unit and layer stages are the GPU test files, run by pytest from the checkout; the
graph stage is `greedy_agreement`, which also backs the model test.
"""
from __future__ import annotations

import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from nanoqwen_lib.config import load
from nanoqwen_lib.model.generate import generate_ids
from nanoqwen_lib.model.reference import top2

ROOT = Path(__file__).resolve().parents[2]
UNIT_TESTS = ("tests/test_gpu_gemv.py", "tests/test_gpu_attention.py", "tests/test_gpu_prefill.py",
              "tests/test_gpu_fp8.py")
LAYER_TESTS = ("tests/test_gpu_engine.py", "-k", "layer")


@dataclass
class Agreement:
    """Greedy streams compared up to their first divergence (after it, the contexts differ)."""
    tokens: int = 0                 # generated tokens in all prompts
    identical: int = 0              # tokens equal to the reference before any divergence
    divergences: int = 0            # prompts whose stream diverged
    near_tie_divergences: int = 0   # ... at a step where the reference's top-2 gap was a near-tie
    uncompared_after_near_ties: int = 0
    first_divergence: list = field(default_factory=list)   # (prompt index, step, ref gap)

    @property
    def match(self) -> float:
        """Identical tokens over the tokens compared, near-tie divergences counted apart."""
        compared = self.tokens - self.uncompared_after_near_ties
        return self.identical / compared if compared else 1.0

    def passes(self) -> bool:
        return bool(self.match >= load().validation.token_match_min)

    def summary(self) -> str:
        v = load().validation
        return (f"{self.identical}/{self.tokens} tokens identical; {self.divergences} divergences, "
                f"{self.near_tie_divergences} at near-ties (top-2 gap < {v.near_tie_logit_gap}); "
                f"match {100 * self.match:.2f}% (threshold {100 * v.token_match_min:.1f}%)")


def validation_prompts(n: int, seed: int = 0, vocab: int = 151643) -> list[list[int]]:
    """n prompts of varied lengths: every length 1..64 appears (page boundaries at 16, 32, 48
    and their neighbours), then random ones; token ids from the tokenizer's range."""
    rng = np.random.default_rng(seed)
    lengths = [1 + i % 64 for i in range(n)]
    return [rng.integers(0, vocab, L).tolist() for L in lengths]


def greedy_agreement(candidate, reference, prompts, new_tokens: int, refs=None) -> Agreement:
    """candidate: a generate.py backend; reference: a ReferenceModel (greedy -> ids, gaps);
    refs: the reference's (ids, gaps) per prompt, when already computed."""
    near = load().validation.near_tie_logit_gap
    a = Agreement()
    for k, p in enumerate(prompts):
        want, gaps = refs[k] if refs is not None else reference.greedy(p, new_tokens)
        got = list(generate_ids(candidate, p, new_tokens))
        a.tokens += new_tokens
        for i, (x, y) in enumerate(zip(got, want)):
            if x != y:
                a.divergences += 1
                a.first_divergence.append((k, i, float(gaps[i])))
                if gaps[i] < near:
                    a.near_tie_divergences += 1
                    a.uncompared_after_near_ties += new_tokens - i
                break
            a.identical += 1
    return a


@dataclass
class ForcedAgreement:
    """Teacher-forced: each step of the candidate gets the reference's previous token, so
    each step's argmax is compared on the same context, on its own. Where the candidate
    exposes its logits, each step's logit error against the reference is kept too."""
    tokens: int = 0
    identical: int = 0
    near_tie_mismatches: int = 0        # mismatches where the reference's top-2 gap was a near-tie
    mismatches: list = field(default_factory=list)   # (prompt, step, ref gap), first 50
    logit_err: list = field(default_factory=list)    # per step: max |candidate - reference| over the vocab
    gap_err: list = field(default_factory=list)      # per step: candidate's top-2 gap (on the reference's
                                                     # top-2 ids) minus the reference's

    @property
    def match(self) -> float:
        """Identical over compared, near-tie mismatches counted apart (left out)."""
        compared = self.tokens - self.near_tie_mismatches
        return self.identical / compared if compared else 1.0

    def logit_error_summary(self) -> dict:
        """Percentiles of the per-step errors (empty when the candidate showed no logits)."""
        if not self.logit_err:
            return {}
        q = (50, 99, 99.9, 100)
        return {"steps": len(self.logit_err),
                "max_abs_logit_err": dict(zip(map(str, q), np.percentile(self.logit_err, q).round(4).tolist())),
                "abs_gap_err": dict(zip(map(str, q), np.percentile(np.abs(self.gap_err), q).round(4).tolist()))}

    def logit_error_ok(self) -> bool:
        """The engine's logit error is within `logit_err_max` (p99.9 of the per-step max),
        so that near-ties are the engine's rounding noise, not a bug's (True when the
        candidate showed no logits: nothing to judge)."""
        return bool(not self.logit_err or np.percentile(self.logit_err, 99.9) <= load().validation.logit_err_max)

    def summary(self) -> str:
        s = (f"teacher-forced: {self.identical}/{self.tokens} steps identical, {self.near_tie_mismatches} "
             f"mismatches at near-ties; match {100 * self.match:.2f}%")
        e = self.logit_error_summary()
        if e:
            s += (f"; logit error max|d| median {e['max_abs_logit_err']['50']}, p99.9 "
                  f"{e['max_abs_logit_err']['99.9']}; top-2 gap error p99.9 {e['abs_gap_err']['99.9']}, "
                  f"max {e['abs_gap_err']['100']}")
        return s


def reference_streams(reference, prompts, new_tokens: int, batch: int = 1):
    """(k, prompt, the reference's logits step by step) for each prompt. batch 1: the
    reference steps lazily, prompt by prompt (greedy_steps). batch B > 1, for a reference
    with greedy_steps_batch (ReferenceModel): B prompts decode at once, each step one
    matrix through the weights instead of one row per prompt, and the chunk's logits are
    kept (B x new_tokens x vocab fp32) until the candidate has been compared. The batched
    reference sums in another order than the one-row one, so its logits differ from it by
    noise of the engine's kind (tests/test_reference.py); the near-tie line was measured
    against batch 1 (nanoqwen.yaml)."""
    if batch <= 1 or not hasattr(reference, "greedy_steps_batch"):
        for k, p in enumerate(prompts):
            yield k, list(p), reference.greedy_steps(list(p), new_tokens)
        return
    for start in range(0, len(prompts), batch):
        chunk = [list(p) for p in prompts[start:start + batch]]
        steps = list(reference.greedy_steps_batch(chunk, new_tokens))        # new_tokens x [B, vocab]
        for b, p in enumerate(chunk):
            yield start + b, p, (step[b] for step in steps)


def teacher_forced(candidate, reference, prompts, new_tokens: int, batch: int = 1):
    """The reference's greedy decode and the candidate, step for step: after each step the
    candidate is fed the reference's token (`force`; GpuBackend.force replays the graph).
    candidate: prefill(ids) -> token, force(token) -> token, optionally logits() -> the
    last step's logits; reference: greedy_steps(ids, n) -> logits per step, and optionally
    greedy_steps_batch (reference_streams). Returns (ForcedAgreement, refs): refs[k] =
    the reference's (ids, top-2 gaps) on prompt k, the same as reference.greedy, for
    greedy_agreement."""
    near = load().validation.near_tie_logit_gap
    a, refs = ForcedAgreement(), [None] * len(prompts)
    show = getattr(candidate, "logits", None)
    for k, p, stream in reference_streams(reference, prompts, new_tokens, batch):
        ids, gaps = [], []
        for i, r in enumerate(stream):
            got = candidate.prefill(p) if i == 0 else candidate.force(ids[-1])
            best, second = top2(r)
            gap = float(r[best] - r[second])
            ids.append(best)
            gaps.append(gap)
            a.tokens += 1
            if got == best:
                a.identical += 1
            else:
                a.near_tie_mismatches += gap < near
                if len(a.mismatches) < 50:
                    a.mismatches.append((k, i, gap))
            if show is not None:
                e = show()
                a.logit_err.append(float(abs(e - r).max()))
                a.gap_err.append(float(e[best] - e[second]) - gap)
        refs[k] = (ids, gaps)
    return a, refs


def run_pytest(args, progress=print) -> bool:
    """One stage's GPU tests, from the checkout (they are not part of the installed package)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", *args]
    progress(" ".join(cmd[2:]))
    return subprocess.run(cmd, cwd=ROOT).returncode == 0


def run_ladder(nq_file, prompts: int | None = None, new_tokens: int | None = None,
               stages=("unit", "layer", "graph"), progress=print, reference_batch: int = 1) -> dict:
    """The ladder on the GPU; stops at the first failing stage. Returns what each stage saw."""
    import cupy as cp

    from nanoqwen_lib.gpu.engine import GpuBackend
    from nanoqwen_lib.model.reference import ReferenceModel
    v = load().validation
    out = {}
    for stage in stages:
        progress(f"stage {stage}")
        if stage == "unit":
            out[stage] = {"passed": run_pytest(UNIT_TESTS, progress)}
        elif stage == "layer":
            out[stage] = {"passed": run_pytest(LAYER_TESTS, progress)}
        else:
            ps = validation_prompts(prompts or v.graph_prompts)
            n = new_tokens or v.graph_gen_tokens
            engine = GpuBackend(nq_file, max_tokens=max(map(len, ps)) + n + 16)
            reference = ReferenceModel(nq_file.dims, nq_file.model_tensors(), xp=cp)
            f, refs = teacher_forced(engine, reference, ps, n, batch=reference_batch)
            progress(f.summary())
            a = greedy_agreement(engine, reference, ps, n, refs)
            progress(a.summary())
            if not f.logit_error_ok():
                progress(f"logit error p99.9 above logit_err_max = {v.logit_err_max}: near-ties cannot be trusted")
            out[stage] = {"passed": a.passes() and f.logit_error_ok(), **asdict(a), "match": a.match,
                          "forced": {**asdict(f), "match": f.match, "logit_error": f.logit_error_summary()}}
        if not out[stage]["passed"]:
            progress(f"stage {stage} failed: the ladder stops here")
            break
    return out
