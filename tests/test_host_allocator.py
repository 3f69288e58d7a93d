"""The CPU profile's allocator preset: freed memory is kept for the next step, and run.json says so."""

import ctypes.util
import json
import subprocess
import sys

import pytest

from ferry.platform.hardware import load_profile
from ferry.train import train

GLIBC = ctypes.util.find_library("c") is not None and hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallopt")


def test_the_cpu_profile_keeps_freed_memory_and_accelerator_profiles_do_not():
    assert load_profile("cpu").host_allocator == "keep_freed"
    assert load_profile("h200").host_allocator == "default"


# A fresh process frees a 64 MiB tensor (above glibc's largest mmap threshold) under `preset` and prints how many
# bytes its heap took from the system for it and kept after the free (glibc's mallinfo2 `arena`). Counted as free
# heap bytes (`fordblks`) instead, a few KiB of them may already be in use again by small allocations in between.
KEPT_AFTER_FREE = """
import ctypes, sys, torch
from ferry.platform.allocator import apply_host_allocator

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
apply_host_allocator(sys.argv[1])
heap_before = libc.mallinfo2().arena
buffer = torch.ones(16 * 2**20)
del buffer
print(libc.mallinfo2().arena - heap_before)
"""


@pytest.mark.skipif(not GLIBC, reason="the preset is a glibc setting")
def test_with_the_preset_a_freed_large_buffer_stays_in_the_process():
    kept = {
        preset: int(
            subprocess.run(
                [sys.executable, "-c", KEPT_AFTER_FREE, preset], check=True, capture_output=True, text=True
            ).stdout
        )
        for preset in ("default", "keep_freed")
    }
    buffer_bytes = 64 * 2**20
    assert kept["default"] < buffer_bytes // 2  # unmapped on free: the next step maps and faults it afresh
    assert kept["keep_freed"] >= buffer_bytes


@pytest.mark.skipif(not GLIBC, reason="the preset is a glibc setting")
def test_run_json_records_the_preset_and_a_run_may_keep_the_c_librarys_default(make_config, tmp_path):
    train(make_config("train.steps=2", run_dir=tmp_path / "preset"))
    recorded = json.loads((tmp_path / "preset" / "run.json").read_text())["hardware"]["host_allocator"]
    assert recorded["preset"] == "keep_freed" and recorded["applied"]
    assert recorded["mallopt"] == {"M_MMAP_MAX": 0, "M_TRIM_THRESHOLD": 2**31 - 1}
    train(make_config("train.steps=2", "run.host_allocator=default", run_dir=tmp_path / "default"))
    recorded = json.loads((tmp_path / "default" / "run.json").read_text())["hardware"]["host_allocator"]
    assert recorded == {"preset": "default", "applied": False}
