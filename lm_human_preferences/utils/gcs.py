"""Downloading and caching files (replaces the original utils/gcs.py; the name is kept so imports map 1:1).

The original fetched gs:// paths with the Google Cloud client / gsutil, which cannot download the
https://openaipublic.blob.core.windows.net URLs the code was later migrated to. We fetch http(s) URLs
with `requests` into a local cache, `datasets_dir()/downloads/<host>/<path>`:
  - streamed into `<dest>.tmp-<pid>` (its sha256 computed on the way), checked against Content-Length,
    fsynced, optionally checked by the caller (`validate`: a label file's schema, say), then renamed
    into place, so the cache never holds a partial or refused file;
  - beside each cached file, its download record `<dest>.source.json`: where the bytes came from, their
    size and sha256, written before the file is renamed into place. Every later use checks the file
    against it: a file changed or truncated since is refused, never used silently;
  - a host that cannot be resolved (no internet) fails at once, in one line suggesting the offline demo;
    timeouts, connection errors, cut-off transfers and HTTP 5xx/408/429 are retried with exponential
    backoff; other HTTP errors (404, 403, ...) fail at once;
  - where the original's file has a public mirror (MIRRORS), a failed download tries the mirror;
  - every failure ends in one line: `DownloadError: could not download <url>: <reason>`.
In a torch.distributed group rank 0 downloads and the other ranks wait for its result.
"""

import hashlib
import json
import os
import re
import socket
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import requests

from lm_human_preferences.utils import files, ranks

REPO_ROOT = str(Path(__file__).resolve().parents[2])

# Transfers at least this large get a tqdm progress bar.
PROGRESS_MIN_BYTES = 8 << 20


def datasets_dir():
    """Where prepared data and downloads live; read at call time so tests can point it elsewhere."""
    return os.environ.get('LMHP_DATASETS_DIR') or os.path.join(REPO_ROOT, 'datasets')


def saved_models_dir():
    """Where converted / downloaded model checkpoints live; read at call time."""
    return os.environ.get('LMHP_SAVED_MODELS_DIR') or os.path.join(REPO_ROOT, 'saved_models')


OFFLINE_HINT = 'the offline demo runs without it: python launch.py train_policy demo NAME'

# Public mirrors of the original's files: URL prefix -> the mirror's prefix for the same relative path.
# The Hugging Face dataset vwxyzjn/lm-human-preferences holds the label files under the original's
# layout: its file listing (tree/main) has the folders cnndm/ descriptiveness/ sentiment/ tldr/, tldr/
# holds offline_60k.json and online_45k.json, descriptiveness/ offline_5k.json; TRL's
# examples/datasets/sentiment_descriptiveness.py downloads "sentiment/offline_5k.json" and
# "descriptiveness/offline_5k.json" from it, and vwxyzjn/lm-human-preference-details trains on
# "sentiment/offline_5k.json". The names inside cnndm/ are not confirmed: a different name is a 404 there,
# and the error names both URLs.
MIRRORS = {
    'https://openaipublic.blob.core.windows.net/lm-human-preferences/labels/':
        'https://huggingface.co/datasets/vwxyzjn/lm-human-preferences/resolve/main/',
}


def mirror_url(url):
    """The public mirror's URL of the same file, or None."""
    for prefix, mirror in MIRRORS.items():
        if url.startswith(prefix):
            return mirror + url[len(prefix):]
    return None


class _Retryable(Exception):
    """A failure worth another attempt (network trouble, cut-off transfer, server-side error)."""


class _Fatal(Exception):
    """A failure another attempt will not fix (e.g. HTTP 404)."""


class _Unresolvable(_Fatal):
    """The host name does not resolve: offline (or a typo). Retrying only makes the user wait."""


class _Refused(Exception):
    """validate() refused the downloaded file (its ValueError's message)."""


