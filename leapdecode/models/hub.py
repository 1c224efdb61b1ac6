"""Hugging Face repo ids (``org/name``) as model names: the local snapshot folder that ``huggingface_hub`` keeps.

Online, the snapshot is downloaded (or brought up to date) into the HF cache; with ``HF_HUB_OFFLINE=1`` the cached
snapshot is used as is. Only what an HF model folder needs is fetched (config, tokenizer, safetensors weights),
never the ``.bin``/``.gguf`` variants a repo may also carry.
"""

from __future__ import annotations

import re
from pathlib import Path

import huggingface_hub
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
)

# owner/name as the Hub spells them (letters, digits, '-', '_', '.'), optionally @revision
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")
SNAPSHOT_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def is_repo_id(model: str) -> bool:
    """Whether ``model`` has the shape of a Hub repo id (``org/name`` or ``org/name@revision``)."""
    return bool(_REPO_ID.fullmatch(model)) and ".." not in model


def snapshot_path(repo_id: str) -> Path:
    """The local folder of ``repo_id``'s snapshot (``org/name@revision`` picks a branch, tag or commit)."""
    repo, _, revision = repo_id.partition("@")
    try:
        folder = huggingface_hub.snapshot_download(repo, revision=revision or None, allow_patterns=SNAPSHOT_FILES)
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"{repo_id!r} is not in the local Hugging Face cache and the Hub cannot be reached (HF_HUB_OFFLINE=1 or "
            "no network); download it once online, or pass a local folder"
        ) from None
    except GatedRepoError:
        raise FileNotFoundError(
            f"{repo_id!r} is gated on the Hugging Face Hub: accept its terms there and set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{repo_id!r}: no such model repository on the Hugging Face Hub") from None
    except HfHubHTTPError as e:
        raise FileNotFoundError(f"could not download {repo_id!r} from the Hugging Face Hub: {e}") from None
    return Path(folder)
