"""routepack.adapters: plans of real configs (examples/config-small.json with its bundled
batch examples/small.rpt, and a TP 2 / ETP 1 layout of it) through the verl, slime and
Megatron-Core adapters: every sequence exactly once, equal counts per rank, micro-batch
token sums and cu_seqlens equal to the plan's, slime's schedule invariants, the expert
permutation stock Megatron runs, and the errors for what verl, slime or stock Megatron
cannot take.

The upstream forms are pinned here with where they come from; the Megatron test builds the
real PackedSeqParams when megatron-core is installed (scripts/test-python.sh installs
megatron-core==0.16.1 beside torch)."""

import copy
import dataclasses
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

import routepack
from routepack.adapters import megatron, slime, verl
from conftest import REPO, SMALL_CONFIG, random_step

# megatron-core 0.16.1, megatron/core/packed_seq_params.py (the newest release for Python
# 3.10/3.11): the dataclass's fields, in order. Megatron-LM main (commit d98e8a6, 0.20.0
# dev) appends total_tokens, seq_idx, tokens_per_sample, pad_between_seqs, cp_scatter_cache.
PACKED_SEQ_PARAMS_0_16_1 = ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
                            "cu_seqlens_kv_padded", "max_seqlen_q", "max_seqlen_kv",
                            "local_cp_size", "cp_group")
MEGATRON_CORE_VERSION = "0.16.1"


@dataclasses.dataclass
class PinnedPackedSeqParams:
    """The field list above as a class, for runs without megatron-core."""
    qkv_format: str = None
    cu_seqlens_q: object = None
    cu_seqlens_kv: object = None
    cu_seqlens_q_padded: object = None
    cu_seqlens_kv_padded: object = None
    max_seqlen_q: int = None
    max_seqlen_kv: int = None
    local_cp_size: int = None
    cp_group: object = None


def small_config(**trainer):
    cfg = json.loads(SMALL_CONFIG.read_text())
    cfg["policy"]["search_path"] = [str(REPO / "policies")]
    cfg["trainer"] = dict({"equal_sequences_per_rank": True}, **trainer)
    return cfg


def tp_config(slots_per_gpu=8):
    """config-small's node as Megatron TP 2, ETP 1, EP 8: 4 DP ranks (TP groups) in one EP
    group of 8 EP ranks, each DP rank holding 2 EP ranks."""
    cfg = small_config()
    cfg["topology"].update(tensor_parallel_size=2, expert_tensor_parallel_size=1, ep_size=8,
                           slots_per_gpu=slots_per_gpu)
    return cfg


@pytest.fixture(scope="module")
def batch():
    with routepack.TraceReader(REPO / "examples" / "small.rpt") as tr:
        st = tr[0]
        return (np.array(st.seq_lens), np.array(st.routing), np.array(st.group_ids))


def plan(cfg, batch, policy=None, steps=1):
    lens, routing, groups = batch
    with routepack.Scheduler(cfg, policy=policy) as s:
        for _ in range(steps):
            res = s.step(lens, routing, group_ids=groups)
    return res


@pytest.fixture(scope="module")
def small_step(batch):
    # priced as the "ideal" executor (every lever): the joint plan then keeps its extra
    # replicas and shares on this batch, which the Megatron adapter must refuse (under the
    # default routepack_torch a baseline without them wins this step)
    cfg = small_config()
    cfg["execution"] = {"executor": "ideal"}
    return plan(cfg, batch)


@pytest.fixture(scope="module")
def tp_step(batch):
    return plan(tp_config(), batch)


def cp_config():
    """config-small's node as Megatron TP 2, CP 2, ETP 1, EP 8: 2 DP ranks of 4 GPUs in one
    EP group, each DP rank holding 4 EP ranks."""
    cfg = small_config()
    cfg["topology"].update(tensor_parallel_size=2, context_parallel_size=2,
                           expert_tensor_parallel_size=1, ep_size=8, slots_per_gpu=8)
    return cfg


def test_cp_pads_to_twice_tp_times_cp(batch):
    """Under context parallelism a sequence is padded to 2 x TP x CP (verl's align_size),
    read from the config the step ran with; no torch needed."""
    res = plan(cp_config(), batch)
    assert res.config.context_parallel_size == 2 and res.config.tensor_parallel_size == 2
    assert res.num_gpus == 2
    assert megatron.default_pad_multiple(res) == 8
    with pytest.raises(routepack.InvalidArgumentError, match="2 DP ranks.*TP group of 2 GPUs x CP 2.*dp_size is 8"):
        verl.batch_plan(res, dp_size=8)


@pytest.fixture(scope="module")
def four_mb_step(batch):
    """config-small with 4 micro-batches a rank (2 sequences each), packed as verl packs
    (the routepack policy leaves some of them empty, which verl cannot run)."""
    cfg = small_config()
    cfg["limits"]["num_microbatches"] = 4
    return plan(cfg, batch, policy="verl_kk+eplb")


@pytest.fixture(scope="module")
def eplb_step(batch):
    """config-small under EPLB: its 16 spare slots hold replicas of hot experts."""
    return plan(small_config(), batch, policy="token_kk+eplb")


