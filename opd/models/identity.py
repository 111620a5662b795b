"""A model's identity: one sha256 over a checkpoint folder's files, or its hub id and commit.

eval.py keys its resumable predictions on it (not on the path), and train.py records the identity of every
model a resumed run loads again from its path (frozen teachers, DAPD's base) and refuses a changed one.
`DigestCache` remembers each file's digest by (path, size, mtime, ctime), so an unchanged 8 GB checkpoint
is read once per cache file.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from opd.models.loading import cached_snapshot
from opd.storage import write_atomic

MODEL_FILES = (".safetensors", ".bin", ".json", ".jinja", ".txt", ".model", ".tiktoken")  # what outputs depend on
HASH_BLOCK = 16 << 20  # bytes read per hashlib update


class DigestCache:
    """sha256 digests of files, remembered in a JSON file by (path, size, mtime_ns, ctime_ns).

    A file is re-read only when one of those changed. Nothing is written until `save()`.
    """

    def __init__(self, path):
        self.path = Path(path)
        try:
            self.entries: dict[str, dict] = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            self.entries = {}
        self.dirty = False

    @staticmethod
    def _stamp(path: Path) -> list[int]:
        st = path.stat()
        return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]

    def known(self, path: Path) -> bool:
        """Whether `path`'s digest is cached and the file unchanged since."""
        return self.entries.get(str(path.resolve()), {}).get("stamp") == self._stamp(path)

    def file(self, path: Path) -> str:
        """The sha256 of a file's content, read in HASH_BLOCK blocks unless cached and unchanged."""
        if not self.known(path):
            self.entries[str(path.resolve())] = {"stamp": self._stamp(path), "sha256": file_sha256(path)}
            self.dirty = True
        return self.entries[str(path.resolve())]["sha256"]

    def folder(self, folder: Path) -> str:
        """One sha256 over the names, sizes and content digests of a checkpoint folder's files
        (weights, configs, tokenizer and chat template: the MODEL_FILES suffixes, hidden files left out)."""
        files = sorted(p for p in Path(folder).iterdir()
                       if p.is_file() and not p.name.startswith(".") and p.name.endswith(MODEL_FILES))
        todo = sum(p.stat().st_size for p in files if not self.known(p))
        if todo > 1 << 30:
            print(f"hashing {todo / 2**30:.1f} GiB of {folder} (once per output folder) ...", file=sys.stderr,
                  flush=True)
        listing = [[p.name, p.stat().st_size, self.file(p)] for p in files]
        return hashlib.sha256(json.dumps(listing).encode("utf-8")).hexdigest()

    def save(self) -> None:
        if not self.dirty:
            return
        write_atomic(self.path, json.dumps(self.entries, indent=1, sort_keys=True))
        self.dirty = False


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def hub_snapshot(folder: Path) -> tuple[str, str] | None:
    """(repo id, commit) of a snapshot folder in the Hugging Face cache (.../models--org--name/snapshots/<commit>)."""
    folder = Path(folder).absolute()
    repo = folder.parent.parent.name
    if folder.parent.name != "snapshots" or not repo.startswith("models--"):
        return None
    return repo[len("models--"):].replace("--", "/"), folder.name


def model_identity(source: str, digests: DigestCache) -> dict:
    """What predictions depend on about the model, for settings.json.

    ``model``: "sha256:<digest of the folder's files>" for a local folder, "hf:<repo id>" for a hub
    model; ``model_revision``: the hub commit (from the cache; None while not downloaded);
    ``model_path``: where it was loaded from (a note, not compared).
    """
    folder = Path(source)
    if folder.is_dir():
        hub = hub_snapshot(folder)
        if hub is not None:
            return {"model": f"hf:{hub[0]}", "model_revision": hub[1], "model_path": source}
        return {"model": "sha256:" + digests.folder(folder), "model_revision": None, "model_path": source}
    snapshot = cached_snapshot(source)
    if snapshot is not None:
        return {**model_identity(snapshot, digests), "model_path": source}
    return {"model": f"hf:{source}", "model_revision": None, "model_path": source}
