"""routepack.links and ``routepack.calibrate --links``: the links between 2 pinned gloo
ranks of this machine are measured (a bandwidth and a latency, both positive and of a
plausible order), written as the calibration file's "links", and a config that loads the
file takes them as its topology's link figures where it leaves them out; a bad rank count
is refused before anything runs."""

import json

import pytest

pytest.importorskip("torch", reason="routepack.links needs PyTorch (pip install torch)")

from conftest import REPO  # noqa: E402

import routepack  # noqa: E402
from routepack import calibrate, links  # noqa: E402

SMALL = str(REPO / "examples" / "config-small.json")


def test_calibrate_writes_the_links_a_config_takes(tmp_path):
    out = tmp_path / "calibration.json"
    assert calibrate.main(["--fake", "--config", SMALL, "--links", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    got = doc["links"]
    assert got["backend"] == "gloo" and got["ranks"] == 2
    # gloo over loopback on one machine: far below NVLink, far above nothing
    assert 1e6 < got["bytes_per_s"] < 1e12
    assert 0 < got["latency_us"] < 1e5
    cfg = json.loads((REPO / "examples" / "config-small.json").read_text())
    cfg["calibration"] = str(out)
    cfg["hardware"] = {"peak_flops": 989e12}
    cfg["topology"].pop("nvlink_bytes_per_s", None)
    cfg["topology"].pop("nvlink_latency_us", None)
    cfg.pop("$schema", None)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with routepack.Scheduler(str(path), policy="token_kk+contiguous", log_level=None) as sched:
        topo = sched._lib.rp_config_topology(sched.config.handle).contents
        assert topo.nvlink_bytes_per_s == pytest.approx(got["bytes_per_s"], rel=1e-9)
        assert topo.nvlink_latency_s == pytest.approx(got["latency_us"] * 1e-6, rel=1e-9)


def test_links_need_two_ranks(tmp_path, capsys):
    assert calibrate.main(["--fake", "--config", SMALL, "--links", "1", "--out", str(tmp_path / "c.json")]) == 1
    assert "at least 2 ranks" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()
    with pytest.raises(ValueError, match="at least 2 ranks"):
        links.measure_spawned(1)
