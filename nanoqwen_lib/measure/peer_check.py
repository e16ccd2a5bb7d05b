"""Does a peer compute our model? The judgement every peer passes before it gets a ratio.

A peer is run teacher-forced against a reference (validate.teacher_forced: each step is
fed the reference's token, so each step's argmax is compared on the same context) and
free-running (validate.greedy_agreement: its own greedy stream against the reference's).
Bit-identical streams are not to be expected from a peer that rounds differently (tinygemm
takes bf16 activations, llama.cpp quantizes activations to 8 bits), so the judgement is:

* the peer's rounding noise is measured, not assumed: per step, its error on the
  reference's top-2 gap (its logit of the reference's best minus its logit of the
  reference's runner-up, minus the reference's gap), taken at its p99.9 over the steps
  where it agreed (a mismatch's own error would excuse itself);
* a mismatch is excused when the reference's top-2 gap there is below that noise (a
  near-tie the peer's rounding can flip), and is a real disagreement otherwise;
* the peer agrees when it has no real disagreement and its noise is at most
  `validation.peer_noise_max` (nanoqwen.yaml), so that a broken peer cannot widen its own
  near-tie line until every mismatch is excused.

A peer that does not agree is reported as wrong, never as a ratio.
"""
from __future__ import annotations

import numpy as np

from nanoqwen_lib.config import load


class RecordingPeer:
    """A peer behind the backend protocol of validate.teacher_forced / greedy_agreement
    (prefill, decode, force, logits), recording the token it chose at each call.

    peer: prefill(ids) -> logits [vocab] of the last prompt position; step(token) ->
    logits [vocab] of the next position (host NumPy or anything xp.asarray takes). The
    logits are handed to the reference on its array module xp."""

    def __init__(self, peer, dims, xp=np, max_tokens=None):
        self.peer, self.dims, self.xp, self.max_tokens = peer, dims, xp, max_tokens
        self.chosen: list[int] = []
        self._last = None

    def _take(self, logits) -> int:
        self._last = self.xp.array(logits, dtype="float32")      # a copy: a peer may reuse its buffer
        tok = int(self._last.argmax())
        self.chosen.append(tok)
        return tok

    def prefill(self, ids) -> int:
        return self._take(self.peer.prefill(list(map(int, ids))))

    def decode(self, token: int) -> int:
        return self._take(self.peer.step(int(token)))

    force = decode

    def logits(self):
        return self._last


def noise_of(gap_err, matched) -> float:
    """The peer's rounding noise on a top-2 gap: p99.9 of |gap error| over agreeing steps
    (inf when it agreed nowhere)."""
    e = np.abs(np.asarray(gap_err, dtype=np.float64))[np.asarray(matched, dtype=bool)]
    return float(np.percentile(e, 99.9)) if e.size else float("inf")


def judge(matched, ref_gaps, gap_err, noise_max: float | None = None) -> dict:
    """Per teacher-forced step: matched (peer's argmax == reference's), the reference's
    top-2 gap, the peer's error on it -> the verdict (a JSON-able dict)."""
    noise_max = load().validation.peer_noise_max if noise_max is None else noise_max
    matched = np.asarray(matched, dtype=bool)
    gaps = np.asarray(ref_gaps, dtype=np.float64)
    if not (matched.shape == gaps.shape == np.shape(gap_err)) or matched.size == 0:
        raise ValueError(f"judge: one entry per step expected, got {matched.shape}, {gaps.shape}, {np.shape(gap_err)}")
    noise = noise_of(gap_err, matched)
    miss = ~matched
    excused = miss & (gaps < noise)
    real = miss & ~excused
    noisy = not noise <= noise_max
    reasons = []
    if noisy:
        reasons.append(f"its rounding noise on the top-2 gap ({noise:.3g} logits) exceeds peer_noise_max = {noise_max}")
    if real.any():
        worst = int(np.argmax(np.where(real, gaps, -np.inf)))
        reasons.append(f"{int(real.sum())} steps disagree where the reference's top-2 gap is above that noise "
                       f"(largest gap {gaps[worst]:.3g} at step {worst})")
    return {"steps": int(matched.size), "identical": int(matched.sum()),
            "near_tie_mismatches": int(excused.sum()), "real_mismatches": int(real.sum()),
            "noise_logits": noise, "noise_max": noise_max,
            "agrees": not reasons, "why_not": "; ".join(reasons)}


def check_peer(peer, reference, dims, prompts, new_tokens: int, xp=np) -> dict:
    """Run `peer` teacher-forced and then free-running against `reference` (a
    ReferenceModel on xp) on `prompts`; -> the verdict of judge() with the free-running
    agreement beside it (tokens identical before each prompt's first divergence)."""
    from nanoqwen_lib.measure.validate import greedy_agreement, teacher_forced
    rec = RecordingPeer(peer, dims, xp)
    forced, refs = teacher_forced(rec, reference, prompts, new_tokens)
    want = [t for ids, _ in refs for t in ids]
    gaps = [g for _, gs in refs for g in gs]
    v = judge([a == b for a, b in zip(rec.chosen, want)], gaps, forced.gap_err)
    v["logit_error"] = forced.logit_error_summary()
    free = greedy_agreement(rec, reference, prompts, new_tokens, refs)
    v["free_running"] = {"tokens": free.tokens, "identical_prefix_tokens": free.identical,
                         "first_divergence": [(k, i, round(g, 4)) for k, i, g in free.first_divergence]}
    v["prompts"], v["gen_tokens"] = len(prompts), new_tokens
    return v


def summary(v: dict) -> str:
    """One line for the console."""
    if "error" in v:
        return f"could not be checked: {v['error']}"
    head = (f"teacher-forced {v['identical']}/{v['steps']} identical, {v['near_tie_mismatches']} near-tie, "
            f"{v['real_mismatches']} real mismatches (noise {v['noise_logits']:.3g} logits); free-running "
            f"{v['free_running']['identical_prefix_tokens']}/{v['free_running']['tokens']} before divergence")
    return head + ("" if v["agrees"] else f"  -> WRONG: {v['why_not']}")
