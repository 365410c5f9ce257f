"""routepack.torch.DistributedScheduler on 3 gloo ranks, each holding only its own
sequences' routing: the merged statistics equal the single-process ones, every rank gets
the plan a single process makes from the whole batch (hash, packing, placement), the
physical routing of each rank's own tokens equals the whole-batch remap, and when one
rank's policy fails the fallback is collective (every rank still on one plan). The API
reads like the binding's: step(seq_lens, routing, ...) as Scheduler.step (the former order
warns and still plans the same), and remap_rank gives tensors for tensors."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="routepack.torch needs PyTorch (pip install torch)")

import torch_world  # noqa: E402
from conftest import random_step  # noqa: E402

CONFIG = {
    "topology": {"num_nodes": 1, "gpus_per_node": 3, "ep_size": 3, "slots_per_gpu": 3},
    "model": {"num_layers": 2, "num_experts": 7, "top_k": 2, "hidden_size": 64,
              "expert_ffn_size": 32, "num_heads": 4, "num_kv_heads": 4, "head_dim": 16},
    "limits": {"max_tokens_per_microbatch": 4096, "num_microbatches": 2},
}


def _batch(step):
    rng = np.random.default_rng(40 + step)
    lens, ids = random_step(rng, 17, 2, 2, 7, max_len=30)
    groups = np.arange(17) // 4
    return lens, ids, groups


def _mine(lens, world, rank, step):
    """This rank's sequences, in a rank-local order that is not the global one."""
    rng = np.random.default_rng(step * 10 + rank)
    own = np.nonzero(np.arange(len(lens)) % world == rank)[0]
    return rng.permutation(own)


def _rank_batch(rank, world, step):
    """Step ``step``'s whole batch (lens, ids, groups, cu_seqlens) and this rank's part:
    its sequences (_mine) and their routing as one tensor in that order."""
    lens, ids, groups = _batch(step)
    cu = np.concatenate([[0], np.cumsum(lens)])
    mine = _mine(lens, world, rank, step)
    routing = torch.as_tensor(np.concatenate([ids[cu[s]:cu[s + 1]] for s in mine]))
    return lens, ids, groups, cu, mine, routing


def _sched_rank(rank, world, policy, fail_rank):
    import routepack
    from routepack.torch import DistributedScheduler
    options = {"max_instructions": 1} if rank == fail_rank else {}
    ds = DistributedScheduler(CONFIG, policy=policy, **options)
    ref = routepack.Scheduler(CONFIG, policy=policy)
    out = []
    for step in range(3):
        lens, ids, groups, cu, mine, routing = _rank_batch(rank, world, step)
        res = ds.step(lens[mine], routing, mine, groups[mine], step=step)
        want = ref.step(lens, ids, step=step, group_ids=groups)
        # merged statistics: bit-identical to the single-process scan
        whole = ref.compute_stats(lens, ids)
        parts = [ref.compute_stats(lens[_mine(lens, world, r, step)],
                                   np.concatenate([ids[cu[s]:cu[s + 1]] for s in _mine(lens, world, r, step)]))
                 .to_bytes() for r in range(world)]
        merged = ref.merge_stats(parts, [_mine(lens, world, r, step) for r in range(world)], len(lens))
        same_stats = np.array_equal(merged.expert_load(), whole.expert_load()) and all(
            np.array_equal(merged.seq_hist(s), whole.seq_hist(s)) for s in range(len(lens)))
        # this rank's own tokens remapped equal the whole batch's remap
        whole_phys = res.remap(ids)
        remap_ok = True
        for m in range(res.num_microbatches):
            seqs = res.microbatches[rank][m]
            if len(seqs):
                r = np.concatenate([np.arange(cu[s], cu[s + 1]) for s in seqs])
                remap_ok &= np.array_equal(res.remap_rank(rank, m, ids[r]), whole_phys[r])
        out.append({"hash": res.plan_hash, "want": want.plan_hash if fail_rank < 0 else None,
                    "same_plan": fail_rank >= 0 or (
                        all(np.array_equal(a, b) for a, b in zip(res.phy2log, want.phy2log)) and
                        all(np.array_equal(x, y) for ra, rb in zip(res.microbatches, want.microbatches)
                            for x, y in zip(ra, rb))),
                    "stats": same_stats, "remap": remap_ok, "fallback": res.fallback,
                    "exchange": ds.last_exchange_bytes})
    ds.close()
    ref.close()
    return out


def test_distributed_step_equals_the_single_process_step():
    out = torch_world.run(_sched_rank, 3, "routepack", -1)
    for step in range(3):
        hashes = {o[step]["hash"] for o in out}
        assert len(hashes) == 1, "ranks planned differently at step %d" % step
        assert out[0][step]["hash"] == out[0][step]["want"]
        for o in out:
            assert o[step]["same_plan"] and o[step]["stats"] and o[step]["remap"]
            assert o[step]["exchange"]["sent"] > 64