def _cache_path(url, cache_dir):
    parsed = urlparse(url)
    if parsed.scheme not in ('http', 'https'):
        raise DownloadError(f"could not download {url}: unsupported URL scheme '{parsed.scheme}' (use http or https)")
    rel = unquote(parsed.path).lstrip('/')
    root = os.path.abspath(os.path.join(cache_dir, parsed.netloc))
    dest = os.path.abspath(os.path.join(root, rel))
    if not rel or rel.endswith('/') or not dest.startswith(root + os.sep):
        raise DownloadError(f'could not download {url}: the URL does not name a file')
    if parsed.query:  # another query, another file (e.g. a version): its own cache entry
        dest += f'.query-{hashlib.sha256(parsed.query.encode()).hexdigest()[:16]}'
    return dest


def _unresolvable(e):
    """Whether a requests exception comes from a failed host name lookup (socket.gaierror, wrapped by
    urllib3 in NameResolutionError and MaxRetryError)."""
    seen = set()
    stack = [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, socket.gaierror) or type(x).__name__ == 'NameResolutionError':
            return True
        stack += [x.__cause__, x.__context__, getattr(x, 'reason', None),
                  *(a for a in getattr(x, 'args', ()) if isinstance(a, BaseException))]
    return False


def _short_reason(e):
    """One line for a requests exception (its str() is a long nested repr)."""
    text = str(e)
    m = re.search(r'\[Errno -?\d+\][^\'")]*', text)
    if isinstance(e, requests.exceptions.Timeout) or 'timed out' in text:
        return 'timed out'  # connect or read timeout, or a transfer that stalled midway
    if isinstance(e, requests.exceptions.ConnectionError) and m:
        return f'connection failed: {m.group(0).strip()}'
    if 'IncompleteRead' in text or 'Connection broken' in text:
        return 'connection closed before the whole file arrived'
    return f'{type(e).__name__}: {text}'.replace('\n', ' ')[:300]


def _download_once(url, tmp, *, timeout_s, announce):
    """Stream url into tmp; returns (bytes, sha256). announce() is called once the server answers."""
    # identity encoding: the bytes we count are then the bytes Content-Length announces.
    try:
        with requests.get(url, stream=True, timeout=timeout_s, headers={'Accept-Encoding': 'identity'}) as r:
            if r.status_code != 200:
                reason = f'HTTP {r.status_code} {r.reason}'.strip()
                if r.status_code >= 500 or r.status_code in (408, 429):
                    raise _Retryable(reason)
                raise _Fatal(reason)
            announce()
            expected = r.headers.get('Content-Length')
            expected = int(expected) if expected is not None else None
            received = 0
            sha256 = hashlib.sha256()
            progress = None
            if expected is not None and expected >= PROGRESS_MIN_BYTES:
                from tqdm import tqdm
                progress = tqdm(total=expected, unit='B', unit_scale=True, desc=os.path.basename(tmp.split('.tmp-')[0]))
            try:
                with open(tmp, 'wb') as f:
                    for chunk in r.iter_content(chunk_size=1 << 20):
                        f.write(chunk)
                        sha256.update(chunk)
                        received += len(chunk)
                        if progress is not None:
                            progress.update(len(chunk))
                    f.flush()
                    os.fsync(f.fileno())
            finally:
                if progress is not None:
                    progress.close()
            if expected is not None and received != expected:
                raise _Retryable(f'got {received} of {expected} bytes (connection closed early)')
            return received, sha256.hexdigest()
    except requests.exceptions.RequestException as e:
        if _unresolvable(e):
            raise _Unresolvable(f'the host {urlparse(url).hostname} cannot be resolved (no internet?)') from None
        raise _Retryable(_short_reason(e)) from None


