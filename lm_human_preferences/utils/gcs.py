"""Downloading and caching files (replaces the original utils/gcs.py; the name is kept so imports map 1:1).

The original fetched gs:// paths with the Google Cloud client / gsutil, which cannot download the
https://openaipublic.blob.core.windows.net URLs the code was later migrated to. We fetch http(s) URLs
with `requests` into a local cache:
  - streamed into `<dest>.tmp-<pid>`, checked against Content-Length, fsynced, then renamed into place,
    so an interrupted transfer never leaves a partial file where the cache expects a complete one;
  - transient failures (connection errors, cut-off transfers, HTTP 5xx/408/429) are retried with
    exponential backoff; other HTTP errors (404, 403, ...) fail at once;
  - every failure ends in one line: `DownloadError: could not download <url>: <reason>`.
In a torch.distributed group rank 0 downloads and the other ranks wait for its result.
"""

import os
import re
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import requests

REPO_ROOT = str(Path(__file__).resolve().parents[2])

# Transfers at least this large get a tqdm progress bar.
PROGRESS_MIN_BYTES = 8 << 20


def datasets_dir():
    """Where prepared data and downloads live; read at call time so tests can point it elsewhere."""
    return os.environ.get('LMHP_DATASETS_DIR') or os.path.join(REPO_ROOT, 'datasets')


def saved_models_dir():
    """Where converted / downloaded model checkpoints live; read at call time."""
    return os.environ.get('LMHP_SAVED_MODELS_DIR') or os.path.join(REPO_ROOT, 'saved_models')


class _Retryable(Exception):
    """A failure worth another attempt (network trouble, cut-off transfer, server-side error)."""


class _Fatal(Exception):
    """A failure another attempt will not fix (e.g. HTTP 404)."""


def _cache_path(url, cache_dir):
    parsed = urlparse(url)
    if parsed.scheme not in ('http', 'https'):
        raise DownloadError(f"could not download {url}: unsupported URL scheme '{parsed.scheme}' (use http or https)")
    rel = unquote(parsed.path).lstrip('/')
    root = os.path.abspath(os.path.join(cache_dir, parsed.netloc))
    dest = os.path.abspath(os.path.join(root, rel))
    if not rel or rel.endswith('/') or not dest.startswith(root + os.sep):
        raise DownloadError(f'could not download {url}: the URL does not name a file')
    return dest


def _short_reason(e):
    """One line for a requests exception (its str() is a long nested repr)."""
    text = str(e)
    m = re.search(r'\[Errno -?\d+\][^\'")]*', text)
    if isinstance(e, requests.exceptions.ConnectionError) and m:
        return f'connection failed: {m.group(0).strip()}'
    if isinstance(e, requests.exceptions.Timeout):
        return 'timed out'
    if 'IncompleteRead' in text or 'Connection broken' in text:
        return 'connection closed before the whole file arrived'
    return f'{type(e).__name__}: {text}'.replace('\n', ' ')[:300]


def _download_once(url, tmp, *, timeout_s):
    # identity encoding: the bytes we count are then the bytes Content-Length announces.
    try:
        with requests.get(url, stream=True, timeout=timeout_s, headers={'Accept-Encoding': 'identity'}) as r:
            if r.status_code != 200:
                reason = f'HTTP {r.status_code} {r.reason}'.strip()
                if r.status_code >= 500 or r.status_code in (408, 429):
                    raise _Retryable(reason)
                raise _Fatal(reason)
            expected = r.headers.get('Content-Length')
            expected = int(expected) if expected is not None else None
            received = 0
            progress = None
            if expected is not None and expected >= PROGRESS_MIN_BYTES:
                from tqdm import tqdm
                progress = tqdm(total=expected, unit='B', unit_scale=True, desc=os.path.basename(tmp.split('.tmp-')[0]))
            try:
                with open(tmp, 'wb') as f:
                    for chunk in r.iter_content(chunk_size=1 << 20):
                        f.write(chunk)
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
    except requests.exceptions.RequestException as e:
        raise _Retryable(_short_reason(e)) from None


def _download(url, dest, *, retries, backoff_s, timeout_s):
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = f'{dest}.tmp-{os.getpid()}'
    delay = backoff_s
    for attempt in range(1, retries + 1):
        try:
            _download_once(url, tmp, timeout_s=timeout_s)
            os.replace(tmp, dest)
            return
        except _Fatal as e:
            reason = str(e)
            break
        except _Retryable as e:
            reason = f'{e} (after {attempt} attempt{"s" if attempt > 1 else ""})'
            if attempt < retries:
                print(f'download of {url} failed ({e}); retry {attempt}/{retries - 1} in {delay:g}s', file=sys.stderr)
                time.sleep(delay)
                delay *= 2
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    raise DownloadError(f'could not download {url}: {reason}')


# ---------------------------------------------------------------------------------------------------
# Downloads

class DownloadError(RuntimeError):
    """A file could not be downloaded; the message names the URL and the reason."""


def is_url(path):
    return isinstance(path, str) and '://' in path


def download_file_cached(url, *, cache_dir=None, retries=4, backoff_s=1.0, timeout_s=60):
    """Return a local path holding the file at url, downloading it once into the cache.

    A local path (no '://') is returned unchanged after checking that it exists. The default cache is
    `datasets_dir()/downloads/<host>/<path>`. WARNING (as the original): only use this for files whose
    contents never change. Collective when a torch.distributed group is initialised: every rank must
    call it; rank 0 downloads and the others use the file once it is in place.
    """
    if not is_url(url):
        if not os.path.exists(url):
            raise FileNotFoundError(f'{url} does not exist')
        return url
    from lm_human_preferences.utils import core  # lazily: core imports torch
    cache_dir = cache_dir if cache_dir is not None else os.path.join(datasets_dir(), 'downloads')
    dest = _cache_path(url, cache_dir)
    error = None
    if core.is_root() and not os.path.exists(dest):
        print(f'downloading {url} -> {dest}', file=sys.stderr)
        try:
            _download(url, dest, retries=retries, backoff_s=backoff_s, timeout_s=timeout_s)
        except DownloadError as e:
            error = str(e)
    # The broadcast doubles as the barrier: the other ranks wait here until rank 0 is done, and fail
    # with rank 0's error instead of waiting for a file that will never come.
    error = core.mpi_bcast(error)
    if error is not None:
        raise DownloadError(error)
    if not os.path.exists(dest):
        raise DownloadError(f'could not download {url}: rank 0 downloaded it to {dest}, which rank {core.get_rank()} '
                           f'cannot see (the cache dir must be shared by all ranks)')
    return dest
