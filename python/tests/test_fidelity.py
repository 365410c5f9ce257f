"""routepack.fidelity: Kendall tau, MAPE and a plan's compute time under both sync
structures against hand-computed values; score() over a hand-made cells document; and the
whole pipeline on the CPU at a tiny shape: plans and cells here, every cell timed through
LayerCell (MoELayer's compute path) with CPU torch, figures back here."""

import json
import math

import numpy as np
import pytest

from conftest import TINY_CONFIG

from routepack import fidelity


def test_kendall_tau_by_hand():
    # pairs of [1,2,3,4] vs [1,3,2,4]: 5 concordant, 1 discordant -> (5 - 1) / 6
    assert fidelity.kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    assert fidelity.kendall_tau([1, 2, 3], [3, 2, 1]) == -1.0
    assert fidelity.kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0
    # tau-b with ties: x = [1,1,2,3], y = [1,2,2,3]: 4 concordant, 0 discordant, one pair tied
    # in x only and one in y only -> 4 / sqrt(5 x 5)
    assert fidelity.kendall_tau([1, 1, 2, 3], [1, 2, 2, 3]) == pytest.approx(0.8)
    assert math.isnan(fidelity.kendall_tau([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError):
        fidelity.kendall_tau([1, 2], [1, 2, 3])


def test_mape_by_hand():
    # |1.1 - 1| / 1 = 10%, |0.9 - 1| / 1 = 10%, |2 - 2| / 2 = 0 -> 20 / 3 %
    assert fidelity.mape([1.1, 0.9, 2.0], [1.0, 1.0, 2.0]) == pytest.approx(20 / 3)
    assert fidelity.mape([3.0], [2.0]) == pytest.approx(50.0)
    with pytest.raises(ValueError):
        fidelity.mape([1.0], [0.0])


def test_plan_compute_by_hand():
    cells = [[1, 2, 3, 4],    # microbatch 0, GPUs 0..3 (EP groups {0,1}, {2,3})
             [4, 3, 2, 1]]
    # group: group 0 = max(1,2) + max(4,3) = 6, group 1 = max(3,4) + max(2,1) = 6 -> 6
    assert fidelity.plan_compute_s(cells, 2, "group") == 6.0
    # global: max(1,2,3,4) + max(4,3,2,1) = 8
    assert fidelity.plan_compute_s(cells, 2, "global") == 8.0
    cells = [[5, 1, 1, 1], [5, 1, 1, 1]]
    assert fidelity.plan_compute_s(cells, 2, "group") == 10.0   # group 0: 5 + 5
    assert fidelity.plan_compute_s(cells, 4, "group") == 10.0
    with pytest.raises(ValueError):
        fidelity.plan_compute_s(cells, 2, "nccl")


def _doc():
    """Three plans over 2 GPUs (one EP group of 2) and four distinct cells."""
    return {"format": fidelity.FORMAT_CELLS, "ep_size": 2, "step": 0, "layer": 0, "sync": "group",
            "cells": [{"lengths": [1], "expert_counts": [1]}] * 4,
            "plans": [{"name": "a", "cells": [[0, 1]], "predicted": [[1.0, 2.0]]},
                      {"name": "b", "cells": [[2, 3]], "predicted": [[3.0, 1.0]]},
                      {"name": "c", "cells": [[0, 1], [2, 3]], "predicted": [[1.0, 2.0], [3.0, 1.0]]}]}


def test_score_by_hand():
    measured = {"seconds": {"0": 1.0, "1": 2.5, "2": 2.0, "3": 1.5}}
    s = fidelity.score(_doc(), measured)
    # cells (plan by plan): predicted [1,2, 3,1, 1,2,3,1], measured [1,2.5, 2,1.5, 1,2.5,2,1.5]
    pred = [1, 2, 3, 1, 1, 2, 3, 1]
    meas = [1, 2.5, 2, 1.5, 1, 2.5, 2, 1.5]
    assert s["cells"] == 8 and s["plans"] == 3
    assert s["cell_mape_percent"] == pytest.approx(np.mean([0, 0.2, 0.5, 1 / 3] * 2) * 100)
    assert s["cell_tau"] == pytest.approx(fidelity.kendall_tau(pred, meas))
    # plans: predicted a 2, b 3, c 2 + 3 = 5; measured a 2.5, b 2, c 4.5
    assert [p["predicted_s"] for p in s["per_plan"]] == [2.0, 3.0, 5.0]
    assert [p["measured_s"] for p in s["per_plan"]] == [2.5, 2.0, 4.5]
    # pairs (a,b): -; (a,c): +; (b,c): + -> (2 - 1) / 3
    assert s["plan_tau"] == pytest.approx(1 / 3)
    assert "communication cannot be measured on one GPU" in s["note"]


def test_noise_floor_by_hand():
    # the same 4 cells timed twice: one pair (1, 2) swaps order, so of 6 pairs 5 agree
    measured = {"seconds": {"0": 1.0, "1": 2.5, "2": 2.0, "3": 10.0}}
    retest = {"seconds": {"0": 1.0, "1": 2.0, "2": 2.5, "3": 10.0, "7": 3.0}}
    s = fidelity.score(_doc(), measured, retest=retest)
    f = s["noise_floor"]
    assert f["cells"] == 4 and f["span"] == pytest.approx(10.0)
    assert f["retest_tau"] == pytest.approx((5 - 1) / 6)
    # retest against the first: 0, 0.5 / 2.5, 0.5 / 2, 0
    assert f["retest_mape_percent"] == pytest.approx(np.mean([0, 0.2, 0.25, 0]) * 100)
    assert fidelity.score(_doc(), measured)["noise_floor"] is None
    with pytest.raises(RuntimeError, match="at least 2"):
        fidelity.noise_floor(measured, {"seconds": {"0": 1.0}})


def test_score_uses_complete_plans_only():
    # plan b lacks cell 3 and plan c too: only plan a is complete, too few to rank
    with pytest.raises(RuntimeError, match="at least 2"):
        fidelity.score(_doc(), {"seconds": {"0": 1.0, "1": 2.5, "2": 2.0}})
    s = fidelity.score(_doc(), {"seconds": {"0": 1.0, "1": 2.5, "2": 2.0, "3": 1.5, "9": 1.0}})
    assert s["plans"] == 3
    with pytest.raises(RuntimeError, match="at least 2"):
        fidelity.score(_doc(), {"seconds": {"0": 1.0, "1": 2.5}})


# ---- the whole pipeline on the CPU ----

def _measure_on_cpu(rank, world, doc):
    import torch
    torch.set_num_threads(1)
    return fidelity.measure(doc, device="cpu", budget_s=300, warmup=1, reps=2, log=lambda m: None)


def test_pipeline_on_cpu(tmp_path):
    pytest.importorskip("torch", reason="the device step needs PyTorch")
    import routepack
    import torch_world
    from conftest import cli_path
    if cli_path() is None:
        pytest.skip("the routepack tool is not built")
    cfg = json.loads(json.dumps(TINY_CONFIG))
    cfg["model"].update(hidden_size=32, expert_ffn_size=16, num_heads=2, num_kv_heads=1, head_dim=16)
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(cfg))
    rng = np.random.default_rng(4)
    lens = rng.integers(4, 40, 12).astype(np.int32)
    routing = rng.integers(0, 8, (int(lens.sum()), 2, 2)).astype(np.uint8)
    routing[:, :, 1] = (routing[:, :, 0] + 1 + rng.integers(0, 7, routing.shape[:2])) % 8
    trace = tmp_path / "t.rpt"
    with routepack.TraceWriter(trace, 8) as w:
        w.append(0, lens, routing)
    try:
        doc = fidelity.make_cells(cfg_path, trace, 0, 1, log=lambda m: None)
    except RuntimeError as e:
        if "no \"compute\" cells" in str(e):
            pytest.skip(str(e))
        raise
    assert len(doc["plans"]) >= 10
    assert doc["ep_size"] == 2 and doc["num_gpus"] == 2 and doc["layer"] == 1
    for plan in doc["plans"]:
        M = plan["microbatches"]
        assert len(plan["cells"]) == M and len(plan["predicted"]) == M
        # every GPU's cell holds its own sequences; the cells of a plan cover the batch
        seqs = sum(len(doc["cells"][i]["lengths"]) for row in plan["cells"] for i in row)
        assert seqs == len(lens)
        # and the token-choices of layer 1: every token's two choices land on some GPU
        choices = sum(sum(doc["cells"][i]["expert_counts"]) for row in plan["cells"] for i in row)
        assert choices == 2 * int(lens.sum())
    measured = torch_world.run(_measure_on_cpu, 1, doc, timeout=300)[0]
    assert measured["plans_complete"] == len(doc["plans"])
    assert all(t > 0 for t in measured["seconds"].values())
    s = fidelity.score(doc, measured)
    pred = [x for p in doc["plans"] for row in p["predicted"] for x in row]
    meas = [measured["seconds"][str(i)] for p in doc["plans"] for row in p["cells"] for i in row]
    assert s["cell_tau"] == pytest.approx(fidelity.kendall_tau(pred, meas))
    assert s["cell_mape_percent"] == pytest.approx(fidelity.mape(pred, meas))
    assert -1 <= s["plan_tau"] <= 1


def test_committed_cells_still_price():
    """examples/fidelity/cells-small.json (what device-check.sh times) holds >= 10 plans
    spanning >= 10% in predicted step time, and today's cost model still prices each of
    its plans (score --config re-predicts them)."""
    from conftest import REPO, cli_path
    if cli_path() is None:
        pytest.skip("the routepack tool is not built")
    doc = json.loads((REPO / "examples" / "fidelity" / "cells-small.json").read_text())
    assert doc["format"] == fidelity.FORMAT_CELLS
    assert len(doc["plans"]) >= 10 and doc["predicted_step_span"] >= 0.10
    names = {p["name"].split(",")[0] for p in doc["plans"]}
    assert "joint" in names and "token_kk+eplb" in names
    pred, sync = fidelity.repredict(doc, REPO / "examples" / "config-small.json", REPO / "examples" / "small.rpt")
    assert sync in ("group", "global")
    for p, cells in zip(doc["plans"], pred):
        assert np.shape(cells) == np.shape(p["predicted"]) and all(x > 0 for row in cells for x in row)


def _measure_failing(rank, world, doc):
    from routepack.torch import cell as cellmod
    real = cellmod.LayerCell.inputs

    def inputs(self, lengths, counts):
        if sum(counts) == 7:
            raise RuntimeError("CUDA out of memory (injected)")
        return real(self, lengths, counts)
    cellmod.LayerCell.inputs = inputs
    return fidelity.measure(doc, device="cpu", budget_s=300, warmup=0, reps=1, log=lambda m: None)


def test_measure_keeps_what_it_timed_when_a_cell_fails():
    pytest.importorskip("torch", reason="the device step needs PyTorch")
    import torch_world
    doc = {"shape": dict(hidden_size=16, expert_ffn_size=8, num_heads=2, num_kv_heads=1, head_dim=8),
           "cells": [{"lengths": [3], "expert_counts": [2, 1]}, {"lengths": [4], "expert_counts": [5, 2]},
                     {"lengths": [2], "expert_counts": [1, 1]}],
           "plans": [{"cells": [[0]]}, {"cells": [[1, 2]]}]}
    out = torch_world.run(_measure_failing, 1, doc)[0]
    assert out["plans_complete"] == 1 and sorted(out["seconds"]) == ["0"]
    assert "cell 1" in out["error"] and "injected" in out["error"]
