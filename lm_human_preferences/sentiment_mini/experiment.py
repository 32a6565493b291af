"""The sentiment miniature's experiment (ours; the package's docstring says what it is): its query dataset,
pretraining corpus and settings, and VADER as its labeler."""

from functools import partial
from pathlib import Path

from lm_human_preferences.datasets.local import local_texts
from lm_human_preferences.labeling import questions
from lm_human_preferences.language import datasets, encodings
from lm_human_preferences.offline import experiment
from lm_human_preferences.offline.pretrain import PretrainHParams
from lm_human_preferences.sentiment_mini import vader

NAME = 'sentiment_mini'
BOOKS_DIR = Path(__file__).with_name('books')

# The query dataset: the books' passages (not cached as texts: they ship with the code; the prepared
# queries are cached, keyed by the texts' hash).
SentimentMini = datasets.Dataset(NAME, texts=partial(local_texts, BOOKS_DIR), cache_texts=False)


def pretraining_corpus():
    """The passages of the train split, in book order, as one text: the test queries' passages are left out."""
    return ' '.join(local_texts(BOOKS_DIR, 'train'))


# Declared: the layers below learn its model and labeler by name (offline/experiment.OfflineExperiment.declare).
EXPERIMENT = experiment.OfflineExperiment(
    name=NAME,
    encoding=encodings.Main,
    corpus=pretraining_corpus,
    # Windows of 96 tokens (more than the task's 8 query + 16 response tokens); 800 steps: about 2.8 passes over
    # the train split.
    # seed 1: one initial model for every run.seed, as the paper's runs all start from one GPT-2; published (below).
    # bf16 products where the CPU multiplies bf16 natively: the output layer's three products are ~98 % of a
    # step's FLOPs, and on a Zen 4 (AVX512-BF16) bf16 runs them at 205-420 GFLOP/s against fp32's 57-174
    # (benchmarks/README.md). A CPU pretrains another model than another kind's (its kernels round otherwise):
    # the published one is what every CPU starts from.
    pretrain=PretrainHParams(n_layer=2, n_embd=128, n_head=4, n_ctx=96, steps=800, batch_size=8, lr=3e-3,
                             seed=1, bf16_products=True),
    labeler=experiment.Labeler(name='vader', description='VADER (vaderSentiment): prefer the most positive response '
                                                       '(the highest compound score)',
                             score_name='VADER compound score', score=vader.compound_score, title='VADER',
                             # The paper's sentiment question, which VADER answers by its compound score.
                             instruction=questions.INSTRUCTIONS['sentiment']),
    # 1,024 test queries: the trained policy's gain to a standard error of ~0.05 of the initial scores' std.
    eval_queries=1024,
    # 2,048 held-out labels: the reward model's accuracy to a standard error of ~1 point (512 left 2 points, and a
    # seed's 512 could be 8 points harder than another's for every reward model: docs/sentiment_mini.md).
    held_out_labels=2048,
    cpu_threads=2,  # unlike the demo's, this model's time goes to large matrix products (the logits)
    encoding_note=" (OpenAI's GPT-2 BPE, a Hugging Face GPT-2's): a model of the original's `test` characters runs "
                  "on the demo experiment",
    # The initial model and run.seed 1-3's labels, made on a CPU with AMX (published/published.json): 27 MB of
    # weights and 1.6 MB of gzipped labels a seed, against 18 of a first run's 28 minutes on an AVX2-only CPU and
    # another experiment on every kind of CPU (published.py).
    published=str(Path(__file__).with_name('published')),
).declare()
