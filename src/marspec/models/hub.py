"""Models named by Hugging Face Hub id (``ORG/NAME``), resolved through ``huggingface_hub`` to a snapshot
folder in the user's Hugging Face cache.

Everything about where and whether to download is huggingface_hub's, read from the environment when it
is imported, so marspec behaves as any Hugging Face tool does: ``HF_HOME`` / ``HF_HUB_CACHE`` (where
snapshots live), ``HF_HUB_OFFLINE=1`` (never reach the network: use what is cached), ``HF_TOKEN`` or
``hf auth login`` (gated and private models), ``HF_ENDPOINT`` (a mirror). Online, a snapshot is checked
against the Hub and the missing files are downloaded with huggingface_hub's progress bars; offline, the
cached snapshot of the ``main`` revision is used.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from marspec.errors import MarspecError, one_line

# One slash between two non-empty parts, no spaces. Narrower checks (allowed characters, "--", length)
# are huggingface_hub's own validator's, so its reason reaches the user.
_HUB_ID = re.compile(r"[^/\s]+/[^/\s]+")

# The files transformers loads a causal LM from: configurations, tokenizer files and safetensors weights,
# at the top of the repository. Repositories often also hold the same weights as GGUF, ONNX or PyTorch
# pickles, in sub-folders ("original/", "onnx/") or as Mistral's "consolidated" copy: gigabytes marspec
# would never read.
_ALLOW_SMALL = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja"]  # configurations and tokenizers
_ALLOW = [*_ALLOW_SMALL, "*.safetensors"]
_IGNORE = ["*/*", "consolidated*"]

# Snapshot folders resolved in this process, by (repo id, cache folder, with weights): a second load of
# the same id (the CLI fetches before its spinner, then loads) does not ask the Hub again.
_resolved: dict[tuple[str, str, bool], Path] = {}


def is_hub_id(text: str) -> bool:
    """Whether ``text`` has the form of a Hub id ``ORG/NAME`` (not a path: no leading ``.``, ``~`` or
    ``/``, one slash, no ``.gguf`` suffix). Whether it exists is the Hub's to say."""
    return (
        bool(_HUB_ID.fullmatch(text))
        and not text.startswith((".", "~"))
        and not text.lower().endswith(".gguf")
    )


def names_hub_model(name: str | os.PathLike[str]) -> bool:
    """Whether ``name`` is resolved on the Hub: a string (a ``Path`` object is always a path) of the form
    of a Hub id, and no local path of that name exists (a local folder wins, as in transformers)."""
    return isinstance(name, str) and is_hub_id(name) and not Path(name).expanduser().exists()


def hub_snapshot(repo_id: str, weights: bool = True) -> Path:
    """The local snapshot folder of Hub model ``repo_id`` (``ORG/NAME``), downloading what is missing
    unless ``HF_HUB_OFFLINE`` is set; any failure is a one-line :class:`MarspecError` saying what to do.
    ``weights=False`` fetches only its configuration and tokenizer files (to check a pair before
    downloading gigabytes)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    from marspec.version import __version__

    cache = constants.HF_HUB_CACHE
    key = (repo_id, os.fspath(cache), weights)
    if key in _resolved:
        return _resolved[key]
    page = f"{constants.ENDPOINT}/{repo_id}"
    login = "log in with `hf auth login` or set HF_TOKEN"
    try:
        folder = Path(
            snapshot_download(
                repo_id,
                allow_patterns=_ALLOW if weights else _ALLOW_SMALL,
                ignore_patterns=_IGNORE,
                library_name="marspec",
                library_version=__version__,
            )
        )
    except HFValidationError as exc:
        raise MarspecError(
            f"{repo_id!r} is not a valid Hugging Face Hub id ({one_line(exc)}): use ORG/NAME, e.g. "
            "Qwen/Qwen2.5-Coder-0.5B-Instruct, or a local folder"
        ) from None
    except GatedRepoError:
        raise MarspecError(
            f"Hub model {repo_id!r} is gated: accept its terms on {page}, then {login}"
        ) from None
    except RepositoryNotFoundError:
        raise MarspecError(
            f"Hub model {repo_id!r} does not exist or is private: check the id on {page}; for a private "
            f"model {login}"
        ) from None
    except LocalEntryNotFoundError as exc:
        if constants.HF_HUB_OFFLINE:
            raise MarspecError(
                f"Hub model {repo_id!r} is not (completely) in the Hugging Face cache {cache} and "
                "HF_HUB_OFFLINE is set: download it once with network access (unset HF_HUB_OFFLINE), "
                "point HF_HUB_CACHE at a cache that holds it, or pass a local model folder"
            ) from None
        cause = one_line(exc.__cause__ or exc)
        raise MarspecError(
            f"cannot reach the Hugging Face Hub for {repo_id!r} ({cause}) and it is not (completely) in "
            f"the cache {cache}: check the network (or HF_ENDPOINT), set HF_HUB_OFFLINE=1 to use cached "
            "models only, or pass a local model folder"
        ) from None
    except HfHubHTTPError as exc:
        raise MarspecError(
            f"the Hugging Face Hub refused {repo_id!r} ({one_line(exc)}): try again later, or pass a local "
            "model folder"
        ) from None
    except OSError as exc:
        raise MarspecError(
            f"downloading {repo_id!r} into {cache} failed ({exc.strerror or one_line(exc)}): free disk "
            "space or point HF_HUB_CACHE at a writable folder"
        ) from None
    if not (folder / "config.json").is_file():
        raise MarspecError(
            f"Hub model {repo_id!r} has no config.json ({folder}): it is not a transformers model"
        )
    if weights and not any(folder.glob("*.safetensors")):
        raise MarspecError(
            f"Hub model {repo_id!r} has no safetensors weights ({folder}): marspec loads safetensors "
            "checkpoints; pick a repository that has them, or convert it and pass the local folder"
        )
    _resolved[key] = folder
    return folder
