"""`routepack trace import --npz`: every step of a run saved by numpy.savez in one
command, read in place from the archive (stored members, zip64 records), checked whole
before anything is written, all or nothing."""

import struct
import subprocess
import zlib

import numpy as np
import pytest

import routepack


def run(cli, *args):
    return subprocess.run([cli, "trace", "import", *map(str, args)], capture_output=True, text=True)


def make_step(rng, n=5, layers=3, k=2, experts=16):
    prompt = rng.integers(1, 6, size=n).astype(np.int32)
    response = rng.integers(0, 9, size=n).astype(np.int32)
    tokens = int((prompt + response).sum())
    routing = rng.integers(0, experts, size=(tokens, layers, k)).astype(np.int64)
    groups = (np.arange(n) // 2).astype(np.int32)
    return prompt, response, groups, routing


def check_trace(path, steps, indexes):
    with routepack.TraceReader(path) as t:
        assert len(t) == len(steps)
        for s, (prompt, response, groups, routing), k in zip(t, steps, indexes):
            assert s.step == k
            np.testing.assert_array_equal(s.prompt_lens, prompt)
            np.testing.assert_array_equal(s.response_lens, response)
            np.testing.assert_array_equal(s.routing, routing)


def test_run_of_numbered_steps(cli, tmp_path):
    rng = np.random.default_rng(1)
    steps = [make_step(rng) for _ in range(3)]
    arrays = {}
    for k, (p, r, g, ids) in zip((0, 1, 10), steps):
        arrays["routing_%d" % k] = ids
        arrays["group_ids_%d" % k] = g
        if k == 1:   # one step gives its lengths as two arrays
            arrays["prompt_lens_1"], arrays["response_lens_1"] = p, r
        else:
            arrays["lens_%d" % k] = np.stack([p, r], axis=1)
    np.savez(tmp_path / "run.npz", **arrays)
    r = run(cli, "--npz", tmp_path / "run.npz", "--experts", 16, "--out", tmp_path / "run.rpt")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("step") >= 3 and "the trace has 3 steps" in r.stdout
    check_trace(tmp_path / "run.rpt", steps, [0, 1, 10])
    with routepack.TraceReader(tmp_path / "run.rpt") as t:
        np.testing.assert_array_equal(t[2].group_ids, steps[2][2])


def test_one_unnumbered_step_with_layout(cli, tmp_path):
    rng = np.random.default_rng(2)
    p, rr, g, ids = make_step(rng)
    np.savez(tmp_path / "one.npz", routing=np.ascontiguousarray(ids.transpose(1, 0, 2)),
             lens=np.stack([p, rr], axis=1))
    r = run(cli, "--npz", tmp_path / "one.npz", "--experts", 16, "--layout", "per_layer",
            "--step", 7, "--out", tmp_path / "one.rpt")
    assert r.returncode == 0, r.stderr
    check_trace(tmp_path / "one.rpt", [(p, rr, g, ids)], [7])


def test_append_is_all_or_nothing(cli, tmp_path):
    rng = np.random.default_rng(3)
    first = make_step(rng)
    np.savez(tmp_path / "a.npz", routing=first[3], lens=np.stack(first[:2], axis=1))
    assert run(cli, "--npz", tmp_path / "a.npz", "--experts", 16, "--out",
               tmp_path / "t.rpt").returncode == 0
    before = (tmp_path / "t.rpt").read_bytes()
    good, bad = make_step(rng), make_step(rng)
    bad[3][-1, -1, -1] = 99        # the second step of the archive has an id out of range
    np.savez(tmp_path / "b.npz", routing_1=good[3], lens_1=np.stack(good[:2], axis=1),
             routing_2=bad[3], lens_2=np.stack(bad[:2], axis=1))
    r = run(cli, "--npz", tmp_path / "b.npz", "--experts", 16, "--append", "--out", tmp_path / "t.rpt")
    assert r.returncode == 1 and "b.npz:routing_2.npy" in r.stderr and "expert id 99" in r.stderr
    assert (tmp_path / "t.rpt").read_bytes() == before      # step 1 was cut back too
    bad[3][-1, -1, -1] = 0
    np.savez(tmp_path / "b.npz", routing_1=good[3], lens_1=np.stack(good[:2], axis=1),
             routing_2=bad[3], lens_2=np.stack(bad[:2], axis=1))
    r = run(cli, "--npz", tmp_path / "b.npz", "--experts", 16, "--append", "--out", tmp_path / "t.rpt")
    assert r.returncode == 0, r.stderr
    check_trace(tmp_path / "t.rpt", [first, good, bad], [0, 1, 2])
    # the same steps again: refused, named
    r = run(cli, "--npz", tmp_path / "b.npz", "--experts", 16, "--append", "--out", tmp_path / "t.rpt")
    assert r.returncode == 1 and "already holds step 1" in r.stderr


@pytest.mark.parametrize("arrays,message", [
    ({"routing_0": np.zeros((2, 1, 1), np.int8), "lens_0": np.array([2]), "extra": np.zeros(1, np.int32)},
     "unexpected array 'extra'"),
    ({"routing": np.zeros((2, 1, 1), np.int8), "lens": np.array([2]),
      "routing_1": np.zeros((2, 1, 1), np.int8), "lens_1": np.array([2])}, "mixes unnumbered"),
    ({"routing_3": np.zeros((2, 1, 1), np.int8)}, "no lens (or prompt_lens and response_lens)_3"),
    ({"lens_0": np.array([2])}, "no routing_0"),
])
def test_archive_contents_checked(cli, tmp_path, arrays, message):
    np.savez(tmp_path / "x.npz", **arrays)
    r = run(cli, "--npz", tmp_path / "x.npz", "--experts", 4, "--out", tmp_path / "x.rpt")
    assert r.returncode == 1 and message in r.stderr, r.stderr
    assert not (tmp_path / "x.rpt").exists()


def test_compressed_and_corrupt_archives(cli, tmp_path):
    arrays = {"routing": np.zeros((2, 1, 1), np.int8), "lens": np.array([2])}
    np.savez_compressed(tmp_path / "c.npz", **arrays)
    r = run(cli, "--npz", tmp_path / "c.npz", "--experts", 4, "--out", tmp_path / "c.rpt")
    assert r.returncode == 1 and "compressed" in r.stderr and "numpy.savez" in r.stderr
    np.savez(tmp_path / "d.npz", **arrays)
    data = bytearray((tmp_path / "d.npz").read_bytes())
    at = data.index(b"\x93NUMPY") + 100           # inside the first member's data
    data[at] ^= 0xFF
    (tmp_path / "d.npz").write_bytes(bytes(data))
    r = run(cli, "--npz", tmp_path / "d.npz", "--experts", 4, "--out", tmp_path / "d.rpt")
    assert r.returncode == 1 and "CRC-32 mismatch" in r.stderr
    (tmp_path / "e.npz").write_bytes(bytes(data[: len(data) // 2]))
    r = run(cli, "--npz", tmp_path / "e.npz", "--experts", 4, "--out", tmp_path / "e.rpt")
    assert r.returncode == 1 and "not a zip archive" in r.stderr
    np.save(tmp_path / "f.npy", arrays["routing"])
    r = run(cli, "--npz", tmp_path / "f.npy", "--experts", 4, "--out", tmp_path / "f.rpt")
    assert r.returncode == 1 and "a .npy file, not an .npz archive" in r.stderr


def npy_bytes(arr):
    import io
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def zip64_archive(members):
    """A stored zip whose central directory and end record use zip64 for everything (as
    an archive over 4 GiB must), built by hand so the small test exercises that path."""
    out, central = bytearray(), bytearray()
    for name, data in members.items():
        name = name.encode()
        crc, offset = zlib.crc32(data), len(out)
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 45, 0, 0, 0, 0, crc, 0xFFFFFFFF,
                           0xFFFFFFFF, len(name), 20)
        out += name + struct.pack("<HHQQ", 1, 16, len(data), len(data)) + data
        extra = struct.pack("<HHQQQ", 1, 24, len(data), len(data), offset)
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45, 0, 0, 0, 0, crc,
                               0xFFFFFFFF, 0xFFFFFFFF, len(name), len(extra), 0, 0, 0, 0,
                               0xFFFFFFFF)
        central += name + extra
    cd_offset = len(out)
    out += central
    end64 = len(out)
    n = len(members)
    out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, len(central), cd_offset)
    out += struct.pack("<IIQI", 0x07064B50, 0, end64, 1)
    out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    return bytes(out)


def test_zip64_directory(cli, tmp_path):
    rng = np.random.default_rng(4)
    p, rr, g, ids = make_step(rng)
    (tmp_path / "z.npz").write_bytes(zip64_archive({
        "routing_4.npy": npy_bytes(ids), "lens_4.npy": npy_bytes(np.stack([p, rr], axis=1))}))
    with np.load(tmp_path / "z.npz") as z:          # numpy agrees it is a valid archive
        np.testing.assert_array_equal(z["routing_4"], ids)
    r = run(cli, "--npz", tmp_path / "z.npz", "--experts", 16, "--out", tmp_path / "z.rpt")
    assert r.returncode == 0, r.stderr
    check_trace(tmp_path / "z.rpt", [(p, rr, g, ids)], [4])
