"""Megatron-Core's own MoE layer (GPTModel, SequentialMLP experts, the all-to-all token
dispatcher, DDP, the distributed optimizer; megatron-core from PyPI) on 2 gloo ranks with
RoutePack's plans, through examples/megatron/train_moe.py: a run whose experts migrate every
step (token_kk+eplb) has the losses, every logical parameter and every optimizer state
(exp_avg, exp_avg_sq, expert_bias included) of the run that never moves an expert
(token_kk+contiguous), to fp32 round-off; its logical checkpoint loads into a run that never
migrated. MegatronMigration refuses a model registered without its optimizer state."""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="routepack.torch needs PyTorch (pip install torch)")
pytest.importorskip("megatron.core", reason="needs megatron-core (pip install megatron-core)")

import torch_world  # noqa: E402
from conftest import REPO  # noqa: E402

EXAMPLE = REPO / "examples" / "megatron" / "train_moe.py"


def _run(tmp_path, name, *extra, steps=3):
    dump = tmp_path / (name + ".pt")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLE), "--steps", str(steps), "--dump", str(dump)] + list(extra)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, "%s failed:\n%s\n%s" % (" ".join(cmd), p.stdout[-3000:], p.stderr[-5000:])
    return p.stdout, torch.load(dump)


def _close(state, ref):
    assert state.keys() == ref.keys()
    for name, p in state.items():
        q = ref[name]
        # fp32 round-off: the combine sums a token's experts in another order
        assert (p - q).abs().max() <= 1e-5 * max(q.abs().max(), 1e-30), name


def test_megatron_migration_equals_the_contiguous_run(tmp_path):
    out, run = _run(tmp_path, "eplb", "--policy", "token_kk+eplb")
    ref_out, ref = _run(tmp_path, "contiguous", "--policy", "token_kk+contiguous")
    moved = [int(l.split("experts moved ")[1].split()[0]) for l in out.splitlines() if l.startswith("step")]
    assert len(moved) == 3 and sum(moved) > 0                 # experts did move
    assert all(" experts moved 0 " in l for l in ref_out.splitlines() if l.startswith("step"))
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    state, ref_state = run["state"], ref["state"]
    # every expert and router row, their Adam moments, expert_bias and the dense parameters
    assert any(k.endswith("/exp_avg_sq") and ".expert." in k for k in state)
    assert "moe.1.router.expert_bias" in state and ref_state["moe.1.router.expert_bias"].abs().sum() > 0
    _close(state, ref_state)

    # a checkpoint of the migrated run, in logical order, loads into a run that never migrated
    _, loaded = _run(tmp_path, "loaded", "--policy", "token_kk+contiguous", "--load", str(tmp_path / "eplb.pt"),
                     steps=0)
    for name, p in run["state"].items():
        if name.endswith("local_tokens_per_expert"):
            continue      # a counter of the running step, not state a checkpoint needs
        assert torch.equal(loaded["state"][name], p), name


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
    ps.destroy_model_parallel()
    sched.close()
    return said, ok.num_local


def test_megatron_migration_refuses_weights_only():
    for said, num_local in torch_world.run(_refuses, 2, timeout=300):
        assert said[0] is not None and "no optimizer" in said[0]
        assert said[1] is not None and "MoE layer 0 local expert 0 linear_fc1.weight" in said[1], said[1]
        assert num_local == 4
