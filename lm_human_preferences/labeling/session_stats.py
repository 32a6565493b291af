"""Ours: a labeling session's statistics, read from its store (labeling/store.py) under the store's lock: how far it
is (progress), how often two labelers of a question asked twice agree (agreement), how often people prefer the
trained policy's samples in the validation form (policy_wins), and each labeler's answers, skips and pace
(per_labeler). The page's status, the label command's lines and the online loop's round stats read them."""


def progress(store, labeler=None):
    """{done: labels given, target, mine: the labeler's answers, skipped: theirs}."""
    with store.lock:
        mine = store.done_by.get(labeler, {}).values()
        return dict(done=len(store.events), target=store.schedule.target, mine=sum(1 for v in mine if v == 'answer'),
                    skipped=sum(1 for v in mine if v == 'skip'))


def agreement(store):
    """How often two labelers of a question asked twice agree: best_of_N, the same pick (chance 1/N);
    scalar_compare, the same sign of the difference; scalar_rating, scores within 1 of each other. Returns
    dict(pairs, agree: the share, or None without pairs, chance: best_of_N's)."""
    with store.lock:
        pairs = [a for a in store.answers.values() if len(a) >= 2]
    same = {'best': lambda x, y: x == y, 'difference': lambda x, y: (x > 0) - (x < 0) == (y > 0) - (y < 0),
            'score': lambda x, y: abs(x - y) <= 1}[store.label_key]
    agree = [same(a[0]['label'][store.label_key], a[1]['label'][store.label_key]) for a in pairs]
    return dict(pairs=len(pairs), agree=sum(agree) / len(agree) if agree else None,
                chance=1 / len(store.sample_keys) if store.label_key == 'best' else None)


def policy_wins(store):
    """For best_of_N questions in the validation form (their `pi_samples`: the indices sampled from the
    trained policy pi, the others from the initial one rho), the share of answers that picked a sample of pi
    (0.5 by chance with as many of each), and their number: dict(wins, answers)."""
    with store.lock:
        picks = [e['label']['best'] in store.questions[e['question']]['pi_samples'] for e in store.events
                 if store.label_key == 'best' and store.questions[e['question']].get('pi_samples')]
    return dict(wins=sum(picks) / len(picks) if picks else None, answers=len(picks))


def per_labeler(store):
    """Per labeler: answers, skips, median seconds an answer took (as the server timed them)."""
    with store.lock:
        summary = {}
        for labeler, history in store.history.items():
            seconds = sorted(e['seconds'] for e in history if e['event'] == 'answer' and e['seconds'] is not None)
            summary[labeler] = dict(answers=sum(1 for e in history if e['event'] == 'answer'),
                                    skips=sum(1 for e in history if e['event'] == 'skip'),
                                    median_seconds=seconds[len(seconds) // 2] if seconds else None)
        return summary
