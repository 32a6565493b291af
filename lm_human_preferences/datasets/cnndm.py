"""CNN/DailyMail query texts: the raw .story files, cleaned as the original cnndm.py did.

The original read the stories from a copy of the DeepMind Q&A story files in a private bucket
(`gs://lm-human-preferences/datasets/cnndm/cache_{mode}`), selected and ordered by abisee's URL lists.
We read the same story files from the two public tarballs that the Hugging Face `cnn_dailymail`
loading script downloaded (pinned to the commit it used), so the texts are the original's texts.
Not the `datasets` library's `cnn_dailymail` 3.0.0 `article` field: that joins the lines with spaces
and appends missing periods, which loses the paragraph newlines (the task's end_text is '\n') and
breaks the byline clean-up below (it drops the first two *lines*).
"""

import hashlib
import io
import re
import tarfile

from tqdm import tqdm

from lm_human_preferences.utils import gcs

# The original's URL lists (data originally from https://github.com/abisee/cnn-dailymail); `{mode}` is
# 'train', 'val' or 'test'.
URL_LISTS_URL = ('https://openaipublic.blob.core.windows.net/lm-human-preferences/datasets/cnndm/url_lists/'
                 'all_{mode}.txt')
# The DeepMind Q&A story tarballs: members are `cnn/stories/<sha1>.story`, `dailymail/stories/<sha1>.story`.
_STORIES = 'https://huggingface.co/datasets/cnn_dailymail/resolve/11343c3752184397d56efc19a8a7cceb68089318/data'
STORIES_URLS = {
    'cnn': f'{_STORIES}/cnn_stories.tgz',
    'dailymail': f'{_STORIES}/dailymail_stories.tgz',
}


def hashhex(s):
    """Returns a heximal formated SHA1 hash of the input string."""
    h = hashlib.sha1()
    h.update(s)
    return h.hexdigest()


def get_path_of_url(url):
    if 'dailymail.co.uk' in url or 'mailonsunday.ie' in url or 'lib.store.yahoo.net' in url:
        site = 'dailymail'
    else:
        if not ('cnn.com' in url or 'cnn.hk' in url):
            raise ValueError(f'cnndm: URL {url!r} is neither a CNN nor a Daily Mail article')
        site = 'cnn'
    url_hash = hashhex(url.encode('utf-8'))
    return f'{site}/stories/{url_hash}.story'


def clean_up_start(text):
    if text[:2] == 'By':
        text = '\n'.join(text.split('\n')[2:])
    text = re.split(r'\(CNN\) +--', text)[-1]
    text = re.split(r"\(CNN\)", text[:100])[-1]+text[100:]
    text = re.sub(r"^and \w+\n", "", text)
    # As the original: `[2011|2012|...]` is a character class (one of "012345|"), not a year alternation.
    text = re.split(r".*UPDATED:\s+[0-9]{2}:[0-9]{2}.*[2011|2012|2013|2014|2015]", text)[-1]
    text = text.replace('’', "'")
    text = text.replace('‘', "'")
    return text.strip()


def clean_story(text):
    """The original generator's clean-up of one story file: the article before the first @highlight."""
    import ftfy  # lazily: only preparing cnndm/tldr needs it
    text = clean_up_start(text)
    text = ftfy.fix_text(text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.split('@highlight')[0].strip()


def read_stories(tgz_path, wanted):
    """{member path: text} for the members of a story tarball named in `wanted`.

    Decoded like the original's `open(path).read()`: UTF-8 with universal newlines ('\\r\\n', '\\r' -> '\\n').
    """
    stories = {}
    with tarfile.open(tgz_path, 'r|gz') as tar:  # streamed: one pass, no seeking in the 0.5 GB archive
        for member in tqdm(tar, desc=f'cnndm: reading {tgz_path.rsplit("/", 1)[-1]}', unit='file'):
            name = member.name[2:] if member.name.startswith('./') else member.name
            if member.isfile() and name in wanted:
                raw = tar.extractfile(member).read()
                stories[name] = io.TextIOWrapper(io.BytesIO(raw), encoding='utf-8').read()
    return stories


def cnndm_texts(mode):
    """All articles of a split, cleaned, in URL-list order (language/datasets.py shuffles and caches them).

    The original's cnndm_generator(mode, seed, shuffle, comm); shuffling moved to Dataset.
    """
    if mode == 'valid':
        mode = 'val'
    if mode not in ('train', 'val', 'test'):
        raise ValueError(f"cnndm: unknown mode '{mode}' (expected 'train', 'valid', 'val' or 'test')")
    with open(gcs.download_file_cached(URL_LISTS_URL.format(mode=mode))) as f:
        urls = [line.strip() for line in f]
    paths = [get_path_of_url(url) for url in urls]

    stories = {}
    for site, stories_url in STORIES_URLS.items():
        wanted = {p for p in paths if p.startswith(site + '/')}
        if wanted:
            stories.update(read_stories(gcs.download_file_cached(stories_url), wanted))

    texts = []
    for url, path in zip(tqdm(urls, desc=f'cnndm {mode}: cleaning stories', unit='story'), paths):
        if path not in stories:
            site = path.split('/')[0]
            raise ValueError(f'cnndm: no story {path} for URL {url} in {STORIES_URLS[site]}')
        texts.append(clean_story(stories[path]))
    return texts
