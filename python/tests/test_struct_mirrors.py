"""The binding's ctypes mirrors of the C structs (routepack/_lib.py, executor.py,
distributed.py) against the library they load: each has the size the library gives
(rp_struct_size), so none lacks a field the headers appended after it was written; and
the fields at the end of the config structs read back what the config says (a bool
appended after the last one would not change the size)."""

import ctypes
import inspect
import json

import pytest

import routepack
from routepack import _lib, distributed, executor

from conftest import SMALL_CONFIG

MIRRORS = sorted(
    (name, cls)
    for mod in (_lib, executor, distributed)
    for name, cls in inspect.getmembers(mod, inspect.isclass)
    if name.startswith("rp_") and issubclass(cls, ctypes.Structure))


def test_the_mirrors_are_found():
    names = {name for name, _ in MIRRORS}
    assert {"rp_execution", "rp_trainer", "rp_topology", "rp_step_report", "rp_comm",
            "rp_migration_options"} <= names


@pytest.mark.parametrize("name,cls", MIRRORS, ids=[name for name, _ in MIRRORS])
def test_mirror_size_equals_the_library(name, cls):
    size = _lib.load().rp_struct_size(name.encode())
    assert size > 0, f"libroutepack does not know {name}"
    if name == "rp_sched_options":
        # only passed by pointer and filled by rp_sched_options_default: every field,
        # then a reserved tail for fields a newer library appends
        assert cls._reserved.offset == size
    else:
        assert ctypes.sizeof(cls) == size, (
            f"{name}: the mirror has {ctypes.sizeof(cls)} bytes, the C struct {size}: "
            f"mirror every field of core/include/routepack")


def test_unknown_struct_has_no_size():
    lib = _lib.load()
    assert lib.rp_struct_size(b"rp_no_such_struct") == 0
    assert lib.rp_struct_size(None) == 0


@pytest.mark.parametrize("balancer", [True, False])
def test_config_tail_fields_read_back(tmp_path, balancer):
    cfg = json.loads(SMALL_CONFIG.read_text())
    cfg["execution"] = {"per_forward_balancing": "virtual_experts" if balancer else "none",
                        "combine_bytes_per_element": 1}
    cfg["trainer"] = {"nonempty_microbatches": True, "per_forward_balancer": balancer,
                      "microbatch_multiple": 2}
    path = tmp_path / "tail.json"
    path.write_text(json.dumps(cfg))
    with routepack.Scheduler(str(path)) as s:
        lib = _lib.load()
        x = lib.rp_config_execution(s.config.handle).contents
        assert (x.per_forward_balancing, x.combine_bytes_per_element) == (int(balancer), 1)
        t = lib.rp_config_trainer(s.config.handle).contents
        assert (t.nonempty_microbatches, t.per_forward_balancer, t.microbatch_multiple) == (True, balancer, 2)
        assert s.config.per_forward_balancer is balancer
