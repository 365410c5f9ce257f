"""Megatron-Core's own MoE layer (GPTModel, SequentialMLP experts, the all-to-all token
dispatcher, DDP, the distributed optimizer; megatron-core from PyPI) on 2 gloo ranks with
RoutePack's plans, through examples/megatron/train_moe.py: a run whose experts are replicated
and migrate every step (token_kk+eplb with a spare slot per rank, RoutePackMoELayer), and
one with Megatron's stock MoELayer whose experts are renumbered every step, each have the
losses, every logical parameter and every optimizer state (exp_avg, exp_avg_sq, expert_bias
included) of the run that never moves an expert (token_kk+contiguous), to fp32 round-off;
a logical checkpoint loads into a run that never migrated. MegatronMigration refuses a
model registered without its optimizer state; GroupedMLP's experts are what its forward
multiplies."""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="routepack.torch needs PyTorch (pip install torch)")
pytest.importorskip("megatron.core", reason="needs megatron-core (pip install megatron-core)")

import torch_world  # noqa: E402
from conftest import REPO  # noqa: E402

EXAMPLE = REPO / "examples" / "megatron" / "train_moe.py"


@pytest.fixture(scope="module")
def contiguous(tmp_path_factory):
    """The run that never moves an expert (RoutePackMoELayer, token_kk+contiguous), shared
    by the tests that compare against it."""
    return _run(tmp_path_factory.mktemp("contiguous"), "contiguous", "--policy", "token_kk+contiguous")


def _run(tmp_path, name, *extra, steps=3):
    dump = tmp_path / (name + ".pt")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLE), "--steps", str(steps), "--dump", str(dump)] + list(extra)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, "%s failed:\n%s\n%s" % (" ".join(cmd), p.stdout[-3000:], p.stderr[-5000:])
    return p.stdout, torch.load(dump)


def _close(state, ref, norm=False):
    assert state.keys() == ref.keys()
    for name, p in state.items():
        q = ref[name]
        if norm:
            # replicas sum an expert's gradient in another order, and Adam's elementwise
            # g / (|g| + eps) magnifies that round-off where an element's gradient is near 0:
            # the tensor's difference against its norm
            assert (p - q).norm() <= 1e-5 * max(q.norm(), 1e-30), name
        else:
            # fp32 round-off: the combine sums a token's experts in another order
            assert (p - q).abs().max() <= 1e-5 * max(q.abs().max(), 1e-30), name


def _moved_replicated(out):
    rows = [l for l in out.splitlines() if l.startswith("step")]
    return ([int(l.split("experts moved ")[1].split()[0]) for l in rows],
            [int(l.split("replicated ")[1].split()[0]) for l in rows])


def test_megatron_replicas_and_migration_equal_the_contiguous_run(tmp_path, contiguous):
    """RoutePackMoELayer (a spare slot per rank): token_kk+eplb replicates hot experts there
    and migrates every step; Megatron's dispatcher runs the slots, replicas' gradients are
    summed among their holders, and nothing differs from the contiguous run."""
    out, run = _run(tmp_path, "eplb", "--policy", "token_kk+eplb")
    ref_out, ref = contiguous
    moved, replicated = _moved_replicated(out)
    assert len(moved) == 3 and sum(moved) > 0 and min(replicated) > 0   # moved, and replicas
    assert _moved_replicated(ref_out) == ([0, 0, 0], [0, 0, 0])
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    state, ref_state = run["state"], ref["state"]
    # every expert and router row, their Adam moments, expert_bias and the dense parameters
    assert any(k.endswith("/exp_avg_sq") and ".expert." in k for k in state)
    assert "moe.1.router.expert_bias" in state and ref_state["moe.1.router.expert_bias"].abs().sum() > 0
    _close(state, ref_state, norm=True)

    # a checkpoint of the migrated run, in logical order, loads into a run that never migrated
    _, loaded = _run(tmp_path, "loaded", "--policy", "token_kk+contiguous", "--load", str(tmp_path / "eplb.pt"),
                     steps=0)
    for name, p in run["state"].items():
        if name.endswith("local_tokens_per_expert"):
            continue      # a counter of the running step, not state a checkpoint needs
        assert torch.equal(loaded["state"][name], p), name


def test_megatron_overlapped_grad_reduce_equals_the_contiguous_run(tmp_path, contiguous):
    """DDP's overlap_grad_reduce (gradients reduce-scattered during the backward, earlier
    micro-batches under no_sync): the replicas' gradients are summed as each layer's
    backward ends (OverlappedReplicaGrads, installed by MegatronMigration), before DDP
    starts their bucket; losses and state equal the contiguous run's."""
    out, run = _run(tmp_path, "overlap", "--policy", "token_kk+eplb", "--overlap-grad-reduce")
    ref_out, ref = contiguous
    moved, replicated = _moved_replicated(out)
    assert sum(moved) > 0 and min(replicated) > 0
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    _close(run["state"], ref["state"], norm=True)


def test_megatron_stock_layer_migration_equals_the_contiguous_run(tmp_path):
    """Megatron's own MoELayer, one slot per expert: the experts renumbered every step (router
    rows, expert_bias and their optimizer state permuted with them)."""
    out, run = _run(tmp_path, "eplb", "--policy", "token_kk+eplb", "--layer", "stock")
    ref_out, ref = _run(tmp_path, "contiguous", "--policy", "token_kk+contiguous", "--layer", "stock")
    moved, replicated = _moved_replicated(out)
    assert sum(moved) > 0 and replicated == [0, 0, 0]
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    _close(run["state"], ref["state"])


