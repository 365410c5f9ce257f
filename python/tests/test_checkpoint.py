"""Checkpoint and resume: a scheduler restored from state_dict() plans the following steps
exactly as the original did (same plan hashes), also across a hot swap."""

import json

import numpy as np
import pytest

import routepack
from conftest import DATA, SMALL_CONFIG

pytestmark = pytest.mark.skipif(
    not routepack.can_checkpoint(),
    reason="libroutepack has no rp_sched_save_state/rp_sched_load_state")


def steps(trace, n):
    for i in range(n):
        rec = trace[i % len(trace)]
        # later passes shuffle the sequences so that no two steps are alike
        order = np.random.default_rng(i).permutation(rec.num_seqs) if i >= len(trace) \
            else np.arange(rec.num_seqs)
        per_seq = rec.per_sequence()
        yield i, (rec.prompt_lens[order], rec.response_lens[order]), [per_seq[s] for s in order]


@pytest.mark.parametrize("swap", [False, True])
def test_resumed_run_plans_as_the_original(small_trace, tmp_path, swap):
    n, cut = 12, 5
    original, saved = [], None
    with routepack.Scheduler(SMALL_CONFIG) as s:
        for i, lens, routing in steps(small_trace, n):
            if swap and i == 3:
                s.stage_policy(path=str(DATA / "swap_attn.lua"))
            original.append(s.step(lens, routing).plan_hash)
            if i == cut:
                s.save_state(tmp_path / "sched.json")
                saved = s.state_dict()
    assert json.loads((tmp_path / "sched.json").read_text()) == saved
    resumed = routepack.Scheduler(SMALL_CONFIG)
    resumed.load_state(tmp_path / "sched.json")
    assert resumed.next_step == cut + 1
    replanned = [resumed.step(lens, routing).plan_hash
                 for i, lens, routing in steps(small_trace, n) if i > cut]
    assert replanned == original[cut + 1:]
    resumed.close()


def test_bad_state_is_refused_and_changes_nothing(small_trace):
    with routepack.Scheduler(SMALL_CONFIG) as s:
        for i, lens, routing in steps(small_trace, 2):
            s.step(lens, routing)
        good = s.state_dict()
        with pytest.raises(routepack.InvalidArgumentError):
            s.load_state_dict({"format": "something else"})
        with pytest.raises(routepack.Error):
            s.load_state_dict(dict(good, state='{"not": "a state"}'))
        assert s.state_dict() == good


@pytest.mark.parametrize("where, key", [("last_batch", "response_lens"), ("last_batch", "group_ids"),
                                        ("last_batch", "expert_load"), ("last_batch", "seq_hist"),
                                        ("history", "expert_load")])
def test_state_missing_a_field_is_refused(small_trace, where, key):
    # these crashed the process (a NULL dereference in the loader)
    with routepack.Scheduler(SMALL_CONFIG) as s:
        for i, lens, routing in steps(small_trace, 2):
            s.step(lens, routing)
        good = s.state_dict()
        doc = json.loads(good["state"])
        part = doc[where][-1] if where == "history" else doc[where]
        del part[key]
        with pytest.raises(routepack.Error, match="%s.*is required" % key):
            s.load_state_dict(dict(good, state=json.dumps(doc)))
        assert s.state_dict() == good


def test_duplicate_seq_hist_is_refused_and_a_resumed_run_resumes_again(small_trace):
    with routepack.Scheduler(SMALL_CONFIG) as s:
        for i, lens, routing in steps(small_trace, 2):
            s.step(lens, routing)
        good = s.state_dict()
        doc = json.loads(good["state"])
        doc["last_batch"]["seq_hist"][4:4] = doc["last_batch"]["seq_hist"][:4]
        with pytest.raises(routepack.FormatError, match="listed twice"):
            s.load_state_dict(dict(good, state=json.dumps(doc)))
    # the state as written (reformatted by Python's json) loads, and saves as the same bytes
    resumed = routepack.Scheduler(SMALL_CONFIG)
    resumed.load_state_dict(dict(good, state=json.dumps(json.loads(good["state"]), indent=1)))
    again = resumed.state_dict()
    assert again["state"] == good["state"]
    other = routepack.Scheduler(SMALL_CONFIG)
    other.load_state_dict(again)
    assert other.state_dict()["state"] == good["state"]
    resumed.close()
    other.close()