def _download(url, dest, *, requested_url, validate, retries, backoff_s, timeout_s):
    """Download url into dest (with its download record), or raise _Fatal / _Refused / _Retryable (the
    last attempt's reason, with the number of attempts)."""
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = f'{dest}.tmp-{os.getpid()}'
    delay = backoff_s
    announced = []

    def announce():
        if not announced:
            print(f'downloading {url} -> {dest}', file=sys.stderr)
            announced.append(True)
    for attempt in range(1, retries + 1):
        try:
            size, sha256 = _download_once(url, tmp, timeout_s=timeout_s, announce=announce)
            if validate is not None:
                try:
                    validate(tmp)
                except ValueError as e:
                    raise _Refused(str(e)) from None
            # The record first: a crash before the rename leaves a record without its file (downloaded
            # again), never a cached file without its record.
            _write_record(dest, dict(url=url, requested_url=requested_url, bytes=size, sha256=sha256))
            os.replace(tmp, dest)
            return
        except _Retryable as e:
            reason = f'{e} (after {attempt} attempt{"s" if attempt > 1 else ""})'
            if attempt == retries:
                raise _Retryable(reason) from None
            print(f'download of {url} failed ({e}); retry {attempt}/{retries - 1} in {delay:g}s', file=sys.stderr)
            time.sleep(delay)
            delay *= 2
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


# ---------------------------------------------------------------------------------------------------
# Download records

def _record_path(path):
    return path + '.source.json'


def _write_record(path, record):
    files.atomic_write(_record_path(path), json.dumps(record, indent=1).encode())


def download_record(path):
    """The download record of a cached file: {url (where its bytes came from; None for a file that was
    in the cache before records were kept), requested_url, bytes, sha256}; None for a file that was not
    downloaded. Raises DownloadError for an unreadable record."""
    record_path = _record_path(path)
    if not os.path.exists(record_path):
        return None
    try:
        with open(record_path) as f:
            record = json.load(f)
        if not isinstance(record, dict) or not {'bytes', 'sha256'} <= set(record):
            raise ValueError('expected a JSON object with bytes and sha256')
    except (ValueError, UnicodeDecodeError) as e:
        raise DownloadError(f'the download record {record_path} is unreadable ({e}); delete it and {path} to '
                            f'download the file again') from None
    return record


def _check_cached(url, path, validate):
    """Check a cached file against its download record. A file without one (cached before records were
    kept, or put there by hand) is checked by validate and adopted: its record gets url None."""
    record = download_record(path)
    if record is None:
        if validate is not None:
            try:
                validate(path)
            except ValueError as e:
                raise DownloadError(f'the cached file {path} (for {url}) was refused: {e}') from None
        _write_record(path, dict(url=None, requested_url=url, bytes=os.path.getsize(path),
                                 sha256=files.sha256_file(path)))
        return
    size = os.path.getsize(path)
    if size != record['bytes']:
        found = f'has {size} bytes, its download record {_record_path(path)} says {record["bytes"]}'
    elif files.sha256_file(path) != record['sha256']:
        found = f'does not match the sha256 of its download record {_record_path(path)}'
    else:
        return
    raise DownloadError(f'cached file {path} {found}: it changed after it was downloaded; delete it to '
                        f'download it again')


# ---------------------------------------------------------------------------------------------------
# Downloads

class DownloadError(RuntimeError):
    """A file could not be downloaded; the message names the URL and the reason."""


def is_url(path):
    return isinstance(path, str) and '://' in path


def cached_path(url, *, cache_dir=None):
    """Where download_file_cached keeps the file at url (default cache: datasets_dir()/downloads)."""
    return _cache_path(url, cache_dir if cache_dir is not None else os.path.join(datasets_dir(), 'downloads'))


def _fetch(url, dest, **kwargs):
    """Download url, else its public mirror, into dest; returns None, or the one-line error."""
    mirror = mirror_url(url)
    sources = [(url, url)] + ([(mirror, f'{mirror} (the mirror of {url})')] if mirror else [])
    failures, offline = [], True
    for source, named in sources:
        try:
            _download(source, dest, requested_url=url, **kwargs)
            return None
        except _Refused as e:  # the server's file is not what we need: another source will not help
            return f'could not download {named}: the downloaded file was refused, not cached: {e}'
        except (_Fatal, _Retryable) as e:
            failures.append(str(e))
            offline = offline and isinstance(e, _Unresolvable)
    error = f'could not download {url}: {failures[0]}'
    if len(failures) > 1:
        error += f'; its mirror {mirror} failed too: {failures[1]}'
    return error + (f'; {OFFLINE_HINT}' if offline else '')


