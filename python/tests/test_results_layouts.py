"""scripts/results/layouts.py (docs/results.md's "Parallel layouts" section, issue 19) and
scripts/results.py --splice, on small fake simulate runs: the figures come from the runs,
the layout from the config each run names, and a spliced section lands where a full render
puts it."""

import json
import subprocess
import sys

from conftest import REPO, load_script

SCRIPTS = REPO / "scripts"


layouts = load_script("results_layouts", "results/layouts.py")
results = load_script("results", "results.py")


def _policy(name, baseline, steps):
    """steps: (step_ms, migration_ms, fallback) per step."""
    return {"policy": name, "status": "ok", "summary": {"baseline": baseline},
            "steps": [{"step": i, "step_ms": s, "migration_ms": m, "ratio": 1.0, "shared_ratio": 1.25,
                       "migration_bytes": 0, "fallback": fb} for i, (s, m, fb) in enumerate(steps)]}


def _run(config, policies, best):
    return {"format": "routepack-simulate", "version": 1, "config": str(config),
            "input": {"kind": "trace", "path": "/tmp/x/layout-x.rpt", "steps": 2},
            "shape": {"num_gpus": 4, "num_nodes": 2, "gpus_per_node": 2, "ep_size": 2, "num_layers": 6,
                      "num_experts": 16, "top_k": 2},
            "policies": policies, "verdict": {"text": "verdict: fake", "steps": 2, "best_baseline": best,
                                              "fastest": "routepack"}}