def _refuses(rank, world):
    sys.path.insert(0, str(EXAMPLE.parent))
    import megatron_cpu
    megatron_cpu.apply()
    import train_moe
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from routepack import errors
    from routepack.adapters.megatron_migration import MegatronMigration
    from routepack.torch import DistributedScheduler

    sched = DistributedScheduler(train_moe.config_for(world), policy="token_kk+eplb", log_level=None)
    cfg, model = train_moe.build(world, 0, sched.initial_placement())
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True,
                                                 bf16=False), [ddp])
    group = ps.get_expert_model_parallel_group()
    said = []
    for optimizer in (None, opt.chained_optimizers[0]):      # none; the dense parameters' only
        try:
            MegatronMigration(sched, ddp, optimizer, group=group)
            said.append(None)
        except errors.InvalidArgumentError as e:
            said.append(str(e))
    ok = MegatronMigration(sched, ddp, opt, group=group)     # the whole optimizer: accepted

    # a plan with an extra replica (a policy that adds one, under routepack_torch's profile,
    # which runs them): Megatron's expert forms cannot, and execute refuses before moving
    import tempfile
    policy = os.path.join(tempfile.mkdtemp(), "one_extra.lua")
    with open(policy, "w") as f:
        f.write('return {name = "one_extra", version = "1.0.0", api = 1, description = "an extra replica",\n'
                'plan = function(ctx)\n'
                '  local p = rp.baseline("token_kk+contiguous")\n'
                '  p:set({extra_replicas = {{microbatch = 0, layer = 0, expert = 0, ep_rank = 1}}})\n'
                '  return p end}\n')
    config = train_moe.config_for(world)
    config["execution"] = {"executor": "routepack_torch"}
    other = DistributedScheduler(config, policy=policy, log_level=None)
    import numpy as np
    lens = np.full(4, 8, np.int32)
    t = np.arange(32)[:, None, None] + np.arange(2)[None, :, None] + np.arange(2)[None, None, :]
    routing = torch.as_tensor(t % 8, dtype=torch.int32)          # [tokens, layers, k], distinct k
    res = other.step(lens, routing, np.arange(4) + 4 * rank)
    extras = len(res.extra_replicas)
    refused = None
    try:
        MegatronMigration(other, ddp, opt, group=group).execute(res)
    except errors.NotSupportedError as e:
        refused = str(e)
    other.close()
    ps.destroy_model_parallel()
    sched.close()
    return said, ok.num_local, extras, refused


def test_megatron_migration_refuses_weights_only():
    for said, num_local, extras, refused in torch_world.run(_refuses, 2, timeout=300):
        assert extras == 1 and refused is not None and "1 per-microbatch extra replicas" in refused
        assert 'execution.executor "megatron_routepack"' in refused, refused
        assert said[0] is not None and "no optimizer" in said[0]
        assert said[1] is not None and "MoE layer 0 local expert 0 linear_fc1.weight" in said[1], said[1]
        assert num_local == 5     # 4 experts and a spare slot per rank


def _grouped_forward(rank, world):
    """Megatron's GroupedMLP (the real class) with grouped_gemm's gmm given as the loop it
    computes (x[rows of expert i] @ w[i]): its output against each expert computed alone from
    expert_pieces' parts of weight1 / weight2."""
    sys.path.insert(0, str(EXAMPLE.parent))
    import megatron_cpu
    megatron_cpu.apply()
    import megatron.core.transformer.moe.experts as experts_mod
    import megatron.core.transformer.moe.grouped_gemm_util as gg
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig
    from routepack.adapters.megatron_migration import expert_form, expert_pieces

    class _Ops:
        @staticmethod
        def gmm(a, b, batch_sizes, trans_b=False):
            out, at = [], 0
            for i, n in enumerate(batch_sizes.tolist()):
                out.append(a[at:at + n] @ (b[i].t() if trans_b else b[i]))
                at += n
            return torch.cat(out)
    gg.assert_grouped_gemm_is_available = lambda: None
    experts_mod.gg.ops = _Ops
    ps.initialize_model_parallel(1, 1)
    n, hidden, ffn = 4, 8, 6
    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=2, num_moe_experts=n,
                            moe_ffn_hidden_size=ffn, use_cpu_initialization=True, moe_grouped_gemm=True,
                            gated_linear_unit=True, add_bias_linear=False, bf16=True,
                            params_dtype=torch.bfloat16)
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    mlp = experts_mod.GroupedMLP(n, cfg, pg_collection=get_default_pg_collection())
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    tokens = torch.tensor([3, 0, 2, 4])
    x = torch.randn(int(tokens.sum()), hidden, generator=torch.Generator().manual_seed(1)).bfloat16()
    probs = torch.rand(int(tokens.sum()), generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.no_grad():
        out, _ = mlp(x, tokens, probs)
        want, at = [], 0
        for i, count in enumerate(tokens.tolist()):
            pieces = {name: select(p.data) for name, p, select in expert_pieces(mlp, i)}
            w1, w2 = pieces["weight1"].view(hidden, -1), pieces["weight2"].view(-1, hidden)
            h = x[at:at + count] @ w1
            a, b = h.chunk(2, dim=-1)
            want.append((cfg.activation_func(a) * b * probs[at:at + count, None]) @ w2)   # its GLU
            at += count
    ps.destroy_model_parallel()
    return expert_form(mlp), [tuple(p.shape) for _, p, _ in expert_pieces(mlp, 0)], \
        float((out.float() - torch.cat(want).float()).abs().max()), float(out.float().abs().max())


def test_grouped_mlp_experts_are_what_its_forward_multiplies():
    form, shapes, diff, scale = torch_world.run(_grouped_forward, 1, timeout=120)[0]
    assert form == "GroupedMLP" and shapes == [(8, 4 * 2 * 6), (4 * 6, 8)]
    assert scale > 0 and diff <= 2e-2 * scale       # bf16 round-off only
