"""routepack.fidelity: how well the cost model ranks and prices plans, checked against
one GPU (docs/calibration.md).

Three steps, two machines:

    # here: plans of one batch (baselines and the joint policy, 1 and 2 microbatches),
    # each cell's content (its sequences' lengths, its experts' token-choices at one layer)
    python -m routepack.fidelity plan --config C --trace T [--step K] [--layer L] --out cells.json
    # on the GPU: time every distinct cell's compute (forward + backward of one layer)
    python -m routepack.fidelity measure --cells cells.json --out measured.json [--budget-s 110]
    # here (or there): predictions from the cost model (`routepack plan eval --json`,
    # the breakdown's "compute" cells) with the config, or the config plus a calibration
    python -m routepack.fidelity score --cells cells.json --measured measured.json \\
        [--retest measured2.json] [--config C] [--calibration calibration.json] [--json OUT]

A cell is one GPU's compute for one microbatch at one layer: the attention block over its
own sequences and the MoE block over the token-choices its experts receive
(routepack.torch.cell.LayerCell, through MoELayer's compute path). Communication (the
all-to-alls, gradient reductions, weight copies) cannot be measured on one GPU, so it is
not part of a cell, of the predictions compared, or of the plans' ranking here: the
ranking sums the cells under the configured sync structure (group: the slowest EP group's
sum over microbatches of its slowest GPU; global: the sum over microbatches of the slowest
GPU anywhere), compute only.

Figures: Kendall tau (tau-b) and MAPE between predicted and measured cells, over every
(plan, microbatch, GPU) cell, and Kendall tau between the plans' predicted and measured
compute times."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

FORMAT_CELLS, FORMAT_MEASURED = "routepack-fidelity-cells", "routepack-fidelity-measured"
PACKINGS = ("token_kk", "verl_kk", "attn_kk")
PLACEMENTS = ("contiguous", "eplb")
MICROBATCHES = (1, 2)


# ---- figures ----

def kendall_tau(x, y):
    """Kendall's tau-b of two equally long sequences (ties in either count as neither
    concordant nor discordant, and shrink the denominator); nan when either is constant
    or there are fewer than two items."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError("kendall_tau takes two 1-d sequences of one length, got %s and %s" % (x.shape, y.shape))
    n = len(x)
    conc = disc = tie_x = tie_y = 0
    for i in range(n):
        dx = np.sign(x[i + 1:] - x[i])
        dy = np.sign(y[i + 1:] - y[i])
        prod = dx * dy
        conc += int(np.sum(prod > 0))
        disc += int(np.sum(prod < 0))
        tie_x += int(np.sum((dx == 0) & (dy != 0)))
        tie_y += int(np.sum((dy == 0) & (dx != 0)))
    denom = math.sqrt((conc + disc + tie_x) * (conc + disc + tie_y))
    return (conc - disc) / denom if denom > 0 else float("nan")


def mape(predicted, measured):
    """Mean absolute percentage error of the predictions, in percent of the measured."""
    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    if np.any(m <= 0):
        raise ValueError("MAPE needs positive measured values")
    return float(np.mean(np.abs(p - m) / m) * 100.0)


