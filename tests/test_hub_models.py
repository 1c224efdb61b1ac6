"""Hugging Face repo ids as model names, offline: the test builds an HF cache (models--org--name/snapshots/<rev>,
refs/main) holding a tiny model, and ``LLM("org/name")`` / ``leapdecode serve --model org/name`` load from it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import huggingface_hub
import pytest

from leapdecode import LLM, SamplingParams
from leapdecode.models.hub import is_repo_id
from leapdecode.server.api_server import build_app

REPO = "tiny-org/tiny-llama"
REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("hf_cache")
    repo = cache / ("models--" + REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / REV
    snapshot.mkdir(parents=True)
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    return cache


@pytest.fixture
def offline(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # huggingface_hub reads HF_HUB_CACHE / HF_HUB_OFFLINE once, at import: set what it read
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return hub_cache


def test_repo_id_shapes() -> None:
    for ok in ("org/name", "HuggingFaceTB/SmolLM2-135M-Instruct", "a/b@main", "org/name.v2"):
        assert is_repo_id(ok), ok
    for bad in ("name", "/abs/path", "a/b/c", "./x", "../a/b", "org/", "a b/c"):
        assert not is_repo_id(bad), bad


def test_llm_loads_a_repo_id_from_the_offline_cache(offline: Path, tiny_model_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6)
    llm = LLM(model=REPO, kv_cache_blocks=32)
    assert llm.engine.model_path == offline / f"models--{REPO.replace('/', '--')}" / "snapshots" / REV
    want = LLM(model=str(tiny_model_dir), kv_cache_blocks=32).generate("Hello", params, use_tqdm=False)
    assert llm.generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert build_app(llm).state.model_name == REPO  # served under the repo id, not the snapshot's hash
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        LLM(model="tiny-org/not-downloaded")


def test_serve_model_repo_id_offline(hub_cache: Path) -> None:
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "leapdecode.cli", "serve", "--model", REPO, "--port", "0",
           "--kv-cache-blocks", "16", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        url = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert url, line
        models: Any = httpx.get(url.group(0) + "/v1/models", trust_env=False, timeout=60).json()
        assert [m["id"] for m in models["data"]] == [REPO]
        r = httpx.post(url.group(0) + "/v1/completions", json={"model": REPO, "prompt": "Hi", "max_tokens": 2},
                       trust_env=False, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        proc.terminate()
        proc.wait(30)
