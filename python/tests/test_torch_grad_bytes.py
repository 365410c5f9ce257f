"""The routepack_torch executor profile prices what routepack.torch runs: the bytes of the
replica gradient exchange the cost model charges each GPU (`routepack plan eval --json`,
"replica_grad" "sent_bytes") equal the bytes MoELayer.reduce_replica_grads sends among the
holders (its replica_grad_bytes), and each rank's point-to-point sends counted on 4 gloo
ranks, for a placement with replicated experts and an extra replica."""

import json
import subprocess

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="routepack.torch needs PyTorch (pip install torch)")

import routepack  # noqa: E402
import torch_world  # noqa: E402
from conftest import cli_path  # noqa: E402

HID, FFN, E, K, SLOTS, WORLD = 8, 6, 5, 2, 2, 4
# EP rank r holds PHY2LOG[2r], PHY2LOG[2r + 1]: experts 0, 1, 2 twice, 3 and 4 once; an
# extra replica of expert 3 on EP rank 0 in microbatch 0
PHY2LOG = [0, 1, 1, 2, 2, 3, 4, 0]
EXTRAS = [(3, 0)]


def _config(tmp_path):
    """4 GPUs in one node, EP 4, SwiGLU experts (3 d f parameters) in FP32 weights: the
    layer's float32 parameters, so its all-reduce moves 4 bytes an element."""
    cfg = {"topology": {"num_nodes": 1, "gpus_per_node": WORLD, "ep_size": WORLD, "slots_per_gpu": SLOTS},
           "model": {"num_layers": 1, "num_experts": E, "top_k": K, "hidden_size": HID,
                     "expert_ffn_size": FFN, "num_heads": 1, "head_dim": HID, "bytes_per_param": 4},
           "limits": {"max_tokens_per_microbatch": 1000}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def _model_bytes(tmp_path):
    """The replica_grad bytes the cost model charges for the plan's only layer."""
    cfg = _config(tmp_path)
    rng = np.random.default_rng(0)
    lens = [4, 4, 4, 4]
    routing = np.stack([rng.choice(E, K, replace=False) for _ in range(sum(lens))])[:, None, :]
    trace = tmp_path / "t.rpt"
    with routepack.TraceWriter(trace, E) as w:
        w.append(0, lens, routing.astype(np.uint8))
    plan = {"format": "routepack-plan", "version": 1, "num_gpus": WORLD, "ep_size": WORLD,
            "num_microbatches": 1, "num_layers": 1, "num_experts": E, "num_seqs": 4,
            "packing": [[[0]], [[1]], [[2]], [[3]]],
            "placement": [[PHY2LOG[2 * r:2 * r + 2] for r in range(WORLD)]],
            "extra_replicas": [{"microbatch": 0, "layer": 0, "expert": e, "ep_rank": j} for e, j in EXTRAS]}
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan))
    out = subprocess.run([str(cli_path()), "plan", "eval", "--config", str(cfg), "--trace", str(trace),
                          "--plan", str(plan_path), "--json"], capture_output=True, text=True, check=True)
    doc = json.loads(out.stdout)["breakdown"]
    assert doc["execution"]["executor"] == "routepack_torch"
    rg = doc["replica_grad"]
    assert rg["form"] == "holders" and rg["bytes_per_element"] == 4
    return rg["layers"][0]


def _layer_bytes(rank, world):
    """Run one step of MoELayer; (what it says it sent, the bytes of its isends counted)."""
    from routepack.torch import ExpertPlacement, MoELayer
    extras = [np.array(EXTRAS, dtype=np.int64)]
    placement = ExpertPlacement(np.array(PHY2LOG), np.arange(world + 1) * SLOTS, extras)
    layer = MoELayer(HID, FFN, E, K, SLOTS, gated=True)
    g = torch.Generator().manual_seed(1)
    layer.load_experts(torch.randn(E, HID, 2 * FFN, generator=g), torch.randn(E, FFN, HID, generator=g), placement)
    layer.fetch_replicas(placement)   # (fetches the extra replica's weights: not counted)
    # the exchange may start as the step's last backward ends: count from the forward on
    with torch_world.counting_sends() as seen:
        x = torch.randn(4, HID, generator=g).requires_grad_()
        layer(x, microbatch=0).sum().backward()
        layer.reduce_replica_grads()
    return layer.replica_grad_bytes["sent"], sum(seen), layer.replica_grad_bytes["received"]


def test_replica_gradient_bytes_equal_what_the_layer_moves(tmp_path):
    model = _model_bytes(tmp_path)
    # holders: expert 0 on ranks 0 and 3, 1 on 0 and 1, 2 on 1 and 2, 3 on 2 and 0 (its
    # extra replica); only slot holders receive: 3 d f = 144 parameters, 4 bytes: rank 0
    # sends 3 x 576 B (experts 0, 1, and 3 to its slot holder, rank 2), rank 1 two, rank 2
    # one (expert 3 goes to nobody: rank 0 holds it as an extra replica only), rank 3 one;
    # they receive 2 (nothing for the extra), 2, 2 (expert 3 from rank 0) and 1
    one = 3 * HID * FFN * 4
    assert model["experts"] == 4 and model["sent_bytes"] == [3 * one, 2 * one, one, one]
    received = [2 * one, 2 * one, 2 * one, one]
    counted = torch_world.run(_layer_bytes, WORLD)
    for rank in range(WORLD):
        want = (model["sent_bytes"][rank], model["sent_bytes"][rank], received[rank])
        assert counted[rank] == want, (rank, counted[rank], model)
