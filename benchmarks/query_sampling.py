#!/usr/bin/env python3
"""Query sampling speed: lm_tasks.make_query_sampler on a books-like dataset.

The corpus is the two public-domain books that ship with the sentiment miniature
(lm_human_preferences/sentiment_mini/books), read as a `local:<dir>` dataset with the books task's
settings (query_length 64, start and end text '.') and GPT-2's encoding. Prepared queries go to a
temporary datasets dir, so the first line times a cold preparation.

    python benchmarks/query_sampling.py                   # batch 512, 200 batches
    python benchmarks/query_sampling.py --batch 64 --batches 1000
"""
import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from lm_human_preferences import lm_tasks  # noqa: E402
from lm_human_preferences.language import encodings  # noqa: E402
from lm_human_preferences.sentiment_mini import BOOKS_DIR  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--batch', type=int, default=512)
    parser.add_argument('--batches', type=int, default=200)
    parser.add_argument('--query-length', type=int, default=64)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        os.environ['LMHP_DATASETS_DIR'] = os.path.join(tmp, 'datasets')
        encoder = encodings.Main.get_encoder()
        hparams = lm_tasks.TaskHParams(query_length=args.query_length, query_dataset=f'local:{BOOKS_DIR}',
                                       response_length=24, start_text='.', end_text='.')
        print(f'corpus: the public-domain books in {BOOKS_DIR}\nencoding: main (GPT-2 BPE)\n'
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
