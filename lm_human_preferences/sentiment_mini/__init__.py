"""The paper's sentiment task in miniature (ours): `python launch.py train_policy sentiment_mini NAME`.

The paper's `sentiment` experiment (continue book passages so that the continuations become more
positive, as labelers who picked the best of four judged, under a KL penalty) on a CPU in minutes, with
nothing downloaded, through the offline experiments' engine (offline/); the experiment: experiment.py, its
bindings: bindings.py.

- The real `main` encoding: OpenAI's GPT-2 BPE (50,257 tokens, padding token 50259), through
  encodings.Main as every run of the paper.
- Real English: the public-domain books in books/ (README there: sources, sha256s, license), read
  through the books task's query pipeline as the `sentiment_mini` query dataset (the `local:` recipe of
  datasets/local.py); launch.py's books task but for the dataset, the model and shorter queries and
  responses (bindings.py).
- Initial model: a small GPT-2 on that vocabulary, pretrained on the books' train split, one for every
  run.seed; published in published/ with run.seed 1-3's labels (offline/published.py), so that every CPU
  starts from the same weights and labels.
- Labeler: VADER (vader.py), a published sentiment model, picks the most positive of the initial
  policy's 4 responses to each query: the paper's sentiment instructions with VADER in the labelers' seat.

Its experiment, once asked for, registers the `sentiment_mini` query dataset (sample.py asks, to sample from a
run's policy); it imports vaderSentiment only when labels are made.
"""


# experiment.py's names, imported when first asked for (PEP 562): it pulls in the trainers and torch, which
# launch.py's start-up (bindings.py, the --help) does without.
DECLARED = ('EXPERIMENT', 'NAME', 'BOOKS_DIR', 'SentimentMini', 'pretraining_corpus')


def __getattr__(name):
    if name not in DECLARED:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    from lm_human_preferences.sentiment_mini import experiment
    return getattr(experiment, name)
