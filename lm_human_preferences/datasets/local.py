"""Query texts from a directory of .txt files, for bringing your own corpus offline (no original).

Use it as `task.query_dataset=local:<dir>`. Every `*.txt` file under <dir> (recursively, in sorted
path order, read as UTF-8) is cut into passages with the books recipe (datasets/books.py), and the
passages are split into train and test the same way, so a directory of books stands in for the books
dataset.
"""

from pathlib import Path

from lm_human_preferences.datasets.books import split_for_mode, split_into_passages


def text_files(directory):
    """The sorted .txt files under directory; an error naming the directory if there are none."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f'local dataset: {directory} is not a directory')
    files = sorted(p for p in root.rglob('*.txt') if p.is_file())
    if not files:
        raise ValueError(f'local dataset: no .txt files under {directory}')
    return files


def local_texts(directory, mode):
    """All passages of a split, in file order (language/datasets.py shuffles them)."""
    passages = []
    for path in text_files(directory):
        try:
            text = path.read_text(encoding='utf-8')
        except UnicodeDecodeError as e:
            raise ValueError(f'local dataset: {path} is not UTF-8 text ({e})') from None
        passages.extend(split_into_passages(text))
    return split_for_mode(passages, mode)
