"""Tests for language/datasets.py and the sources in lm_human_preferences/datasets/.

Download paths are exercised for real against a local http.server on 127.0.0.1 serving files the
tests write (a tldr JSON, cnndm URL list and story tarballs); BookCorpus goes through the real
`datasets.load_dataset` on a local JSON file.
"""
import hashlib
import io
import json
import os
import random
import tarfile
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from lm_human_preferences.datasets import books, cnndm, local, tldr
from lm_human_preferences.language import datasets, encodings, query_streams
from lm_human_preferences.utils import gcs, launch, ranks

P = 27  # the test encoding's padding token ('a'..'z' are 0..25, '.' is 26)


@pytest.fixture
def test_encoder():
    return encodings.Test.get_encoder()


def cut(tokens, L, start=None, end=None, pad=P):
    return datasets.cut_query(tokens, sequence_length=L, start_token=start, end_token=end, padding_token=pad)


# ---------------------------------------------------------------------------------------------------
# The per-text pipeline, hand-computed

def test_cut_query_start_token_is_cut_with_its_first_occurrence():
    assert cut([1, 26, 2, 3, 26, 4], 8, start=26) == [2, 3, 26, 4, P, P, P, P]


def test_cut_query_start_token_as_last_token_keeps_the_whole_text():
    # The original only cuts when something follows the start token.
    assert cut([1, 2, 26], 4, start=26) == [1, 2, 26, P]


def test_cut_query_skips_texts_without_start_or_end_token():
    assert cut([1, 2, 3], 4, start=26) is None
    assert cut([1, 2, 3], 4, end=26) is None
    # The end token must survive truncation to sequence_length.
    assert cut([26, 1, 2, 3, 4, 26], 4, start=26, end=26) is None


def test_cut_query_truncates_then_cuts_after_last_end_token():
    # after start: [1, 26, 2, 3, 26, 5, 6]; first 4: [1, 26, 2, 3]; up to the last 26: [1, 26]
    assert cut([26, 1, 26, 2, 3, 26, 5, 6], 4, start=26, end=26) == [1, 26, P, P]
    assert cut([5, 6, 7, 8, 9], 3) == [5, 6, 7]
    assert cut([], 2) == [P, P]


# ---------------------------------------------------------------------------------------------------
# Datasets over a local directory of .txt files

def write_corpus(root, texts):
    root.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(texts):
        (root / f'{i:02d}.txt').write_text(text, encoding='utf-8')
    return root


def reference_stream(texts, encoder, L, start, end, seed=0):
    """The original's tf_dataset for one epoch, written out: shuffle (global random, seed), encode, cut, skip."""
    texts = list(texts)
    random.seed(seed)
    random.shuffle(texts)
    out = []
    for text in texts:
        q = cut(encoder.encode(text), L, start=start, end=end, pad=encoder.padding_token)
        if q is not None:
            out.append(q)
    return out


