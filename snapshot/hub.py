"""A Hugging Face hub id as the model to build (`warmstart build ORG/NAME`, `serve ORG/NAME`), as vLLM takes one.

The files come through huggingface_hub, so its configuration holds: the cache under HF_HOME (or HF_HUB_CACHE), a
token from HF_TOKEN or `hf auth login` for gated and private models, HF_ENDPOINT for a mirror, HF_HUB_OFFLINE to
use the cache alone. Only what a build reads is fetched (config, safetensors weights, tokenizer and generation
files). The revision the files come from (the commit, whatever branch or tag was asked for) is returned for the
manifest's provenance. A revision given as a full commit hash is read from the cache without asking the hub when
it is there: a commit never changes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# what a build reads (snapshot/build.py, runtime/tokenizer.py): no *.bin, no ONNX, GGUF or other formats
BUILD_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.json",
               "chat_template.jinja")
# The hub's rule for a repo id: one namespace and one name of letters, digits, '-', '_', '.', no '--' or '..'
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_COMMIT = re.compile(r"[0-9a-f]{40}")


class HubError(Exception):
    """The hub id could not be resolved; the message is one sentence: what was wrong and what to do."""


@dataclass(frozen=True)
class HubModel:
    repo_id: str
    revision: str  # the commit the files are from
    path: Path  # the model directory in the local cache

    def provenance(self) -> dict[str, str]:
        return {"hub_id": self.repo_id, "revision": self.revision}


def is_hub_id(ref: str) -> bool:
    """Whether ``ref`` has the form of a hub id (ORG/NAME); a path that exists is a path, not an id."""
    return bool(_HUB_ID.fullmatch(ref)) and "--" not in ref and ".." not in ref and not Path(ref).exists()


def resolve(repo_id: str, revision: str | None = None) -> HubModel:
    """The model's files in the local cache, downloaded first where the hub has newer ones (progress on stderr)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{repo_id}@{revision}" if revision else repo_id
    local_first = revision is not None and bool(_COMMIT.fullmatch(revision))
    try:
        try:
            path = snapshot_download(repo_id, revision=revision, allow_patterns=list(BUILD_FILES),
                                     local_files_only=local_first or constants.HF_HUB_OFFLINE)
        except LocalEntryNotFoundError:
            if not local_first or constants.HF_HUB_OFFLINE:
                raise
            path = snapshot_download(repo_id, revision=revision, allow_patterns=list(BUILD_FILES))
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub cannot be reached"
        raise HubError(f"{at} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}: download it "
                       f"where the hub is reachable (`hf download {repo_id}`, with the same HF_HOME), or give a local "
                       "model directory") from None
    except GatedRepoError:
        raise HubError(f"{repo_id} is gated: accept its terms on https://huggingface.co/{repo_id}, then set HF_TOKEN "
                       "to a token of that account (or run `hf auth login`)") from None
    except RevisionNotFoundError:
        raise HubError(f"{repo_id} has no revision {revision!r}; give a branch, a tag or a commit hash of it") from None
    except RepositoryNotFoundError:
        raise HubError(f"no model {repo_id!r} on the hub (check the id; a private model needs HF_TOKEN)") from None
    except HfHubHTTPError as e:
        raise HubError(f"the hub refused {at}: {str(e).splitlines()[0]}") from None
    local = Path(path)
    return HubModel(repo_id, local.name, local)  # the cache keeps each commit's files under snapshots/<commit>/