def edited(res, microbatches):
    """A copy of a result with other microbatch lists (plans the C side would refuse)."""
    out = copy.copy(res)
    out.microbatches = microbatches
    return out


# ---- verl ---------------------------------------------------------------------------

@pytest.mark.parametrize("order", ["plan", "batch"])
@pytest.mark.parametrize("which", ["small", "tp", "four_mb"])
def test_verl_chunks_are_the_plans_ranks(which, order, small_step, tp_step, four_mb_step):
    res = {"small": small_step, "tp": tp_step, "four_mb": four_mb_step}[which]
    vp = verl.batch_plan(res, order=order)
    S, G, M = res.num_seqs, res.num_gpus, res.num_microbatches
    assert vp.dp_size == G and vp.num_micro_batches == M
    assert sorted(vp.order.tolist()) == list(range(S))          # every sequence exactly once
    assert vp.sequences_per_rank * G == S
    # DataProto.chunk(G) splits the reordered batch into G equal consecutive parts
    # (verl/protocol.py, "only support equal chunk"): each is the rank's sequences.
    parts = np.split(vp.order, G)
    lens = np.diff(res.cu_seqlens)
    for r in range(G):
        assert parts[r].tolist() == vp.chunks[r].tolist()
        assert set(parts[r].tolist()) == set(np.concatenate(res.microbatches[r]).tolist())
        if order == "batch":
            assert parts[r].tolist() == sorted(parts[r].tolist())
        for m in range(M):
            picked = parts[r][vp.micro_batch_indices[r][m]]
            assert picked.tolist() == res.microbatches[r][m].tolist()
            assert vp.micro_batch_tokens[r, m] == lens[picked].sum() == res.microbatch_tokens(r)[m]


def test_verl_reverse_indices_restore_the_chunk_order(four_mb_step):
    vp = verl.batch_plan(four_mb_step, order="batch")
    assert vp.num_micro_batches == 4
    for r in range(vp.dp_size):
        chunk = vp.chunks[r]
        # per-sequence outputs concatenated in micro-batch order, as verl's actor gets them
        outputs = np.concatenate([chunk[idx] for idx in vp.micro_batch_indices[r]])
        assert outputs[vp.reverse_indices(r)].tolist() == chunk.tolist()
    assert vp.reverse_indices(0) != list(range(vp.sequences_per_rank))   # not trivially


def reordered(res):
    """A copy of a result whose ranks run their microbatches in reverse (a plan's
    microbatch_order, as pipeline parallelism sets it)."""
    out = copy.copy(res)
    out.microbatch_order = np.tile(np.arange(res.num_microbatches)[::-1], (res.num_gpus, 1))
    return out


@pytest.mark.parametrize("order", ["plan", "batch"])
def test_verl_micro_batches_follow_the_plans_run_order(order, four_mb_step):
    res = four_mb_step
    assert (res.microbatch_order == np.arange(4)).all()      # no order in this plan
    rev = reordered(res)
    vp = verl.batch_plan(rev, order=order)
    assert (vp.microbatch_order == rev.microbatch_order).all()
    for r in range(vp.dp_size):
        for k in range(4):
            m = 3 - k
            assert vp.chunks[r][vp.micro_batch_indices[r][k]].tolist() == res.microbatches[r][m].tolist()
            assert vp.micro_batch_tokens[r, k] == res.microbatch_tokens(r)[m]
    bad = copy.copy(res)
    bad.microbatch_order = np.tile([0, 1, 1, 3], (res.num_gpus, 1))
    with pytest.raises(routepack.PlanError, match=r"rank 0's microbatch order \[0, 1, 1, 3\] is not a permutation"):
        verl.batch_plan(bad)


def test_verl_forms_are_the_ones_verl_takes(four_mb_step):
    """verl b178a3c: DataProto.reorder indexes a TensorDict with a LongTensor (int64 order);
    rearrange_micro_batches returns plain lists of int per micro-batch, which the actor
    flattens and passes to get_reverse_idx, itself a list of int."""
    vp = verl.batch_plan(four_mb_step)
    assert vp.order.dtype == np.int64 and vp.order.ndim == 1
    for r in range(vp.dp_size):
        assert isinstance(vp.micro_batch_indices[r], list)
        assert all(isinstance(mb, list) and all(type(i) is int for i in mb)
                   for mb in vp.micro_batch_indices[r])
        rev = vp.reverse_indices(r)
        assert isinstance(rev, list) and all(type(i) is int for i in rev)


def test_verl_tp_plan_counts_dp_ranks_not_gpus(tp_step):
    assert tp_step.num_gpus == 4 and tp_step.config.tensor_parallel_size == 2
    assert verl.batch_plan(tp_step, dp_size=4).dp_size == 4
    with pytest.raises(routepack.InvalidArgumentError, match="4 DP ranks.*TP group of 2 GPUs.*dp_size is 8"):
        verl.batch_plan(tp_step, dp_size=8)


