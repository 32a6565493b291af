"""Ours: a labeling session's labels as a Hugging Face `datasets` folder in TRL's preference format (one row a
pair: prompt, chosen, rejected; texts as the page showed them), so that TRL's reward and DPO trainers read them
(`datasets.load_from_disk`). A best_of_N label gives N - 1 pairs (the best against each other response); a
scalar_compare label one pair (none when the difference is 0); scalar_rating labels compare nothing."""

import os

from lm_human_preferences.labeling.store import LabelStore, SESSION_FILE
from lm_human_preferences.language import encodings


def preference_rows(store):
    """{prompt, chosen, rejected, labeler, question} lists of the session's labels, in the order given."""
    if store.label_key == 'score':
        raise ValueError(f'{store.directory} holds scalar_rating labels: one response each, no pair to prefer '
                         f'(TRL\'s preference format needs best_of_N or scalar_compare labels)')
    texts = store.session['texts']
    encoder = encodings.get(texts['encoding']).get_encoder()
    rows = dict(prompt=[], chosen=[], rejected=[], labeler=[], question=[])

    def add(question, event, better, worse):
        for key, value in (('prompt', texts['query_prefix'] + encoder.decode(question['query']) + texts['query_suffix']),
                           ('chosen', encoder.decode(question[better])), ('rejected', encoder.decode(question[worse])),
                           ('labeler', event['labeler']), ('question', question['id'])):
            rows[key].append(value)
    for event in store.events:
        question = store.questions[event['question']]
        for better, worse in label_pairs(store.label_key, store.sample_keys, event['label']):
            add(question, event, better, worse)
    return rows


def label_pairs(label_key, sample_keys, label):
    """The (better, worse) sample keys of one label: its label_key field ('best': an index into sample_keys, a
    best_of_N label; 'difference': scalar_compare's, positive when sample1 is the better one)."""
    if label_key == 'best':
        best = sample_keys[label['best']]
        return [(best, other) for other in sample_keys if other != best]
    if label['difference']:
        return [('sample0', 'sample1') if label['difference'] < 0 else ('sample1', 'sample0')]
    return []


def export_labels(session_dir, out):
    """Write session_dir's labels to out (a new or empty folder) as a datasets.Dataset; returns the row count."""
    if not os.path.isfile(os.path.join(session_dir, SESSION_FILE)):
        raise ValueError(f'{session_dir} holds no labeling session ({SESSION_FILE} is missing): give the folder '
                         f'`python launch.py label` wrote')
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(f'--out {out} exists and is not an empty folder: give a new one')
    import datasets  # a core dependency, imported here: it is slow to import
    rows = preference_rows(LabelStore(session_dir, writable=False))
    datasets.Dataset.from_dict(rows).save_to_disk(out)
    return len(rows['prompt'])
