"""Book passages for the sentiment and descriptiveness tasks.

The original read OpenAI's `book_passages/{train,test}.jsonl` (one BookCorpus passage string per line),
which is no longer published. We cut passages of our own from BookCorpusOpen (the public re-crawl of
BookCorpus, one book per row) with the `datasets` library, by the recipe in `book_passages` below. A
passage only has to hold enough text for the query pipeline (language/datasets.py): it skips to just
after the first '.', keeps query_length (64) tokens, cuts back to the last '.'.

The same recipe cuts a directory of your own .txt books into passages (datasets/local.py).
"""

import os

from tqdm import tqdm

from lm_human_preferences.utils import gcs

# Arguments of datasets.load_dataset for BookCorpusOpen (columns `title`, `text`).
BOOKCORPUS = dict(path='lucadiliello/bookcorpusopen', split='train')

# Passages of about 1000 characters (~230 GPT-2 tokens): a first sentence to skip plus well over 64
# query tokens.
PASSAGE_CHARS = 1000
# Per BookCorpus book, at most this many passages, evenly spaced over its middle 80% (skipping the
# front and back matter: title pages, copyright notices, author notes). ~18k books -> ~1.1M passages.
PASSAGES_PER_BOOK = 64
# Every TEST_EVERY-th passage (in corpus order) is in the test split, the others in train.
TEST_EVERY = 20


def split_into_passages(text, passage_chars=PASSAGE_CHARS):
    """Consecutive passages of a text: whitespace runs (line breaks included) collapsed to one space,
    cut at the first space after every `passage_chars` characters (so no word is split)."""
    text = ' '.join(text.split())
    passages = []
    start = 0
    while start < len(text):
        end = text.find(' ', start + passage_chars)
        end = len(text) if end == -1 else end
        passages.append(text[start:end])
        start = end + 1
    return passages


def book_passages(text):
    """The passages we take from one BookCorpus book (see PASSAGES_PER_BOOK)."""
    passages = split_into_passages(text)
    skip = len(passages) // 10
    passages = passages[skip:len(passages) - skip]
    if len(passages) > PASSAGES_PER_BOOK:
        passages = [passages[i * len(passages) // PASSAGES_PER_BOOK] for i in range(PASSAGES_PER_BOOK)]
    return passages


def split_for_mode(passages, mode):
    """The train or test part of a list of passages (every TEST_EVERY-th passage is test)."""
    if mode == 'test':
        return passages[::TEST_EVERY]
    if mode == 'train':
        return [p for i, p in enumerate(passages) if i % TEST_EVERY != 0]
    raise ValueError(f"unknown mode '{mode}' for a books-like dataset (expected 'train' or 'test')")


def books_texts(mode):
    """All passages of a split, in corpus order (language/datasets.py shuffles and caches them).

    The original's books_generator(mode, seed, shuffle, comm); shuffling moved to Dataset.
    """
    split_for_mode([], mode)  # reject an unknown mode before a long download
    import datasets  # lazily: a heavy import only preparing the books data needs
    # Streamed: one pass over the ~6 GB of parquet, without a second on-disk copy as Arrow.
    books = datasets.load_dataset(**BOOKCORPUS, streaming=True,
                                  cache_dir=os.path.join(gcs.datasets_dir(), 'downloads', 'huggingface'))
    passages = []
    for i, book in enumerate(tqdm(books, desc='books: cutting passages', unit='book')):
        if not isinstance(book.get('text'), str):
            raise ValueError(f"books: row {i} of {BOOKCORPUS['path']} has no string 'text' column")
        passages.extend(book_passages(book['text']))
    return split_for_mode(passages, mode)
