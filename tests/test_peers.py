"""The peers: the judgement that a peer computes our model (constructed logits), the torch
INT4 peer and transformers on the tiny model on the CPU, the dequantize + matmul prefill's
math on NumPy, and the llama.cpp recipe's pieces that need no build."""
from __future__ import annotations

import numpy as np
import pytest

from nanoqwen_lib.measure.peer_check import check_peer, judge

V = 997


class ConstructedReference:
    """Logits per (prompt, step) from a seed: N(0, 8^2) over V ids, with planted near-ties
    (top-2 gap 0.004) at the steps listed in `ties`."""

    def __init__(self, seed=0, ties=((0, 3), (1, 7))):
        self.seed, self.ties = seed, set(ties)

    def logits(self, k, i):
        r = np.random.default_rng([self.seed, k, i]).standard_normal(V).astype(np.float32) * 8
        if (k, i) in self.ties:
            b = int(r.argmax())
            s = int(np.argsort(r)[-2])
            r[s] = r[b] - 0.004
        return r

    def greedy_steps(self, prompt, n):
        k = prompt[0]                 # the prompts below carry their index as first id
        for i in range(n):
            yield self.logits(k, i)


class ConstructedPeer:
    """The reference's logits plus Gaussian noise of std `noise`; at the steps in `flip`
    (reference top-2 near-ties) the runner-up wins by 0.004; at the steps in `bug` a third
    id wins by a whole logit; `wrong=True`: logits of another model."""

    def __init__(self, ref, noise=0.003, flip=(), bug=(), wrong=False, seed=1):
        self.ref, self.noise, self.flip, self.bug, self.wrong = ref, noise, set(flip), set(bug), wrong
        self.rng = np.random.default_rng(seed)

    def _at(self):
        k, i = self.k, self.i
        r = (ConstructedReference(seed=99).logits(k, i) if self.wrong else self.ref.logits(k, i)).copy()
        c = r + self.rng.standard_normal(V).astype(np.float32) * self.noise
        order = np.argsort(r)
        if (k, i) in self.flip:
            c[order[-2]] = c[order[-1]] + 0.004
        if (k, i) in self.bug:
            c[order[-10]] = c[order[-1]] + 1.0
        return c

    def prefill(self, ids):
        self.k, self.i = ids[0], 0
        return self._at()

    def step(self, token):
        self.i += 1
        return self._at()


class Dims:
    vocab = V


PROMPTS = [[0, 5, 6], [1, 9], [2, 3, 4, 8]]


def run(peer, ref):
    return check_peer(peer, ref, Dims, PROMPTS, 16)


def test_a_correct_peer_agrees_and_its_near_tie_flips_are_excused():
    ref = ConstructedReference()
    v = run(ConstructedPeer(ref, flip=ref.ties), ref)
    assert v["agrees"], v["why_not"]
    assert v["steps"] == 48 and v["near_tie_mismatches"] == 2 and v["real_mismatches"] == 0
    assert v["identical"] == 46
    assert 0.004 < v["noise_logits"] < 0.05
    # free-running: prompt 0 diverges at its near-tie (step 3), prompt 1 at step 7, prompt 2 never
    fr = v["free_running"]
    assert fr["identical_prefix_tokens"] == 3 + 7 + 16
    assert [(k, i) for k, i, _ in fr["first_divergence"]] == [(0, 3), (1, 7)]


def test_a_peer_that_disagrees_at_a_decisive_step_is_wrong():
    ref = ConstructedReference()
    v = run(ConstructedPeer(ref, flip=ref.ties, bug={(2, 11)}), ref)
    assert not v["agrees"]
    assert v["real_mismatches"] == 1 and v["near_tie_mismatches"] == 2
    assert "step 43" in v["why_not"]          # prompt 2 step 11 = 16 + 16 + 11


def test_a_peer_of_another_model_is_wrong_by_its_noise():
    ref = ConstructedReference()
    v = run(ConstructedPeer(ref, wrong=True), ref)
    assert not v["agrees"]
    assert v["noise_logits"] > v["noise_max"]
    assert "peer_noise_max" in v["why_not"]


def test_a_noisy_peer_cannot_excuse_itself():
    """Noise of 1 logit (above peer_noise_max): its many flips are not waved through."""
    ref = ConstructedReference()
    v = run(ConstructedPeer(ref, noise=1.0), ref)
    assert not v["agrees"] and v["noise_logits"] > 0.5


def test_judge_counts_on_arrays():
    rng = np.random.default_rng(3)
    n = 200
    gaps = rng.exponential(1.6, n)
    err = rng.normal(0, 0.02, n)
    matched = np.ones(n, bool)
    near = np.argsort(gaps)[:3]                    # flip the three smallest gaps
    matched[near] = False
    noise = np.percentile(np.abs(err[matched]), 99.9)
    v = judge(matched, gaps, err, noise_max=0.5)
    assert v["noise_logits"] == pytest.approx(noise)
    assert v["near_tie_mismatches"] == int((gaps[near] < noise).sum())
    assert v["real_mismatches"] == 3 - v["near_tie_mismatches"]
    assert v["agrees"] == (v["real_mismatches"] == 0)
    with pytest.raises(ValueError):
        judge(matched[:5], gaps, err)