def test_verl_refuses_unequal_counts(small_step):
    mbs = [[ids.copy() for ids in row] for row in small_step.microbatches]
    moved = mbs[0][0][-1]
    mbs[0][0] = mbs[0][0][:-1]
    mbs[1][0] = np.append(mbs[1][0], moved)
    with pytest.raises(routepack.PlanError, match=r"DataProto.chunk\(8\) gives every DP rank 8 of the 64 "
                       r"sequences, but the plan gives rank 0 7 and rank 1 9$"):
        verl.batch_plan(edited(small_step, mbs))


def test_verl_unequal_counts_hint_the_trainer_key(batch):
    cfg = small_config(equal_sequences_per_rank=False)
    cfg["topology"]["gpus_per_node"] = 8
    lens, routing, groups = batch
    keep = np.arange(len(lens) - 2)        # 62 sequences: they cannot divide over 8 ranks
    cu = np.concatenate([[0], np.cumsum(lens)])
    rows = np.concatenate([np.arange(cu[s], cu[s + 1]) for s in keep])
    res = plan(cfg, (lens[keep], routing[rows], groups[keep]), policy="token_kk+contiguous")
    with pytest.raises(routepack.PlanError, match="trainer.equal_sequences_per_rank: true"):
        verl.batch_plan(res)


def test_verl_refuses_a_missing_or_repeated_sequence(small_step):
    mbs = [[ids.copy() for ids in row] for row in small_step.microbatches]
    lost = int(mbs[2][0][0])
    mbs[2][0] = mbs[2][0][1:]
    with pytest.raises(routepack.PlanError, match="sequence %d is in no microbatch" % lost):
        verl.batch_plan(edited(small_step, mbs))
    mbs = [[ids.copy() for ids in row] for row in small_step.microbatches]
    twice = int(mbs[0][0][0])
    mbs[3][0] = np.append(mbs[3][0], twice)
    with pytest.raises(routepack.PlanError,
                       match="sequence %d is in rank 0 microbatch 0 and in rank 3 microbatch 0" % twice):
        verl.batch_plan(edited(small_step, mbs))
    mbs = [[ids.copy() for ids in row] for row in small_step.microbatches]
    mbs[1][0] = np.append(mbs[1][0], 64)
    with pytest.raises(routepack.PlanError, match="holds sequence 64; the step has 64 sequences"):
        verl.batch_plan(edited(small_step, mbs))


def test_verl_refuses_an_empty_micro_batch(batch):
    cfg = small_config()
    cfg["limits"]["num_microbatches"] = 9          # 8 sequences per rank: one stays empty
    res = plan(cfg, batch, policy="token_kk+contiguous")
    assert any(len(ids) == 0 for row in res.microbatches for ids in row)
    with pytest.raises(routepack.PlanError, match="holds no sequence.*at most 8, the sequences per rank"):
        verl.batch_plan(res)


def test_verl_refuses_the_empty_micro_batches_of_a_plan(batch):
    """The routepack policy with 3 micro-batches for 8 sequences a rank leaves some empty
    (without trainer.nonempty_microbatches): verl cannot run that plan."""
    cfg = small_config()
    cfg["limits"]["num_microbatches"] = 3
    res = plan(cfg, batch)
    if not any(len(ids) == 0 for row in res.microbatches for ids in row):
        pytest.skip("this build's routepack policy fills every micro-batch")
    with pytest.raises(routepack.PlanError, match="holds no sequence.*the policy left it empty "
                       "with 8 sequences for 3 micro-batches"):
        verl.batch_plan(res)


def test_verl_runs_the_plan_under_nonempty_microbatches(batch):
    """trainer.nonempty_microbatches: the same step with 3 micro-batches for 8 sequences a
    rank fills every micro-batch, and verl takes the plan."""
    cfg = small_config(nonempty_microbatches=True)
    cfg["limits"]["num_microbatches"] = 3
    res = plan(cfg, batch)
    assert all(len(ids) > 0 for row in res.microbatches for ids in row)
    verl.batch_plan(res)


def test_verl_micro_batch_multiple(batch, small_step):
    cfg = small_config(microbatch_multiple=3)
    res = plan(cfg, batch, policy="verl_kk+eplb")
    assert res.config.microbatch_multiple == 3 and res.num_microbatches % 3 == 0
    assert verl.batch_plan(res).num_micro_batches == res.num_microbatches
    M = small_step.num_microbatches
    with pytest.raises(routepack.PlanError, match="the plan has %d micro-batches, not a multiple of "
                       "num_batches_divided_by = %d.*trainer.microbatch_multiple: %d" % (M, M + 1, M + 1)):
        verl.batch_plan(small_step, num_batches_divided_by=M + 1)
    with pytest.raises(routepack.InvalidArgumentError, match="order must be one of"):
        verl.batch_plan(small_step, order="random")



@pytest.fixture(scope="module")
def mini_step(batch):
    """config-small trained as 2 mini-batches of 4 sequences a rank, 2 micro-batches each,
    over 2 epochs (verl: ppo_mini_batch_size 4 a rank, ppo_epochs 2)."""
    cfg = small_config(mini_batches=2, epochs=2, nonempty_microbatches=True)
    cfg["limits"]["num_microbatches"] = 4
    return plan(cfg, batch)


