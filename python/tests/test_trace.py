"""The trace reader and writer: what the C reader says, round trips through every routing
form, views that outlive the reader, and errors with the C message."""

import json
import subprocess

import numpy as np
import pytest

import routepack
from conftest import SMALL_TRACE, cli_path, random_step


def test_reader_matches_cli_info(small_trace):
    cli = cli_path()
    if cli is None:
        pytest.skip("the routepack tool is not built")
    info = json.loads(subprocess.run([cli, "trace", "info", str(SMALL_TRACE), "--json"],
                                     check=True, capture_output=True, text=True).stdout)
    assert len(small_trace) == info["num_steps"]
    for i, st in enumerate(info["steps"]):
        mine = small_trace.info(i)
        for key in ("step", "num_seqs", "num_tokens", "num_layers", "num_experts", "top_k",
                    "id_width", "checksum"):
            assert mine[key] == st[key], key
        step = small_trace[i]
        assert step.routing.shape == (st["num_tokens"], st["num_layers"], st["top_k"])
        assert int(step.seq_lens.sum()) == st["num_tokens"]


def test_views_outlive_the_reader():
    reader = routepack.TraceReader(SMALL_TRACE)
    step = reader[2]
    checksum = int(step.routing.astype(np.int64).sum())
    reader.close()
    del reader
    assert int(step.routing.astype(np.int64).sum()) == checksum
    assert not step.routing.flags.writeable
    with pytest.raises(ValueError):
        step.routing[0, 0, 0] = 1


def test_index_errors(small_trace):
    with pytest.raises(IndexError):
        small_trace[len(small_trace)]
    assert small_trace[-1].step == small_trace.info(len(small_trace) - 1)["step"]


def test_writer_round_trip_every_form(tmp_path):
    rng = np.random.default_rng(7)
    lens = rng.integers(1, 21, size=9)
    lens[4] = 0                                   # an empty sequence
    lens, ids = random_step(rng, 9, 3, 2, 40, dtype=np.uint8, lens=lens)
    groups = np.arange(9, dtype=np.int32) // 3
    cu = np.concatenate([[0], np.cumsum(lens)])
    per_seq = [ids[cu[s]:cu[s + 1]] for s in range(9)]
    per_layer = [ids[:, l, :] for l in range(3)]
    forms = {
        "packed": dict(seq_lens=lens, routing=ids),
        "cu_seqlens": dict(seq_lens=None, routing=ids, cu_seqlens=cu),
        "per_seq": dict(seq_lens=None, routing=per_seq),
        "per_layer": dict(seq_lens=lens, routing=per_layer),
        "stacked": dict(seq_lens=lens, routing=np.ascontiguousarray(ids.transpose(1, 0, 2)),
                        layout="per_layer"),
        "int64": dict(seq_lens=lens, routing=ids.astype(np.int64)),
        "strided": dict(seq_lens=lens, routing=np.asfortranarray(ids)),
    }
    sums = set()
    for name, kw in forms.items():
        path = tmp_path / (name + ".rpt")
        with routepack.TraceWriter(path, 40) as w:
            w.append(5, kw.pop("seq_lens"), kw.pop("routing"), group_ids=groups, **kw)
        r = routepack.TraceReader(path)
        st = r[0]
        assert st.step == 5
        np.testing.assert_array_equal(st.routing, ids, err_msg=name)
        np.testing.assert_array_equal(st.seq_lens, lens)
        np.testing.assert_array_equal(st.group_ids, groups)
        sums.add(r.info(0)["checksum"])
    assert len(sums) == 1


def test_writer_reports_bad_id_and_keeps_earlier_steps(tmp_path):
    rng = np.random.default_rng(1)
    lens, ids = random_step(rng, 4, 2, 2, 16, max_len=10)
    path = tmp_path / "t.rpt"
    w = routepack.TraceWriter(path, 16)
    w.append(0, lens, ids)
    bad = ids.copy()
    cu = np.concatenate([[0], np.cumsum(lens)])
    s = int(np.flatnonzero(lens)[1])
    bad[cu[s] + 1, 1, 0] = 16
    with pytest.raises(routepack.RoutingError) as e:
        w.append(1, lens, bad)
    assert e.value.sequence == s and e.value.expert == 16
    assert "sequence %d token 1 layer 1 choice 0 has expert id 16" % s in str(e.value)
    w.close()
    r = routepack.TraceReader(path)
    assert len(r) == 1


def test_reader_errors_carry_the_c_message(tmp_path):
    with pytest.raises(routepack.FileError) as e:
        routepack.TraceReader(tmp_path / "missing.rpt")
    assert "missing.rpt" in str(e.value)
    bad = tmp_path / "bad.rpt"
    bad.write_bytes(b"not a trace at all, just text" * 4)
    with pytest.raises(routepack.Error) as e:
        routepack.TraceReader(bad)
    assert "bad.rpt" in str(e.value)
    assert e.value.status in (routepack.errors.EFORMAT, routepack.errors.EIO)