def test_one_ranks_policy_failing_falls_back_on_every_rank_alike():
    out = torch_world.run(_sched_rank, 3, "routepack", 1)
    for step in range(3):
        assert len({o[step]["hash"] for o in out}) == 1, "ranks diverged after one rank's policy failed"
        assert out[1][step]["fallback"]            # rank 1's own policy failed
        assert all(o[step]["remap"] for o in out)


def _ahead_rank(rank, world):
    import time

    from routepack import errors
    from routepack.torch import DistributedScheduler
    sync = DistributedScheduler(CONFIG, policy="routepack")
    ahead = DistributedScheduler(CONFIG, policy="routepack", plan_ahead=True)
    out = {"hashes": [], "refused": []}
    try:
        sync.step_ahead(None, [], [])
    except errors.InvalidArgumentError as e:
        out["refused"].append(str(e))
    for step in range(3):
        lens, _, groups, _, mine, routing = _rank_batch(rank, world, step)
        want = sync.step(lens[mine], routing, mine, groups[mine], step=step)
        if step == 2 and rank == 1:
            time.sleep(1.0)      # rank 0's plan is late: its exchange waits for this rank
        planned = ahead.step_ahead(lens[mine], routing, mine, groups[mine], step=step)
        if step == 1:
            for call in (lambda: ahead.step(lens[mine], routing, mine, groups[mine], step=step),
                         lambda: ahead.step_ahead(lens[mine], routing, mine, groups[mine], step=step)):
                try:
                    call()
                except errors.InvalidArgumentError as e:
                    out["refused"].append(str(e))
        before = ahead.last_exchange_bytes   # the step before's until result(): the thread never writes it
        res = planned.result()
        out.setdefault("exchange", []).append((before, ahead.last_exchange_bytes, res.exchange_bytes,
                                               want.exchange_bytes))
        out["hashes"].append((res.plan_hash, want.plan_hash))
        out.setdefault("waited", []).append(planned.waited_s)
        assert planned.planning_s > 0 and planned.done()
    sync.close()
    ahead.close()
    return out


def test_planned_ahead_is_the_synchronous_plan_and_waits_when_late():
    out = torch_world.run(_ahead_rank, 3)
    for o in out:
        # the statistics exchange travels on the result; last_exchange_bytes moves only when
        # result() hands the step over, on the trainer's thread
        prev = None
        for before, last, carried, sync in o["exchange"]:
            assert before == prev and last == carried == sync and carried["sent"] > 64
            prev = carried
        assert [a for a, _ in o["hashes"]] == [b for _, b in o["hashes"]]   # the same plans
        assert "plan_ahead=True" in o["refused"][0]
        assert all("a plan is in flight" in r for r in o["refused"][1:]) and len(o["refused"]) == 3
    assert len({tuple(o["hashes"]) for o in out}) == 1                       # on every rank
    assert out[0]["waited"][2] > 0.5     # the late plan was waited for, not skipped
def _order_rank(rank, world):
    """Step 0 in the binding's order, step 1 in the former one (routing first)."""
    import warnings
    import routepack
    from routepack.torch import DistributedScheduler
    ds = DistributedScheduler(CONFIG, policy="routepack")
    ref = routepack.Scheduler(CONFIG, policy="routepack")
    out = []
    for step in range(2):
        lens, ids, groups, _, mine, mine_ids = _rank_batch(rank, world, step)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if step == 0:
                res = ds.step(lens[mine], mine_ids, mine, groups[mine], step=step)
            else:
                res = ds.step(mine_ids, lens[mine], mine, groups[mine], step=step)
        out.append((res.plan_hash, ref.step(lens, ids, step=step, group_ids=groups).plan_hash,
                    [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]))
    try:
        ds.step(np.zeros((2, 2)), np.zeros(4, np.int32), [0, 1])
        refused = ""
    except Exception as e:   # raised before any collective: every rank alike
        refused = "%s: %s" % (type(e).__name__, e)
    ds.close()
    ref.close()
    return out, refused