def _work(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    topo = {"num_nodes": 2, "gpus_per_node": 8, "tensor_parallel_size": 4, "expert_tensor_parallel_size": 1,
            "ep_size": 8}
    (tmp_path / "tp.json").write_text(json.dumps({"topology": topo}))
    # PP with VPP and no schedule named: docs/config.md's default, interleaved
    (tmp_path / "pp.json").write_text(json.dumps({"topology": dict(
        topo, num_nodes=4, pipeline_parallel_size=2, virtual_pipeline_size=2)}))
    # the PP layout with two seeds, pooled; a stale run the list does not name is ignored
    (work / "layout-pp-s1.json").write_text(json.dumps(_run("pp.json", [
        _policy("token_kk+eplb", True, [(100.0, 20.0, False), (100.0, 0.0, False)]),
        _policy("routepack", False, [(90.0, 0.0, True), (100.0, 0.0, False)])], "token_kk+eplb")))
    (work / "layout-pp-s2.json").write_text(json.dumps(_run("pp.json", [
        _policy("token_kk+eplb", True, [(100.0, 0.0, False), (100.0, 0.0, False)]),
        _policy("routepack", False, [(110.0, 0.0, False), (110.0, 0.0, False)])], "token_kk+eplb")))
    (work / "layout-tp-s1.json").write_text(json.dumps(_run("tp.json", [
        _policy("token_kk+contiguous", True, [(200.0, 0.0, False), (200.0, 0.0, False)]),
        _policy("routepack", False, [(250.0, 0.0, False), (250.0, 0.0, False)])], "token_kk+contiguous")))
    (work / "layout-stale.json").write_text("{}")
    (work / "layouts.tsv").write_text(
        "tp\ttp.json\tgen-x.json\t1\t2\tlayout-tp-s1.json\n"
        "pp\tpp.json\tgen-x.json\t1\t2\tlayout-pp-s1.json\n"
        "pp\tpp.json\tgen-x.json\t2\t2\tlayout-pp-s2.json\n")
    return work


def test_layouts_section_from_runs(tmp_path):
    text = layouts.render(str(_work(tmp_path)), str(tmp_path), commit="abc1234")
    lines = text.split("\n")
    assert lines[0] == "## Parallel layouts (TP/ETP, PP/VPP)"
    assert lines[2].startswith("Rendered at commit abc1234 (")
    # in the list's order, each named with its layout, defaults filled in
    tp, pp = lines.index("### tp.json"), lines.index("### pp.json")
    assert tp < pp
    assert lines[tp + 2] == "TP 4, ETP 1, EP 8, PP 1, VPP 1, schedule none (PP 1); 16 GPUs (2 nodes x 8)."
    assert lines[pp + 2] == "TP 4, ETP 1, EP 8, PP 2, VPP 2, schedule interleaved; 32 GPUs (4 nodes x 8)."
    assert lines[pp + 4].startswith("gen-x.json, seeds 1, 2, 2 steps each.")
    # step, step/sLB, migration, step + migration, vs best baseline pooled and per seed, fell back:
    # seeds pooled (eplb 420 ms over 4 steps, routepack 410), each seed against its own best
    assert ("| token_kk+eplb (best baseline) | 100.000 | 1.250 | 5.000 | 105.000 | +0.0% | +0.0% / +0.0% | - |"
            in lines)
    assert "| routepack | 102.500 | 1.250 | 0.000 | 102.500 | +2.4% | +15.8% / -9.1% | 1 of 4 steps |" in lines
    assert "| routepack | 250.000 | 1.250 | 0.000 | 250.000 | -20.0% | -20.0% | 0 of 2 steps |" in lines
    assert "`seed 2: verdict: fake`" in lines
    # each fallback's reason, counted (the fakes give none)
    assert "Why `routepack` fell back: no reason given (1 step)." in lines
    assert sum(1 for line in lines if line.startswith("Why")) == 1
    assert layouts.summary(str(tmp_path / "work"), str(tmp_path)) == (
        "tp.json -20.0% (vs token_kk+contiguous); pp.json +2.4% (vs token_kk+eplb; routepack fell back at 1 of 4 steps)")
    assert layouts.render(str(tmp_path), str(tmp_path)) is None


def _full_render(root, work):
    subprocess.run([sys.executable, str(SCRIPTS / "results.py"), str(work), str(root)], check=True,
                   capture_output=True)
    return (root / "docs" / "results.md").read_text()


def _root(tmp_path):
    root = tmp_path / "root"
    (root / "docs").mkdir(parents=True)
    (root / "scripts" / "results").mkdir(parents=True)
    (root / "scripts" / "results" / "previous.md").write_text("## Appendix\n\nold figures\n")
    (root / "README.md").write_text("# x\n\n## Results\n\nnone\n\n## More\n")
    return root


def _splice(root, work):
    subprocess.run([sys.executable, str(SCRIPTS / "results.py"), str(work), str(root), "--splice",
                    "tp-pp-layouts"], check=True, capture_output=True)
    return (root / "docs" / "results.md").read_text()


def test_splice_puts_the_section_where_a_full_render_does(tmp_path):
    root, work = _root(tmp_path), tmp_path / "work"
    work.mkdir()
    section = work / "section-tp-pp-layouts.md"
    for extras in ([], ["section-structure.md", "section-zz.md"]):
        for name in extras:
            (work / name).write_text("## Section %s\n\nits text\n" % name)
        section.unlink(missing_ok=True)
        without = _full_render(root, work)
        section.write_text("## Parallel layouts (TP/ETP, PP/VPP)\n\nfigures\n\n### tp\n\nmore\n")
        full = _full_render(root, work)
        assert full != without
        (root / "docs" / "results.md").write_text(without)
        assert _splice(root, work) == full
        # again: replaced in place, not added twice
        assert _splice(root, work) == full
        section.write_text("## Parallel layouts (TP/ETP, PP/VPP)\n\nnew figures\n")
        assert _splice(root, work) == _full_render(root, work)


def test_splice_at_the_end(tmp_path):
    doc = "# R\n\n## A\n\ntext\n"
    section = "## L\n\nfigures\n"
    assert results.splice(doc, section, [], None) == doc + "\n" + section
    assert results.splice(doc + "\n" + section, "## L\n\nnew\n", [], None) == doc + "\n## L\n\nnew\n"


def test_splice_updates_the_header_and_readme(tmp_path):
    root, work = _root(tmp_path), _work(tmp_path)
    (root / "README.md").write_text("# x\n\n## Results\n\n<!-- results: begin (scripts/results.sh) -->\nfigures\n"
                                    "<!-- results: end -->\n\n## More\n")
    (root / "docs" / "results.md").write_text(
        "# Results\n\nGenerated by `scripts/results.sh` (commit 9b1ef14, 2026-12-03); edit that script, "
        "`scripts/results.py`\nor notes.\n\n## A\n\ntext\n")
    # the test's configs are relative to tmp_path: a section made from them
    (work / "section-tp-pp-layouts.md").write_text(layouts.render(str(work), str(tmp_path), commit="abc1234") + "\n")
    for f in ("tp.json", "pp.json"):
        (root / f).write_text((tmp_path / f).read_text())
    doc = _splice(root, work)
    assert ("Generated by `scripts/results.sh` (commit 9b1ef14, 2026-12-03; a section that names its own commit was\n"
            "rendered alone at that one since); edit that script, `scripts/results.py`\n") in doc
    assert "Rendered at commit abc1234 (" in doc
    readme = (root / "README.md").read_text()
    line = ("<!-- results: end -->\n\n<!-- layouts: begin (scripts/results.sh --layouts) -->\nParallel layouts "
            "(`docs/results.md`, \"Parallel layouts\"; seeds pooled): routepack against the best baseline on step + "
            "migration: tp.json -20.0% (vs token_kk+contiguous); pp.json +2.4% (vs token_kk+eplb; routepack fell back at 1 "
            "of 4 steps).\n"
            "<!-- layouts: end -->\n\n## More\n")
    assert readme.endswith(line)
    assert _splice(root, work) == doc and (root / "README.md").read_text() == readme  # again: the same
