"""Reward models (port of the original rewards.py)."""

import torch
from torch import nn

from lm_human_preferences.language import model, trained_models


class RewardNorm(nn.Module):
    """The original's `reward_norm/{gain,bias}` variables. They are trainable (the original's
    get_params() handed them to the optimizer along with the model)."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))
        self.bias = nn.Parameter(torch.zeros(()))


# TODO (as the original): combine this with TrainedRewardModel
class RewardModelTrainer(nn.Module):
    def __init__(
            self,
            trained_model, *,
            scope='reward_model',
    ):
        super().__init__()
        self.trained_model = trained_model
        self.hparams = trained_model.hparams()
        self.encoder = self.trained_model.encoding.get_encoder()
        self.scope = scope  # the TF variable scope; kept only as a name (our checkpoints hold one scope)
        self.model = model.Model(hparams=self.hparams, scalar_heads=['reward'])
        self.reward_norm = RewardNorm()
        self.padding_token = self.encoder.padding_token
        # The original loaded the weights on rank 0 only and broadcast them; every rank loads here.
        self.fresh_keys = self.trained_model.init_model(self)  # ours: what the checkpoint did not have

    @property
    def reward_gain(self):
        return self.reward_norm.gain

    @property
    def reward_bias(self):
        return self.reward_norm.bias

    def get_encoder(self):
        return self.encoder

    def get_rewards(self, queries, responses):
        """gain * (reward head at the last position) + bias, on the raw query + response tokens [b]."""
        tokens = torch.cat([queries, responses], dim=1)
        # Only the last position's head output is used, no logits and no KV cache (the original computed
        # every position's heads; TF's graph pruning skipped the rest). With the pad-fill, position -1
        # holds the last real token's reward.
        lm_output = self.model(tokens, padding_token=self.padding_token, output_positions=slice(-1, None),
                               lm_logits=False, return_present=False)
        reward = lm_output['reward'][:, -1]
        return self.reward_gain * reward + self.reward_bias

    @torch.no_grad()
    def reset_reward_scale(self):
        self.reward_gain.fill_(1)
        self.reward_bias.fill_(0)

    @torch.no_grad()
    def set_reward_norm(self, *, old_mean, old_std, new_mean, new_std):
        """Given old_mean+-old_std of reward_model, change gain and bias to get N(new_mean,new_std)."""
        old_gain, old_bias = self.reward_gain.item(), self.reward_bias.item()
        assert old_gain == 1 and old_bias == 0,\
            f'set_reward_norm expects gain = 1 and bias = 0, not {old_gain}, {old_bias}'
        # gain * N(old_mean,old_std) + bias = N(gain * old_mean, gain * old_std) + bias
        #                                   = N(gain * old_mean + bias, gain * old_std)
        # gain * old_std = new_std, gain = new_std / old_std
        # gain * old_mean + bias = new_mean, bias = new_mean - gain * old_mean
        gain = new_std / old_std
        bias = new_mean - gain * old_mean
        self.reward_gain.fill_(float(gain))
        self.reward_bias.fill_(float(bias))


class TrainedRewardModel(RewardModelTrainer):
    """A trained reward model for scoring: our save dir of one (`<save_dir>/reward_model`), an original
    TF train_reward save dir (converted on first use), or 'test' (random, as the original)."""

    def __init__(self, train_dir, encoding, *, scope='reward_model', allow_untrained_head=False):
        if train_dir == 'test':
            trained_model = trained_models.TrainedModel('test')
        else:
            trained_model = trained_models.TrainedModel(train_dir, savedir=train_dir, scope=scope)
        hparams = trained_model.hparams()
        if hparams.n_vocab != encoding.n_vocab:
            raise ValueError(f'reward model {train_dir} has n_vocab {hparams.n_vocab}, but encoding '
                             f'{encoding.name!r} has {encoding.n_vocab}')
        trained_model.encoding = encoding  # the original took the padding token from this encoding
        super().__init__(trained_model, scope=scope)
        # Ours: a model without a trained reward head (a policy dir: a value head is not a reward head; a
        # bare language model) would score at random, silently.
        if 'model.heads.reward.w' in self.fresh_keys and not allow_untrained_head:
            raise ValueError(f'{train_dir} is not a trained reward model: its checkpoint has no reward head (a '
                             f'policy\'s value head is not one); give the reward_model dir of a train_reward run, or '
                             f'set rewards.allow_untrained_head true to score with a random reward head')
        self.train_dir = train_dir
        self.encoding = encoding

    @torch.no_grad()
    def score_fn(self, queries, responses):
        return self.get_rewards(queries, responses)
