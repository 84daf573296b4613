"""Hugging Face hub ids as --model (`Qwen/Qwen3-0.6B`), resolved as vLLM does: through
huggingface_hub's own cache and settings (HF_HOME / HF_HUB_CACHE, HF_ENDPOINT,
HF_TOKEN, HF_HUB_OFFLINE), at a --revision (a branch, tag or commit; default main).

Only what kvserve reads is fetched: the config, safetensors weights, tokenizer and
chat-template files (no PyTorch .bin or other formats). Offline, or with the hub out
of reach, a snapshot already in the cache is served; without one the error says
which repository and revision are missing, where the cache is, and how to fill it."""
from __future__ import annotations

import os
import re
from pathlib import Path

from kvserve.modelstore.errors import ModelLoadError

# org/name, as the hub spells repository ids (no path of this shape exists here).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")
# What a model directory needs here: config, weights, tokenizer and template files.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def is_hub_id(model: str) -> bool:
    """A string shaped like org/name that names no local file or directory."""
    model = str(model)
    return (bool(_HUB_ID.match(model)) and not model.endswith(".gguf")
            and not os.path.exists(model))


def fetch(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot directory of repo_id at `revision`, downloaded into the hub cache
    where it is not there already. Raises ModelLoadError, with what is missing."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    at = f"{repo_id} at revision {revision or 'main'}"
    try:
        path = Path(snapshot_download(repo_id, revision=revision,
                                      allow_patterns=ALLOW_PATTERNS))
    except LocalEntryNotFoundError:
        raise ModelLoadError(_not_cached(at)) from None
    except GatedRepoError:
        raise ModelLoadError(f"{repo_id} is gated on the hub: accept its terms there and "
                             "set HF_TOKEN") from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"the hub has no revision {revision!r} of {repo_id}") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(f"no repository {repo_id} on the hub ({_endpoint()}), or it "
                             "is private: set HF_TOKEN") from None
    except OSError as exc:  # disk full, a cache directory we may not write
        raise ModelLoadError(f"cannot fetch {at} into {_cache_dir()}: {exc}") from None
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{at} has no config.json: not a transformers model "
                             "repository kvserve can serve")
    return path


def _not_cached(at: str) -> str:
    from huggingface_hub import constants

    why = ("HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE
           else f"the hub ({_endpoint()}) could not be reached")
    return (f"{at} is not in the Hugging Face cache ({_cache_dir()}) and {why}: "
            "download it where the hub is reachable (hf download REPO --revision REV, "
            "with the same HF_HOME / HF_HUB_CACHE), or pass a local model directory")


def _cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT
