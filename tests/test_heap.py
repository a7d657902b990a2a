"""train.keep_heap: the C heap kept between steps, measured by the page faults a step's allocations take."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specforge_core import heap
from specforge_core.config import TrainOptions
from specforge_core.options import build_options

# A "step": twelve 4 MiB blocks malloc'd, written and freed (last first, so the heap's top can shrink as
# glibc's defaults shrink it), eight times; the page faults of each step. Straight from the C library
# (torch's CPU tensors come from the same malloc), so no other block sits between them.
STEPS = """
import ctypes, json, resource, sys
from specforge_core.heap import keep_heap
said = keep_heap(sys.argv[1] == "on")
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(4 << 20) for _ in range(12)]
    for block in blocks:
        ctypes.memset(block, 1, 4 << 20)
    for block in reversed(blocks):
        libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"said": said, "faults": faults}))
"""
PAGES = 12 * 4 * 2**20 // os.sysconf("SC_PAGE_SIZE")  # the pages one step writes


def run_steps(mode: str, **env: str) -> dict:
    environ = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, timeout=120,
                         env={**environ, "OMP_NUM_THREADS": "1", **env}, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(heap._glibc() is None, reason="the heap policy is glibc's")
def test_a_kept_heap_reuses_its_pages_where_the_default_faults_them_in_every_step():
    kept, default = run_steps("on"), run_steps("off")
    assert kept["said"] == "the heap kept between steps (blocks up to 32 MiB, trimmed above 1024 MiB free)"
    assert default["said"] == "the C library's default heap policy (train.keep_heap is off)"
    assert kept["faults"][0] >= 0.9 * PAGES  # the first step faults its pages in either way
    assert max(kept["faults"][1:]) < 0.02 * PAGES, kept  # later steps reuse its pages
    assert min(default["faults"][1:]) > 0.9 * PAGES, default  # glibc's defaults give them back every step


@pytest.mark.skipif(heap._glibc() is None, reason="the heap policy is glibc's")
def test_the_environments_malloc_settings_win_over_keep_heap():
    env = run_steps("on", MALLOC_TRIM_THRESHOLD_="131072")
    assert env["said"] == "the C library's heap as the environment sets it (MALLOC_TRIM_THRESHOLD_)"
    assert min(env["faults"][1:]) > 0.9 * PAGES  # not kept: what the variable asked for
    tunables = run_steps("on", GLIBC_TUNABLES="glibc.malloc.trim_threshold=131072")
    assert tunables["said"] == "the C library's heap as the environment sets it (GLIBC_TUNABLES)"


def test_other_c_libraries_keep_their_own_policy(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    for name in heap._USER_SETTINGS + ("GLIBC_TUNABLES",):
        monkeypatch.delenv(name, raising=False)
    assert heap._glibc() is None
    assert heap.keep_heap() == "the C library's default heap policy (not glibc)"


class _RefusingGlibc:
    """A fake glibc whose ``mallopt`` refuses every setting: this machine's glibc accepts both thresholds, so the
    refusal can only be staged."""

    def mallopt(self, param: int, value: int) -> int:
        return 0


def test_a_refused_threshold_is_reported_as_the_default_policy(monkeypatch):
    for name in heap._USER_SETTINGS + ("GLIBC_TUNABLES",):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(heap, "_glibc", _RefusingGlibc)
    assert heap.keep_heap() == "the C library's default heap policy (glibc refused the thresholds)"


def test_keep_heap_is_a_train_option_on_by_default():
    assert build_options(TrainOptions, {}, section="train").keep_heap is True
    assert build_options(TrainOptions, {"keep_heap": False}, section="train").keep_heap is False
