"""The offline demo's experiment (ours; the package's docstring says what it is): its dataset, pretraining,
labeler (THE RULE) and model."""

from pathlib import Path

from lm_human_preferences.demo.story import demo_corpus  # importing it registers the `demo` query dataset
from lm_human_preferences.language import encodings
from lm_human_preferences.offline import experiment
from lm_human_preferences.offline.pretrain import PretrainHParams

RULE_LETTER = 'e'


def rule_score(text):
    """THE RULE's score of one response: the number of letters 'e' in it."""
    return text.count(RULE_LETTER)


# Declared: the layers below learn its model and labeler by name (offline/experiment.OfflineExperiment.declare).
EXPERIMENT = experiment.OfflineExperiment(
    name='demo',
    encoding=encodings.Test,
    corpus=demo_corpus,
    pretrain=PretrainHParams(n_layer=2, n_embd=128, n_head=4, n_ctx=64, steps=400, batch_size=32, lr=3e-3),
    labeler=experiment.Labeler(name='rule', description=f"the rule: prefer the response with the most letters "
                                                      f"'{RULE_LETTER}'",
                             score_name='rule score', score=rule_score, title='the rule',
                             instruction=dict(best=f"Which response has the most letters '{RULE_LETTER}'?",
                                              score=f"How many letters '{RULE_LETTER}' does this response have "
                                                    f"(1: none, 7: seven or more)?",
                                              difference=f"Which response has more letters '{RULE_LETTER}'?")),
    # Two threads: the demo's whole command took 64 s against one thread's 102 on 2 idle cores (an AMX Xeon,
    # benchmarks/demo_threads.py; train_reward 15 against 25 s, PPO 39 against 64): its products are large enough
    # to split. Other numbers by rounding (the products block otherwise), the same learning. On cores shared with
    # other work, LMHP_CPU_THREADS=1: spinning OpenMP threads slow every step many times there.
    cpu_threads=2,
    encoding_note=" (the original's 26 letters and '.'): a model of GPT-2's BPE (`main`, a Hugging Face GPT-2 "
                  "included) runs on the sentiment_mini experiment or the paper's tasks",
    # The initial model and run.seed 1's labels (published/published.json: 1.6 MB of weights, 0.16 MB of gzipped
    # labels), so that the first command a new user runs trains only what the paper's method trains, from the same
    # files on every CPU.
    published=str(Path(__file__).with_name('published')),
).declare()