def corpus_texts(n):
    # Lowercase letters and '.' only (the test encoding maps anything else to '.'); no spaces, so each file
    # is one passage. Every third text has no '.', so the pipeline skips it.
    def letters(i):
        return chr(97 + i % 26) + chr(97 + i // 26)
    return [f'intro{letters(i)}.passage{letters(i)}ends.tail' if i % 3 else f'nostop{letters(i)}' for i in range(n)]


def test_local_dataset_matches_the_original_pipeline(tmp_path, test_encoder):
    texts = corpus_texts(60)
    root = write_corpus(tmp_path / 'corpus', texts)
    train = [t for i, t in enumerate(texts) if i % books.TEST_EVERY != 0]  # one passage per file
    assert local.local_texts(str(root), 'train') == train

    data = datasets.get_dataset(f'local:{root}').torch_dataset(16, mode='train', encoder=test_encoder,
                                                              start_token=26, end_token=26)
    expected = reference_stream(train, test_encoder, 16, 26, 26)
    assert 0 < len(expected) < len(train)  # some texts were skipped
    got = torch.cat([data.next_batch(7) for _ in range(2 * len(expected) // 7 + 1)])  # > 2 epochs
    assert got.dtype == torch.long and got.shape[1] == 16
    want = torch.tensor([expected[i % len(expected)] for i in range(len(got))])
    assert torch.equal(got, want)
    assert next(iter(data))['tokens'].shape == (16,)


def test_prepared_queries_are_cached_and_memory_mapped(tmp_path, test_encoder):
    root = write_corpus(tmp_path / 'corpus', corpus_texts(30))
    name = f'local:{root}'
    first = datasets.get_dataset(name).torch_dataset(8, mode='test', encoder=test_encoder, start_token=26)
    files = sorted(os.listdir(os.path.join(gcs.datasets_dir(), datasets.get_dataset(name).cache_name)))
    assert [f for f in files if f.endswith('.npy')] and not [f for f in files if '.tmp-' in f]
    again = datasets.get_dataset(name).torch_dataset(8, mode='test', encoder=test_encoder, start_token=26)
    assert isinstance(again.shards[0].queries, np.memmap)
    assert again.shards[0].queries.dtype == np.uint16
    assert torch.equal(first.next_batch(5), again.next_batch(5))
    # What a run records of its queries: the sha256 of the query stream and its length, the same from
    # the cache as freshly prepared
    assert first.fingerprint == again.fingerprint
    assert set(first.fingerprint) == {'dataset', 'mode', 'sha256', 'queries'} and len(first.fingerprint['sha256']) == 64
    order = first.shards[0].order
    assert first.fingerprint['sha256'] == hashlib.sha256(np.asarray(again.shards[0].queries)[order].tobytes()).hexdigest()

    # Editing the corpus changes the texts' hash: the queries are prepared again, not read stale.
    (root / '00.txt').write_text('zzz.yyy', encoding='utf-8')
    edited = datasets.get_dataset(name).torch_dataset(8, mode='test', encoder=test_encoder, start_token=26)
    assert edited.fingerprint['sha256'] != first.fingerprint['sha256']
    assert not isinstance(edited.shards[0].queries, np.memmap)
    assert 'yyy' in [test_encoder.decode(q) for q in edited.next_batch(len(edited.shards[0].order)).tolist()]


def test_sharding_takes_every_nth_query_of_the_repeated_stream():
    queries = np.arange(10 * 2).reshape(10, 2)
    order = np.array([3, 1, 4, 0, 9, 2, 6])  # 7 valid queries, shuffled
    stream = [order[i % 7] for i in range(40)]
    for shard in range(3):
        data = query_streams.ArrayQueries(queries, order, num_shards=3, shard_idx=shard, repeat_count=None)
        got = torch.cat([data.next_batch(4) for _ in range(3)])
        want = torch.tensor(queries[stream[shard::3][:12]])
        assert torch.equal(got, want)


def test_finite_repeat_count_drops_the_remainder():
    queries = np.arange(5)[:, None]
    data = query_streams.ArrayQueries(queries, np.arange(5), num_shards=2, shard_idx=1, repeat_count=2)
    # Stream of 10: shard 1 gets positions 1, 3, 5, 7, 9 -> queries 1, 3, 0, 2, 4.
    assert data.next_batch(2).flatten().tolist() == [1, 3]
    assert data.next_batch(2).flatten().tolist() == [0, 2]
    with pytest.raises(StopIteration):
        data.next_batch(2)


def _shard_worker(root, out_dir):
    data = datasets.get_dataset(f'local:{root}').torch_dataset(
        16, mode='train', encoder=encodings.Test.get_encoder(), start_token=26, end_token=26)
    batches = ranks.for_each_rank(lambda: data.next_batch(3))
    for rank, batch in zip(ranks.local_ranks(), batches):
        np.save(os.path.join(out_dir, f'rank{rank}.npy'), batch.numpy())
    with pytest.raises(RuntimeError, match='inside their rank sections'):
        data.next_batch(3)  # which rank's? this process carries two


@pytest.mark.slow
def test_four_ranks_in_two_processes_take_every_fourth_query(tmp_path, test_encoder, gloo):
    texts = corpus_texts(40)
    root = write_corpus(tmp_path / 'corpus', texts)
    launch.launch('shards', partial(_shard_worker, str(root), str(tmp_path)), mpi=4, procs=2)
    train = [t for i, t in enumerate(texts) if i % books.TEST_EVERY != 0]
    expected = reference_stream(train, test_encoder, 16, 26, 26)
    stream = [expected[i % len(expected)] for i in range(12)]
    for rank in range(4):
        assert np.load(tmp_path / f'rank{rank}.npy').tolist() == stream[rank::4]


def test_a_dataset_without_any_query_is_an_error(tmp_path, test_encoder):
    root = write_corpus(tmp_path / 'corpus', ['nostophere', 'noneheremeither'])
    with pytest.raises(ValueError, match='none of its 1 texts gives a query'):
        datasets.get_dataset(f'local:{root}').torch_dataset(8, mode='train', encoder=test_encoder, start_token=26)


def test_local_dataset_errors_name_the_directory(tmp_path, test_encoder):
    with pytest.raises(FileNotFoundError, match='is not a directory'):
        local.local_texts(str(tmp_path / 'nope'), 'train')
    (tmp_path / 'empty').mkdir()
    with pytest.raises(ValueError, match='no .txt files under'):
        local.local_texts(str(tmp_path / 'empty'), 'train')


def test_unknown_dataset_lists_the_registered_ones():
    with pytest.raises(KeyError, match='books, cnndm, .*test, tldr'):
        datasets.get_dataset('bookz')


def test_test_dataset_gives_right_padded_queries(test_encoder):
    data = datasets.get_dataset('test').torch_dataset(6, mode='train', encoder=test_encoder, start_token=26)
    batch = data.next_batch(50)
    assert batch.shape == (50, 6)
    assert batch.min() >= 0 and batch.max() <= P
    for row in batch.tolist():
        n = row.index(P) if P in row else 6
        assert row[n:] == [P] * (6 - n) and n > 0


def test_shipped_books_with_gpt2():
    """The public-domain books that ship with the sentiment miniature, as a local: dataset."""
    from lm_human_preferences.sentiment_mini import BOOKS_DIR
    encoder = encodings.Main.get_encoder()
    data = datasets.get_dataset(f'local:{BOOKS_DIR}').torch_dataset(
        64, mode='train', encoder=encoder, start_token=13, end_token=13)
    assert len(data.shards[0].order) > 700  # Alice + Pride and Prejudice: ~800 train passages, nearly all usable
    for row in data.next_batch(20).tolist():
        real = [t for t in row if t != encoder.padding_token]
        assert real[-1] == 13 and row[len(real):] == [encoder.padding_token] * (64 - len(real))


# ---------------------------------------------------------------------------------------------------
# Books recipe

def test_split_into_passages_cuts_at_the_first_space_after_the_limit():
    text = 'aaaa bb\n\ncc   dddd e'  # -> 'aaaa bb cc dddd e'
    assert books.split_into_passages(text, passage_chars=5) == ['aaaa bb', 'cc dddd', 'e']
    assert books.split_into_passages('', passage_chars=5) == []


def test_book_passages_take_64_evenly_from_the_middle():
    # 6-character words and a space: with PASSAGE_CHARS = 1000 a passage is 143 words (it ends at the
    # space at 1000 = 7 * 142 + 6).
    assert books.PASSAGE_CHARS == 1000 and books.PASSAGES_PER_BOOK == 64
    words = [f'w{i:05d}' for i in range(143 * 100)]
    passages = books.book_passages(' '.join(words))
    # 100 passages, the middle 80 (10..89), 64 of them at 10 + i*80//64.
    assert len(passages) == 64
    for i, idx in [(0, 10), (1, 11), (4, 15), (63, 88)]:
        assert passages[i] == ' '.join(words[143 * idx:143 * (idx + 1)])


def test_books_texts_from_bookcorpus_rows(tmp_path, monkeypatch):
    rows = [{'title': f'book {b}', 'text': ' '.join(f'b{b}w{i:03d}' for i in range(1700))} for b in range(3)]
    path = tmp_path / 'books.jsonl'
    path.write_text(''.join(json.dumps(r) + '\n' for r in rows))
    monkeypatch.setattr(books, 'BOOKCORPUS', dict(path='json', data_files=str(path), split='train'))
    everything = [p for r in rows for p in books.book_passages(r['text'])]
    train, test = books.books_texts('train'), books.books_texts('test')
    assert test == everything[::20] and len(test) + len(train) == len(everything)
    assert set(train).isdisjoint(test) and train[0] == everything[1]
    with pytest.raises(ValueError, match="unknown mode 'valid'"):
        books.books_texts('valid')


# ---------------------------------------------------------------------------------------------------
# tldr and cnndm: parsing and clean-up of real files, downloaded from a local server

@pytest.fixture
def http_root(tmp_path):
    root = tmp_path / 'www'
    root.mkdir()
    server = ThreadingHTTPServer(('127.0.0.1', 0), partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True)
    thread.start()
    yield root, f'http://127.0.0.1:{server.server_address[1]}'
    server.shutdown()
    server.server_close()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_tldr_downloads_and_cleans_posts(http_root, monkeypatch, test_encoder):
    root, url = http_root
    (root / 'tldr').mkdir()
    posts = [
        {'subreddit': 'x', 'content': '  First post.\n\n\n\nSecond paragraph\u2019s text.  \n'},
        {'content': 'Mojibake: caf\u00c3\u00a9 and \u201cquotes\u201d.'},
    ]
    (root / 'tldr' / 'valid-subset.json').write_text(json.dumps(posts))
    monkeypatch.setattr(tldr, 'TLDR_URL', url + '/tldr/{mode}-subset.json')
    assert tldr.tldr_texts('test') == ["First post.\n\nSecond paragraph's text.", 'Mojibake: caf\u00e9 and "quotes".']

    # Through the registered dataset: prepared once, then read from the cache.
    data = datasets.get_dataset('tldr').torch_dataset(12, mode='test', encoder=test_encoder, shuffle=False)
    cached = os.path.join(gcs.datasets_dir(), 'tldr', 'test.texts.jsonl')
    assert [json.loads(line) for line in open(cached)] == tldr.tldr_texts('test')
    assert test_encoder.decode(data.next_batch(1)[0].tolist()) == '.irst.post..'  # '.' stands for unknowns (here 'F', ' ')

    (root / 'tldr' / 'train-subset.json').write_text(json.dumps([{'title': 'no content'}]))
    with pytest.raises(ValueError, match="post 0 has no string 'content' field"):
        tldr.tldr_texts('train')
    with pytest.raises(ValueError, match="unknown mode 'dev'"):
        tldr.tldr_texts('dev')


CNN_STORY = """By . Jane Reporter .

(CNN) -- The first paragraph \u2018is\u2019 here.



The second paragraph.

@highlight

A highlight

@highlight

Another"""

DM_STORY = """Line one header\r
PUBLISHED: 10:00 EST, 1 May 2013 | UPDATED: 12:34 EST, 2 May 2013\r
\r
Body text starts here.\r
\r
@highlight\r
\r
Summary"""


def _add(tar, name, text):
    raw = text.encode('utf-8')
    info = tarfile.TarInfo(name)
    info.size = len(raw)
    tar.addfile(info, io.BytesIO(raw))


def test_cnndm_reads_and_cleans_stories(http_root, monkeypatch):
    root, url = http_root
    urls = ['http://www.cnn.com/2013/story-a.html', 'http://www.dailymail.co.uk/news/article-1.html']
    h = [hashlib.sha1(u.encode()).hexdigest() for u in urls]
    (root / 'all_test.txt').write_text('\n'.join(reversed(urls)) + '\n')  # order: daily mail first
    for site, members in [('cnn', [(f'cnn/stories/{h[0]}.story', CNN_STORY), ('cnn/stories/other.story', 'x')]),
                          ('dailymail', [(f'./dailymail/stories/{h[1]}.story', DM_STORY)])]:
        with tarfile.open(root / f'{site}.tgz', 'w:gz') as tar:
            for name, text in members:
                _add(tar, name, text)
    monkeypatch.setattr(cnndm, 'URL_LISTS_URL', url + '/all_{mode}.txt')
    monkeypatch.setattr(cnndm, 'STORIES_URLS', {'cnn': url + '/cnn.tgz', 'dailymail': url + '/dailymail.tgz'})

    assert cnndm.get_path_of_url(urls[0]) == f'cnn/stories/{h[0]}.story'
    assert cnndm.cnndm_texts('test') == [
        # The UPDATED header line and everything before it goes; '\r\n' read as '\n'.
        'Body text starts here.',
        # The byline's two lines go, then everything up to "(CNN) --"; smart quotes straightened,
        # 4 newlines become 2, the @highlight part goes.
        "The first paragraph 'is' here.\n\nThe second paragraph.",
    ]

    (root / 'all_val.txt').write_text('http://www.cnn.com/missing.html\n')
    with pytest.raises(ValueError, match=r'no story cnn/stories/\w+\.story for URL http://www.cnn.com/missing.html'):
        cnndm.cnndm_texts('valid')
    with pytest.raises(ValueError, match='neither a CNN nor a Daily Mail'):
        cnndm.get_path_of_url('http://example.com/a')


def test_cnndm_clean_up_start_cases():
    assert cnndm.clean_up_start('WASHINGTON (CNN)The president spoke.') == 'The president spoke.'
    # "(CNN)" is only looked for in the first 100 characters.
    late = 'x' * 120 + ' (CNN) y'
    assert cnndm.clean_up_start(late) == late
    assert cnndm.clean_up_start('and more\nText') == 'Text'
