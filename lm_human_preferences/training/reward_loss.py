"""Ours: train_reward's loss on the labels of the ranks a process carries side by side, in microbatches of at
most run.microbatch_size sequences: the original's `label_type.loss(reward_model=..., labels=minibatch)`, computed
for each rank on its own labels, each rank's gradient from passes of its own (training/side_by_side.py)."""

import torch

from lm_human_preferences.utils import passes


def loss(trainer, labels, *, train, ranks=1):
    """The label type's stats (its 'loss' included) on labels, and the rewards each sample got ({sample
    key: [n]}). ranks (ours): the labels of that many ranks side by side (rows grouped by rank); the stats
    are then each rank's, [ranks] per key, and with train each rank's gradient, from its own passes, is added
    to trainer.rank_gradients (the original's ranks each computed theirs; see training/side_by_side.py).

    Ours: the reward model runs on microbatches of labels holding at most run.microbatch_size sequences
    (a label's query with each of its samples), each microbatch's share of the mean loss back-propagated
    at once, so no graph holds more. The stats are the label type's on each rank's labels, from the
    rewards the samples got (no model pass): the same as without a split, for every label type.
    """
    n = len(labels['query'])
    per_rank = n // ranks
    microbatch_size = trainer.execution.microbatch_size
    labels_per_piece = None if microbatch_size is None else microbatch_size // len(trainer.sample_keys)
    rewards = {k: [] for k in trainer.sample_keys}
    # Training, each rank's labels in passes of their own; evaluating, a pass may span ranks.
    for group in passes.microbatches(n, per_rank) if train else [slice(0, n)]:
        for piece in passes.microbatches(group.stop - group.start, labels_per_piece):
            piece = slice(group.start + piece.start, group.start + piece.stop)
            piece_labels = {k: v[piece] for k, v in labels.items()}
            sample_key = {id(piece_labels[k]): k for k in trainer.sample_keys}

            def reward_model(queries, responses):  # records what each sample scored
                scored = trainer.reward_model.get_rewards(queries, responses)
                rewards[sample_key[id(responses)]].append(scored.detach())
                return scored
            with torch.set_grad_enabled(train), trainer.execution.autocast():
                piece_loss = trainer.label_type.loss(reward_model=reward_model, labels=piece_labels)['loss']
            if train:
                # The label type's loss is a mean over labels: a microbatch adds its share of its rank's.
                (piece_loss * ((piece.stop - piece.start) / per_rank)).backward()
        if train:
            trainer.rank_gradients.add_rank()
    rewards = {k: passes.cat_pieces(v) for k, v in rewards.items()}
    with torch.no_grad(), trainer.execution.autocast():
        rank_stats = [_label_type_loss(trainer, {k: v[rows] for k, v in rewards.items()},
                                            {k: v[rows] for k, v in labels.items()})
                      for rows in passes.microbatches(n, n // ranks)]
    return {k: torch.stack([s[k] for s in rank_stats]).detach().float() for k in rank_stats[0]}, rewards


def _label_type_loss(trainer, rewards, labels):
    """The label type's loss and stats on labels whose samples got `rewards` ({sample key: [n]})."""
    sample_key = {id(labels[k]): k for k in trainer.sample_keys}
    return trainer.label_type.loss(reward_model=lambda queries, responses: rewards[sample_key[id(responses)]],
                                labels=labels)
