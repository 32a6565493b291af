"""Ours: how a run executes. The port's own run.* hparams (the original had seed, log_interval, save_interval and
save_dir: train_reward.RunHParams adds those to these), and what they resolve to on this device, once:
`Execution.prepare`
turns run.bf16, run.cuda_graph and run.microbatch_size (auto: planned for the free memory, training/memory.py) into
a frozen Execution that both train() functions make, pass to their trainer and that reaches Policy.respond. The
hparams keep what was asked: a rerun resolves `auto` again."""

from dataclasses import dataclass
from typing import Literal, Optional, Union

import torch

from lm_human_preferences.training import memory
from lm_human_preferences.utils import core, hyperparams, passes

# The run.* hparams that change what a run logs or keeps, or its memory use or speed, not its results: a rerun
# may change them and still resume (the trainers pass these, and their own, to training/run.Run).
RERUN_MAY_CHANGE = ('run.log_interval', 'run.wandb', 'run.wandb_project', 'run.keep_checkpoints',
                    'run.microbatch_size', 'run.cuda_graph')


@dataclass
class PortRunHParams(hyperparams.HParams):
    # Forward passes under bf16 autocast (the original ran fp32 only). None = on when CUDA is available, off on
    # a CPU. Losses, softmaxes, normalization statistics and Adam state stay fp32 (language/bf16.py).
    bf16: Optional[bool] = None
    # Weights & Biases logging (train_policy, which reuses the struct as the original did, logs).
    wandb: bool = False
    wandb_project: str = 'lm-human-preferences'
    # Model checkpoints kept in the save dir (the original's Saver max_to_keep); training states keep the last 3.
    keep_checkpoints: int = 20
    # At most this many sequences in any forward or backward pass of a model (sampling, logprobs, scoring, the
    # PPO and reward-model losses, evaluation), to fit memory; None: no split; 'auto': the largest that fits the
    # device's free memory. Results are the same up to fp32 rounding (the sampled tokens too).
    microbatch_size: Optional[Union[int, Literal['auto']]] = None
    # On CUDA, one decoding step captured as a CUDA graph and replayed for every later token (language/sample.py):
    # one launch per token instead of hundreds. None = on with CUDA.
    cuda_graph: Optional[bool] = None
    rules = dict(at_least_1=('keep_checkpoints',))  # what a field allows (utils/hyperparams.py)

    def validate(self, *, prefix=''):
        super().validate(prefix=prefix)
        hyperparams.require(self.microbatch_size in (None, 'auto') or self.microbatch_size > 0,
                            prefix + 'microbatch_size', self.microbatch_size,
                            "it must be at least 1 ('auto': the largest that fits the free memory; unset: no split)")

    def use_bf16(self):
        """Whether bf16 autocast is on: run.bf16, or (None) whether CUDA is available."""
        return torch.cuda.is_available() if self.bf16 is None else self.bf16

    def use_cuda_graph(self):
        """Whether decoding replays its steps as a CUDA graph: run.cuda_graph, or (None) whether CUDA is
        available (the graph needs CUDA; on a CPU the steps run eagerly whatever this says)."""
        return torch.cuda.is_available() if self.cuda_graph is None else self.cuda_graph


@dataclass(frozen=True)
class Execution:
    device: torch.device
    bf16: bool = False  # forward passes under bf16 autocast
    cuda_graph: bool = False  # decoding steps replayed as a CUDA graph (on CUDA)
    microbatch_size: Optional[int] = None  # at most this many sequences per model pass; None: no split

    def autocast(self):
        """bf16 autocast on the device where bf16 is on; a no-op block elsewhere (passes.autocast)."""
        return passes.autocast(self.bf16, self.device)

    @classmethod
    def prepare(cls, run_hparams: PortRunHParams, passes, model_hparams, *, resident, trained, what, smallest=1):
        """The run's Execution on this process's device: run.microbatch_size 'auto' planned for the device's
        free memory (memory.resolve: collective over processes) for its model passes; see memory.plan."""
        device = core.get_device()
        microbatch_size = memory.resolve(run_hparams, passes, model_hparams, resident=resident, trained=trained,
                                         device=device, what=what, smallest=smallest)
        return cls(device=device, bf16=run_hparams.use_bf16(), cuda_graph=run_hparams.use_cuda_graph(),
                   microbatch_size=microbatch_size)

    @classmethod
    def of(cls, run_hparams: PortRunHParams, device=None):
        """The execution run_hparams ask for on device (default: core.get_device()), without a memory plan: for
        callers that build a trainer themselves ('auto' needs prepare)."""
        if run_hparams.microbatch_size == 'auto':
            raise ValueError("run.microbatch_size 'auto' is planned by Execution.prepare")
        return cls(device=device or core.get_device(), bf16=run_hparams.use_bf16(),
                   cuda_graph=run_hparams.use_cuda_graph(), microbatch_size=run_hparams.microbatch_size)

