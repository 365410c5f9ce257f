"""Regenerates the .npy fixtures of tests/test_npy.c and tests/test_cli_trace.c with
real NumPy (the tests never run Python): python3 make.py, in this folder."""
import numpy as np
from numpy.lib import format as npf

def save(name, arr, version=None):
    with open(name, "wb") as f:
        npf.write_array(f, arr, version=version, allow_pickle=True)

# every accepted integer dtype, extremes included, shape (2, 3), version 1.0
for t in ["i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8"]:
    info = np.iinfo(t)
    lo = info.min
    save(f"{t}.npy", np.array([lo, lo + 1 if lo == 0 else -1, 0, 1, 2, info.max], dtype="<" + t).reshape(2, 3))
save("v2.npy", np.arange(4, dtype="<i4"), version=(2, 0))
save("v3.npy", np.arange(4, dtype="<u2").reshape(2, 2), version=(3, 0))
save("scalar.npy", np.array(7, dtype="<i4"))
save("empty.npy", np.zeros((0, 3), dtype="<i8"))
# rejected
save("big_endian.npy", np.arange(6, dtype=">i4"))
save("fortran.npy", np.asfortranarray(np.arange(6, dtype="<i4").reshape(2, 3)))
save("float32.npy", np.arange(6, dtype="<f4"))
save("bool.npy", np.array([True, False]))
save("object.npy", np.array([1, "x"], dtype=object))
save("structured.npy", np.zeros(2, dtype=[("a", "<i4")]))
# a small routing replay as a trainer would dump it: 3 sequences, int64 ids
lens = np.array([[2, 1], [0, 0], [1, 1]], dtype="<i8")      # (prompt, response)
tokens = int(lens.sum())
routing = (np.arange(tokens * 2 * 2, dtype="<i8").reshape(tokens, 2, 2) * 7) % 64
save("routing_i8.npy", routing)
save("lens_pairs.npy", lens)
save("groups.npy", np.array([0, 0, 1], dtype="<i4"))
