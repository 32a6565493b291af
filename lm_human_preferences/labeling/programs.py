"""Ours: a program in the labelers' seat picks the best of a question's responses as a person would on the page:
the response it scores highest, ties broken at random. The offline experiments' labels (offline/labels.py), the
online loop's program rounds (online/loop.py) and the report's questions (offline/report.py) all pick this way.
A labeler is anything with scores(responses [b, length], encoder) -> [b] (offline/experiment.py's Labeler)."""

import numpy as np
import torch

# The programs that can label, by name (--online.labeler NAME): each offline experiment declares its labeler
# (offline/experiment.OfflineExperiment.declare).
LABELERS = {}


def pick_best(scores, rng):
    """Index of the highest score in each row of scores [n, N], ties broken at random by rng."""
    return np.array([rng.choice(np.flatnonzero(row == row.max())) for row in np.asarray(scores)])


def label_best(labeler, samples, encoder, rng):
    """The labeler's pick of each row of samples [b, N, length] (postprocessed responses): the index of its highest
    score, ties broken at random by rng."""
    scores = torch.stack([labeler.scores(samples[:, j], encoder) for j in range(samples.shape[1])], dim=1)  # [b, N]
    return pick_best(scores.numpy(), rng)
