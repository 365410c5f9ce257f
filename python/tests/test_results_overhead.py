"""scripts/results.py --splice overhead (scripts/results.sh --overhead, issue 35): the section
"Planning overhead per rank" rendered from a fake bench_overhead JSON lands where a full
render puts it (before the extra sections, replacing the old one in place), with the load
average beside the figures, and README's sentence on the overhead is replaced inside its
Results block, the rest of the README untouched."""

import json
import subprocess
import sys

from conftest import REPO

SCRIPTS = REPO / "scripts"

HEADING = "## Planning overhead per rank (issue 16)"


def _bench(total_ms, interval_ms):
    """bench_overhead --json's keys that the section reads (10 s predicted step)."""
    return {"scale": 1, "reps": 3, "ranks": 64, "num_seqs": 4096, "rank_seqs": 64, "rank_tokens": 209073,
            "policy": "routepack", "part_bytes": 786560, "exchange_bytes": 50339840.0, "stats_ms": 23.0,
            "exchange_ms": 1.6, "merge_ms": 9.0, "merge_fresh_ms": 33.0, "policy_ms": total_ms - 36.6,
            "policy_wall_ms": 60.0, "validate_ms": 3.0, "total_ms": total_ms, "predicted_step_ms": 10000.0,
            "overhead_percent": total_ms / 100.0, "step_fallback_checks": 0, "check_step": 8,
            "check_policy_ms": 127.0, "check_validate_ms": 1.8, "check_total_ms": 163.0, "interval_checks": 1,
            "interval_policy_ms": 62.0, "interval_validate_ms": 1.9, "interval_total_ms": interval_ms,
            "every_step_policy_ms": 148.0, "every_step_validate_ms": 2.7, "every_step_total_ms": 185.0,
            "no_balancer_policy_ms": 59.0, "no_balancer_validate_ms": 2.8, "no_balancer_total_ms": 96.0,
            "no_balancer_interval_total_ms": 101.0, "construction_ms": 49.0, "checked_construction_ms": 139.0,
            "fallback_check_ms": 90.0, "fallback_chosen": "joint", "fallback_changed": 0, "peak_rss_mib": 289.0,
            "rank_peak_mib": 289.0, "rank_routing_bytes": 80284032, "step_routing_bytes": 5138178048,
            "stats_bytes": 50417753, "plan_ahead_ms": 119.0, "plan_ahead_train_ms": 1000.0, "exposed_ms": 0.0,
            "exposed_percent": 0.0}


def _root(tmp_path, readme):
    root = tmp_path / "root"
    (root / "docs").mkdir(parents=True)
    (root / "scripts" / "results").mkdir(parents=True)
    (root / "scripts" / "results" / "previous.md").write_text("## Appendix\n\nold figures\n")
    (root / "README.md").write_text(readme)
    return root


def _results(root, work, *extra):
    subprocess.run([sys.executable, str(SCRIPTS / "results.py"), str(work), str(root), *extra], check=True,
                   capture_output=True)
    return (root / "docs" / "results.md").read_text()


README = ("# x\n\n## Results\n\n<!-- results: begin (scripts/results.sh) -->\nPredicted: routepack +5%. "
          "Planning overhead per rank at the reference scale (64 GPUs, 4096 sequences; one CPU thread, "
          "`bench_overhead`): 113 ms a step between fallback checks (1.12% of the predicted 10.1 s step), "
          "120 ms the mean step of an interval (1.20%). `docs/results.md` has every figure.\n"
          "<!-- results: end -->\n\nPlanning overhead per rank at the reference scale (not in the block). (9.99%). "
          "\n\n## More\n")


def test_splice_puts_the_overhead_section_where_a_full_render_does(tmp_path):
    root, work = _root(tmp_path, README), tmp_path / "work"
    work.mkdir()
    (work / "section-structure.md").write_text("## Structure\n\nits text\n")
    without = _results(root, work)
    assert HEADING not in without
    (work / "bench-overhead.out").write_text(json.dumps(_bench(90.0, 95.0)))
    (work / "bench-overhead.load").write_text("1.20 1.50 1.70 / 1.30 1.50 1.70")
    full = _results(root, work)
    assert full.index(HEADING) < full.index("## Structure") < full.index("## Appendix")
    (root / "docs" / "results.md").write_text(without)
    assert _results(root, work, "--splice", "overhead") == full
    # again: replaced in place, not added twice
    assert _results(root, work, "--splice", "overhead") == full
    # new figures replace the old section where it stands
    (work / "bench-overhead.out").write_text(json.dumps(_bench(80.0, 84.0)))
    spliced = _results(root, work, "--splice", "overhead")
    assert spliced == _results(root, work)
    lines = spliced.split("\n")
    assert lines.count(HEADING) == 1
    assert "| **total** | **80.0** | **0.80%** (goal 1%) of 10.0 s |" in lines
    assert "| **total, the mean step of that interval** (steps 1 to 8; policy 62.0 ms) | **84.0** | **0.84%** |" in lines
    assert any(line.startswith("Rendered at commit ") and line.endswith(
        "; load average (1, 5, 15 min) before / after: 1.20 1.50 1.70 / 1.30 1.50 1.70.") for line in lines)


def test_splice_replaces_the_readme_sentence_in_its_block(tmp_path):
    root, work = _root(tmp_path, README), tmp_path / "work"
    work.mkdir()
    (root / "docs" / "results.md").write_text("# Results\n\n## A\n\ntext\n")
    (work / "bench-overhead.out").write_text(json.dumps(_bench(85.0, 92.0)))
    doc = _results(root, work, "--splice", "overhead")
    assert doc.startswith("# Results\n\n## A\n\ntext\n\n" + HEADING + "\n")
    readme = (root / "README.md").read_text()
    new = ("Planning overhead per rank at the reference scale (64 GPUs, 4096 sequences; one CPU thread, "
           "`bench_overhead`): 85 ms a step between fallback checks (0.85% of the predicted 10.0 s step), "
           "92 ms the mean step of an interval (0.92%). ")
    assert readme == README.replace(README[README.index("Planning overhead"):README.index("`docs/results.md`")], new,
                                    1)
    _results(root, work, "--splice", "overhead")
    assert (root / "README.md").read_text() == readme  # again: the same
    # a block without the sentence gets it before its closing words
    (root / "README.md").write_text(README.replace(README[README.index("Planning overhead"):
                                                          README.index("`docs/results.md`")], "", 1))
    _results(root, work, "--splice", "overhead")
    assert (root / "README.md").read_text() == readme


def test_splice_without_figures_fails(tmp_path):
    root, work = _root(tmp_path, README), tmp_path / "work"
    work.mkdir()
    (root / "docs" / "results.md").write_text("# Results\n")
    run = subprocess.run([sys.executable, str(SCRIPTS / "results.py"), str(work), str(root), "--splice", "overhead"],
                         capture_output=True, text=True)
    assert run.returncode != 0 and "bench-overhead.out" in run.stderr
    assert (root / "docs" / "results.md").read_text() == "# Results\n"
    assert (root / "README.md").read_text() == README
