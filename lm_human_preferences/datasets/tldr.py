"""TL;DR (Reddit posts) query texts: OpenAI's subset files, cleaned as the original tldr.py did."""

import json
import re

from tqdm import tqdm

from lm_human_preferences.utils import gcs

# The original's URL; `{mode}` is 'train' or 'valid'.
TLDR_URL = 'https://openaipublic.blob.core.windows.net/lm-human-preferences/tldr/{mode}-subset.json'


def clean_post(text):
    """The original's per-post clean-up: ftfy, at most one blank line in a row, strip."""
    import ftfy  # lazily: only preparing cnndm/tldr needs it
    text = ftfy.fix_text(text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def tldr_texts(mode):
    """All posts of a split, cleaned, in file order (language/datasets.py shuffles and caches them).

    The original's tldr_generator(mode, seed, shuffle, comm); shuffling moved to Dataset.
    """
    if mode == 'test':
        mode = 'valid'  # validation set serves as training set, since we don't have access..
    if mode not in ('train', 'valid'):
        raise ValueError(f"tldr: unknown mode '{mode}' (expected 'train', 'valid' or 'test')")
    url = TLDR_URL.format(mode=mode)
    path = gcs.download_file_cached(url)
    with open(path) as f:
        try:
            datas = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f'tldr: {path} (from {url}) is not valid JSON: {e}') from None
    if not isinstance(datas, list):
        raise ValueError(f'tldr: {path} (from {url}) must hold a JSON list of posts, got {type(datas).__name__}')
    texts = []
    for i, data in enumerate(tqdm(datas, desc=f'tldr {mode}: cleaning posts', unit='post')):
        if not isinstance(data, dict) or not isinstance(data.get('content'), str):
            raise ValueError(f"tldr: {path} (from {url}) post {i} has no string 'content' field")
        texts.append(clean_post(data['content']))
    return texts