def test_step_takes_lengths_then_routing_and_warns_on_the_former_order():
    for out, refused in torch_world.run(_order_rank, 3):
        (h0, want0, warned0), (h1, want1, warned1) = out
        assert h0 == want0 and not warned0, "step(seq_lens, routing, ...) plans the single-process step"
        assert h1 == want1, "the former order still plans the same step"
        assert len(warned1) == 1 and "step(seq_lens, routing, global_ids" in warned1[0]
        assert refused.startswith("InvalidArgumentError: seq_lens has 2 dimensions")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_remap_rank_gives_tensors_for_tensors(device, monkeypatch):
    """Torch in, torch out: the same ids (and counts) as for numpy, as int32 / int64
    tensors on the routing's device. A packed CUDA tensor is remapped on the device
    (rp_gpu_remap_rank): no host copy of the routing is made."""
    import routepack
    from routepack import _routing
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU (torch.cuda.is_available() is False)")
    lens, ids, groups = _batch(0)
    cu = np.concatenate([[0], np.cumsum(lens)])
    with routepack.Scheduler(CONFIG, policy="routepack") as sched:
        res = sched.step(lens, ids, group_ids=groups)
    checked = 0
    for rank in range(3):
        for m in range(res.num_microbatches):
            seqs = res.microbatches[rank][m]
            rows = np.concatenate([np.arange(cu[s], cu[s + 1]) for s in seqs]) if len(seqs) else np.zeros(0, int)
            want, want_counts = res.remap_rank(rank, m, ids[rows], slot_tokens=True)
            assert isinstance(want, np.ndarray)
            mine = torch.as_tensor(ids[rows]).to(device)
            if device == "cuda":   # the packed tensor stays on the device
                with monkeypatch.context() as mp:
                    mp.setattr(_routing, "host_arrays", lambda r: pytest.fail("a host copy of CUDA routing"))
                    got = res.remap_rank(rank, m, mine)
                    got2, counts = res.remap_rank(rank, m, mine, slot_tokens=True)
            else:
                got = res.remap_rank(rank, m, mine)
                got2, counts = res.remap_rank(rank, m, mine, slot_tokens=True)
            assert torch.is_tensor(got) and got.device.type == device and got.dtype == torch.int32
            assert counts.device.type == device and counts.dtype == torch.int64
            assert np.array_equal(got.cpu().numpy(), want) and np.array_equal(got2.cpu().numpy(), want)
            assert np.array_equal(counts.cpu().numpy(), want_counts)
            # per layer, as Megatron's router replay keeps it: a list of [tokens, k] tensors
            per_layer = res.remap_rank(rank, m, [mine[:, l] for l in range(mine.shape[1])])
            assert torch.is_tensor(per_layer) and np.array_equal(per_layer.cpu().numpy(), want)
            checked += len(rows) > 0
    assert checked >= 3


def _demote_rank(rank, world, path):
    import routepack
    from routepack.torch import DistributedScheduler
    try:
        DistributedScheduler(CONFIG, policy=path, demote_after=0)
        refused = ""
    except routepack.RangeError as e:
        refused = str(e)
    ds = DistributedScheduler(CONFIG, policy=path, demote_after=2)
    out = []
    for step in range(5):
        lens, _, groups, _, mine, routing = _rank_batch(rank, world, step)
        res = ds.step(lens[mine], routing, mine, groups[mine], step=step)
        out.append((res.fallback, res.demoted, res.demoted_to))
    return refused, out


def _device_rank(rank, world):
    """The statistics of routing in GPU memory come from Scheduler.compute_stats (the
    binding's device path, which hands the pointer to the C library), for the ids a torch
    CUDA tensor holds (int32, and int16 read in place). Checked without a GPU through
    test_gpu_routing's HostAsCuda, this rank's library told it reads device memory: the C
    library then finds host memory behind the pointer and scans it there."""
    import routepack
    from routepack import _routing
    from routepack.torch import DistributedScheduler
    from test_gpu_routing import HostAsCuda
    _routing.library_reads_device = lambda: True   # this rank's process only
    ds = DistributedScheduler(CONFIG, policy="routepack")
    ref = routepack.Scheduler(CONFIG, policy="routepack")
    out = []
    for step, dtype in enumerate((np.int32, np.int16)):
        lens, ids, groups, _, mine, routing = _rank_batch(rank, world, step)
        res = ds.step(lens[mine], HostAsCuda(routing.numpy().astype(dtype)), mine, groups[mine], step=step)
        out.append((res.plan_hash, ref.step(lens, ids, step=step, group_ids=groups).plan_hash))
    ds.close()
    ref.close()
    return out


def test_device_statistics_come_from_the_binding():
    for out in torch_world.run(_device_rank, 3):
        assert [a for a, _ in out] == [b for _, b in out]


def test_demote_after_is_forwarded(tmp_path):
    # fails from step 2: demote_after=2 demotes after step 3 on every rank alike
    text = ("return {name = 'late_failure', version = '1.0.0', api = 1, description = 'fails late',\n"
            "plan = function(ctx) if ctx.step >= 2 then error('broken') end\n"
            "return rp.baseline('token_kk+eplb') end}\n")
    path = tmp_path / "late_failure.lua"
    path.write_text(text)
    out = torch_world.run(_demote_rank, 3, str(path))
    for refused, steps in out:
        assert "demote_after is 0" in refused
        assert [s[1] for s in steps] == [False, False, False, True, False]
        assert steps[3][2] == "attn_kk" and not steps[4][0]
