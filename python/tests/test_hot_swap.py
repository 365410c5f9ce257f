"""Hot swap from Python: a policy staged for step 3 takes over there and the report says
so; a policy that fails its dry run is refused, the running policy stays and the report
says why; one that does not compile is refused at once."""

import numpy as np
import pytest

import routepack
from conftest import DATA, SMALL_CONFIG


def run(sched, trace, steps):
    out = []
    for i in steps:
        rec = trace[i % len(trace)]
        out.append(sched.step(rec.lengths, rec.routing, step=i, group_ids=rec.group_ids))
    return out


def test_staged_file_takes_over_at_step_3(small_trace):
    with routepack.Scheduler(SMALL_CONFIG) as s:
        first = run(s, small_trace, [0])[0]
        s.stage_policy(path=str(DATA / "swap_attn.lua"), at_step=3)
        res = [first] + run(s, small_trace, range(1, 6))
    before = {r.policy_name for r in res[:3]}
    assert before == {first.policy_name} and first.policy_name != "py_swap_attn"
    assert [r.swapped for r in res] == [False, False, False, True, False, False]
    for r in res[3:]:
        assert r.policy_name == "py_swap_attn" and r.policy_version == "1.2.3"
        assert not r.fallback and r.swap_error == ""
    assert res[3].policy_hash != res[2].policy_hash
    assert isinstance(res[3].report, dict) and res[3].report   # from rp_sched_report_json


def test_staged_source_text(small_trace):
    src = (DATA / "swap_attn.lua").read_text()
    with routepack.Scheduler(SMALL_CONFIG) as s:
        run(s, small_trace, [0])
        s.stage_policy(source=src)                 # at the next step
        r = run(s, small_trace, [1])[0]
    assert r.swapped and r.policy_name == "py_swap_attn"


def test_broken_policy_is_refused_and_the_report_says_why(small_trace):
    with routepack.Scheduler(SMALL_CONFIG) as s:
        r0 = run(s, small_trace, [0])[0]
        s.stage_policy(path=str(DATA / "broken_at_plan.lua"))
        r1 = run(s, small_trace, [1])[0]
        r2 = run(s, small_trace, [2])[0]
    assert not r1.swapped
    assert "py_broken_at_plan fails on purpose" in r1.swap_error
    assert r1.policy_name == r0.policy_name and r1.policy_hash == r0.policy_hash
    assert not r1.fallback                        # the running policy planned this step
    assert r2.swap_error == "" and r2.policy_name == r0.policy_name
    # the report dict carries the reason too
    assert "py_broken_at_plan fails on purpose" in str(r1.report)


def test_syntax_error_is_reported_at_once(small_trace):
    with routepack.Scheduler(SMALL_CONFIG) as s:
        r0 = run(s, small_trace, [0])[0]
        with pytest.raises(routepack.PolicyError) as e:
            s.stage_policy(path=str(DATA / "syntax_error.lua"))
        assert "syntax_error.lua" in str(e.value)
        with pytest.raises(routepack.Error):
            s.stage_policy(path=str(DATA / "does_not_exist.lua"))
        with pytest.raises(routepack.InvalidArgumentError):
            s.stage_policy()
        r1 = run(s, small_trace, [1])[0]
    assert not r1.swapped and r1.swap_error == "" and r1.policy_name == r0.policy_name
