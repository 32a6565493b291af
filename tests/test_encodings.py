"""Encoding tests: our tiktoken-based GPT-2 BPE gives the original ReversibleEncoder's ids.

The reference below reimplements the original's BPE algorithm (language/encodings.py) in plain
Python, reading the same encoder.json / vocab.bpe, which ship with the package (language/gpt2_bpe/).
"""

import functools
import hashlib
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

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
def gpt2_dir():
    return Path(encodings.GPT2_BPE_DIR)


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
    cache_dir_before = os.environ.get('TIKTOKEN_CACHE_DIR')  # a machine may set its own
    encodings.Main.get_encoder()
    cache = os.path.join(tempfile.gettempdir(), 'data-gym-cache')
    for f in ('encoder.json', 'vocab.bpe'):
        key = hashlib.sha1(str(gpt2_dir / f).encode()).hexdigest()
        assert not os.path.exists(os.path.join(cache, key))
    assert os.environ.get('TIKTOKEN_CACHE_DIR') == cache_dir_before


def test_bad_bpe_files(tmp_path, gpt2_dir, monkeypatch):
    """A missing or altered BPE file is one line naming it (a broken install)."""
    monkeypatch.setattr(encodings, 'GPT2_BPE_DIR', str(tmp_path))
    encodings._tiktoken_main.cache_clear()
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'encoder.json'} is missing: GPT-2's encoder.json ships "
                                                r"with the package \(reinstall it\)"):
        encodings.Main.get_encoder()
    (tmp_path / 'encoder.json').write_bytes((gpt2_dir / 'encoder.json').read_bytes()[:-2] + b'}')
    shutil.copy(gpt2_dir / 'vocab.bpe', tmp_path / 'vocab.bpe')
    with pytest.raises(ValueError, match=f"Hash mismatch: {tmp_path / 'encoder.json'} has sha256 "):
        encodings.Main.get_encoder()
    encodings._tiktoken_main.cache_clear()


def test_main_needs_no_network(monkeypatch):
    """The shipped files are GPT-2's (the sha256s tiktoken expects, with their MIT license beside them),
    and the `main` encoding is built from them with every connection refused (the original downloaded
    them)."""
    shipped = Path(encodings.GPT2_BPE_DIR)
    for name, digest in encodings._MAIN_HASHES.items():
        assert hashlib.sha256((shipped / name).read_bytes()).hexdigest() == digest
    assert 'Copyright (c) 2019 OpenAI' in (shipped / 'LICENSE').read_text(encoding='utf-8')

    def refuse(*args, **kwargs):
        raise AssertionError('the main encoding tried to connect')
    monkeypatch.setattr(socket, 'create_connection', refuse)
    monkeypatch.setattr(socket.socket, 'connect', refuse)
    encodings._tiktoken_main.cache_clear()
    assert encodings.Main.get_encoder().encode('Hello world') == [15496, 995]


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
