"""The pieces of ``make wheel-check`` (scripts/wheel_check.sh: wheel -> fresh venv -> serve -> ask) that run in
seconds: the wheel holds what an installed leapdecode needs (the kernels' C++ sources and headers, the shipped
artifacts, the ``leapdecode`` command, every dependency the code imports), and scripts/serve_check.sh, the script's
last step, passes against a live server and fails, naming the step, where there is none."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from leapdecode import LLM
from leapdecode.server.api_server import build_app
from tests.server_helpers import live_server

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"


def test_scripts_parse() -> None:
    for name in ("wheel_check.sh", "serve_check.sh"):
        subprocess.run(["sh", "-n", str(SCRIPTS / name)], check=True)


@pytest.mark.slow
def test_the_wheel_holds_what_an_install_needs(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a copy: setuptools writes build/ and *.egg-info into the tree it builds
    shutil.copytree(ROOT / "leapdecode", src / "leapdecode", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, timeout=300)
    [wheel] = (tmp_path / "dist").glob("leapdecode-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {p.name for p in (ROOT / "leapdecode" / "kernels").iterdir() if p.suffix in (".cpp", ".h")}
    assert sources and {f"leapdecode/kernels/{n}" for n in sources} <= names
    shipped = {str(p.relative_to(ROOT)) for p in (ROOT / "leapdecode" / "artifacts").rglob("*") if p.is_file()
               and "__pycache__" not in p.parts}
    assert shipped <= names
    assert "leapdecode/server/routes/responses.py" in names and not any(n.startswith("tests/") for n in names)
    meta = zipfile.ZipFile(wheel)
    info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "leapdecode = leapdecode.cli:main" in meta.read(info).decode()
    requires = meta.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    for dist in ("torch", "fastapi", "uvicorn", "gguf", "huggingface-hub", "pyyaml", "prometheus-client"):
        assert f"Requires-Dist: {dist}" in requires, dist


def test_serve_check_passes_against_a_server_and_fails_without_one(tiny_model_dir, tmp_path: Path) -> None:
    llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=64)
    with live_server(build_app(llm)) as base:
        ok = subprocess.run(["sh", str(SCRIPTS / "serve_check.sh"), base], capture_output=True, text=True,
                            timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert '"kernels_built":true' in ok.stdout and ok.stdout.rstrip().endswith("serve check passed")
    gone = subprocess.run(["sh", str(SCRIPTS / "serve_check.sh"), base], capture_output=True, text=True,
                          timeout=120)
    assert gone.returncode != 0 and "FAILED: POST /v1/chat/completions" in gone.stdout