def download_file_cached(url, *, cache_dir=None, validate=None, retries=4, backoff_s=1.0, timeout_s=60):
    """Return a local path holding the file at url, downloading it once into the cache.

    A local path (no '://') is returned unchanged after checking that it exists. The default cache is
    `datasets_dir()/downloads/<host>/<path>`. validate(path), if given, checks a downloaded file before
    it enters the cache (a ValueError refuses it: nothing is cached), and a cached file without a
    download record. A cached file is checked against its record (size and sha256) on every call.
    WARNING (as the original): only use this for files whose contents never change. Collective when a
    torch.distributed group is initialised: every rank must call it; rank 0 downloads and the others use
    the file once it is in place.
    """
    if not is_url(url):
        if not os.path.exists(url):
            raise FileNotFoundError(f'{url} does not exist')
        return url
    from lm_human_preferences.utils import core  # lazily: core imports torch
    dest = cached_path(url, cache_dir=cache_dir)

    def download():
        try:
            if os.path.exists(dest):
                _check_cached(url, dest, validate)
                return
            error = _fetch(url, dest, validate=validate, retries=retries, backoff_s=backoff_s, timeout_s=timeout_s)
        except OSError as e:  # the cache cannot be written (read-only, full disk)
            error = f'could not download {url} into the cache {dest}: {e.strerror or e}'
        if error is not None:
            raise DownloadError(error)
    # The other ranks wait until rank 0 is done, and fail with rank 0's error instead of waiting for a file that
    # will never come.
    core.root_tries(download, fails=(DownloadError,))
    if not os.path.exists(dest):
        raise DownloadError(f'could not download {url}: rank 0 downloaded it to {dest}, which rank {ranks.get_rank()} '
                           f'cannot see (the cache dir must be shared by all ranks)')
    return dest


def download_hub_snapshot(repo_id, *, allow_patterns, cache_dir, note=''):
    """Ours: the local folder holding the files of the Hugging Face hub model repo_id that match
    allow_patterns, downloaded once through huggingface_hub (its snapshot_download, into cache_dir; a
    later call uses the cached snapshot, offline too). Every failure is one line: DownloadError.
    Collective, as download_file_cached: rank 0 downloads, the other ranks then read the cache. note: said
    after the name in the errors."""
    from huggingface_hub import snapshot_download
    from huggingface_hub import errors

    from lm_human_preferences.utils import core  # lazily: core imports torch
    what = f"could not download the Hugging Face model '{repo_id}'{note}"

    def download():
        try:
            snapshot_download(repo_id, allow_patterns=allow_patterns, cache_dir=cache_dir)
            return
        except errors.GatedRepoError:
            error = f'{what}: it is gated (accept its terms on the hub, then log in: hf auth login)'
        except errors.RepositoryNotFoundError:
            error = f'{what}: the hub has no such model (or it is private: hf auth login)'
        except errors.LocalEntryNotFoundError:  # offline, and not cached
            error = (f'{what}: the hub cannot be reached (no internet?) and it is not in the cache {cache_dir}; '
                     f'{OFFLINE_HINT}')
        except errors.HfHubHTTPError as e:
            error = f'{what}: {str(e).splitlines()[0]}'
        except OSError as e:  # the cache cannot be written (read-only, full disk)
            error = f'{what} into the cache {cache_dir}: {e.strerror or e}'
        raise DownloadError(error)
    core.root_tries(download, fails=(DownloadError,))
    return snapshot_download(repo_id, allow_patterns=allow_patterns, cache_dir=cache_dir, local_files_only=True)