@pytest.mark.parametrize("order", ["plan", "batch"])
def test_verl_mini_batches(order, mini_step):
    """Each chunk laid out mini-batch after mini-batch: data.split(ppo_mini_batch_size) hands
    the actor the plan's mini-batches, and mini_batch_indices are what
    rearrange_micro_batches returns for each (indices into the mini-batch, run order)."""
    res = mini_step
    assert res.config.mini_batches == 2 and res.config.epochs == 2 and res.num_microbatches == 4
    vp = verl.batch_plan(res, order=order)
    assert vp.num_mini_batches == 2 and vp.mini_batch_size == vp.sequences_per_rank // 2 == 4
    run = vp.microbatch_order
    for r in range(vp.dp_size):
        chunk = vp.chunks[r]
        # DataProto.split(ppo_mini_batch_size): consecutive rows of the chunk
        minis = [chunk[k * 4:(k + 1) * 4] for k in range(2)]
        for k in range(2):
            if order == "batch":
                assert minis[k].tolist() == sorted(minis[k].tolist())
            assert len(vp.mini_batch_indices[r][k]) == 2
            for j, idx in enumerate(vp.mini_batch_indices[r][k]):
                m = int(run[r][2 * k + j])
                assert m // 2 == k                                  # its own mini-batch's
                assert minis[k][idx].tolist() == res.microbatches[r][m].tolist()
                assert all(type(i) is int for i in idx)
            outputs = np.concatenate([minis[k][idx] for idx in vp.mini_batch_indices[r][k]])
            assert outputs[vp.reverse_indices(r, k)].tolist() == minis[k].tolist()
        # the flat lists over the chunk say the same
        for m in range(4):
            assert chunk[vp.micro_batch_indices[r][m]].tolist() == \
                res.microbatches[r][int(run[r][m])].tolist()


def test_verl_one_mini_batch_is_the_chunk(small_step):
    vp = verl.batch_plan(small_step)
    assert vp.num_mini_batches == 1 and vp.mini_batch_size == vp.sequences_per_rank
    assert vp.mini_batch_indices == [[lists] for lists in vp.micro_batch_indices]
    assert vp.reverse_indices(0, 0) == vp.reverse_indices(0)


def test_verl_refuses_what_verls_mini_batches_cannot_run(mini_step):
    mbs = [[ids.copy() for ids in row] for row in mini_step.microbatches]
    moved = mbs[0][0][-1]
    mbs[0][0] = mbs[0][0][:-1]
    mbs[0][2] = np.append(mbs[0][2], moved)
    with pytest.raises(routepack.PlanError, match=r"rank 0 mini-batch 0 \(micro-batches 0 to 1\) holds 3 "
                       r"sequences; verl splits each rank's 8 into trainer.mini_batches 2 mini-batches"):
        verl.batch_plan(edited(mini_step, mbs))
    across = copy.copy(mini_step)
    across.microbatch_order = np.tile([2, 1, 0, 3], (mini_step.num_gpus, 1))
    with pytest.raises(routepack.PlanError, match="rank 0 runs microbatch 2 at position 0, in mini-batch 0"):
        verl.batch_plan(across)
    with pytest.raises(routepack.PlanError, match="in trainer.mini_batches 2 mini-batches each needs a "
                       "multiple of num_batches_divided_by = 4"):
        verl.batch_plan(mini_step, num_batches_divided_by=4)


# ---- Megatron-Core: PackedSeqParams ----------------------------------------------------

def packed_seq_params_class():
    try:
        from megatron.core.packed_seq_params import PackedSeqParams
        return PackedSeqParams
    except ImportError:
        return None


def test_megatron_core_field_list_is_the_pinned_one():
    """The installed megatron-core's PackedSeqParams has the fields this adapter was
    written against (skipped where megatron-core is not installed: the list stays pinned)."""
    cls = packed_seq_params_class()
    if cls is None:
        pytest.skip("megatron-core is not installed (scripts/test-python.sh installs it with torch)")
    from megatron.core import package_info
    names = tuple(f.name for f in dataclasses.fields(cls))
    assert names[:len(PACKED_SEQ_PARAMS_0_16_1)] == PACKED_SEQ_PARAMS_0_16_1, package_info.__version__
    if package_info.__version__.startswith(MEGATRON_CORE_VERSION):
        assert names == PACKED_SEQ_PARAMS_0_16_1


