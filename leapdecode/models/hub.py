"""Hugging Face repo ids as model names: a safetensors repo's snapshot folder, or one GGUF file of a GGUF repo, as
``huggingface_hub`` keeps them in its cache.

A model reference is ``org/name``, optionally ``@revision`` (a branch, tag or commit) and ``:TAG``, where the tag
is a quantization (``org/name:Q4_K_M``, as llama.cpp's ``-hf`` and ollama take it) or a file name
(``org/name:model-q4_k_m.gguf``; :func:`model_ref` builds one from ``LLM(model, revision=..., gguf_file=...)``).

* A repo with ``config.json`` and no tag: its snapshot (config, tokenizer, safetensors weights), never the
  ``.bin``/``.gguf`` variants it may also carry.
* Otherwise its ``.gguf`` files: the tag picks one (the file whose name holds the quantization, case-insensitive);
  without a tag the repo's only file, else its Q4_K_M (llama.cpp's default), else an error listing the choices.
  Only the chosen file is downloaded (with a progress bar).

Online, the repo's file list comes from the Hub; with ``HF_HUB_OFFLINE=1`` (or no network) from the cached snapshot,
and nothing is downloaded: what is not in the cache is a clear error.
"""

from __future__ import annotations

import re
from pathlib import Path

import huggingface_hub
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
)

# owner/name as the Hub spells them (letters, digits, '-', '_', '.'), optionally @revision, optionally :tag
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?(:[\w./-]+)?")
SNAPSHOT_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
DEFAULT_QUANT = "Q4_K_M"
_NOT_WEIGHTS = ("mmproj",)  # vision projectors that GGUF repos ship beside the language model
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


def is_repo_id(model: str) -> bool:
    """Whether ``model`` has the shape of a Hub model reference (``org/name[@revision][:tag]``)."""
    return bool(_REPO_ID.fullmatch(model)) and ".." not in model


def split_ref(ref: str) -> tuple[str, str | None, str | None]:
    """``org/name[@revision][:tag]`` as ``(repo, revision, tag)``."""
    head, _, tag = ref.partition(":")
    repo, _, revision = head.partition("@")
    return repo, revision or None, tag or None


def model_ref(model: str, revision: str | None = None, gguf_file: str | None = None) -> str:
    """``model`` with a revision and a GGUF file name folded in (``ValueError`` when they conflict)."""
    if revision is None and gguf_file is None:
        return model
    if not is_repo_id(model):
        raise ValueError(f"revision and gguf_file are for Hugging Face repo ids (org/name); got model={model!r}")
    repo, rev, tag = split_ref(model)
    if revision is not None and rev is not None and revision != rev:
        raise ValueError(f"model {model!r} names revision {rev!r} but revision={revision!r}")
    if gguf_file is not None:
        if tag is not None and tag != gguf_file:
            raise ValueError(f"model {model!r} names {tag!r} but gguf_file={gguf_file!r}")
        if not gguf_file.endswith(".gguf") or ".." in gguf_file.split("/") or gguf_file.startswith("/"):
            raise ValueError(f"gguf_file must name a .gguf file of the repo, got {gguf_file!r}")
        tag = gguf_file
    ref = repo + (f"@{revision or rev}" if (revision or rev) else "")
    return ref + (f":{tag}" if tag else "")


def display_name(ref: str) -> str:
    """The served name of a reference: its repo id (no revision), with its tag when it has one."""
    repo, _, tag = split_ref(ref)
    return f"{repo}:{tag}" if tag else repo


def _errors(ref: str, e: Exception) -> FileNotFoundError:
    if isinstance(e, LocalEntryNotFoundError):
        return FileNotFoundError(
            f"{ref!r} is not in the local Hugging Face cache and the Hub cannot be reached (HF_HUB_OFFLINE=1 or "
            "no network); download it once online, or pass a local folder or .gguf file"
        )
    if isinstance(e, GatedRepoError):
        return FileNotFoundError(f"{ref!r} is gated on the Hugging Face Hub: accept its terms there and set HF_TOKEN")
    if isinstance(e, RepositoryNotFoundError):
        return FileNotFoundError(f"{ref!r}: no such model repository on the Hugging Face Hub")
    if isinstance(e, EntryNotFoundError):
        return FileNotFoundError(f"{ref!r}: no such file in the repository")
    return FileNotFoundError(f"could not download {ref!r} from the Hugging Face Hub: {e}")


_HUB_ERRORS = (LocalEntryNotFoundError, GatedRepoError, RepositoryNotFoundError, EntryNotFoundError, HfHubHTTPError)


def repo_files(repo: str, revision: str | None) -> list[str]:
    """The repo's files: the Hub's list online, the cached snapshot's offline (nothing is downloaded)."""
    if not hub_constants.HF_HUB_OFFLINE:  # read per call: the environment's value, or a test's
        try:
            return huggingface_hub.list_repo_files(repo, revision=revision)
        except (GatedRepoError, RepositoryNotFoundError):
            raise
        except (HfHubHTTPError, OSError):
            pass  # no network: what the cache holds
    folder = Path(huggingface_hub.snapshot_download(repo, revision=revision, local_files_only=True,
                                                    allow_patterns=["*.gguf", "config.json"]))
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() or p.is_symlink())


def pick_gguf(files: list[str], tag: str | None, ref: str) -> str:
    """The repo's GGUF file that ``tag`` (a quantization or a file name; None: the default) names."""
    ggufs = [f for f in files if f.endswith(".gguf") and not any(x in Path(f).name.lower() for x in _NOT_WEIGHTS)]
    if tag is not None and tag.endswith(".gguf"):
        if tag in files:
            return tag
        raise FileNotFoundError(f"{ref!r}: the repo has no file {tag!r} (its GGUF files: {', '.join(ggufs) or 'none'})")
    if tag is None and len(ggufs) == 1:
        chosen = ggufs
    else:
        quant = (tag or DEFAULT_QUANT).lower()
        pattern = re.compile(rf"(^|[-._]){re.escape(quant)}([-._]|$)")
        chosen = [f for f in ggufs if pattern.search(Path(f).name.lower().removesuffix(".gguf"))]
    if len(chosen) != 1 or _SPLIT.search(chosen[0] if chosen else ""):
        what = f"quantization {tag!r}" if tag else "a tag"
        if chosen and _SPLIT.search(chosen[0]):
            raise ValueError(f"{ref!r}: {chosen[0]} is one part of a split GGUF file, which leapdecode does not "
                             "load; merge the parts with llama.cpp's gguf-split --merge and pass the merged file")
        listing = ", ".join(Path(f).name for f in ggufs) or "none"
        raise FileNotFoundError(f"{ref!r}: {what} does not pick one GGUF file (the repo's GGUF files: {listing}); "
                                "name one with org/name:QUANT or gguf_file=")
    return chosen[0]


def snapshot_path(ref: str) -> Path:
    """The local path of ``ref``: a safetensors repo's snapshot folder, or the GGUF file the tag picks."""
    repo, revision, tag = split_ref(ref)
    try:
        files = repo_files(repo, revision)
        if tag is None and "config.json" in files:
            return Path(huggingface_hub.snapshot_download(repo, revision=revision, allow_patterns=SNAPSHOT_FILES))
        name = pick_gguf(files, tag, ref)
        return Path(huggingface_hub.hf_hub_download(repo, name, revision=revision))
    except _HUB_ERRORS as e:
        raise _errors(ref, e) from None
