"""`model.path` as a local directory: a Hugging Face hub id (`org/name`, `org/name@revision`)
resolved through huggingface_hub's cache, a cache's own repo folder (`models--org--name`),
or a directory as given.

The cache is read first, with no network call, so a compute node without network finds what
the login node downloaded (`HF_HOME` / `HF_HUB_CACHE` on a shared file system). Only what a
decomposition reads is fetched: configs, safetensors and the tokenizer, not the other
formats a repository may also hold (`.bin`, `.gguf`, ...).
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

from pdecomp.core.config import ConfigError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
PATTERNS = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt")


def local_model_dir(path: str, key: str = "model.path") -> str:
    """`path` as the local directory to read (unchanged when it is one already)."""
    if not path:
        return path
    local = Path(path).expanduser()
    ref = local / "refs" / "main"
    if (local / "snapshots").is_dir() and ref.is_file():  # the cache's folder of one repo
        return str(local / "snapshots" / ref.read_text().strip())
    if local.exists() or not HUB_ID.match(path):
        return path
    return snapshot(path, key)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


@functools.cache
def snapshot(hub_id: str, key: str) -> str:
    """The hub cache's snapshot of `hub_id`: from the cache, else downloaded into it (unless
    HF_HUB_OFFLINE says there is no network, when the error gives the command that fetches
    it where there is)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo, _, revision = hub_id.partition("@")
    where = {"repo_id": repo, "revision": revision or None, "allow_patterns": list(PATTERNS)}
    try:
        return snapshot_download(**where, local_files_only=True)
    except LocalEntryNotFoundError:
        if _offline():
            pin = f" --revision {revision}" if revision else ""
            fetch = f"hf download {repo}{pin} --include " + " ".join(f"'{p}'" for p in PATTERNS)
            raise ConfigError(key, hub_id, (
                f"a Hugging Face hub id that is not in the hub cache ({constants.HF_HUB_CACHE}) "
                f"and HF_HUB_OFFLINE is set: fetch it where there is network ({fetch}), "
                "or give a local directory")) from None
    try:
        return snapshot_download(**where)
    except Exception as e:  # noqa: BLE001 - huggingface_hub's and the network's errors alike
        why = " ".join(str(e).split())[:300]
        raise ConfigError(key, hub_id, f"could not be fetched from the Hugging Face hub "
                                       f"({type(e).__name__}: {why})") from None