def plan_compute_s(cells, ep_size, sync):
    """A plan's compute time from its cells [M][G] (seconds, one layer): group sync: the
    largest over EP groups of the sum over microbatches of the group's slowest GPU;
    global: the sum over microbatches of the slowest GPU."""
    c = np.asarray(cells, dtype=float)
    M, G = c.shape
    if sync == "global":
        return float(c.max(axis=1).sum())
    if sync != "group":
        raise ValueError("sync must be 'group' or 'global', got %r" % (sync,))
    groups = c.reshape(M, G // ep_size, ep_size).max(axis=2)   # [M, Q]
    return float(groups.sum(axis=0).max())


# ---- here: plans and cells ----

def _cli():
    cli = os.environ.get("ROUTEPACK_CLI") or shutil.which("routepack")
    if not cli:
        raise RuntimeError("the routepack CLI is needed for `plan eval`: set ROUTEPACK_CLI or put it on PATH")
    return cli


def plan_eval(config_path, trace_path, step, plan_text):
    """The breakdown of `routepack plan eval --json` for a plan (its JSON text)."""
    with tempfile.TemporaryDirectory(prefix="rp-fidelity-") as tmp:
        path = os.path.join(tmp, "plan.json")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(plan_text)
        run = subprocess.run([_cli(), "plan", "eval", "--config", str(config_path), "--trace", str(trace_path),
                              "--step", str(step), "--plan", path, "--json"],
                             capture_output=True, text=True, check=False)
    if run.returncode != 0:
        raise RuntimeError("routepack plan eval failed (exit %d): %s" % (run.returncode, run.stderr.strip()))
    return json.loads(run.stdout)["breakdown"]


def predicted_cells(breakdown, layer):
    """[M][G] forward+backward compute of each (microbatch, GPU) at ``layer``: the
    breakdown's "compute" [[[C(g, m, l) for g] for l] for m]."""
    if "compute" not in breakdown:
        raise RuntimeError("this routepack's plan eval --json has no \"compute\" cells (issue 14's breakdown); "
                           "rebuild the CLI")
    return [[float(c) for c in per_layer[layer]] for per_layer in breakdown["compute"]]


def _cell_contents(res, lens, routing, layer):
    """[M][G] (lengths, expert counts) of a step result at ``layer``."""
    _, slot_tokens = res.remap(routing, slot_tokens=True)
    G, M, ep = res.num_gpus, res.num_microbatches, res.ep_size
    ranks = res._ranks()   # [M, L, width]: EP rank of each physical id
    out = []
    for m in range(M):
        row = []
        counts_m = slot_tokens[m][layer]                     # [Q, P]
        P = counts_m.shape[1]
        for g in range(G):
            q, r = divmod(g, ep)
            seqs = res.microbatches[g][m]
            lengths = [int(lens[s]) for s in seqs]
            mine = np.nonzero(ranks[m, layer, :P] == r)[0]
            row.append((lengths, [int(counts_m[q, p]) for p in mine]))
        out.append(row)
    return out


def make_cells(config_path, trace_path, step=0, layer=0, log=print, microbatches=MICROBATCHES):
    """The cells document: every plan (its JSON, name, predicted step time and cells) and
    the distinct cells' contents. ``microbatches``: the counts each policy plans with
    (more counts, smaller cells: the CPU substrate takes 1, 2, 4, 8 so that its cells
    span more than 10x)."""
    import routepack
    with open(config_path, encoding="utf-8") as fh:
        config = json.load(fh)
    batch = routepack.TraceReader(trace_path)[step]
    lens = batch.seq_lens
    specs = [("%s+%s" % (p, q), None) for p in PACKINGS for q in PLACEMENTS] + [(None, "joint")]
    plans, cells, index, sync = [], [], {}, "group"
    for M in microbatches:
        cfg = json.loads(json.dumps(config))
        cfg.setdefault("limits", {})["num_microbatches"] = M
        base = os.path.dirname(os.path.abspath(config_path))   # paths relative to the config's directory
        if "policy" in cfg and "search_path" in cfg["policy"]:
            cfg["policy"]["search_path"] = [p if os.path.isabs(p) else os.path.join(base, p)
                                            for p in cfg["policy"]["search_path"]]
        if isinstance(cfg.get("calibration"), str) and not os.path.isabs(cfg["calibration"]):
            cfg["calibration"] = os.path.join(base, cfg["calibration"])
        for policy, label in specs:
            with routepack.Scheduler(cfg, policy=policy) as sched:
                res = sched.step(batch.lengths, batch.routing, group_ids=batch.group_ids)
                plan_text = sched.plan_json()
            name = "%s, %d microbatch%s" % (label or policy, M, "" if M == 1 else "es")
            bd = plan_eval(config_path, trace_path, step, plan_text)
            sync = bd.get("execution", {}).get("sync", sync)
            contents = _cell_contents(res, lens, batch.routing, layer)
            ids = []
            for row in contents:
                ids_row = []
                for lengths, counts in row:
                    key = (tuple(lengths), tuple(counts))
                    if key not in index:
                        index[key] = len(cells)
                        cells.append({"lengths": list(lengths), "expert_counts": list(counts)})
                    ids_row.append(index[key])
                ids.append(ids_row)
            plans.append({"name": name, "policy": res.policy_name, "microbatches": res.num_microbatches,
                          "predicted_step_s": bd["summary"]["step_s"], "cells": ids,
                          "predicted": predicted_cells(bd, layer), "plan": json.loads(plan_text)})
            log("  %-40s predicted step %.3f ms" % (name, bd["summary"]["step_s"] * 1e3))
    model = config["model"]
    shape = {k: int(model.get(k, model.get("num_heads"))) for k in
             ("hidden_size", "expert_ffn_size", "num_heads", "num_kv_heads", "head_dim")}
    steps = [p["predicted_step_s"] for p in plans]
    return {"format": FORMAT_CELLS, "version": 1, "config": os.path.basename(str(config_path)),
            "trace": os.path.basename(str(trace_path)), "step": step, "layer": layer,
            "shape": shape, "ep_size": _ep_size(config), "num_gpus": len(plans[0]["cells"][0]), "sync": sync,
            "predicted_step_span": max(steps) / min(steps) - 1, "plans": plans, "cells": cells}


def _ep_size(config):
    topo = config["topology"]
    return int(topo.get("ep_size", topo.get("gpus_per_node", 1)))


# ---- on the device: measure ----

def measure(doc, device="cuda", budget_s=110.0, warmup=2, reps=5, log=print, shard=(0, 1)):
    """Times every distinct cell (forward + backward of one layer), plan by plan, until
    ``budget_s`` runs out. Returns the measured document. On a GPU: BF16, the median of
    ``reps`` (CUDA events). On the CPU (routepack.cpu): fp32, one thread pinned to core
    ``shard[0]``, the least thread CPU time of ``reps``. ``shard`` (i, n): only the cells
    whose index is i modulo n (n pinned workers split the cells: measure_workers)."""
    import torch

    from routepack import cpu
    from routepack.torch import kernels
    from routepack.torch.cell import LayerCell, median_seconds
    start = time.monotonic()
    dev = torch.device(device)
    on_cpu = dev.type == "cpu"
    dtype = cpu.dtype() if on_cpu else torch.bfloat16
    core = cpu.pin(shard[0]) if on_cpu else None
    expert_kernel, why = kernels.choose_expert_kernel(dev, dtype)
    attention_kernel, notes = kernels.choose_attention_kernel(dev, dtype, allow_unfused=on_cpu)
    if attention_kernel is None:
        raise RuntimeError("no fused varlen attention kernel runs on %s: %s" % (device, "; ".join(notes)))
    log("fidelity: %s; experts %s (%s); attention %s%s" % (
        torch.cuda.get_device_name(dev) if not on_cpu else "cpu core %d, fp32, least thread CPU time" % core,
        expert_kernel, why, attention_kernel, "; " + cpu.load() if on_cpu else ""))

    def timed(fn):
        if on_cpu:
            return cpu.min_thread_seconds(fn, warmup, reps)
        return median_seconds(fn, dev, warmup, reps)
    layers, seconds = {}, {}
    complete = 0
    for plan in doc["plans"]:
        for ids in plan["cells"]:
            for i in ids:
                if str(i) in seconds or i % shard[1] != shard[0]:
                    continue
                if time.monotonic() - start > budget_s:
                    log("fidelity: the %.0f s budget ran out after %d of %d plans" % (budget_s, complete,
                                                                                   len(doc["plans"])))
                    return _measured(doc, seconds, expert_kernel, attention_kernel, complete, device)
                cell = doc["cells"][i]
                n_local = max(len(cell["expert_counts"]), 1)
                try:
                    if n_local not in layers:
                        layers[n_local] = LayerCell(doc["shape"], n_local, attention_kernel=attention_kernel,
                                                    expert_kernel=expert_kernel, dtype=dtype, device=dev)
                    layer = layers[n_local]
                    inputs = layer.inputs(cell["lengths"], cell["expert_counts"])
                    seconds[str(i)] = timed(lambda: layer.step(inputs))
                except Exception as e:  # noqa: BLE001 - what was measured still comes back
                    log("fidelity: cell %d (%d sequences, %d token-choices) failed: %s: %s" % (
                        i, len(cell["lengths"]), sum(cell["expert_counts"]), type(e).__name__,
                        str(e).splitlines()[0][:300] if str(e) else ""))
                    out = _measured(doc, seconds, expert_kernel, attention_kernel, complete, device)
                    out["error"] = "cell %d: %s: %s" % (i, type(e).__name__, str(e)[:300])
                    return out
        complete += 1
    return _measured(doc, seconds, expert_kernel, attention_kernel, complete, device)


def _measured(doc, seconds, expert_kernel, attention_kernel, complete, device):
    out = {"format": FORMAT_MEASURED, "version": 1, "device": device, "expert_kernel": expert_kernel,
           "attention_kernel": attention_kernel, "plans_complete": complete,
           "cells_measured": len(seconds), "seconds": seconds}
    if device.startswith("cpu"):
        from routepack import cpu
        out.update(timing="least thread CPU time, one pinned thread, fp32", load=cpu.load())
    return out


def plans_complete(doc, seconds):
    """How many plans, in order, have every cell in ``seconds``."""
    done = 0
    for plan in doc["plans"]:
        if not all(str(c) in seconds for row in plan["cells"] for c in row):
            break
        done += 1
    return done


def measure_workers(cells_path, out_path, workers, device="cpu", budget_s=110.0, reps=5, log=print):
    """``measure`` split over ``workers`` processes, worker i pinned to core i (the CPU
    substrate's ranks), the cells dealt round-robin; their seconds merged into one
    measured document at ``out_path``. Returns it."""
    with open(cells_path, encoding="utf-8") as fh:
        doc = json.load(fh)
    with tempfile.TemporaryDirectory(prefix="rp-fidelity-") as tmp:
        procs, outs = [], []
        for w in range(workers):
            outs.append(os.path.join(tmp, "shard%d.json" % w))
            procs.append(subprocess.Popen([sys.executable, "-m", "routepack.fidelity", "measure", "--cells",
                                           str(cells_path), "--out", outs[-1], "--device", device,
                                           "--budget-s", str(budget_s), "--reps", str(reps),
                                           "--shard", "%d/%d" % (w, workers)]))
        for p in procs:
            p.wait()
        parts = []
        for path in outs:
            if not os.path.exists(path):
                raise RuntimeError("a measuring worker wrote nothing (%s)" % path)
            with open(path, encoding="utf-8") as fh:
                parts.append(json.load(fh))
    seconds = {}
    for part in parts:
        seconds.update(part["seconds"])
    out = dict(parts[0], seconds=seconds, cells_measured=len(seconds), plans_complete=plans_complete(doc, seconds),
               workers=workers, load=[p.get("load") for p in parts])
    errors = [p["error"] for p in parts if "error" in p]
    if errors:
        out["error"] = "; ".join(errors)
    with open(out_path, "w", encoding="utf-8") as fh:
        json.dump(out, fh)
    return out


# ---- here: score ----

def noise_floor(measured, retest):
    """What two measurements of the same cells agree to (issue 30's test-retest figure):
    Kendall tau and MAPE of the second against the first over the distinct cells both
    timed, and how far the first's cells spread (largest / smallest). A model cannot be
    judged to a tau above the first, nor to a MAPE below the second."""
    a, b = measured["seconds"], retest["seconds"]
    ids = sorted(set(a) & set(b), key=int)
    if len(ids) < 2:
        raise RuntimeError("the retest timed %d of the measured cells; the noise floor needs at least 2" % len(ids))
    x, y = [a[i] for i in ids], [b[i] for i in ids]
    return {"cells": len(ids), "retest_tau": kendall_tau(x, y), "retest_mape_percent": mape(y, x),
            "span": max(x) / min(x) if min(x) > 0 else math.inf}


def score(doc, measured, predicted=None, sync="group", retest=None):
    """The figures: cell tau and MAPE over every (plan, microbatch, GPU) cell of the plans
    measured completely, plan tau over those plans. ``predicted``: [plan][M][G] to use
    instead of the document's (re-evaluated with another config). ``retest``: a second
    measurement of the same cells, for the noise floor beside them (noise_floor)."""
    secs = measured["seconds"]
    pred_cells, meas_cells, pred_plans, meas_plans, names = [], [], [], [], []
    for i, plan in enumerate(doc["plans"]):
        ids = plan["cells"]
        if not all(str(c) in secs for row in ids for c in row):
            continue
        pred = predicted[i] if predicted is not None else plan["predicted"]
        meas = [[secs[str(c)] for c in row] for row in ids]
        pred_cells += [x for row in pred for x in row]
        meas_cells += [x for row in meas for x in row]
        pred_plans.append(plan_compute_s(pred, doc["ep_size"], sync))
        meas_plans.append(plan_compute_s(meas, doc["ep_size"], sync))
        names.append(plan["name"])
    if len(names) < 2:
        raise RuntimeError("%d plans were measured completely; the ranking needs at least 2" % len(names))
    floor = noise_floor(measured, retest) if retest is not None else None
    return {"plans": len(names), "cells": len(pred_cells), "sync": sync, "noise_floor": floor,
            "cell_tau": kendall_tau(pred_cells, meas_cells), "cell_mape_percent": mape(pred_cells, meas_cells),
            "plan_tau": kendall_tau(pred_plans, meas_plans),
            "per_plan": [{"name": n, "predicted_s": p, "measured_s": m}
                         for n, p, m in zip(names, pred_plans, meas_plans)],
            "note": "compute only: communication cannot be measured on one GPU"}


def repredict(doc, config_path, trace_path, calibration=None):
    """[plan][M][G] predictions of every plan of ``doc`` with ``config_path`` (plus
    ``"calibration": calibration`` when given), and the sync the config runs."""
    with open(config_path, encoding="utf-8") as fh:
        config = json.load(fh)
    with tempfile.TemporaryDirectory(prefix="rp-fidelity-") as tmp:
        path = str(config_path)
        if calibration is not None:
            config["calibration"] = os.path.abspath(calibration)
            if "policy" in config and "search_path" in config["policy"]:
                base = os.path.dirname(os.path.abspath(config_path))
                config["policy"]["search_path"] = [p if os.path.isabs(p) else os.path.join(base, p)
                                                   for p in config["policy"]["search_path"]]
            path = os.path.join(tmp, "config.json")
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(config, fh)
        out, sync = [], None
        for plan in doc["plans"]:
            bd = plan_eval(path, trace_path, doc["step"], json.dumps(plan["plan"]))
            out.append(predicted_cells(bd, doc["layer"]))
            sync = bd.get("execution", {}).get("sync", sync)
    return out, sync or "group"


def print_score(s, out=sys.stdout):
    print("fidelity (%d plans, %d (plan, microbatch, GPU) cells, one layer, forward+backward compute, sync %s):"
          % (s["plans"], s["cells"], s["sync"]), file=out)
    print("  cell Kendall tau   %.3f   (goal >= 0.9)" % s["cell_tau"], file=out)
    print("  cell MAPE          %.1f%%  (goal <= 15%%)" % s["cell_mape_percent"], file=out)
    print("  plan Kendall tau   %.3f   (goal >= 0.9)" % s["plan_tau"], file=out)
    f = s.get("noise_floor")
    if f:
        print("  noise floor: test-retest tau %.3f, MAPE %.1f%% over %d cells spanning %.1fx%s" % (
            f["retest_tau"], f["retest_mape_percent"], f["cells"], f["span"],
            "" if f["retest_tau"] >= 0.9 else " (below 0.9: the cell figures above are judged against it)"),
            file=out)
    for p in s["per_plan"]:
        print("    %-40s predicted %.3f ms  measured %.3f ms" % (p["name"], p["predicted_s"] * 1e3,
                                                               p["measured_s"] * 1e3), file=out)
    print("  %s" % s["note"], file=out)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m routepack.fidelity", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="here: plans, predictions and cells -> cells.json")
    p.add_argument("--config", required=True)
    p.add_argument("--trace", required=True)
    p.add_argument("--step", type=int, default=0)
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--microbatches", default=",".join(map(str, MICROBATCHES)),
                   help="the microbatch counts each policy plans with (default 1,2; the CPU substrate: 1,2,4,8)")
    p.add_argument("--out", required=True)
    p = sub.add_parser("measure", help="on the GPU (or the CPU): time every cell -> measured.json")
    p.add_argument("--cells", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--budget-s", type=float, default=110.0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--workers", type=int, default=1,
                   help="CPU: this many processes, one pinned core each, split the cells")
    p.add_argument("--shard", help="I/N: only cells I modulo N (what --workers runs)")
    p = sub.add_parser("score", help="here: tau and MAPE")
    p.add_argument("--cells", required=True)
    p.add_argument("--measured", required=True)
    p.add_argument("--config", help="re-predict with this config (default: the predictions in the cells file)")
    p.add_argument("--trace", help="the trace of the cells file (needed with --config)")
    p.add_argument("--calibration", help="re-predict with the config plus this calibration.json")
    p.add_argument("--sync", choices=("group", "global"), help="default: the config's (group)")
    p.add_argument("--retest", help="a second measurement of the same cells: the noise floor beside the figures")
    p.add_argument("--json", help="write the figures here too")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "plan":
            counts = tuple(int(x) for x in args.microbatches.split(","))
            doc = make_cells(args.config, args.trace, args.step, args.layer, microbatches=counts)
            with open(args.out, "w", encoding="utf-8") as fh:
                json.dump(doc, fh)
            print("fidelity: %d plans, %d distinct cells, predicted step times span %.1f%%; wrote %s" % (
                len(doc["plans"]), len(doc["cells"]), doc["predicted_step_span"] * 100, args.out))
            if doc["predicted_step_span"] < 0.10:
                print("fidelity: the plans span less than 10%: the ranking says little", file=sys.stderr)
            return 0
        with open(args.cells, encoding="utf-8") as fh:
            doc = json.load(fh)
        if doc.get("format") != FORMAT_CELLS:
            raise RuntimeError("%s is not a %s file" % (args.cells, FORMAT_CELLS))
        if args.cmd == "measure":
            if args.workers > 1:
                m = measure_workers(args.cells, args.out, args.workers, args.device, args.budget_s, args.reps)
            else:
                shard = (0, 1)
                if args.shard:
                    i, n = (int(x) for x in args.shard.split("/"))
                    if not 0 <= i < n:
                        raise ValueError("--shard I/N needs 0 <= I < N, got %s" % args.shard)
                    shard = (i, n)
                m = measure(doc, args.device, args.budget_s, reps=args.reps, shard=shard)
                with open(args.out, "w", encoding="utf-8") as fh:
                    json.dump(m, fh)
            print("fidelity: measured %d cells (%d of %d plans complete); wrote %s" % (
                m["cells_measured"], m["plans_complete"], len(doc["plans"]), args.out))
            return 0 if m["plans_complete"] == len(doc["plans"]) else 1
        with open(args.measured, encoding="utf-8") as fh:
            measured = json.load(fh)
        predicted, sync = None, doc.get("sync", "group")
        if args.config or args.calibration:
            if not (args.config and args.trace):
                raise RuntimeError("re-predicting needs --config and --trace")
            predicted, sync = repredict(doc, args.config, args.trace, args.calibration)
        retest = None
        if args.retest:
            with open(args.retest, encoding="utf-8") as fh:
                retest = json.load(fh)
        s = score(doc, measured, predicted, args.sync or sync, retest)
        print_score(s)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(s, fh, indent=1)
        return 0
    except (OSError, RuntimeError, ValueError) as e:
        print("fidelity: %s" % e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
