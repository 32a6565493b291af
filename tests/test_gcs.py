"""Tests for utils/gcs.py against a local http.server on 127.0.0.1 (no other network)."""
import hashlib
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lm_human_preferences.utils import gcs

BODY = bytes(range(256)) * 40  # 10 KiB


class _Handler(BaseHTTPRequestHandler):
    # Behaviour by path; server.requests records every request.
    def do_GET(self):
        self.server.requests.append(self.path)
        if self.path.startswith('/missing'):
            self.send_error(404)
        elif self.path.startswith('/flaky') and self.server.requests.count(self.path) == 1:
            self.send_error(503)
        elif self.path.startswith('/cut'):
            # Announce the whole body, send half, close: a transfer cut off midway.
            self.send_response(200)
            self.send_header('Content-Length', str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY[:len(BODY) // 2])
            self.wfile.flush()
            self.close_connection = True
        elif self.path.startswith('/slowonce') and self.server.requests.count(self.path) == 1:
            time.sleep(1.0)  # longer than the test's timeout_s: a read timeout, then a retry
            self.close_connection = True  # the client has given up on this one: answer nothing
        elif self.path.startswith('/halfonce') and self.server.requests.count(self.path) == 1:
            self.send_response(200)
            self.send_header('Content-Length', str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY[:100])
            self.close_connection = True
        else:
            self.send_response(200)
            self.send_header('Content-Length', str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(('127.0.0.1', 0), _Handler)
    httpd.requests = []
    thread = threading.Thread(target=httpd.serve_forever, kwargs=dict(poll_interval=0.02), daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def _url(server, path):
    return f'http://127.0.0.1:{server.server_address[1]}{path}'


def test_dirs_follow_env(monkeypatch, tmp_path):
    monkeypatch.setenv('LMHP_DATASETS_DIR', str(tmp_path / 'd'))
    monkeypatch.setenv('LMHP_SAVED_MODELS_DIR', str(tmp_path / 's'))
    assert gcs.datasets_dir() == str(tmp_path / 'd')
    assert gcs.saved_models_dir() == str(tmp_path / 's')
    monkeypatch.delenv('LMHP_DATASETS_DIR')
    monkeypatch.delenv('LMHP_SAVED_MODELS_DIR')
    assert gcs.datasets_dir() == os.path.join(gcs.REPO_ROOT, 'datasets')
    assert gcs.saved_models_dir() == os.path.join(gcs.REPO_ROOT, 'saved_models')
    assert os.path.isdir(os.path.join(gcs.REPO_ROOT, 'lm_human_preferences'))


def test_download_then_cached(server):
    url = _url(server, '/labels/sentiment/offline_5k.json')
    path = gcs.download_file_cached(url)
    host = f'127.0.0.1:{server.server_address[1]}'
    assert path == os.path.join(gcs.datasets_dir(), 'downloads', host, 'labels/sentiment/offline_5k.json')
    with open(path, 'rb') as f:
        assert f.read() == BODY
    assert server.requests == ['/labels/sentiment/offline_5k.json']
    assert gcs.download_file_cached(url) == path
    assert len(server.requests) == 1  # the second call made no request
    # no temp files left; beside the file, its download record: where the bytes came from, size, sha256
    assert sorted(os.listdir(os.path.dirname(path))) == ['offline_5k.json', 'offline_5k.json.source.json']
    assert gcs.download_record(path) == dict(url=url, requested_url=url, bytes=len(BODY),
                                             sha256=hashlib.sha256(BODY).hexdigest())


def test_a_cached_file_that_changed_is_refused(server):
    url = _url(server, '/data.bin')
    path = gcs.download_file_cached(url)
    with open(path, 'r+b') as f:  # one flipped byte, same size
        f.seek(100)
        f.write(bytes([BODY[100] ^ 1]))
    with pytest.raises(gcs.DownloadError) as e:
        gcs.download_file_cached(url)
    assert str(e.value) == (f'cached file {path} does not match the sha256 of its download record '
                            f'{path}.source.json: it changed after it was downloaded; delete it to download it again')
    with open(path, 'ab') as f:
        f.write(b'more')
    with pytest.raises(gcs.DownloadError, match=rf'has {len(BODY) + 4} bytes, its download record .* says {len(BODY)}'):
        gcs.download_file_cached(url)
    os.remove(path)  # as the message says: deleted, it is downloaded again
    assert open(gcs.download_file_cached(url), 'rb').read() == BODY
    assert server.requests == ['/data.bin'] * 2


def test_a_cached_file_without_record_is_checked_then_adopted(server, tmp_path):
    url = _url(server, '/old.json')
    path = gcs.cached_path(url, cache_dir=str(tmp_path))
    os.makedirs(os.path.dirname(path))
    with open(path, 'w') as f:
        f.write('not what validate wants')

    def validate(p):
        if open(p).read() != 'ok':
            raise ValueError(f'{p}: expected ok')
    with pytest.raises(gcs.DownloadError, match=rf'^the cached file {path} \(for {url}\) was refused: {path}: expected ok$'):
        gcs.download_file_cached(url, cache_dir=str(tmp_path), validate=validate)
    assert gcs.download_record(path) is None
    with open(path, 'w') as f:
        f.write('ok')
    assert gcs.download_file_cached(url, cache_dir=str(tmp_path), validate=validate) == path
    assert gcs.download_record(path) == dict(url=None, requested_url=url, bytes=2, sha256=hashlib.sha256(b'ok').hexdigest())
    assert server.requests == []  # the cached file was used, not downloaded again


def test_a_download_validate_refuses_is_not_cached(server):
    url = _url(server, '/labels.json')
    seen = []

    def validate(p):
        seen.append(open(p, 'rb').read())
        raise ValueError('label file x: record 3 has no best')
    with pytest.raises(gcs.DownloadError) as e:
        gcs.download_file_cached(url, validate=validate, backoff_s=0.01)
    assert str(e.value) == (f'could not download {url}: the downloaded file was refused, not cached: '
                            f'label file x: record 3 has no best')
    assert seen == [BODY]  # validate saw the whole download
    assert server.requests == ['/labels.json']  # a refused file is not downloaded again
    path = gcs.cached_path(url)
    assert not os.path.exists(os.path.dirname(path)) or os.listdir(os.path.dirname(path)) == []


def test_urls_differing_in_their_query_are_different_files(server, tmp_path):
    a = gcs.download_file_cached(_url(server, '/d.json?v=1'), cache_dir=str(tmp_path))
    b = gcs.download_file_cached(_url(server, '/d.json?v=2'), cache_dir=str(tmp_path))
    assert a != b and os.path.dirname(a) == os.path.dirname(b)
    assert server.requests == ['/d.json?v=1', '/d.json?v=2']
    assert gcs.download_record(b)['url'] == _url(server, '/d.json?v=2')


def test_a_cache_that_cannot_be_written_is_one_line_naming_the_url(server, tmp_path):
    blocker = tmp_path / 'cache'
    blocker.write_text('a file where the cache dir should be')
    url = _url(server, '/x.bin')
    with pytest.raises(gcs.DownloadError) as e:
        gcs.download_file_cached(url, cache_dir=str(blocker))
    assert str(e.value) == (f'could not download {url} into the cache '
                            f'{gcs.cached_path(url, cache_dir=str(blocker))}: Not a directory')


def test_cache_dir_argument(server, tmp_path):
    path = gcs.download_file_cached(_url(server, '/a/b.txt'), cache_dir=str(tmp_path))
    assert path.startswith(str(tmp_path) + os.sep) and path.endswith(os.path.join('a', 'b.txt'))


def test_404_fails_fast_naming_url(server):
    url = _url(server, '/missing.json')
    with pytest.raises(gcs.DownloadError) as e:
        gcs.download_file_cached(url, backoff_s=0.01)
    assert str(e.value) == f'could not download {url}: HTTP 404 Not Found'
    assert server.requests == ['/missing.json']  # not retried


def test_transient_error_is_retried(server):
    path = gcs.download_file_cached(_url(server, '/flaky.bin'), backoff_s=0.01)
    assert server.requests == ['/flaky.bin', '/flaky.bin']
    with open(path, 'rb') as f:
        assert f.read() == BODY


def test_cut_off_transfer_leaves_no_partial_file(server):
    url = _url(server, '/cut.bin')
    with pytest.raises(gcs.DownloadError) as e:
        gcs.download_file_cached(url, retries=3, backoff_s=0.01)
    msg = str(e.value)
    assert msg.startswith(f'could not download {url}: ') and '\n' not in msg
    assert 'after 3 attempts' in msg
    assert server.requests == ['/cut.bin'] * 3
    dest_dir = os.path.join(gcs.datasets_dir(), 'downloads', f'127.0.0.1:{server.server_address[1]}')
    assert not os.path.exists(dest_dir) or os.listdir(dest_dir) == []


def test_timeout_is_retried(server):
    path = gcs.download_file_cached(_url(server, '/slowonce.bin'), backoff_s=0.01, timeout_s=0.3)
    assert server.requests == ['/slowonce.bin'] * 2
    assert open(path, 'rb').read() == BODY


def test_a_host_that_does_not_resolve_fails_at_once_suggesting_the_demo():
    # .invalid never resolves (RFC 6761), online or not: what an offline machine sees for every host.
    url = 'https://lmhp-test.invalid/lm-human-preferences/labels/x.json'
    started = time.monotonic()
    with pytest.raises(gcs.DownloadError) as e:
        gcs.download_file_cached(url, retries=4, backoff_s=5)
    assert time.monotonic() - started < 4  # not retried: a retry would sleep 5 s first
    assert str(e.value) == (f'could not download {url}: the host lmhp-test.invalid cannot be resolved (no internet?); '
                            f'the offline demo runs without it: python launch.py train_policy demo NAME')


def test_cut_off_once_then_complete(server):
    path = gcs.download_file_cached(_url(server, '/halfonce.bin'), backoff_s=0.01)
    assert server.requests == ['/halfonce.bin'] * 2
    with open(path, 'rb') as f:
        assert f.read() == BODY


def test_unreachable_is_one_line_naming_url():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    url = f'http://127.0.0.1:{port}/x.json'
    with pytest.raises(gcs.DownloadError) as e:
        gcs.download_file_cached(url, retries=2, backoff_s=0.01)
    msg = str(e.value)
    assert msg.startswith(f'could not download {url}: connection failed') and '\n' not in msg
    assert len(msg) < 300


def test_local_paths_and_bad_urls(tmp_path):
    f = tmp_path / 'labels.json'
    f.write_text('[]')
    assert gcs.download_file_cached(str(f)) == str(f)
    with pytest.raises(FileNotFoundError, match='nope.json'):
        gcs.download_file_cached(str(tmp_path / 'nope.json'))
    with pytest.raises(gcs.DownloadError, match="gs://bucket/x: unsupported URL scheme 'gs'"):
        gcs.download_file_cached('gs://bucket/x')
    with pytest.raises(gcs.DownloadError, match='does not name a file'):
        gcs.download_file_cached('http://127.0.0.1:1/dir/')
    with pytest.raises(gcs.DownloadError, match='does not name a file'):
        gcs.download_file_cached('http://127.0.0.1:1/../../etc/passwd')
