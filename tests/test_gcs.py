"""Tests for utils/gcs.py against a local http.server on 127.0.0.1 (no other network)."""
import os
import socket
import threading
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
    assert os.listdir(os.path.dirname(path)) == ['offline_5k.json']  # no temp files left


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
