"""The offline demo (ours): `python launch.py train_policy demo NAME` runs the paper's pipeline on a CPU in
minutes, with nothing downloaded (the engine: offline/). Its story, dataset, pretrained model, labeler and
bindings (bindings.py) live here, so that nothing else in the library knows the name 'demo'.

- Initial model: a small GPT-2 (2 layers, width 128) on the original's character-level `test` encoding
  (26 letters and '.', which writes word breaks), pretrained for about a minute on the built-in story
  (story.txt) so that its samples are words, not noise.
- Labeler, THE RULE: prefer the response with the most letters 'e' (ties at random). A small reward model
  can learn it (it counts one character), the initial model does not maximise it (about 11% of its
  letters are 'e'), and the policy can only push it up by drifting from the initial model's text, which
  the KL penalty resists.
"""

from lm_human_preferences.demo.story import demo_corpus  # importing it registers the `demo` query dataset
from lm_human_preferences.language import encodings
from lm_human_preferences.offline import experiment
from lm_human_preferences.offline.pretrain import PretrainHParams

RULE_LETTER = 'e'


def rule_score(text):
    """THE RULE's score of one response: the number of letters 'e' in it."""
    return text.count(RULE_LETTER)


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
    # One thread: on cores shared with other processes, spinning OpenMP threads slow every step down many times
    # (benchmarks/README.md's roofline account: 3 to 50x at a load of 3 to 4 on 2 cores). On free cores its products
    # (most of its time) take a second thread: LMHP_CPU_THREADS=2 then gives the same numbers, the few ops whose
    # results depend on the thread count running on results_threads' one (utils/cpu.py).
    cpu_threads=1,
    results_threads=1,
    encoding_note=" (the original's 26 letters and '.'): a model of GPT-2's BPE (`main`, a Hugging Face GPT-2 "
                  "included) runs on the sentiment_mini experiment or the paper's tasks",
)


# launch.py's entry points for the `demo` experiments (EXPERIMENT read at call time: tests shorten it).
def train_policy(hparams):
    return experiment.train_policy(EXPERIMENT, hparams)


def train_reward(hparams):
    return experiment.train_reward(EXPERIMENT, hparams)
