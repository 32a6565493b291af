"""Ours: an offline experiment's initial model, a small GPT-2 on its encoding pretrained on its corpus (next-token
prediction) and cached in saved_models_dir()/<name>, reused while its hparams, encoding and corpus are unchanged."""

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from lm_human_preferences.language import bf16, checkpoints, model, model_sources
from lm_human_preferences.offline import published
from lm_human_preferences.training.adam import AdamTF
from lm_human_preferences.training.progress import Progress
from lm_human_preferences.utils import core as utils
from lm_human_preferences.utils import files, ranks


@dataclass(frozen=True)
class PretrainHParams:
    """An experiment's initial model and its pretraining on its corpus (next-token prediction)."""
    n_layer: int = 2
    n_embd: int = 128
    n_head: int = 4
    n_ctx: int = 64  # >= query_length + response_length of the task; the pretraining windows' length
    steps: int = 400
    batch_size: int = 32
    lr: float = 3e-3  # decayed linearly to 0
    seed: int = 0  # the initialisation's and the windows': one initial model for every run.seed
    # The products with the output embedding in bf16 where the CPU multiplies bf16 natively (see
    # pretraining_products_dtype): for a large vocabulary, where they are most of a step's time.
    bf16_products: bool = False


def model_dir(exp):
    """saved_models_dir()/<name>: where the experiment's initial model is made when it is not the published one."""
    return model_sources.offline_model_dir(exp.name)


def _pretrain_key(exp, hparams: PretrainHParams):
    """What the cached model was made from (hparams: the experiment's pretraining): a different key means it must
    be made again."""
    return dict(pretrain=asdict(hparams), encoding=exp.encoding.name,
                corpus_sha1=hashlib.sha1(exp.corpus().encode()).hexdigest(),
                products_dtype=str(pretraining_products_dtype(hparams)).removeprefix('torch.'))


def pretraining_products_dtype(hparams: PretrainHParams):
    """The dtype of the pretraining's three products with the output embedding (_LinearCrossEntropy):
    with hparams.bf16_products, bf16 where the CPU multiplies bf16 natively (AVX512-BF16 or AMX: 2.5x
    fp32's speed on this project's CPU), else fp32 (bf16 would be emulated, slower than fp32). The
    pretraining is ours, not the original's: its precision is our choice."""
    native = bf16.native_bf16_cpu()
    return torch.bfloat16 if hparams.bf16_products and native else torch.float32


