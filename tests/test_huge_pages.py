"""huge_pages: tensors moved onto 2 MB pages keep their identity and values, and the memory really is advised
where the OS offers transparent huge pages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from leapdecode import huge_pages


def _thp_mode() -> str:
    p = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not p.exists():
        return "absent"
    return p.read_text().split("[")[1].split("]")[0]


def _huge_kb_at(ptr: int) -> int:
    """AnonHugePages of the mapping holding address ``ptr`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_gather_keeps_each_tensors_identity_and_values() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(600_000, generator=g)  # with b, past one huge page
    b = torch.randint(0, 255, (70_000, 3), dtype=torch.uint8, generator=g)
    small = torch.randn(10)
    view = torch.randn(100_000, 2)[:, 0]  # not contiguous: left alone
    before = [t.clone() for t in (a, b, small, view)]
    ptrs = [t.data_ptr() for t in (a, b, small, view)]
    moved = huge_pages.gather([a, b, a, small, view])
    if not huge_pages.AVAILABLE:
        assert moved == 0
        return
    assert moved == a.numel() * 4 + b.numel()  # a once, b; not the small one nor the strided view
    for t, ref in zip((a, b, small, view), before):
        assert torch.equal(t, ref)
    assert a.data_ptr() != ptrs[0] and b.data_ptr() != ptrs[1]
    assert small.data_ptr() == ptrs[2] and view.data_ptr() == ptrs[3]
    assert a.data_ptr() % huge_pages.HUGE_PAGE == 0 and (b.data_ptr() - a.data_ptr()) % huge_pages.ALIGN == 0
    a.add_(1)  # still an ordinary, writable tensor
    assert torch.equal(a, before[0] + 1)


def test_empty_is_aligned_and_zeros_is_zero() -> None:
    t = huge_pages.zeros((3, 1 << 19), torch.float32)
    assert t.shape == (3, 1 << 19) and t.dtype == torch.float32 and not t.any()
    if huge_pages.AVAILABLE:
        assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert huge_pages.empty((5,), torch.int64).shape == (5,)  # small: a plain tensor


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="no transparent huge pages on this system")
def test_advised_memory_is_backed_by_huge_pages() -> None:
    t = huge_pages.zeros((16 << 20,), torch.uint8)  # 16 MB, touched by the fill
    assert _huge_kb_at(t.data_ptr()) >= 2048  # at least one 2 MB page (the kernel may be short of free ones)


def test_a_module_is_gathered_once() -> None:
    """Engines that share one model (LLM.from_engine_of) each pack it: its weights move to huge pages the first
    time only, and stay where they are after."""
    lin = torch.nn.Linear(1024, 1024, bias=False).requires_grad_(False)
    lin.packed = torch.randn(700_000)  # a plain tensor attribute, as the kernels' packed weights are
    ptr = lin.packed.data_ptr()
    first = huge_pages.gather_module(lin)
    moved_to = lin.packed.data_ptr()
    assert huge_pages.gather_module(lin) == 0 and lin.packed.data_ptr() == moved_to
    if huge_pages.AVAILABLE:
        assert first == 700_000 * 4 + 1024 * 1024 * 4 and moved_to != ptr

