"""Byte pair encoding utilities (port of the original language/encodings.py).

The original ran its own Python BPE (ReversibleEncoder) on GPT-2's encoder.json / vocab.bpe. We run
the same BPE through tiktoken, built from those same two files (tiktoken checks that the merge list
and the token ids agree); tests/test_encodings.py checks the ids against a reimplementation of the
original's algorithm.
"""

import functools
import hashlib
import os

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

# GPT-2's encoder.json and vocab.bpe ship with the package (gpt2_bpe/README.md: source, sha256s, MIT
# license), so that the `main` encoding needs no network; the original read them from
# gs://gpt-2/encodings/main at run time.
GPT2_BPE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'gpt2_bpe')

# sha256 of GPT-2's encoder.json and vocab.bpe (the hashes tiktoken's own gpt2() expects).
_MAIN_HASHES = {
    'encoder.json': '196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783',
    'vocab.bpe': '1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5',
}

# GPT-2's pre-tokenizer, as the original wrote it (no re.IGNORECASE: "DON'T" does not split at "'T").
# tiktoken's r50k pattern is an equivalent rewrite of it; we give tiktoken this one.
_PAT_STR = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class MainEncoder:
    """GPT-2 BPE (the original's ReversibleEncoder) on tiktoken."""

    def __init__(self, tiktoken_encoding, *, eot_token):
        self._enc = tiktoken_encoding
        self.eot_token = eot_token
        self.padding_token = tiktoken_encoding.n_vocab + 2  # +2 unnecessary, for historical reasons

    def encode(self, text):
        # encode_ordinary: like the original, '<|endoftext|>' in text is ordinary text, not token 50256.
        return self._enc.encode_ordinary(text)

    def decode(self, tokens, pretty=False):
        del pretty
        tokens = [int(t) for t in tokens]
        # The padding token decodes to '' (the original mapped it to '' in its decoder).
        real = [t for t in tokens if t != self.padding_token]
        bad = [t for t in real if not 0 <= t < self._enc.n_vocab]
        if bad:
            raise ValueError(f'cannot decode token ids {sorted(set(bad))}: not in the vocabulary '
                             f'[0, {self._enc.n_vocab}) and not the padding token {self.padding_token}')
        return self._enc.decode(real, errors='replace')


class TestEncoder:
    """The original's 27-symbol test encoding: one token per character, unknown characters map to '.'."""

    vocab = 'abcdefghijklmnopqrstuvwxyz.'

    def __init__(self):
        self.encoder = {w: i for i, w in enumerate(self.vocab)}
        self.decoder = {i: w for w, i in self.encoder.items()}
        self.padding_token = len(self.vocab)
        self.decoder[self.padding_token] = ''
        self.eot_token = None

    def encode(self, text):
        return [self.encoder.get(x, len(self.vocab) - 1) for x in text]

    def decode(self, tokens, pretty=False):
        return ''.join([self.decoder.get(int(t), '<unk>') for t in tokens])


def _check_hash(path, filename):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: GPT-2's {filename} ships with the package (reinstall it)")
    with open(path, 'rb') as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if digest != _MAIN_HASHES[filename]:
        raise ValueError(f'Hash mismatch: {path} has sha256 {digest}, GPT-2\'s {filename} has {_MAIN_HASHES[filename]}')


@functools.lru_cache(maxsize=None)
def _tiktoken_main(encoder_json_path, vocab_bpe_path, n_vocab, eot_token):
    # tiktoken reads even local paths through its download cache, which would write a copy under
    # $TMPDIR; TIKTOKEN_CACHE_DIR="" turns that cache off (and with it tiktoken's hash check, so we
    # check the hashes ourselves). tiktoken asserts that encoder.json agrees with the merges in
    # vocab.bpe: its ranks are then the original's token ids.
    _check_hash(encoder_json_path, 'encoder.json')
    _check_hash(vocab_bpe_path, 'vocab.bpe')
    saved = os.environ.get('TIKTOKEN_CACHE_DIR')
    os.environ['TIKTOKEN_CACHE_DIR'] = ''
    try:
        ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=vocab_bpe_path, encoder_json_file=encoder_json_path)
    finally:
        if saved is None:
            del os.environ['TIKTOKEN_CACHE_DIR']
        else:
            os.environ['TIKTOKEN_CACHE_DIR'] = saved
    return tiktoken.Encoding(name='gpt2', pat_str=_PAT_STR, mergeable_ranks=ranks,
                             special_tokens={'<|endoftext|>': eot_token}, explicit_n_vocab=n_vocab)


class Encoding:
    def __init__(self, name, *, n_vocab=0, eot_token=None):
        self.name = name
        self.eot_token = eot_token
        self.n_vocab = n_vocab

    def bpe_files(self):
        """Ours: the paths of this BPE encoding's encoder.json and vocab.bpe (GPT-2's vocabulary and merges,
        shipped in GPT2_BPE_DIR: the Hugging Face import compares a tokenizer with them, the export writes them)."""
        return os.path.join(GPT2_BPE_DIR, 'encoder.json'), os.path.join(GPT2_BPE_DIR, 'vocab.bpe')

    def get_encoder(self):
        if self.name == 'test':
            assert len(TestEncoder.vocab) == self.n_vocab
            return TestEncoder()
        enc = _tiktoken_main(*self.bpe_files(), self.n_vocab, self.eot_token)
        return MainEncoder(enc, eot_token=self.eot_token)


Main = Encoding('main', n_vocab=50257, eot_token=50256)

Test = Encoding('test', n_vocab=27, eot_token=26)

_ENCODINGS = {e.name: e for e in (Main, Test)}


def get(name):
    if name not in _ENCODINGS:
        raise ValueError(f'unknown encoding {name!r}; known: {sorted(_ENCODINGS)}')
    return _ENCODINGS[name]
