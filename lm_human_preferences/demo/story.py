"""Built-in text for the offline demo (offline/; no original), and its `demo` query dataset.

`story.txt` beside this file is a short story written for this project (MIT, as the rest of the
repository): about 1,700 words of plain English. The demo pretrains its small character-level model
on it and draws its queries from it, so the demo needs no download.

The text is lowercased and every run of non-letters becomes one space: the demo's encoding (the
original's `test` encoding: 26 letters and '.') then writes each word break as '.', and capitals or
punctuation never turn into stray '.' tokens.
"""

import re
from pathlib import Path

from lm_human_preferences.language import datasets

STORY_PATH = Path(__file__).with_name('story.txt')

# Passages: WORDS_PER_PASSAGE consecutive words starting at every word, so that a short corpus still
# gives one query per word. The last TEST_FRACTION of the story is the test split (contiguous, so
# that test queries are not windows of training ones).
WORDS_PER_PASSAGE = 24
TEST_FRACTION = 0.1


def demo_corpus():
    """The whole story, normalized: lowercase words separated by single spaces."""
    text = STORY_PATH.read_text(encoding='utf-8')
    return ' '.join(re.findall(r'[a-z]+', text.lower()))


def demo_texts(mode):
    """The passages of a split, in story order (language/datasets.py shuffles them)."""
    words = demo_corpus().split(' ')
    n_test = int(len(words) * TEST_FRACTION)
    if mode == 'train':
        words = words[:len(words) - n_test]
    elif mode == 'test':
        words = words[len(words) - n_test:]
    else:
        raise ValueError(f"unknown mode '{mode}' for the demo dataset (expected 'train' or 'test')")
    return [' '.join(words[i:i + WORDS_PER_PASSAGE]) for i in range(len(words) - WORDS_PER_PASSAGE + 1)]


# The demo's query dataset (task.query_dataset 'demo'), registered when the demo is imported. Not cached
# as texts: it ships with the code.
Demo = datasets.Dataset(
    "demo",
    texts=demo_texts,
    cache_texts=False,
)
