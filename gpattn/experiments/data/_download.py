"""Checksummed, opt-in downloads and archive opening with errors that name the file.

``fetch`` never touches the network unless ``download=True``; a download goes to a temporary file in
the target directory, is checked against its SHA-256, and only then renamed into place (atomic on
one file system), so a failed or interrupted download never leaves a partial file under the real name.
"""

from __future__ import annotations

import hashlib
import os
import re
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

from gpattn.experiments.data._bundle import DataNotFoundError, missing_file_message

__all__ = ["fetch", "fetch_archive", "open_tar", "open_zip", "read_zip_member", "sha256_file", "verify_sha256"]

_CHUNK = 1 << 20
_HEX64 = re.compile(r"[0-9a-f]{64}")
DEFAULT_TIMEOUT = 60.0  # seconds per blocking socket operation
DEFAULT_MAX_BYTES = 4 << 30  # refuse anything larger than 4 GiB


def sha256_file(path) -> str:
    """Hex SHA-256 digest of the file at ``path``."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _check_digest_format(sha256: str) -> str:
    if not isinstance(sha256, str) or not _HEX64.fullmatch(sha256.lower()):
        raise ValueError(f"sha256 must be 64 hexadecimal characters, got {sha256!r}")
    return sha256.lower()


def verify_sha256(path, sha256: str) -> str:
    """Return the digest of ``path``; ``ValueError`` naming the file and both digests if it differs."""
    expected = _check_digest_format(sha256)
    actual = sha256_file(path)
    if actual != expected:
        raise ValueError(
            f"checksum mismatch for {path}: expected sha256 {expected}, got {actual}. The file is corrupt, "
            f"incomplete or a different version; delete it and download it again."
        )
    return actual


def fetch(
    url: str,
    path,
    sha256: str | None,
    download: bool,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Path:
    """Make sure ``path`` holds the file published at ``url`` and return ``path``.

    - ``path`` exists: its SHA-256 is checked against ``sha256`` (``None`` skips the check of an
      existing file only); a mismatch is a ``ValueError``.
    - ``path`` is missing and ``download`` is False: :class:`DataNotFoundError` naming path and URL.
    - ``path`` is missing and ``download`` is True: stream ``url`` (http, https or file) into a
      temporary file next to ``path`` with ``timeout`` seconds per socket operation and at most
      ``max_bytes`` bytes, verify ``sha256`` (required), then rename into place.
    """
    path = Path(path)
    if path.exists():
        if sha256 is not None:
            verify_sha256(path, sha256)
        return path
    if not download:
        raise DataNotFoundError(missing_file_message(path, url))
    if sha256 is None:
        raise ValueError(f"refusing to download {url} without a sha256 checksum to verify it")
    expected = _check_digest_format(sha256)
    scheme = urllib.parse.urlparse(url).scheme
    if scheme not in ("http", "https", "file"):
        raise ValueError(f"url must be http(s):// or file://, got {url!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        size = 0
        try:
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as response:
                for chunk in iter(lambda: response.read(_CHUNK), b""):
                    size += len(chunk)
                    if size > max_bytes:
                        raise ValueError(f"download of {url} exceeds max_bytes={max_bytes}; aborted")
                    digest.update(chunk)
                    out.write(chunk)
        except (urllib.error.URLError, OSError) as err:
            raise DataNotFoundError(
                f"could not download {url} to {path}: {err}. Check the network, or fetch the file by hand "
                f"and place it at {path} (or point data_dir / --data-dir / GPATTN_DATA_DIR to its directory)."
            ) from err
        actual = digest.hexdigest()
        if actual != expected:
            raise ValueError(
                f"checksum mismatch for {path} downloaded from {url}: expected sha256 {expected}, got {actual}; "
                f"the download was discarded."
            )
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def fetch_archive(url: str, path: Path, sha256: str, download: bool, verify_checksum: bool) -> dict:
    """:func:`fetch` for a loader's official archive, and its provenance for the bundle's ``info``:
    ``{"source", "url", "sha256", "checksum_verified"}``.

    A missing archive is always fetched against the official ``sha256``; an existing one is checked
    against it unless ``verify_checksum`` is False (a synthetic archive), and then its own digest is
    recorded with ``checksum_verified=False``."""
    expected = sha256 if (verify_checksum or not path.exists()) else None
    fetch(url, path, expected, download)
    digest = expected if expected is not None else sha256_file(path)
    return {"source": str(path), "url": url, "sha256": digest, "checksum_verified": expected is not None}


def open_zip(path) -> zipfile.ZipFile:
    """Open a zip archive for reading; ``ValueError`` naming the file if it is not a valid zip archive."""
    try:
        return zipfile.ZipFile(path)
    except zipfile.BadZipFile as err:
        raise ValueError(f"{path} is not a valid zip archive ({err}); delete it and download it again") from err


def read_zip_member(archive: zipfile.ZipFile, member: str) -> bytes:
    """The bytes of ``member``; ``ValueError`` naming the archive and member if absent or damaged."""
    try:
        return archive.read(member)
    except KeyError as err:
        raise ValueError(
            f"{archive.filename} has no member {member!r}; it is not the expected archive "
            f"(members: {archive.namelist()[:10]}...)"
        ) from err
    except (zipfile.BadZipFile, EOFError, OSError) as err:  # e.g. CRC error in a truncated archive
        raise ValueError(f"{archive.filename} is not a valid zip archive: member {member!r}: {err}") from err


def open_tar(path) -> tarfile.TarFile:
    """Open a (compressed) tar archive for streaming; ``ValueError`` naming the file if it is invalid."""
    try:
        return tarfile.open(path, mode="r:*")
    except tarfile.TarError as err:
        raise ValueError(f"{path} is not a valid tar archive ({err}); delete it and download it again") from err
