"""The graph stage's bookkeeping (CPU): backends that agree, diverge at a near-tie, or
diverge where the reference was sure."""
import numpy as np

from nanoqwen_lib.config import load
from nanoqwen_lib.measure.validate import greedy_agreement, teacher_forced, validation_prompts

V = load().validation


class Scripted:
    """A reference whose greedy stream and top-2 gaps are given: step i's logits are 0
    except ids[i] (gaps[i]) and a runner-up id 500 + i (0)."""

    def __init__(self, ids, gaps, vocab=1000):
        self.ids, self.gaps, self.vocab = ids, gaps, vocab

    def step_logits(self, i):
        r = np.full(self.vocab, -1.0, np.float32)
        r[500 + i] = 0.0
        r[self.ids[i]] = self.gaps[i]
        return r

    def greedy_steps(self, prompt, n):
        for i in range(n):
            yield self.step_logits(i)

    def greedy(self, prompt, n):
        return self.ids[:n], self.gaps[:n]


class Replay:
    """A backend (generate.py protocol) that emits a fixed stream."""

    def __init__(self, ids, vocab=1000):
        self.ids = ids
        self.dims = type("D", (), {"vocab": vocab, "max_position": 10**6})()
        self.max_tokens = None

    def prefill(self, prompt):
        self.i = 0
        return self.ids[0]

    def decode(self, token):
        self.i += 1
        return self.ids[self.i]


def test_identical_streams_match_fully():
    ref = Scripted(list(range(10)), [1.0] * 10)
    a = greedy_agreement(Replay(list(range(10))), ref, [[1, 2]] * 3, 10)
    assert (a.tokens, a.identical, a.divergences, a.match) == (30, 30, 0, 1.0) and a.passes()
    assert type(a.passes()) is bool   # `validate` prints it as JSON (a NumPy bool is not)


def test_near_tie_divergence_is_counted_apart():
    gaps = [1.0] * 10
    gaps[4] = V.near_tie_logit_gap / 2
    ref = Scripted(list(range(10)), gaps)
    got = list(range(4)) + [99] * 6
    a = greedy_agreement(Replay(got), ref, [[5]], 10)
    assert a.divergences == a.near_tie_divergences == 1 and a.identical == 4
    assert a.uncompared_after_near_ties == 6 and a.match == 1.0


def test_confident_divergence_fails():
    ref = Scripted(list(range(10)), [1.0] * 10)
    got = list(range(3)) + [99] * 7
    a = greedy_agreement(Replay(got), ref, [[5]] * 2, 10)
    assert a.divergences == 2 and a.near_tie_divergences == 0
    assert np.isclose(a.match, 6 / 20) and not a.passes()
    assert a.first_divergence == [(0, 3, 1.0), (1, 3, 1.0)]


def test_prompts_cover_page_boundaries():
    ps = validation_prompts(V.graph_prompts)
    lengths = {len(p) for p in ps}
    assert len(ps) == V.graph_prompts and {1, 15, 16, 17, 31, 32, 33, 48, 49, 64} <= lengths
    assert validation_prompts(5) == validation_prompts(5)


class Forced(Replay):
    """A teacher-forced candidate: its answer at step i is `answers[i]`, and it records the
    tokens it was forced with."""

    def prefill(self, prompt):
        self.i, self.fed = 0, []
        return self.ids[0]

    def force(self, token):
        self.fed.append(token)
        self.i += 1
        return self.ids[self.i]


def test_forced_mismatch_costs_one_token_and_feeds_the_reference():
    gaps = [1.0] * 10
    gaps[6] = V.near_tie_logit_gap / 2
    ref = Scripted(list(range(10)), gaps)
    got = list(range(10))
    got[3], got[6] = 99, 98                       # one confident mismatch, one at a near-tie
    cand = Forced(got)
    a, _ = teacher_forced(cand, ref, [[5]], 10)
    assert cand.fed == list(range(9))              # always the reference's previous token
    assert (a.tokens, a.identical, a.near_tie_mismatches) == (10, 8, 1)
    assert np.isclose(a.match, 8 / 9) and a.mismatches == [(0, 3, 1.0), (0, 6, np.float32(gaps[6]))]
    b = greedy_agreement(Replay(got), ref, [[5]], 10)   # free-running: the stream is lost at 3
    assert b.identical == 3


def test_teacher_forced_returns_the_references_stream_and_logit_errors():
    """The lockstep pass hands greedy_agreement the reference's (ids, gaps), and measures
    each step's logit error where the candidate shows its logits."""
    gaps = [0.5 + i for i in range(6)]
    ref = Scripted(list(range(6)), gaps)
    cand = Forced(list(range(6)))
    step = iter(range(6))
    offsets = np.zeros(1000, np.float32)
    offsets[1] = 0.25                      # step 1: the best logit is 0.25 too high

    def logits():
        i = next(step)
        return ref.step_logits(i) + (offsets if i == 1 else 0)
    cand.logits = logits
    a, refs = teacher_forced(cand, ref, [[5]], 6)
    assert refs == [(list(range(6)), gaps)] and a.identical == 6
    assert a.logit_err == [0.0, 0.25, 0.0, 0.0, 0.0, 0.0]
    assert np.allclose(a.gap_err, [0, 0.25, 0, 0, 0, 0])
    e = a.logit_error_summary()
    assert e["steps"] == 6 and e["max_abs_logit_err"]["100"] == 0.25
    assert a.logit_error_ok() == (0.25 <= V.logit_err_max)
    assert type(a.logit_error_ok()) is bool   # `validate` prints it as JSON (a NumPy bool is not)


def test_a_large_logit_error_fails_whatever_the_tokens():
    """Identical tokens, but one step's logits are off by more than logit_err_max: the
    engine is not trusted to call its divergences near-ties."""
    ref = Scripted(list(range(4)), [5.0] * 4)
    cand = Forced(list(range(4)))
    step = iter(range(4))
    cand.logits = lambda: ref.step_logits(next(step)) + 2 * V.logit_err_max
    a, _ = teacher_forced(cand, ref, [[5]], 4)
    assert a.identical == 4 and not a.logit_error_ok()


def test_batched_reference_streams_match_the_lazy_ones():
    """reference_streams with batch > 1 hands each prompt the same steps, in prompt order,
    as the prompt-by-prompt path (a scripted reference with greedy_steps_batch)."""
    from nanoqwen_lib.measure.validate import reference_streams

    class Batched(Scripted):
        def greedy_steps_batch(self, prompts, n):
            for i in range(n):
                yield np.stack([self.step_logits(i) + len(p) for p in prompts])

        def greedy_steps(self, prompt, n):
            for i in range(n):
                yield self.step_logits(i) + len(prompt)

    ref = Batched(list(range(6)), [1.0] * 6)
    prompts = [[1], [1, 2], [1, 2, 3], [4] * 4, [5] * 5]
    lazy = [(k, p, [r.copy() for r in s]) for k, p, s in reference_streams(ref, prompts, 6, batch=1)]
    for batch in (2, 5, 8):
        got = [(k, p, list(s)) for k, p, s in reference_streams(ref, prompts, 6, batch=batch)]
        assert [(k, p) for k, p, _ in got] == [(k, p) for k, p, _ in lazy]
        for (_, _, a), (_, _, b) in zip(got, lazy):
            assert all(np.array_equal(x, y) for x, y in zip(a, b)) and len(a) == len(b) == 6
