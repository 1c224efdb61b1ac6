"""The kernel plan: which path each module of a model takes, decided in one place, then applied."""

from __future__ import annotations

import pytest

from leapdecode.kernels import extension
from leapdecode.models import kernel_plan
from leapdecode.models.llama import MLP, Attention, DecoderLayer, RMSNorm
from leapdecode.models.loader import load_model

needs_kernel = pytest.mark.skipif(extension.load_kernel() is None, reason="no C++ toolchain to build the kernel")


@needs_kernel
def test_plan_names_every_path_and_apply_follows_it(tiny_model_dir) -> None:
    model, _ = load_model(tiny_model_dir)
    plan = kernel_plan.plan_kernels(model)
    layers = [n for n, m in model.named_modules() if isinstance(m, DecoderLayer)]
    assert layers and plan.fused_layers == tuple(layers)  # every projection packable: every layer fused
    assert set(plan.op_kernels) == {n for n, m in model.named_modules() if isinstance(m, (RMSNorm, Attention, MLP))}
    assert set(plan.packed.values()) == {"panels"} and "lm_head" in plan.packed  # float weights of an HF folder
    assert not any("embed" in n for n in plan.packed)  # an embedding looks rows up
    assert all(not getattr(m, "use_kernel", False) for m in model.modules())  # planning changes nothing
    assert kernel_plan.apply_plan(model, plan) == len(plan.packed)
    modules = dict(model.named_modules())
    assert all(modules[n].packed is not None for n in plan.packed)
    assert all(modules[n].use_kernel for n in (*plan.op_kernels, *plan.fused_layers))
    assert "fused decoder layers" in plan.summary() and kernel_plan.apply_plan(model, plan) == len(plan.packed)


@needs_kernel
def test_a_layer_with_an_unpackable_projection_runs_op_by_op(tiny_model_dir) -> None:
    model, _ = load_model(tiny_model_dir)
    first = next(m for m in model.modules() if isinstance(m, DecoderLayer))
    first.mlp.down_proj.weight.data = first.mlp.down_proj.weight.data.double()  # not a float32 weight
    plan = kernel_plan.plan_kernels(model)
    name = next(n for n, m in model.named_modules() if m is first)
    assert f"{name}.mlp.down_proj" not in plan.packed and name not in plan.fused_layers
    assert len(plan.fused_layers) == sum(isinstance(m, DecoderLayer) for m in model.modules()) - 1
    kernel_plan.apply_plan(model, plan)
    assert not first.use_kernel and first.mlp.down_proj.packed is None


def test_without_the_kernel_nothing_is_planned(tiny_model_dir, monkeypatch) -> None:
    monkeypatch.setattr(extension, "load_kernel", lambda required=False: None)
    model, _ = load_model(tiny_model_dir)
    assert kernel_plan.use_kernels(model) == 0
    assert all(getattr(m, "packed", None) is None for m in model.modules())
