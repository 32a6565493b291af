"""Encoding tests: our tiktoken-based GPT-2 BPE gives the original ReversibleEncoder's ids.

The reference below reimplements the original's BPE algorithm (language/encodings.py) in plain
Python, reading the same encoder.json / vocab.bpe from ../shared/gpt2-124M.
"""

import functools
import hashlib
import http.server
import json
import os
import tempfile
import threading

import pytest
import regex

from lm_human_preferences.language import encodings

TRICKY = [
    'Hello world',
    "I DON'T know, you don't; they're, we've, I'm, he'll, she'd, IT'S",
    "  leading and trailing spaces   ",
    'tabs\tand\t\tdouble tabs \t mixed',
    'new\nlines\n\n\nand\r\nwindows\n',
    'whitespace runs:      then text',
    'unicode: héllo wörld naïve façade 日本語 Ελληνικά русский',
    'emoji: 😀👍🏽 🇺🇸 family 👨‍👩‍👧',
    'digits 1234567890 3.14159 1,000,000 2nd',
    '<|endoftext|> is plain text here',
    'punctuation!!! ??? ... --- ((nested)) "quotes" \'single\'',
    '',
    ' ',
    '\n',
]


# --- reference: the original's ReversibleEncoder BPE ------------------------------------------------

def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(2 ** 8):
        if b not in bs:
            bs.append(b)
            cs.append(2 ** 8 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def get_pairs(word):
    return {(a, b) for a, b in zip(word[:-1], word[1:])}


class ReferenceEncoder:
    pat = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    def __init__(self, encoder, bpe_merges):
        self.encoder = encoder
        self.byte_encoder = bytes_to_unicode()
        self.bpe_ranks = dict(zip(bpe_merges, range(len(bpe_merges))))

    @functools.lru_cache(maxsize=None)
    def bpe(self, token):
        word = tuple(token)
        pairs = get_pairs(word)
        if not pairs:
            return token
        while True:
            bigram = min(pairs, key=lambda pair: self.bpe_ranks.get(pair, float("inf")))
            if bigram not in self.bpe_ranks:
                break
            first, second = bigram
            new_word = []
            i = 0
            while i < len(word):
                try:
                    j = word.index(first, i)
                except ValueError:
                    new_word.extend(word[i:])
                    break
                new_word.extend(word[i:j])
                i = j
                if word[i] == first and i < len(word) - 1 and word[i + 1] == second:
                    new_word.append(first + second)
                    i += 2
                else:
                    new_word.append(word[i])
                    i += 1
            word = tuple(new_word)
            if len(word) == 1:
                break
            pairs = get_pairs(word)
        return " ".join(word)

    def encode(self, text):
        ids = []
        for token in regex.findall(self.pat, text):
            token = "".join(self.byte_encoder[b] for b in token.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self.bpe(token).split(" "))
        return ids


@pytest.fixture
def gpt2_dir(shared_dir, monkeypatch):
    d = shared_dir / 'gpt2-124M'
    monkeypatch.setenv(encodings.ENCODING_DIR_ENV, str(d))
    return d


@pytest.fixture
def reference(gpt2_dir):
    encoder = json.loads((gpt2_dir / 'encoder.json').read_text())
    merges = [tuple(m.split()) for m in (gpt2_dir / 'vocab.bpe').read_text().split('\n')[1:-1]]
    return ReferenceEncoder(encoder, merges)


def test_main_matches_original_bpe(reference):
    enc = encodings.Main.get_encoder()
    for s in TRICKY:
        assert enc.encode(s) == reference.encode(s), repr(s)
        assert enc.decode(enc.encode(s)) == s, repr(s)
    # the pre-tokenizer has no IGNORECASE: "DON'T" splits differently from "don't"
    assert enc.encode("DON'T")[-2:] != enc.encode("don't")[-2:]
    assert enc.encode('Hello world') == [15496, 995]  # from the GPT-2 README's checks


def test_main_constants_and_padding(gpt2_dir):
    enc = encodings.Main.get_encoder()
    assert encodings.Main.n_vocab == 50257 and encodings.Main.eot_token == 50256
    assert enc.padding_token == 50259
    assert enc.decode([50259]) == ''
    ids = enc.encode('padded text')
    assert enc.decode(ids + [50259, 50259]) == 'padded text'
    assert enc.decode([ids[0], 50259] + ids[1:]) == 'padded text'  # a pad decodes to '' anywhere
    assert enc.decode([50256]) == '<|endoftext|>'
    with pytest.raises(ValueError, match='50300'):
        enc.decode([50300])


def test_tiktoken_writes_no_cache(gpt2_dir):
    """Building the encoder reads the local files without tiktoken copying them into its cache."""
    encodings._tiktoken_main.cache_clear()
    encodings.Main.get_encoder()
    cache = os.path.join(tempfile.gettempdir(), 'data-gym-cache')
    for f in ('encoder.json', 'vocab.bpe'):
        key = hashlib.sha1(str(gpt2_dir / f).encode()).hexdigest()
        assert not os.path.exists(os.path.join(cache, key))
    assert 'TIKTOKEN_CACHE_DIR' not in os.environ


def test_bad_local_files(tmp_path, shared_dir, monkeypatch):
    monkeypatch.setenv(encodings.ENCODING_DIR_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match='encoder.json'):
        encodings.Main.get_encoder()
    (tmp_path / 'encoder.json').write_bytes((shared_dir / 'gpt2-124M' / 'encoder.json').read_bytes()[:-2] + b'}')
    (tmp_path / 'vocab.bpe').write_bytes((shared_dir / 'gpt2-124M' / 'vocab.bpe').read_bytes())
    with pytest.raises(ValueError, match='Hash mismatch'):
        encodings.Main.get_encoder()


def test_download_from_local_server(shared_dir, monkeypatch, tmp_path):
    """Without $LMHP_GPT2_ENCODING_DIR the files are downloaded once (here from a local server laid out
    like the original's public bucket) into datasets_dir()/downloads."""
    root = tmp_path / 'www'
    (root / 'gpt-2' / 'encodings' / 'main').mkdir(parents=True)
    for f in ('encoder.json', 'vocab.bpe'):
        (root / 'gpt-2' / 'encodings' / 'main' / f).write_bytes((shared_dir / 'gpt2-124M' / f).read_bytes())
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.delenv(encodings.ENCODING_DIR_ENV, raising=False)
        monkeypatch.setattr(encodings, 'ENCODINGS_URL', f'http://127.0.0.1:{server.server_port}/gpt-2/encodings')
        enc = encodings.Main.get_encoder()
        assert enc.encode('Hello world') == [15496, 995]
        cached = os.path.join(os.environ['LMHP_DATASETS_DIR'], 'downloads', f'127.0.0.1:{server.server_port}',
                              'gpt-2', 'encodings', 'main', 'vocab.bpe')
        assert os.path.isfile(cached)
    finally:
        server.shutdown()
        server.server_close()


def test_test_encoding():
    """The original's 27-symbol test encoding."""
    enc = encodings.Test.get_encoder()
    assert encodings.Test.n_vocab == 27 and enc.padding_token == 27
    assert enc.encode('abz.') == [0, 1, 25, 26]
    assert enc.encode('a b!') == [0, 26, 1, 26]  # unknown characters map to '.'
    assert enc.decode([7, 4, 11, 11, 14, 27, 27]) == 'hello'
    assert enc.decode([30]) == '<unk>'


def test_get():
    assert encodings.get('main') is encodings.Main and encodings.get('test') is encodings.Test
    with pytest.raises(ValueError, match="unknown encoding 'nope'"):
        encodings.get('nope')
