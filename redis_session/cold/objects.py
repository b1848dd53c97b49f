"""Where cold segments live: an object store, by URL.

``file:///var/lib/rs-cold`` (or a plain path) is a local folder, the embedded default: no service
to run. ``s3://bucket/prefix``, ``gs://…`` and ``az://…`` (``azure://``, ``abfs://``) go through
obstore (the ``cold`` extra: ``pip install 'redis-agent-session[cold]'``), which reads each cloud's usual
environment (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ``GOOGLE_APPLICATION_CREDENTIALS``…).

Objects are immutable: written once under a name that says what they hold, read, listed by prefix
(the sweep) and deleted. A missing object raises `ObjectMissing`.
"""

from __future__ import annotations

import builtins
import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable
from urllib.parse import unquote, urlparse

import anyio


class ObjectMissing(KeyError):
    """No object under that key."""


class ObjectInfo(NamedTuple):
    key: str
    size: int
    modified_ms: int


@runtime_checkable
class ObjectStore(Protocol):
    """The four operations the cold tier needs from an object store."""

    url: str

    async def put(self, key: str, data: bytes) -> None: ...

    async def get(self, key: str) -> bytes: ...

    async def delete(self, key: str) -> None:
        """Remove `key`; an absent key is not an error."""
        ...

    def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]: ...

    # Optional: ``async def create(key, data) -> bool`` writes `key` only if no object has that
    # name, atomically (both stores here have it). The tier claims a folder for one store with it;
    # without it the claim is a plain put read back (two stores claiming at once could both pass).


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in key or "\x00" in key:
        raise ValueError(f"invalid object key {key!r}")
    return key


class LocalFolder:
    """Objects as files under one folder: written to a temporary name, fsynced, then renamed, so
    a crash never leaves a half object under a real name."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().resolve()
        self.url = self.root.as_uri()

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def _put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    async def put(self, key: str, data: bytes) -> None:
        await anyio.to_thread.run_sync(self._put, key, data)

    def _create(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # atomic, and refused when the name exists
        except FileExistsError:
            return False
        finally:
            tmp.unlink()
        return True

    async def create(self, key: str, data: bytes) -> bool:
        """Write `key` only if no object has that name (atomically); whether it was written."""
        return await anyio.to_thread.run_sync(self._create, key, data)

    async def get(self, key: str) -> bytes:
        # a segment is a few KB to a few MB on a local disk: read in place (a thread hop costs
        # more than the read)
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            # a folder where the object should be is no object either (never "Redis is down")
            raise ObjectMissing(key) from None

    async def delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        base = self.root
        if not base.is_dir():
            return
        found = await anyio.to_thread.run_sync(self._walk, prefix)
        for info in found:
            yield info

    def _walk(self, prefix: str) -> builtins.list[ObjectInfo]:
        out = []
        # only the folder the prefix names (a session's, a life's): never the whole store
        head = prefix.rpartition("/")[0]
        top = self.root / _check_key(head) if head else self.root
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                if name.startswith("."):
                    continue  # a temporary file of a write in flight
                p = Path(dirpath) / name
                key = p.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    try:
                        st = p.stat()
                    except FileNotFoundError:
                        continue  # deleted while listed (a merge, a restore, another sweep)
                    out.append(ObjectInfo(key, st.st_size, int(st.st_mtime * 1000)))
        return sorted(out)


class CloudObjects:
    """S3, GCS or Azure through obstore (the ``cold`` extra)."""

    def __init__(self, url: str, **options: Any) -> None:
        try:
            import obstore
            from obstore.store import from_url
        except ImportError as e:  # pragma: no cover - depends on the extra
            raise ImportError(f"{url}: object storage needs obstore: pip install 'redis-agent-session[cold]'") from e
        self._ob = obstore
        self.url = url
        self._store = from_url(url, **options)

    async def put(self, key: str, data: bytes) -> None:
        await self._ob.put_async(self._store, _check_key(key), data)

    async def create(self, key: str, data: bytes) -> bool:
        """Write `key` only if no object has that name (a conditional put); whether it was written."""
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        try:
            await self._ob.put_async(self._store, _check_key(key), data, mode="create")
        except (AlreadyExistsError, PreconditionError):
            return False
        return True

    async def get(self, key: str) -> bytes:
        from obstore.exceptions import NotFoundError

        try:
            res = await self._ob.get_async(self._store, _check_key(key))
            return bytes(await res.bytes_async())
        except (NotFoundError, FileNotFoundError):
            raise ObjectMissing(key) from None

    async def delete(self, key: str) -> None:
        from obstore.exceptions import NotFoundError

        try:
            await self._ob.delete_async(self._store, _check_key(key))
        except (NotFoundError, FileNotFoundError):
            pass

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        async for chunk in self._ob.list(self._store, prefix or None):
            for meta in chunk:
                yield ObjectInfo(str(meta["path"]), int(meta["size"]), int(meta["last_modified"].timestamp() * 1000))


def open_objects(url: str, **options: Any) -> ObjectStore:
    """The object store a URL names: ``file://`` or a path (a local folder), else obstore's."""
    if "://" not in url:
        return LocalFolder(url)
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return LocalFolder(unquote(parsed.path))
    if parsed.scheme in ("s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "memory"):
        return CloudObjects(url, **options)
    raise ValueError(f"unsupported object store URL {url!r} (file://, s3://, gs://, az://)")
