"""bench/kernel_ab.py: the in-process A/B of two kernel builds (the baseline's build itself is too slow for the
suite: its parts are checked here with this checkout's build in both seats, and with a build that differs)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from leapdecode import LLM
from leapdecode.bench import kernel_ab
from leapdecode.engine.model_runner import ForwardResult
from leapdecode.kernels import extension

ext = extension.load_kernel()
needs_kernel = pytest.mark.skipif(ext is None, reason="no C++ toolchain to build the kernel")


def test_same_bits_names_the_largest_difference() -> None:
    a = [ForwardResult(torch.ones(2, 5), torch.zeros(2, 3))]
    assert kernel_ab.same_bits(a, [ForwardResult(torch.ones(2, 5), torch.zeros(2, 3))]) == "identical"
    b = [ForwardResult(torch.ones(2, 5), torch.full((2, 3), 0.25))]
    assert kernel_ab.same_bits(a, b) == "differ (max |diff| 0.25)"


def test_cycle_ratios_pair_each_cycles_halves() -> None:
    # two cycles of 2 steps each: the baseline 2x then 4x slower within its cycle, whatever the machine's level
    old, new = [2.0, 2.0, 40.0, 40.0], [1.0, 1.0, 10.0, 10.0]
    q1, q2, q3 = kernel_ab.cycle_ratios(old, new, every=2)
    assert q1 <= q2 <= q3 and q2 == pytest.approx(3.0) and {q1, q3} <= {1.5, 2.0, 4.0, 4.5}
    assert kernel_ab.cycle_ratios([3.0], [1.5], every=1) == (2.0, 2.0, 2.0)


def test_baseline_must_be_another_checkout(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="not a checkout"):
        kernel_ab.baseline_kernels(tmp_path)
    with pytest.raises(SystemExit, match="this checkout"):
        kernel_ab.baseline_kernels(Path(extension.__file__).parents[2])


@needs_kernel
def test_steps_alternate_between_the_builds_and_the_bits_are_compared(tiny_model_dir) -> None:
    llm = LLM(model=str(tiny_model_dir))
    kernels = {k: getattr(ext, k) for k in dir(ext) if not k.startswith("_")}
    calls: list[str] = []

    def counting(name: str) -> SimpleNamespace:  # this build's kernels, noting which seat ran each step
        def decoder_stack(*args):
            calls.append(name)
            return ext.decoder_stack(*args)

        return SimpleNamespace(**{**kernels, "decoder_stack": decoder_stack})

    before = extension.ext
    old, new, bits = kernel_ab.interleaved(llm, (counting("a"), counting("b")), rows=3, context=5, steps=8, every=2)
    assert extension.ext is before  # put back
    assert bits == "identical" and len(old) == len(new) == 4
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] * 3  # one step each for the bits, a warm-up round, 8 timed

    def off_by_one(*args):  # a build whose layers differ
        return ext.decoder_stack(*args) + 1.0

    odd = SimpleNamespace(**{**kernels, "decoder_stack": off_by_one})
    assert kernel_ab.interleaved(llm, (ext, odd), rows=2, context=5, steps=2, every=1)[2].startswith("differ")
