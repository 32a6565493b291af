#!/usr/bin/env python3
"""Query sampling speed: lm_tasks.make_query_sampler on a books-like dataset.

The corpus is the two public-domain books in ../shared/corpora/books (beside the checkout) when they
are there, else generated sentences, read as a `local:<dir>` dataset with the books task's settings
(query_length 64, start and end text '.'). The encoding is GPT-2's when its files can be found
($LMHP_GPT2_ENCODING_DIR, or ../shared/gpt2-124M), else the 27-symbol test encoding.
Prepared queries go to a temporary datasets dir, so the first line times a cold preparation.

    python benchmarks/query_sampling.py                   # batch 512, 200 batches
    python benchmarks/query_sampling.py --batch 64 --batches 1000
"""
import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from lm_human_preferences import lm_tasks  # noqa: E402
from lm_human_preferences.language import encodings  # noqa: E402

SHARED = REPO_ROOT.parent / 'shared'
WORDS = ('the', 'a', 'she', 'he', 'walked', 'into', 'room', 'quietly', 'garden', 'letter', 'smiled', 'never',
         'morning', 'long', 'house', 'friend', 'said', 'could', 'not', 'believe', 'what', 'happened', 'rain')


def corpus_dir(tmp):
    books = SHARED / 'corpora' / 'books'
    if books.is_dir():
        return books, 'shared public-domain books'
    rng = random.Random(0)
    root = Path(tmp) / 'generated'
    root.mkdir()
    for b in range(4):
        sentences = (' '.join(rng.choice(WORDS) for _ in range(rng.randint(5, 20))).capitalize() + '.'
                     for _ in range(5000))
        (root / f'book{b}.txt').write_text(' '.join(sentences))
    return root, 'generated text (4 x 5000 sentences)'


def encoder_and_name():
    if not os.environ.get(encodings.ENCODING_DIR_ENV) and (SHARED / 'gpt2-124M' / 'encoder.json').is_file():
        os.environ[encodings.ENCODING_DIR_ENV] = str(SHARED / 'gpt2-124M')
    if os.environ.get(encodings.ENCODING_DIR_ENV):
        return encodings.Main.get_encoder(), 'main (GPT-2 BPE)'
    return encodings.Test.get_encoder(), 'test (27 symbols; GPT-2 files not found)'


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--batch', type=int, default=512)
    parser.add_argument('--batches', type=int, default=200)
    parser.add_argument('--query-length', type=int, default=64)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        os.environ['LMHP_DATASETS_DIR'] = os.path.join(tmp, 'datasets')
        corpus, corpus_desc = corpus_dir(tmp)
        encoder, encoding_desc = encoder_and_name()
        hparams = lm_tasks.TaskHParams(query_length=args.query_length, query_dataset=f'local:{corpus}',
                                       response_length=24, start_text='.', end_text='.')
        print(f'corpus: {corpus_desc} ({corpus})\nencoding: {encoding_desc}\n'
              f'query_length {args.query_length}, batch {args.batch}')

        def make():
            return lm_tasks.make_query_sampler(hparams=hparams, encoder=encoder, batch_size=args.batch)

        t = time.perf_counter()
        make()
        print(f'prepare (cold: read, cut passages, encode, save .npy): {time.perf_counter() - t:8.3f} s')
        t = time.perf_counter()
        sampler = make()
        print(f'load (warm: memory-map the prepared .npy):             {time.perf_counter() - t:8.3f} s')

        sampler()  # first touch of the mapped pages
        t = time.perf_counter()
        for _ in range(args.batches):
            tokens = sampler()['tokens']
        dt = (time.perf_counter() - t) / args.batches
        assert tuple(tokens.shape) == (args.batch, args.query_length)
        print(f'sample: {dt * 1e6:10.1f} us per batch of {args.batch}   {args.batch / dt:14,.0f} queries/s '
              f'(on {tokens.device})')


if __name__ == '__main__':
    main()