@pytest.mark.parametrize("which", ["small", "tp", "four_mb"])
def test_packed_seq_params_match_the_plan(which, small_step, tp_step, four_mb_step):
    torch = pytest.importorskip("torch")
    res = {"small": small_step, "tp": tp_step, "four_mb": four_mb_step}[which]
    cls = packed_seq_params_class() or PinnedPackedSeqParams
    lens = np.diff(res.cu_seqlens)
    multiple = 2 if which == "tp" else 1                    # the TP size by default
    assert megatron.default_pad_multiple(res) == multiple
    for r in range(res.num_gpus):
        params = megatron.packed_seq_params(res, r, cls=cls)
        assert len(params) == res.num_microbatches
        for m, p in enumerate(params):
            assert isinstance(p, cls) and p.qkv_format == "thd"
            true = lens[res.microbatches[r][m]]
            assert p.cu_seqlens_q.dtype == torch.int32
            assert p.cu_seqlens_q.tolist() == [0] + np.cumsum(true).tolist()
            assert p.cu_seqlens_kv.tolist() == p.cu_seqlens_q.tolist()
            assert int(p.cu_seqlens_q[-1]) == res.microbatch_tokens(r)[m]
            padded = -(-true // multiple) * multiple
            assert p.max_seqlen_q == p.max_seqlen_kv == padded.max()
            if multiple == 1:
                assert p.cu_seqlens_q_padded is None and p.cu_seqlens_kv_padded is None
            else:
                cp = p.cu_seqlens_q_padded.tolist()
                assert cp == [0] + np.cumsum(padded).tolist()
                assert all(x % multiple == 0 for x in cp)
                assert p.cu_seqlens_kv_padded.tolist() == cp


def test_packed_seq_params_follow_the_plans_run_order(four_mb_step):
    pytest.importorskip("torch")
    res = reordered(four_mb_step)
    lens = np.diff(res.cu_seqlens)
    for r in range(res.num_gpus):
        params = megatron.packed_seq_params(res, r)
        for k, p in enumerate(params):
            true = lens[res.microbatches[r][3 - k]]
            assert p["cu_seqlens_q"].tolist() == [0] + np.cumsum(true).tolist()


def test_packed_seq_params_as_dicts_with_newer_fields(tp_step):
    pytest.importorskip("torch")
    params = megatron.packed_seq_params(tp_step, 1, pad_multiple=8)
    for m, p in enumerate(params):
        lens = np.diff(tp_step.cu_seqlens)[tp_step.microbatches[1][m]]
        assert p["total_tokens"] == int((-(-lens // 8) * 8).sum()) == int(p["cu_seqlens_q_padded"][-1])
        assert p["pad_between_seqs"] is True
    plain = megatron.packed_seq_params(tp_step, 1, pad_multiple=1)
    assert all("cu_seqlens_q_padded" not in p and "total_tokens" not in p for p in plain)


def test_packed_seq_params_errors(batch, small_step):
    pytest.importorskip("torch")

    @dataclasses.dataclass
    class Old:                              # a class without the padded fields
        qkv_format: str = None
        cu_seqlens_q: object = None
        cu_seqlens_kv: object = None
        max_seqlen_q: int = None
        max_seqlen_kv: int = None

    assert len(megatron.packed_seq_params(small_step, 0, cls=Old)) == small_step.num_microbatches
    with pytest.raises(routepack.InvalidArgumentError, match="Old has no field cu_seqlens_q_padded, cu_seqlens_kv_padded"):
        megatron.packed_seq_params(small_step, 0, cls=Old, pad_multiple=2)
    with pytest.raises(routepack.InvalidArgumentError, match="rank must be a DP rank of the plan, 0 to 7, got 8"):
        megatron.packed_seq_params(small_step, 8)
    with pytest.raises(routepack.InvalidArgumentError, match="pad_multiple must be an integer >= 1, got 0"):
        megatron.packed_seq_params(small_step, 0, pad_multiple=0)
    cfg = small_config()
    cfg["limits"]["num_microbatches"] = 9
    res = plan(cfg, batch, policy="token_kk+contiguous")
    r, m = next((r, m) for r, row in enumerate(res.microbatches) for m, ids in enumerate(row) if len(ids) == 0)
    with pytest.raises(routepack.PlanError, match="rank %d microbatch %d holds no sequence" % (r, m)):
        megatron.packed_seq_params(res, r)
    assert megatron.packed_seq_params(res, r, allow_empty=True)[m] is None


# ---- Megatron-Core: expert placement ---------------------------------------------------

def check_permutation(pl, res):
    L, E = res.num_layers, res.num_experts
    assert pl.expert_order.shape == (L, E)
    for l in range(L):
        assert sorted(pl.expert_order[l].tolist()) == list(range(E))   # each expert once
        assert (pl.expert_order[l][pl.expert_index[l]] == np.arange(E)).all()


def test_expert_placement_exact_when_the_plan_is_a_permutation(batch):
    cfg = tp_config(slots_per_gpu=8)                 # E / EP = 64 / 8 slots per EP rank
    res = plan(cfg, batch, policy="token_kk+eplb")
    assert res.config.expert_parallel_size == 8 and res.ep_size == 4
    pl = megatron.expert_placement(res)
    check_permutation(pl, res)
    assert pl.expert_parallel_size == 8 and pl.num_local_experts == 8
    assert (pl.expert_order == res.phy2log).all()    # Megatron index p = physical slot p
    assert not pl.dropped.anything
    for r in range(8):
        assert pl.local_expert_indices(r) == list(range(8 * r, 8 * r + 8))
        # the plan's DP rank r // 2 holds this EP rank's experts in its slots
        j, half = divmod(r, 2)
        slots = np.arange(res.slot_begin[j], res.slot_begin[j + 1])[half * 8:(half + 1) * 8]
        assert pl.local_experts(0, r).tolist() == res.phy2log[0, slots].tolist()


def test_expert_placement_refuses_replicas_and_spare_slots(eplb_step, small_step):
    res = eplb_step                                # 10 slots per EP rank, 64 experts, EP 8
    assert (res.logcnt > 1).any()
    with pytest.raises(routepack.NotSupportedError) as e:
        megatron.expert_placement(res)
    msg = str(e.value)
    assert "has 10 slots per layer where Megatron has num_experts / EP = 8 (80 slots in all for 64 experts)" in msg
    assert "replicas (slots" in msg and "Pass drop=True" in msg
    # the routepack policy's levers: per-microbatch extra replicas and shares
    assert len(small_step.extra_replicas) and small_step.shares
    with pytest.raises(routepack.NotSupportedError,
                       match="%d per-microbatch extra replicas; %d replica token-share sets"
                       % (len(small_step.extra_replicas), len(small_step.shares))):
        megatron.expert_placement(small_step)


@pytest.mark.parametrize("which", ["eplb", "routepack"])
def test_expert_placement_drop_keeps_one_replica_per_expert(which, eplb_step, small_step):
    res = eplb_step if which == "eplb" else small_step
    pl = megatron.expert_placement(res, drop=True)
    check_permutation(pl, res)
    slot_rank = np.repeat(np.arange(8), np.diff(res.slot_begin))     # TP 1: EP rank = DP rank
    for l in range(res.num_layers):
        ranks = pl.expert_index[l] // pl.num_local_experts
        assert (np.bincount(ranks, minlength=8) == 8).all()
        held = [set(slot_rank[res.phy2log[l] == e]) for e in range(res.num_experts)]
        off = sum(1 for e in range(res.num_experts) if ranks[e] not in held[e])
        assert off == pl.dropped.moved[l]
    d = pl.dropped
    assert d.replicas == int((res.logcnt - 1).sum())
    assert d.extra_replicas == len(res.extra_replicas) and d.share_sets == len(res.shares)
    assert d.empty_slots == int((res.phy2log < 0).sum()) and d.anything
    assert d.replicas > 0 if which == "eplb" else d.extra_replicas > 0


def test_expert_placement_drop_moves_only_what_it_must():
    """Hand-made placements of 6 experts on 2 EP ranks of 4 slots (Megatron: 3 each).
    Layer 0: expert 3 has a replica on each rank, so it goes where there is room and
    nothing moves. Layer 1: EP rank 0 holds 4 experts with no copy elsewhere, so exactly
    one (the last matched, expert 3) moves to rank 1."""
    phy2log = np.array([[0, 1, 2, 3, 4, 5, 3, -1],
                        [0, 1, 2, 3, 4, 5, -1, -1]])
    logcnt = np.array([[1, 1, 1, 2, 1, 1], [1, 1, 1, 1, 1, 1]])
    res = types.SimpleNamespace(
        phy2log=phy2log, logcnt=logcnt, num_experts=6, num_layers=2, ep_size=2,
        slot_begin=np.array([0, 4, 8]), extra_replicas=np.zeros((0, 4)), shares={}, config=None)
    with pytest.raises(routepack.NotSupportedError, match="layer 0 expert 3 has 2 replicas \\(slots 3, 6\\)"):
        megatron.expert_placement(res)
    pl = megatron.expert_placement(res, drop=True)
    assert pl.num_local_experts == 3
    assert (pl.expert_index[0] // 3).tolist() == [0, 0, 0, 1, 1, 1]
    assert pl.local_experts(0, 1).tolist() == [4, 5, 3]          # slot order kept
    assert (pl.expert_index[1] // 3).tolist() == [0, 0, 0, 1, 1, 1]
    assert pl.local_experts(1, 1).tolist() == [4, 5, 3]          # the moved expert last
    assert pl.dropped.moved.tolist() == [0, 1]
    assert pl.dropped.replicas == 1 and pl.dropped.empty_slots == 3


def test_expert_placement_renumbering_preserves_routing(eplb_step):
    """Router rows in expert_order and replayed ids through to_megatron select the same
    scores as the logical ids on the logical router (router_replay.py gathers the scores
    at the replayed indices), and permutation_from/moves_from carry one placement to the
    next."""
    torch = pytest.importorskip("torch")
    res = eplb_step
    pl = megatron.expert_placement(res, drop=True)
    rng = np.random.default_rng(0)
    E, l = res.num_experts, 3
    scores = rng.random((50, E))
    ids = rng.integers(0, E, size=(50, 8))
    mine = pl.to_megatron(ids, l)
    assert np.take_along_axis(scores[:, pl.expert_order[l]], mine, 1).tolist() == \
        np.take_along_axis(scores, ids, 1).tolist()
    t = pl.to_megatron(torch.as_tensor(ids, dtype=torch.int32), l)
    assert t.dtype == torch.int64 and t.tolist() == mine.tolist()
    contiguous = megatron.ExpertPlacement(
        expert_order=np.tile(np.arange(E), (res.num_layers, 1)),
        expert_index=np.tile(np.arange(E), (res.num_layers, 1)), expert_parallel_size=8,
        dropped=pl.dropped)
    perm = pl.permutation_from(contiguous)
    router = rng.random((E, 4))                          # rows in the contiguous order
    assert (router[perm[l]] == router[pl.expert_order[l]]).all()
    moves = pl.moves_from(contiguous)
    n_moved = sum(int((pl.expert_index[k] // 8 != np.arange(E) // 8).sum()) for k in range(res.num_layers))
    assert len(moves) == n_moved > 0
    for layer, e, src, dst in moves:
        assert src == e // 8 and dst == pl.expert_index[layer, e] // 8


def test_expert_placement_refuses_experts_not_dividing_ep():
    cfg = {"topology": {"num_nodes": 1, "gpus_per_node": 4, "ep_size": 4, "slots_per_gpu": 4},
           "model": {"num_layers": 2, "num_experts": 14, "top_k": 2, "hidden_size": 256,
                     "expert_ffn_size": 128, "num_heads": 4, "num_kv_heads": 4, "head_dim": 64},
           "limits": {"max_tokens_per_microbatch": 4096}}
    lens, routing = random_step(np.random.default_rng(1), 16, 2, 2, 14)
    with routepack.Scheduler(cfg, policy="token_kk+contiguous") as s:
        res = s.step(lens, routing)
    for drop in (False, True):
        with pytest.raises(routepack.NotSupportedError, match="14 experts, not a multiple of Megatron's EP size 4"):
            megatron.expert_placement(res, drop=drop)


def test_import_adapters_needs_no_torch():
    code = ("import sys, routepack.adapters; "
            "assert 'torch' not in sys.modules, 'routepack.adapters imported torch'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# ---- slime ---------------------------------------------------------------------------
# routepack.adapters.slime: a plan in build_dp_schedule's shapes, with the invariants slime's
# scheduler states (THUDM/slime 624b824a, slime/utils/dp_schedule.py): every rank the same
# micro-batch count per step, every kept sample exactly once, each rank's micro-batch
# indices tiling its partition; and refusals where slime could not run the plan.

def slime_config(**trainer):
    """config-small as slime's trainer runs it: ranks may hold different sample counts."""
    return small_config(equal_sequences_per_rank=False, **trainer)


def check_slime_invariants(sched, res):
    G, S = len(res.microbatches), int(res.num_seqs)
    assert len(sched.partitions) == len(sched.micro_batch_indices) == G
    every = sorted(i for part in sched.partitions for i in part)
    assert every == list(range(S)), "every sample exactly once"
    for r in range(G):
        flat = [i for mb in sched.micro_batch_indices[r] for i in mb]
        assert flat == list(range(len(sched.partitions[r]))), "rank %d's indices tile its partition" % r
        assert len(sched.micro_batch_indices[r]) == sum(sched.num_microbatches)


@pytest.mark.parametrize("policy", ["slime_ff+eplb", "slime_kk+contiguous", "routepack"])
def test_slime_one_step_is_the_plan(policy, batch):
    res = plan(slime_config(nonempty_microbatches=True), batch, policy)
    sched = slime.dp_schedule(res)
    check_slime_invariants(sched, res)
    assert sched.num_microbatches == [res.num_microbatches]
    assert sched.global_batch_sizes == [res.num_seqs]
    for r, row in enumerate(res.microbatches):
        got = [[sched.partitions[r][i] for i in mb] for mb in sched.micro_batch_indices[r]]
        assert got == [list(ids) for ids in row], "rank %d runs the plan's micro-batches, in order" % r
    assert sched.as_tuple() == (sched.partitions, sched.micro_batch_indices, sched.num_microbatches,
                                sched.global_batch_sizes)


def test_slime_mini_batches_are_optimizer_steps(batch):
    cfg = slime_config(mini_batches=2, nonempty_microbatches=True)
    cfg["limits"]["num_microbatches"] = 4
    res = plan(cfg, batch, "slime_ff+eplb")
    sched = slime.dp_schedule(res)
    check_slime_invariants(sched, res)
    assert sched.num_microbatches == [2, 2]
    # step k is the plan's mini-batch k: micro-batches 2k, 2k + 1 of every rank
    for r, row in enumerate(res.microbatches):
        mbs = sched.micro_batch_indices[r]
        for k in range(2):
            got = sorted(sched.partitions[r][i] for mb in mbs[2 * k:2 * k + 2] for i in mb)
            assert got == sorted(int(s) for m in (2 * k, 2 * k + 1) for s in row[m])
    assert sum(sched.global_batch_sizes) == res.num_seqs
    # one rollout a sample without rollout_ids; with them, distinct rollouts per step
    ids = np.arange(res.num_seqs) // 1
    assert slime.dp_schedule(res, rollout_ids=ids).global_batch_sizes == sched.global_batch_sizes


def test_slime_rollout_split_over_steps_is_refused(batch):
    cfg = slime_config(mini_batches=2, nonempty_microbatches=True)
    cfg["limits"]["num_microbatches"] = 4
    res = plan(cfg, batch, "slime_ff+eplb")
    first = [int(s) for row in res.microbatches for s in row[0]][0]
    second = [int(s) for row in res.microbatches for s in row[2]][0]
    rollout = np.arange(res.num_seqs)
    rollout[second] = rollout[first]          # one rollout, two optimizer steps
    with pytest.raises(routepack.PlanError, match="rollout %d has samples in optimizer step" % first):
        slime.dp_schedule(res, rollout_ids=rollout)
    with pytest.raises(routepack.InvalidArgumentError, match="rollout_ids has shape"):
        slime.dp_schedule(res, rollout_ids=rollout[:3])


def test_slime_refusals(batch):
    res = plan(slime_config(nonempty_microbatches=True), batch, "slime_ff+eplb")
    with pytest.raises(routepack.InvalidArgumentError, match="8 DP ranks.*dp_size is 4"):
        slime.dp_schedule(res, dp_size=4)
    empty = copy.copy(res)
    empty.microbatches = [list(row) for row in res.microbatches]
    moved = list(empty.microbatches[0][0])
    empty.microbatches[0] = [[]] + [list(x) for x in empty.microbatches[0][1:]]
    empty.microbatches[1] = [list(empty.microbatches[1][0]) + moved] + [list(x) for x in empty.microbatches[1][1:]]
    with pytest.raises(routepack.PlanError, match="rank 0 micro-batch 0 holds no sample.*nonempty_microbatches"):
        slime.dp_schedule(empty)
    lost = copy.copy(res)
    lost.microbatches = [list(row) for row in res.microbatches]
    gone = int(lost.microbatches[0][0][0])
    lost.microbatches[0] = [list(lost.microbatches[0][0][1:])] + [list(x) for x in lost.microbatches[0][1:]]
    with pytest.raises(routepack.PlanError, match="sample %d is in no micro-batch" % gone):
        slime.dp_schedule(lost)


# ---- the examples ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ["verl_batch.py", "megatron_packed.py",
                                  "verl_batch.py --mini-batches 2 --microbatches 4",
                                  "slime_schedule.py", "slime_schedule.py --policy slime_ff+eplb",
                                  "slime_schedule.py --mini-batches 2 --microbatches 4"])
def test_example_runs(name):
    if name.startswith("megatron"):
        pytest.importorskip("torch")
    name, *args = name.split()
    r = subprocess.run([sys.executable, str(REPO / "examples" / "adapters" / name)] + args,
                       capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.rstrip().splitlines()[-1].startswith("ok:"), r.stdout


def test_megatron_runs_the_balancer_candidates_planned_ownership(cli, tmp_path):
    """On Megatron's balancer (megatron_balancer), routepack's candidate owns each layer's
    experts evenly but not contiguously (an ownership planned for the balancer's pushes,
    core/joint_vexp_own.c); stock Megatron runs it as a relabelling, which
    megatron.expert_placement gives exactly: nothing dropped, every EP rank's Megatron
    indices naming the experts the plan put there, replayed ids mapped to them."""
    cfg = json.loads(open(SMALL_CONFIG).read())
    cfg.pop("$schema", None)
    E, ep = cfg["model"]["num_experts"], cfg["topology"]["ep_size"]
    cfg["topology"]["slots_per_gpu"] = E // ep
    cfg.setdefault("execution", {})["executor"] = "megatron_balancer"
    path = tmp_path / "steps.rpt"
    subprocess.run([cli, "trace", "gen", str(REPO / "examples" / "gen-results-small.json"), "--steps", "2",
                    "--seed", "23", "--out", str(path)], check=True, capture_output=True)
    planned = 0
    with routepack.Scheduler(cfg, policy="routepack", log_level=None) as s:
        for step in routepack.TraceReader(str(path)):
            res = s.step(step.seq_lens, step.routing)
            phy2log = np.asarray(res.phy2log)
            balanced = json.loads(s.plan_json()).get("per_forward_balancing") == "virtual_experts"
            planned += int(balanced and (phy2log != np.arange(E)[None, :]).any())
            pl = megatron.expert_placement(res)
            assert pl.dropped.replicas == pl.dropped.extra_replicas == pl.dropped.share_sets == 0
            assert not np.asarray(pl.dropped.moved).any()
            for layer in range(res.num_layers):
                for r in range(ep):
                    assert sorted(pl.local_experts(layer, r)) == sorted(phy2log[layer, r * E // ep:(r + 1) * E // ep])
                ids = np.asarray(step.routing)[:, layer, :]
                # a replayed id lands on the slot, so the EP rank, the plan put its expert in
                assert (phy2log[layer][pl.to_megatron(ids, layer)] == ids).all()
    assert planned >= 1, "no step ran the balancer on a planned ownership: nothing was checked"
