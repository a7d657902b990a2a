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


MiB = 1 << 20


def test_a_pool_block_is_handed_out_again_only_once_no_tensor_view_or_saved_tensor_holds_it():
    import torch

    pool = heap.BlockPool(keep=4)
    first = pool.empty((4, MiB), torch.float32)  # 16 MiB: a block of 18 (1/8 headroom, 2 MiB pages)
    assert first.shape == (4, MiB) and first.dtype == torch.float32 and first.is_contiguous()
    assert first.untyped_storage().nbytes() == 18 * MiB and pool.stats == {"reused": 0, "new": 1, "unpooled": 0}
    address = first.data_ptr()
    row = first[2]
    del first
    assert pool.free_blocks() == 0  # a view of it is alive
    second = pool.empty((4, MiB), torch.float32)
    assert second.data_ptr() != address and pool.stats["new"] == 2
    del row
    assert pool.free_blocks() == 1
    third = pool.empty((4, MiB - 8), torch.float32)  # a batch padded a little shorter fits the same block
    assert third.data_ptr() == address and pool.stats["reused"] == 1
    # a tensor autograd saved for backward holds its block until the graph is gone
    third.fill_(0.5)
    weight = torch.ones(MiB - 8, requires_grad=True)
    loss = (third * weight).sum()
    del third, second
    assert pool.free_blocks() == 1  # second's block only
    loss.backward()
    assert torch.equal(weight.grad, torch.full((MiB - 8,), 2.0))  # the saved tensor was never overwritten
    del loss
    assert pool.free_blocks() == 2


def test_a_pool_keeps_at_most_its_blocks_evicting_the_least_recently_used_free_one():
    import torch

    pool = heap.BlockPool(keep=2)
    a, b = pool.empty((MiB,), torch.uint8), pool.empty((3 * MiB,), torch.uint8)  # blocks of 2 and 4 MiB
    held = pool.empty((MiB,), torch.uint8)  # both kept blocks in use: plain memory, not kept
    assert pool.stats == {"reused": 0, "new": 2, "unpooled": 1} and len(pool._blocks) == 2
    a_address, b_address = a.data_ptr(), b.data_ptr()
    del a, b, held
    assert pool.empty((1536 * 1024,), torch.uint8).data_ptr() == a_address  # the smallest block that fits
    assert pool.empty((3 * MiB,), torch.uint8).data_ptr() == b_address
    # a block never serves a request under half its size; the new block, the pool being full, evicts the least
    # recently used free one
    full = heap.BlockPool(keep=2)
    first, second = full.empty((8 * MiB,), torch.uint8), full.empty((9 * MiB,), torch.uint8)  # 10 and 12 MiB
    del first, second
    small = full.empty((MiB,), torch.uint8)
    assert full.stats["new"] == 3 and [block.nbytes() for block in full._blocks] == [12 * MiB, 2 * MiB]
    # a request larger than every free block drops those, even with room to spare
    roomy = heap.BlockPool(keep=8)
    kept = [roomy.empty((n * MiB,), torch.uint8) for n in (1, 3, 9)]  # blocks of 2, 4 and 12 MiB
    held = kept[1]
    del kept
    roomy.empty((5 * MiB,), torch.uint8)
    assert sorted(block.nbytes() for block in roomy._blocks) == [4 * MiB, 6 * MiB, 12 * MiB]  # 4 is in use
    del small, held
    pool.clear()
    assert pool.free_blocks() == 0 and pool._blocks == []


def test_large_cpu_batches_come_from_the_process_pool_and_the_switch_turns_it_off(monkeypatch):
    import torch

    heap.BATCHES.clear()
    big = heap.empty_reused((2, 16 * MiB), torch.float32, "cpu")  # 128 MiB
    assert any(block.data_ptr() == big.data_ptr() for block in heap.BATCHES._blocks)
    address = big.data_ptr()
    del big
    assert heap.empty_reused((2, 16 * MiB), torch.bfloat16, torch.device("cpu")).data_ptr() != address  # 64 MiB
    assert heap.empty_reused((4, 16 * MiB), torch.bfloat16, "cpu").data_ptr() == address  # 128 MiB again
    # small tensors and other devices are plain torch.empty
    before = len(heap.BATCHES._blocks)
    assert heap.empty_reused((MiB,), torch.float32, "cpu").shape == (MiB,)
    assert heap.empty_reused((2, 16 * MiB), torch.float32, "meta").device.type == "meta"
    assert len(heap.BATCHES._blocks) == before
    monkeypatch.setenv("SPECFORGE_BATCH_REUSE", "off")
    assert heap.empty_reused((2, 16 * MiB), torch.float32, "cpu").shape == (2, 16 * MiB)
    assert len(heap.BATCHES._blocks) == before
    monkeypatch.setenv("SPECFORGE_BATCH_REUSE", "of")
    with pytest.raises(ValueError, match=r"SPECFORGE_BATCH_REUSE='of': expected on or off, or unset"):
        heap.empty_reused((2, 16 * MiB), torch.float32, "cpu")
    heap.BATCHES.clear()


def test_pad_right_over_a_reused_batch_writes_every_row_and_pad_afresh():
    import torch

    from specforge_core.data.collate import pad_right

    heap.BATCHES.clear()
    full = [torch.full((2048, 4096), 7.0, dtype=torch.bfloat16) for _ in range(4)]  # a 64 MiB batch of 7s
    first = pad_right(full)
    address = first.data_ptr()
    del first
    second = pad_right([torch.ones(2048, 4096, dtype=torch.bfloat16), torch.ones(5, 4096, dtype=torch.bfloat16),
                        torch.full((1900, 4096), 2.0, dtype=torch.bfloat16), torch.ones(0, 4096, dtype=torch.bfloat16)])
    assert second.data_ptr() == address and second.shape == (4, 2048, 4096)
    assert second[0].eq(1).all() and second[1, :5].eq(1).all() and second[1, 5:].eq(0).all()
    assert second[2, :1900].eq(2).all() and second[2, 1900:].eq(0).all() and second[3].eq(0).all()
    heap.BATCHES.clear()
