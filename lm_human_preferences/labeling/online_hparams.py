"""Ours: the online loop's settings, train_policy's `online.*` (the loop itself: online/loop.py, above both
trainers): how many rounds, who labels them (people on the labeling page, or a program an offline experiment
declared) and where the page serves; each field checked beside it. They live here, below train_policy, so that a
run's hparams are one struct (its train_policy_hparams.json) while train_policy knows nothing of the loop; what they
need of train_policy's other hparams is the loop's check (online/loop.check_hparams)."""

from dataclasses import dataclass
from typing import Optional

from lm_human_preferences.labeling import programs
from lm_human_preferences.labeling.server import check_origin, is_loopback
from lm_human_preferences.labeling.store import parse_labelers
from lm_human_preferences.utils import hyperparams

PEOPLE = 'people'


@dataclass
class OnlineHParams(hyperparams.HParams):
    retrains: int = 0  # K: after the first training, the reward model is retrained K times as PPO goes (0: off)
    num_labels: Optional[int] = None  # new labels over all K rounds (default: K * labels.num_train)
    split: str = 'even'  # how num_labels divide over the rounds: 'even', or K weights 'w1,w2,...'
    labeler: Optional[str] = None  # 'people' (the labeling page), or a program: 'rule' (demo), 'vader' (sentiment_mini)
    validation_share: float = 0.1  # of each round's questions, the share in the validation form (rho against pi)
    host: str = '127.0.0.1'  # people: the page's address (another than loopback needs labelers)
    port: int = 8765
    labelers: Optional[str] = None  # people: 'alice,bob', a link with a secret each (None: anyone names themselves)
    origin: Optional[str] = None  # people: the address they open when a reverse proxy serves the page (https://NAME)

    def validate(self, *, prefix=''):
        super().validate(prefix=prefix)
        require = hyperparams.require
        require(self.retrains >= 0, prefix + 'retrains', self.retrains, 'it must be at least 0 (0: off)')
        require(self.num_labels is None or self.num_labels > 0, prefix + 'num_labels', self.num_labels,
                'it must be at least 1')
        require(hyperparams.nonnegative(self.validation_share) and self.validation_share < 1,
                prefix + 'validation_share', self.validation_share, 'it must be a number from 0 to under 1')
        require(isinstance(self.port, int) and 0 <= self.port <= 65535, prefix + 'port', self.port,
                'it must be a port number from 0 to 65535 (0 picks a free one)')
        if self.retrains:
            require(self.labeler in (PEOPLE, *programs.LABELERS), prefix + 'labeler', self.labeler,
                    f"with {prefix}retrains, name who labels: '{PEOPLE}' (the labeling page), or a program: "
                    + ', '.join(f"'{name}' ({labeler.title})" for name, labeler in programs.LABELERS.items()))
            split_weights(self, prefix=prefix)
            hyperparams.require_valid(prefix + 'origin', check_origin, self.origin)
            if self.labeler == PEOPLE and (not is_loopback(self.host) or self.origin is not None):
                require(self.labelers is not None, prefix + 'labelers', self.labelers,
                        f'with {prefix}host {self.host}' + (f' {prefix}origin {self.origin}' if self.origin else '')
                        + ' (beyond this machine) name the labelers, e.g. alice,bob: each gets a link with a secret')
            if self.labelers is not None:
                hyperparams.require_valid(prefix + 'labelers', parse_labelers, self.labelers)


def split_weights(online, *, prefix=''):
    """The rounds' weights: [1] * K for 'even', else the K numbers of online.split."""
    if online.split == 'even':
        return [1.0] * online.retrains
    try:
        weights = [float(w) for w in online.split.split(',')]
    except ValueError:
        weights = []
    hyperparams.require(len(weights) == online.retrains and all(hyperparams.positive(w) for w in weights),
                        prefix + 'split', online.split,
                        f"'even', or {online.retrains} positive weights separated by commas (one a round)")
    return weights
