"""Scheduler's demote_after: a policy whose steps fall back that many times in a row is
demoted (docs/policies.md, Demotion); the option is validated, reaches C, and the streak
is in state_dict(), so a run checkpointed mid-streak demotes at the same step."""

import numpy as np
import pytest

import routepack
from conftest import SMALL_CONFIG

# Plans with token_kk+eplb's baseline until step 2, then fails every step.
LATE_FAILURE = """
return {name = 'late_failure', version = '1.0.0', api = 1, description = 'fails from step 2',
plan = function(ctx)
  if ctx.step >= 2 then error('broken from step 2') end
  return rp.baseline('token_kk+eplb')
end}
"""


@pytest.fixture
def policy(tmp_path):
    path = tmp_path / "late_failure.lua"
    path.write_text(LATE_FAILURE)
    return str(path)


def steps(trace, n):
    for i in range(n):
        rec = trace[i % len(trace)]
        yield i, (rec.prompt_lens, rec.response_lens), rec.per_sequence()


def demoted_at(sched, trace, first, last):
    for i, lens, routing in steps(trace, last):
        if i < first:
            continue
        r = sched.step(lens, routing, step=i)
        if r.demoted:
            return i, r
    return None, None


@pytest.mark.parametrize("after, expect", [(None, None), (1, 2), (2, 3), (3, 4), (-1, None)])
def test_demote_after_reaches_the_scheduler(small_trace, policy, after, expect):
    opts = {} if after == 3 else {"demote_after": after}
    with routepack.Scheduler(SMALL_CONFIG, policy, **opts) as s:
        at, r = demoted_at(s, small_trace, 0, 7)
        assert at == expect
        if r is not None:
            assert r.demoted_to == "attn_kk" and r.failed_steps == after and r.fallback


@pytest.mark.parametrize("bad, cls, words", [
    (0, routepack.RangeError, "demote_after is 0; it must be a positive number"),
    (-2, routepack.RangeError, "or None \\(or -1\\) to never demote"),
    (2**31, routepack.RangeError, "int32"),
    (1.5, routepack.RangeError, "must be an integer"),
    ("3", TypeError, "demote_after must be an integer"),
    (True, TypeError, "got a bool"),
])
def test_demote_after_is_validated(policy, bad, cls, words):
    with pytest.raises(cls, match=words):
        routepack.Scheduler(SMALL_CONFIG, policy, demote_after=bad)


@pytest.mark.skipif(not routepack.can_checkpoint(), reason="no rp_sched_save_state")
def test_checkpoint_mid_streak_demotes_at_the_same_step(small_trace, policy):
    with routepack.Scheduler(SMALL_CONFIG, policy) as s:
        at, _ = demoted_at(s, small_trace, 0, 8)
    assert at == 4
    with routepack.Scheduler(SMALL_CONFIG, policy) as s:
        for i, lens, routing in steps(small_trace, 4):   # steps 2 and 3 fail
            s.step(lens, routing, step=i)
        saved = s.state_dict()
    with routepack.Scheduler(SMALL_CONFIG, policy) as r:
        r.load_state_dict(saved)
        at, rep = demoted_at(r, small_trace, 4, 8)
    assert at == 4 and rep.failed_steps == 3
