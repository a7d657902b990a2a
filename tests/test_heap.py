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


# A large tensor made and written once, as a collate makes a batch: the page faults of writing it.
FILL = """
import json, resource, sys
import torch
from specforge_core.heap import advise_huge_pages
from specforge_core.data.collate import pad_right
torch.set_num_threads(1)
mode = sys.argv[1]
if mode == "pad":  # two samples of 4096-wide bf16 rows, 32 MiB each: the 64 MiB batch pad_right makes
    rows = [torch.ones(4096, 4096, dtype=torch.bfloat16), torch.ones(4088, 4096, dtype=torch.bfloat16)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    out = pad_right(rows)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(json.dumps({"faults": faults, "sum": float(out.sum(dtype=torch.float64)),
                      "tail": float(out[1, 4088:].abs().sum())}))
else:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    out = torch.empty(64 << 20, dtype=torch.uint8)
    advised = advise_huge_pages(out) if mode == "advise" else None
    out.fill_(1)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(json.dumps({"faults": faults, "advised": advised, "small": advise_huge_pages(torch.empty(1 << 20))}))
"""


def _transparent_huge_pages() -> str | None:
    """The kernel's transparent huge page mode (always, madvise or never), None where it has none."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
            return fh.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def fill(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", FILL, mode], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)
    return json.loads(out.stdout)


def most_faults(nbytes: int) -> int:
    """The page faults of writing an advised tensor of ``nbytes`` at most: one per 2 MiB, and small pages at
    either unaligned end (under 2 MiB each), with some to spare for the interpreter and the 1 MiB tensor."""
    small = 2 * (heap._HUGE_PAGE // os.sysconf("SC_PAGE_SIZE"))
    return nbytes // heap._HUGE_PAGE + small + 300


@pytest.mark.skipif(_transparent_huge_pages() != "madvise", reason="transparent huge pages on advice only")
def test_an_advised_large_tensor_faults_in_by_huge_pages_and_a_plain_one_by_small_ones():
    plain, advised, padded = fill("plain"), fill("advise"), fill("pad")
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert plain["faults"] > 0.9 * pages, plain  # every 4 KiB page on its own
    assert advised["advised"] is True and advised["small"] is False
    assert advised["faults"] < most_faults(64 << 20) < 0.1 * pages, advised
    # pad_right advises the batch it makes, and fills it as before
    assert padded["faults"] < most_faults(64 << 20), padded
    assert padded["sum"] == (4096 + 4088) * 4096 and padded["tail"] == 0.0


def test_huge_pages_are_advised_for_large_cpu_tensors_only():
    import torch

    assert heap.advise_huge_pages(torch.empty(1 << 20, dtype=torch.uint8)) is False  # under 32 MiB
    assert heap.advise_huge_pages(torch.empty(64 << 20, dtype=torch.uint8, device="meta")) is False
    if sys.platform.startswith("linux") and _transparent_huge_pages() is not None:
        assert heap.advise_huge_pages(torch.empty(64 << 20, dtype=torch.uint8)) is True


def test_huge_pages_advice_can_be_switched_off_and_a_misspelt_switch_is_refused(monkeypatch):
    import torch

    batch = torch.empty(64 << 20, dtype=torch.uint8)
    monkeypatch.setenv("SPECFORGE_HUGE_PAGES", "off")
    assert heap.advise_huge_pages(batch) is False
    monkeypatch.setenv("SPECFORGE_HUGE_PAGES", "yes")
    with pytest.raises(ValueError, match=r"SPECFORGE_HUGE_PAGES='yes': expected on or off, or unset"):
        heap.advise_huge_pages(batch)
    assert heap.advise_huge_pages(torch.empty(1 << 20, dtype=torch.uint8)) is False  # too small to look
    if sys.platform.startswith("linux") and _transparent_huge_pages() is not None:
        monkeypatch.setenv("SPECFORGE_HUGE_PAGES", " On ")
        assert heap.advise_huge_pages(batch) is True