class _LinearCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of the logits h @ w.T [n, n_vocab] against targets [n], computed a chunk of
    rows at a time with its gradients (softmax - one-hot, then the two products) in the forward pass: with
    GPT-2's 50,257-token vocabulary the logits' softmax and its backward otherwise cost as much as the
    projection itself, and the whole [n, n_vocab] logits never exist at once. Same value and gradients as
    F.cross_entropy(F.linear(h, w), targets) (to float rounding) when products_dtype is h's dtype.

    products_dtype: the dtype of the three products (the logits, and the gradients' two); the softmax, the
    loss and the accumulated gradients stay in h's dtype. bf16 products are mixed-precision training as on
    a GPU: the loss is within about 1e-5 and the gradients within about 1% of fp32's."""

    CHUNK = 128  # rows: 25 MB of fp32 logits with GPT-2's vocabulary

    @staticmethod
    def forward(ctx, h, w, targets, products_dtype):
        n = h.shape[0]
        grad_h, grad_w = torch.empty_like(h), torch.zeros_like(w)
        total = h.new_zeros(())
        w_products = w.to(products_dtype)  # a no-op in h's dtype
        for start in range(0, n, _LinearCrossEntropy.CHUNK):
            rows = slice(start, start + _LinearCrossEntropy.CHUNK)
            h_rows, t_rows = h[rows].to(products_dtype), targets[rows]
            logits = (h_rows @ w_products.T).to(h.dtype)  # [c, n_vocab]
            target_logits = logits.gather(1, t_rows[:, None])[:, 0]
            # log-softmax with one exp pass: logsumexp = max + log(sum(exp(logits - max))).
            top = logits.amax(dim=1, keepdim=True)
            probs = logits.sub_(top).exp_()  # in place: the logits are not needed again
            sums = probs.sum(dim=1, keepdim=True)
            total += (top[:, 0] + sums[:, 0].log() - target_logits).sum()
            probs.div_(sums)
            probs[torch.arange(len(t_rows)), t_rows] -= 1  # d loss / d logits, for the sum over rows
            probs = probs.to(products_dtype)
            grad_h[rows] = probs @ w_products
            if probs.dtype == grad_w.dtype:
                grad_w.addmm_(probs.T, h_rows)  # fused: no [n_vocab, e] temporary
            else:
                grad_w += probs.T @ h_rows  # a bf16 product, summed into the fp32 gradient
        ctx.save_for_backward(grad_h, grad_w)
        ctx.n = n
        return total / n

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_loss / ctx.n
        return grad_h * scale, grad_w * scale, None, None


# The pretraining saves its state at least this often (and when a stop signal ends it), to resume from.
SAVE_EVERY_S = 60


def pretrain(exp, out_dir, key):
    """Train the experiment's initial model on its corpus by the pretraining hparams in key (_pretrain_key: what it
    is made from, written to pretrain.json) and save it to out_dir (our checkpoint format).

    Written to a temporary dir that is then renamed into place, so a crash never leaves a half model. Its state
    (the model, Adam, the windows' generator, the step) goes to <out_dir>.partial at least every SAVE_EVERY_S
    seconds and on a stop signal; a rerun with the same key resumes from it, to the same model.
    """
    hparams = PretrainHParams(**key['pretrain'])
    tokens = torch.tensor(exp.encoding.get_encoder().encode(exp.corpus()), dtype=torch.long)
    model_hparams = model.HParams(n_vocab=exp.encoding.n_vocab, n_ctx=hparams.n_ctx, n_embd=hparams.n_embd,
                                  n_head=hparams.n_head, n_layer=hparams.n_layer)
    # fork_rng: the model's initialisation uses the global RNG; the caller's stream stays untouched.
    with torch.random.fork_rng():
        torch.manual_seed(hparams.seed)
        lm = model.Model(model_hparams)
    generator = torch.Generator().manual_seed(hparams.seed)
    optimizer = AdamTF(lm.parameters(), lr=hparams.lr)
    partial = PartialState(f'{out_dir}.partial', key, lm, optimizer, generator)
    start = partial.restore()
    if start:
        print(f'{exp.name}: resuming the pretraining at step {start}/{hparams.steps} ({partial.path})', flush=True)
    offsets = torch.arange(hparams.n_ctx + 1)
    products_dtype = pretraining_products_dtype(hparams)
    progress, saved_at = Progress(hparams.steps, start=start), time.time()
    step = start
    try:
        for step in range(start, hparams.steps):
            loss = _pretraining_step(lm, optimizer, tokens, generator, offsets, products_dtype, hparams, step)
            progress.done = step + 1
            if progress.due():
                print(f'[{exp.name} pretraining: step {progress()}, loss {loss.item():.3f}]', flush=True)
            if time.time() - saved_at >= SAVE_EVERY_S:
                partial.save(step + 1)
                saved_at = time.time()
    except KeyboardInterrupt as e:  # Ctrl-C or a stop signal: the steps done are kept
        partial.save(progress.done)
        print(f'{exp.name}: pretraining stopped at step {progress.done}/{hparams.steps}, saved; rerunning the same '
              f'command resumes there ({partial.path})', file=sys.stderr, flush=True)
        e.reported = True
        raise

    tmp = f'{out_dir}.tmp-{os.getpid()}'
    checkpoints.save_checkpoint(tmp, hparams.steps, lm, hparams=model_hparams, encoding=exp.encoding)
    with open(os.path.join(tmp, 'pretrain.json'), 'w') as f:
        json.dump(key, f, indent=2)
    if os.path.isdir(out_dir):  # a stale model (other hparams or corpus): replaced
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    partial.remove()
    return out_dir


def _pretraining_step(lm, optimizer, tokens, generator, offsets, products_dtype, hparams, step):
    """One step of next-token prediction on batch_size random windows of the corpus; returns its loss."""
    starts = torch.randint(0, len(tokens) - hparams.n_ctx - 1, (hparams.batch_size, 1), generator=generator)
    window = tokens[starts + offsets]  # [batch, n_ctx + 1]
    h = lm(window[:, :-1], lm_logits=False, return_present=False)['h']  # [batch, n_ctx, n_embd]
    loss = _LinearCrossEntropy.apply(h.reshape(-1, hparams.n_embd), lm.wte, window[:, 1:].reshape(-1),
                                     products_dtype)
    for group in optimizer.param_groups:
        group['lr'] = hparams.lr * (1 - step / hparams.steps)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss


class PartialState:
    """An unfinished pretraining's state in a dir of its own: the model and Adam's moments (safetensors), the
    windows' generator, the step, Adam's scalars and the key of what is being made (JSON). Restored only for
    the same key; written whole or not at all (files.atomic_write), the JSON last."""

    def __init__(self, path, key, lm, optimizer, generator):
        self.path, self.key, self.lm, self.optimizer, self.generator = path, key, lm, optimizer, generator

    def save(self, step):
        os.makedirs(self.path, exist_ok=True)
        opt = self.optimizer.state_dict()
        tensors = {f'model.{k}': v.contiguous() for k, v in self.lm.state_dict().items()}
        tensors.update({f'adam.{i}.{k}': v.contiguous() for i, state in opt['state'].items() for k, v in state.items()})
        tensors['generator'] = self.generator.get_state()
        files.atomic_write(os.path.join(self.path, 'state.safetensors'), save_tensors(tensors))
        sidecar = dict(step=step, key=self.key, param_groups=opt['param_groups'])
        files.atomic_write(os.path.join(self.path, 'state.json'), json.dumps(sidecar).encode())

    def restore(self):
        """The step the saved state reached (0 when there is none for this key, or it cannot be read)."""
        try:
            with open(os.path.join(self.path, 'state.json')) as f:
                sidecar = json.load(f)
            if sidecar['key'] != self.key:
                return 0
            with open(os.path.join(self.path, 'state.safetensors'), 'rb') as f:
                tensors = load_tensors(f.read())
        except (OSError, ValueError, KeyError, SafetensorError):
            return 0
        self.lm.load_state_dict({k[len('model.'):]: v for k, v in tensors.items() if k.startswith('model.')})
        state = {}
        for k, v in tensors.items():
            if k.startswith('adam.'):
                _, i, name = k.split('.', 2)
                state.setdefault(int(i), {})[name] = v
        self.optimizer.load_state_dict(dict(state=state, param_groups=sidecar['param_groups']))
        self.generator.set_state(tensors['generator'])
        return sidecar['step']

    def remove(self):
        shutil.rmtree(self.path, ignore_errors=True)


def ensure_pretrained(exp):
    """Make model_dir(exp) unless it holds a model made from the experiment's pretraining hparams, encoding and
    corpus; collective (rank 0 trains, the others wait). Returns the dir: the experiment's published model where it
    was made from the same (published.py), on every CPU."""
    p = exp.pretrain
    key = _pretrain_key(exp, p)  # every rank: the same key, so the same answer below
    found = published.initial_model(exp, key)
    if found:
        if ranks.is_root():
            print(f"{exp.name}: the experiment's published initial model, {found.made} (every CPU starts from "
                  f"these weights): {found.path}")
        return found.path
    out_dir = model_dir(exp)
    if not ranks.is_root():
        error = utils.mpi_bcast(None)
        if error is not None:
            raise RuntimeError(f'{exp.name} pretraining failed on rank 0: {error}')
        return out_dir
    key_path = os.path.join(out_dir, 'pretrain.json')
    cached = None
    if os.path.isfile(key_path):
        with open(key_path) as f:
            cached = json.load(f)
    try:
        if cached == key and checkpoints.latest_checkpoint(out_dir) is not None:
            print(f'{exp.name}: using the pretrained initial model in {out_dir}')
        else:
            print(f'{exp.name}: pretraining the initial model into {out_dir} ({p.n_layer} layers, width '
                  f'{p.n_embd}, {exp.encoding.n_vocab:,}-token vocabulary, {p.steps} steps of {p.batch_size} '
                  f'x {p.n_ctx} tokens; {key["products_dtype"]} products with the output embedding)', flush=True)
            pretrain(exp, out_dir, key)
    except Exception as e:
        utils.mpi_bcast(f'{type(e).__name__}: {e}')  # the other ranks must not wait for a model that never comes
        raise
    utils.mpi_bcast(None)
    return out_dir
