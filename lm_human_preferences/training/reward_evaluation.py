"""Ours: the reward model's evaluation after training (train_reward.RewardModelTrainer.train): loss and, for
best_of_N, tie-aware accuracy on the held-out labels (the records past labels.num_train) and, with
eval_train_labels, on the training labels. The original reported none."""

import torch

from lm_human_preferences import label_types
from lm_human_preferences.training import reward_loss
from lm_human_preferences.utils import distributed, ranks
from lm_human_preferences.utils import core as utils


def best_credit(logits, best):
    """Ours: for best_of_N, the accuracy credit of each row of logits [n, N] against its labeled best [n]: 1/k when
    the best is one of the k tied for the highest logit (a random tie-break's expectation), else 0."""
    is_max = logits == logits.max(dim=1, keepdim=True).values
    return is_max.gather(1, best.long()[:, None])[:, 0] / is_max.sum(dim=1)


@torch.no_grad()
def evaluate(trainer, labels, *, name):
    """Ours: mean loss (the label type's) and, for best_of_N, accuracy (the labeled best gets the highest
    reward; a k-way tie for the highest counts 1/k, as a random tie-break would, so a constant model
    scores 1/N, not 100%) of the reward model on labels (a dict of tensors), each rank scoring
    labels[rank::num_ranks], the ranks this process carries side by side in batches of their shares of
    batch_size. Logged as <name>/loss and <name>/accuracy at the current global_step; returns that dict."""
    n = len(next(iter(labels.values())))
    ours = torch.cat(trainer.ranks.shares(torch.arange(n)))
    batch_size = utils.exact_div(trainer.hparams.batch_size, trainer.num_ranks) * trainer.ranks.count
    loss_sum, correct = 0.0, 0.0
    for start in range(0, len(ours), batch_size):
        batch = trainer._to_device({k: v[ours[start:start + batch_size]] for k, v in labels.items()})
        stats, rewards = reward_loss.loss(trainer, batch, train=False)
        batch_n = len(batch['query'])
        loss_sum += stats['loss'].item() * batch_n  # the losses are means over the batch
        if isinstance(trainer.label_type, label_types.PickBest):
            logits = torch.stack([rewards[k] for k in trainer.sample_keys], dim=1)
            correct += best_credit(logits, batch['best']).sum().item()
    # This process's totals (its ranks'), summed over processes.
    totals = distributed.processes_sum(torch.tensor([float(len(ours)), loss_sum, correct], dtype=torch.float64))
    count = totals[0].item()
    results = {f'{name}/loss': totals[1].item() / count}
    if isinstance(trainer.label_type, label_types.PickBest):
        results[f'{name}/accuracy'] = totals[2].item() / count
    if ranks.is_root():
        print(f'{name} on {int(count)} labels: ' + ', '.join(f'{k} = {v:.6g}' for k, v in results.items()))
    trainer.run.stats.log(results, trainer.global_step, log_interval=1)
    return results


def evaluate_labels(trainer):
    """Ours: {'eval': the held-out labels' results, 'eval_train': the training labels' (eval_train_labels)}."""
    results = {}
    if trainer.held_out_labels is not None:
        results['eval'] = evaluate(trainer, trainer.held_out_labels, name='eval')
    elif ranks.is_root():
        print(f'no held-out labels: {trainer.hparams.labels.source} has no records past labels.num_train')
    if trainer.hparams.eval_train_labels:
        results['eval_train'] = evaluate(trainer, trainer.train_buffer.data(), name='eval_train')
    return results
