"""GGUF repos on the Hugging Face Hub as model names, offline: the test builds an HF cache holding a GGUF repo (two
quantizations and a vision projector, each a link to the bundled model's file) and checks which file
``org/name``, ``org/name:QUANT`` and ``gguf_file=`` pick, that nothing is downloaded, and that ``LLM`` loads it."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub
import pytest

from leapdecode import LLM, SamplingParams
from leapdecode.models.hub import display_name, is_repo_id, model_ref, pick_gguf, snapshot_path, split_ref
from leapdecode.models.loader import bundled_model_path
from leapdecode.server.serving import default_model_name

REPO = "tiny-org/SmolLM2-GGUF"
REV = "89abcdef0123456789abcdef0123456789abcdef"
FILES = ["smollm2-135m-instruct-Q4_K_M.gguf", "smollm2-135m-instruct-q8_0.gguf", "mmproj-smollm2-f16.gguf"]


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("hf_gguf_cache")
    repo = cache / ("models--" + REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / REV
    snapshot.mkdir(parents=True)
    for name in FILES:
        (snapshot / name).symlink_to(bundled_model_path())
    (snapshot / "README.md").write_text("a GGUF repo\n")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    return cache


@pytest.fixture
def offline(gguf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # huggingface_hub reads HF_HUB_CACHE / HF_HUB_OFFLINE once, at import: set what it read
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(gguf_cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def no_network(*args, **kwargs):
        raise AssertionError("the test tried to reach the Hub")

    monkeypatch.setattr(huggingface_hub, "list_repo_files", no_network)
    return gguf_cache / ("models--" + REPO.replace("/", "--")) / "snapshots" / REV


def test_references() -> None:
    assert is_repo_id("org/name:Q4_K_M") and is_repo_id("org/name@v1:model.Q8_0.gguf")
    assert split_ref("org/name@v1:Q4_K_M") == ("org/name", "v1", "Q4_K_M")
    assert model_ref("org/name", revision="v1", gguf_file="m.gguf") == "org/name@v1:m.gguf"
    assert display_name("org/name@v1:Q4_K_M") == "org/name:Q4_K_M"
    for bad in ({"gguf_file": "weights.bin"}, {"gguf_file": "../x.gguf"}):
        with pytest.raises(ValueError):
            model_ref("org/name", **bad)
    with pytest.raises(ValueError, match="conflict|names"):
        model_ref("org/name:Q4_K_M", gguf_file="other.gguf")


def test_pick_gguf() -> None:
    assert pick_gguf(FILES, None, REPO) == FILES[0]  # no tag: llama.cpp's default, Q4_K_M
    assert pick_gguf(FILES, "Q8_0", REPO) == FILES[1]  # case-insensitive
    assert pick_gguf(FILES, "q4_k_m", REPO) == FILES[0]
    assert pick_gguf(["only.Q5_K_S.gguf", "mmproj.gguf"], None, REPO) == "only.Q5_K_S.gguf"
    assert pick_gguf(FILES, FILES[1], REPO) == FILES[1]
    with pytest.raises(FileNotFoundError, match="Q2_K.*smollm2-135m-instruct-q8_0.gguf"):
        pick_gguf(FILES, "Q2_K", REPO)
    with pytest.raises(FileNotFoundError, match="does not pick one"):
        pick_gguf(["a.Q8_0.gguf", "b.Q6_K.gguf"], None, REPO)  # no default among them
    with pytest.raises(ValueError, match="split"):
        pick_gguf(["m-Q4_K_M-00001-of-00002.gguf", "m-Q4_K_M-00002-of-00002.gguf"], "Q4_K_M", REPO)
    with pytest.raises(FileNotFoundError, match="no file"):
        pick_gguf(FILES, "missing.gguf", REPO)


def test_offline_cache_resolution(offline: Path) -> None:
    assert snapshot_path(REPO) == offline / FILES[0]
    assert snapshot_path(f"{REPO}:Q8_0") == offline / FILES[1]
    assert snapshot_path(model_ref(REPO, gguf_file=FILES[1])) == offline / FILES[1]
    assert snapshot_path(f"{REPO}@{REV}:Q8_0") == offline / FILES[1]
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        snapshot_path("tiny-org/not-downloaded:Q4_K_M")
    with pytest.raises(FileNotFoundError, match="Q3_K_L"):
        snapshot_path(f"{REPO}:Q3_K_L")


@pytest.mark.slow
def test_llm_loads_a_gguf_repo(offline: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6)
    llm = LLM(f"{REPO}:Q8_0", kv_cache_blocks=32)
    assert llm.engine.model_path == offline / FILES[1]
    assert default_model_name(llm.engine) == f"{REPO}:Q8_0"
    want = LLM(kv_cache_blocks=32).generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids == want
    assert LLM(REPO, gguf_file=FILES[0], kv_cache_blocks=32).engine.model_path == offline / FILES[0]
