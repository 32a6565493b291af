"""The offline demo (ours): `python launch.py train_policy demo NAME` runs the paper's pipeline on a CPU in
minutes, with nothing downloaded (the engine: offline/). Its story, dataset, pretrained model, labeler and
bindings live here (experiment.py, bindings.py), so that nothing below the launcher knows the name 'demo'.

- Initial model: a small GPT-2 (2 layers, width 128) on the original's character-level `test` encoding
  (26 letters and '.', which writes word breaks), pretrained for about a minute on the built-in story
  (story.txt) so that its samples are words, not noise.
- Labeler, THE RULE: prefer the response with the most letters 'e' (ties at random). A small reward model
  can learn it (it counts one character), the initial model does not maximise it (about 11% of its
  letters are 'e'), and the policy can only push it up by drifting from the initial model's text, which
  the KL penalty resists.
"""



# experiment.py's names, imported when first asked for (PEP 562): it pulls in the trainers and torch, which
# launch.py's start-up (bindings.py, the --help) does without.
DECLARED = ('EXPERIMENT', 'RULE_LETTER', 'rule_score')


def __getattr__(name):
    if name not in DECLARED:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    from lm_human_preferences.demo import experiment
    return getattr(experiment, name)
