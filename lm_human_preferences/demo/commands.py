"""The offline demo: the paper's whole pipeline in a few minutes on a CPU (no original).

`python launch.py train_policy demo NAME` runs, with nothing downloaded and no file outside the repo:

1. Initial model (`task.policy.initial_model = 'demo'`): a small GPT-2 (PRETRAIN below) on the
   original's character-level `test` encoding (26 letters and '.', which writes word breaks), pretrained
   for about a minute on the built-in story (datasets/demo_story.txt) so that its samples are words,
   not noise. Cached in saved_models_dir()/demo and reused while PRETRAIN and the story are unchanged.
2. Labels (`labels.source = 'demo'`): for each query of the `demo` dataset the initial policy samples 4
   responses at the task temperature, and a program plays the human labeler with THE RULE:

       prefer the response with the most letters 'e' (ties broken at random, seeded).

   A small reward model can learn it (it counts one character), the initial model does not maximise
   it (about 11% of its letters are 'e'), and the policy can only push it up by drifting from the
   initial model's text, which the KL penalty resists. The labels are written in the original's
   best_of_4 JSON format ({query, sample0..3, best}, token ids) to <save_dir>/demo_labels.json, with
   held-out records after the first labels.num_train, and train_reward reads them back through its
   normal download_labels path (validation included).
3. The normal train_reward (normalization before and after) and train_policy (PPO, adaptive KL).
4. A report, printed and written to <save_dir>/demo_report.json: THE RULE's score of samples on the
   test queries, from the initial and the trained policy (mean +- std), objective/kl against the
   adaptive target, and the reward model's held-out accuracy against chance (25%) and against the
   best a perfect learner of the rule can do (ties are broken at random, so 100% is out of reach).

`python launch.py train_reward demo NAME` runs steps 1-3 for the reward model only and reports its
accuracy. The experiments (sizes, learning rates, KL target) are `demo` in launch.py.

Every step is collective under --mpi N: each rank samples its share (in its section, utils/ranks.py) and
the process that carries rank 0 writes the files.
"""

import contextlib
import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

from lm_human_preferences import label_types, lm_tasks, train_policy as train_policy_module, \
    train_reward as train_reward_module
from lm_human_preferences.demo.story import demo_corpus
from lm_human_preferences.language import checkpoints, encodings, model, trained_models
from lm_human_preferences.policy import Policy
from lm_human_preferences.utils import core as utils
from lm_human_preferences.utils import files, gcs, plots
from lm_human_preferences.utils.run import Progress

DEMO_MODEL = 'demo'     # task.policy.initial_model: the pretrained model in saved_models_dir()/demo (resolved here)
LABELS_SOURCE = 'demo'  # labels.source: generate the labels with THE RULE into the save dir
RULE_LETTER = 'e'

# Label records written after the labels.num_train training records: train_reward evaluates on them.
HELD_OUT_LABELS = 256
# Test queries sampled (once per policy) for the report's rule score.
EVAL_QUERIES = 256
# Intra-op threads on a CPU. The demo's model is so small that per-operation overhead dominates: a second
# thread gains ~1.4x on an idle 2-core machine, but when other processes share the cores, OpenMP's
# spin-waiting threads made every step 5-20x slower in our measurements. One thread is never far off.
CPU_THREADS = 1

@dataclass
class PretrainHParams:
    """The demo's initial model and its pretraining on the story (next-character prediction)."""
    n_layer: int = 2
    n_embd: int = 128
    n_head: int = 4
    n_ctx: int = 64  # >= query_length + response_length of the demo task
    steps: int = 400
    batch_size: int = 32
    lr: float = 3e-3  # decayed linearly to 0
    seed: int = 0


PRETRAIN = PretrainHParams()


def rule_score(text):
    """THE RULE's score of one response: the number of letters 'e' in it."""
    return text.count(RULE_LETTER)


def rule_scores(responses, encoder):
    """Rule scores [b] (float) of response token ids [b, n]; decoded, so any encoding works."""
    return torch.tensor([float(rule_score(encoder.decode(r))) for r in responses.tolist()])


def model_dir():
    return os.path.join(gcs.saved_models_dir(), DEMO_MODEL)


# ---------------------------------------------------------------------------------------------------
# 1. The initial model

def _pretrain_key(hparams: PretrainHParams):
    """What the cached model was made from: a different key means it must be made again."""
    return dict(pretrain=asdict(hparams), story_sha1=hashlib.sha1(demo_corpus().encode()).hexdigest())


def pretrain(out_dir, hparams: PretrainHParams, *, log_every=100):
    """Train the demo's initial model on the story and save it to out_dir (our checkpoint format).

    Written to a temporary dir that is then renamed into place, so a crash never leaves a half model.
    """
    encoding = encodings.Test
    encoder = encoding.get_encoder()
    tokens = torch.tensor(encoder.encode(demo_corpus()), dtype=torch.long)  # spaces encode as '.'
    model_hparams = model.HParams(n_vocab=encoding.n_vocab, n_ctx=hparams.n_ctx, n_embd=hparams.n_embd,
                                  n_head=hparams.n_head, n_layer=hparams.n_layer)
    # fork_rng: the model's initialisation uses the global RNG; the caller's stream stays untouched.
    with torch.random.fork_rng():
        torch.manual_seed(hparams.seed)
        lm = model.Model(model_hparams)
    generator = torch.Generator().manual_seed(hparams.seed)
    optimizer = utils.AdamTF(lm.parameters(), lr=hparams.lr)
    offsets = torch.arange(hparams.n_ctx + 1)
    started = time.time()
    for step in range(hparams.steps):
        starts = torch.randint(0, len(tokens) - hparams.n_ctx - 1, (hparams.batch_size, 1), generator=generator)
        window = tokens[starts + offsets]  # [batch, n_ctx + 1]
        logits = lm(window[:, :-1])['lm_logits']
        loss = F.cross_entropy(logits.reshape(-1, model_hparams.n_vocab), window[:, 1:].reshape(-1))
        for group in optimizer.param_groups:
            group['lr'] = hparams.lr * (1 - step / hparams.steps)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if log_every and (step % log_every == 0 or step == hparams.steps - 1):
            print(f'demo pretraining: step {step}/{hparams.steps}, loss {loss.item():.3f} '
                  f'({time.time() - started:.0f}s)')

    tmp = f'{out_dir}.tmp-{os.getpid()}'
    checkpoints.save_checkpoint(tmp, hparams.steps, lm, hparams=model_hparams, encoding=encoding)
    with open(os.path.join(tmp, 'pretrain.json'), 'w') as f:
        json.dump(_pretrain_key(hparams), f, indent=2)
    if os.path.isdir(out_dir):  # a stale model (other PRETRAIN or story): replaced
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def ensure_pretrained():
    """Make saved_models_dir()/demo unless it holds a model made from PRETRAIN (and this story); collective
    (rank 0 trains, the others wait). Returns the dir."""
    hparams = PRETRAIN
    out_dir = model_dir()
    if not utils.is_root():
        error = utils.mpi_bcast(None)
        if error is not None:
            raise RuntimeError(f'demo pretraining failed on rank 0: {error}')
        return out_dir
    key_path = os.path.join(out_dir, 'pretrain.json')
    cached = None
    if os.path.isfile(key_path):
        with open(key_path) as f:
            cached = json.load(f)
    try:
        if cached == _pretrain_key(hparams) and checkpoints.latest_checkpoint(out_dir) is not None:
            print(f'demo: using the pretrained initial model in {out_dir}')
        else:
            print(f'demo: pretraining the initial model into {out_dir} '
                  f'({hparams.n_layer} layers, width {hparams.n_embd}, {hparams.steps} steps)')
            pretrain(out_dir, hparams)
    except Exception as e:
        utils.mpi_bcast(f'{type(e).__name__}: {e}')  # the other ranks must not wait for a model that never comes
        raise
    utils.mpi_bcast(None)
    return out_dir


# ---------------------------------------------------------------------------------------------------
# 2. Labels

def pick_best(scores, rng):
    """Index of the highest score in each row of scores [n, N], ties broken at random by rng."""
    return np.array([rng.choice(np.flatnonzero(row == row.max())) for row in np.asarray(scores)])


def _demo_policy(model_name, task):
    """A frozen Policy of the named model (a name or dir, as task.policy.initial_model) for the task."""
    m = trained_models.TrainedModel(model_name)
    encoder = m.encoding.get_encoder()
    policy = Policy(m, embed_queries=lm_tasks.query_formatter(task, encoder),
                    temperature=task.policy.temperature).to(utils.get_device())
    policy.requires_grad_(False)
    return policy, encoder


def _generator(seed):
    # One stream per rank, as set_mpi_seed; on the device, where sampling happens.
    return torch.Generator(device=utils.get_device()).manual_seed(seed + 100003 * utils.get_rank())


def make_labels(hparams: train_reward_module.HParams, path, *, num_labels, seed):
    """Write num_labels best_of_N records to path, labelled by THE RULE; collective. Each rank (in its
    section) labels its share of its own queries with its own random streams."""
    task = hparams.task
    label_type = label_types.get(hparams.labels.type)
    if not isinstance(label_type, label_types.PickBest):
        raise ValueError(f"the demo's labels are best_of_N; labels.type is '{hparams.labels.type}'")
    policy, encoder = _demo_policy(task.policy.initial_model, task)
    postprocess = lm_tasks.postprocess_fn_from_hparams(task, encoder.padding_token)
    per_rank = utils.ceil_div(num_labels, utils.get_world_size())
    batch_size = min(utils.exact_div(hparams.rollout_batch_size, utils.get_world_size()), per_rank)
    sampler = lm_tasks.make_query_sampler(hparams=task, encoder=encoder, batch_size=batch_size)
    printing, progress = utils.is_root(), Progress(utils.ceil_div(per_rank, batch_size) * len(utils.local_ranks()))

    def rank_records():
        generator = _generator(seed)
        rng = np.random.RandomState(seed + 100003 * utils.get_rank())
        records = []
        while len(records) < per_rank:
            queries = sampler()['tokens']
            with torch.no_grad():
                # The labelers saw postprocessed (truncated) samples, as the original's label files hold.
                samples = [postprocess(policy.respond(queries, task.response_length, generator=generator,
                                                      microbatch_size=hparams.run.microbatch_size)['responses'])
                           for _ in range(label_type.num_responses)]
            scores = torch.stack([rule_scores(s, encoder) for s in samples], dim=1).numpy()  # [b, N]
            best = pick_best(scores, rng)
            for i in range(len(queries)):
                record = dict(query=queries[i].tolist(), best=int(best[i]))
                record.update({f'sample{j}': s[i].tolist() for j, s in enumerate(samples)})
                records.append(record)
            progress.done += 1
            if printing and progress.tenth():
                print(f'[demo labels: batch {progress()}]')
        return records[:per_rank]

    every_rank = utils.gather_ranks_to_root(utils.for_each_rank(rank_records))
    if utils.is_root():
        records = [record for rank in every_rank for record in rank][:num_labels]
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        files.atomic_write(path, json.dumps(records).encode())
    utils.mpi_bcast(None)  # everyone waits until the file is in place


def rule_ceiling(records, encoder):
    """The expected accuracy of a perfect learner of THE RULE on best_of_N records: it can only pick
    one of the samples tied for the most letters, and the label is a random one of those."""
    sample_keys = sorted(k for k in records[0] if k.startswith('sample'))
    inverse_ties = []
    for record in records:
        scores = np.array([rule_score(encoder.decode(record[k])) for k in sample_keys])
        inverse_ties.append(1 / np.sum(scores == scores.max()))
    return float(np.mean(inverse_ties))


def resolve_initial_model(*tasks):
    """task.policy.initial_model 'demo' names the pretrained model, made once (ensure_pretrained): the
    trainers get its directory. All the tasks of a run at once, so that it is checked (and reported) once.
    Collective."""
    demo_tasks = [task for task in tasks if task.policy.initial_model == DEMO_MODEL]
    if demo_tasks:
        model = ensure_pretrained()
        for task in demo_tasks:
            task.policy.initial_model = model


def prepare_reward_training(hparams: train_reward_module.HParams, save_dir):
    """Make the initial model and, for labels.source 'demo', the labels (<save_dir>/demo_labels.json;
    a resumed run reuses them), and point labels.source at them. Collective. Returns the held-out
    accuracy a perfect learner of the rule would reach (rank 0; None when the labels are not ours)."""
    resolve_initial_model(hparams.task)
    if hparams.labels.source != LABELS_SOURCE:
        return None
    if not save_dir:
        raise ValueError(f"labels.source '{LABELS_SOURCE}' writes the labels into run.save_dir, which is not set")
    path = os.path.join(save_dir, 'demo_labels.json')
    num_labels = hparams.labels.num_train + HELD_OUT_LABELS
    started = time.time()
    if not utils.mpi_bcast(os.path.isfile(path)):
        make_labels(hparams, path, num_labels=num_labels, seed=hparams.run.seed or 0)
        made = f'made in {time.time() - started:.0f}s'
    else:
        made = 'reused: this save dir already had them'
    hparams.labels.source = path
    error = ceiling = None
    if utils.is_root():
        with open(path) as f:
            records = json.load(f)
        if len(records) != num_labels:
            error = (f'{path} holds {len(records)} label records, this run needs {num_labels} (labels.num_train '
                     f'{hparams.labels.num_train} + {HELD_OUT_LABELS} held out): it belongs to another run; '
                     f'choose another --save_dir')
        else:
            print(f"demo: {num_labels} labels by the rule 'most letters {RULE_LETTER}' in {path} "
                  f"({hparams.labels.num_train} to train on, {HELD_OUT_LABELS} held out; {made})")
            if HELD_OUT_LABELS:
                encoder = trained_models.TrainedModel(hparams.task.policy.initial_model).encoding.get_encoder()
                ceiling = rule_ceiling(records[hparams.labels.num_train:], encoder)
    error = utils.mpi_bcast(error)  # every rank stops, not only rank 0
    if error is not None:
        raise ValueError(error)
    return ceiling


# ---------------------------------------------------------------------------------------------------
# 4. The report

@torch.no_grad()
def sample_rule_scores(model_name, task, *, n, seed):
    """THE RULE's scores of one response per test query, for n test queries (the same queries for every
    model); collective. Returns (scores [n] on every process, rank 0's first samples as text)."""
    policy, encoder = _demo_policy(model_name, task)
    per_rank = utils.exact_div(n, utils.get_world_size())
    sampler = lm_tasks.make_query_sampler(hparams=task, encoder=encoder, batch_size=per_rank, mode='test')
    postprocess = lm_tasks.postprocess_fn_from_hparams(task, encoder.padding_token)

    def rank_scores():
        queries = sampler()['tokens']
        responses = postprocess(policy.respond(queries, task.response_length, generator=_generator(seed))['responses'])
        examples = [(encoder.decode(q), encoder.decode(r)) for q, r in zip(queries[:3].tolist(), responses[:3].tolist())]
        return rule_scores(responses, encoder).tolist(), examples

    results = utils.for_each_rank(rank_scores)
    scores = torch.tensor([s for rank in utils.all_gather_ranks([r for r, _ in results]) for s in rank])
    return scores, results[0][1]


def read_stats(path):
    """The rows of a stats JSONL file (utils.core.record_stats), [] when it does not exist."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _mean_std(scores):
    return dict(mean=float(scores.mean()), std=float(scores.std(unbiased=False)))


def reward_report(save_dir, *, ceiling, num_responses):
    """The reward model part of the report, from <save_dir>/train_reward_stats.jsonl."""
    rows = read_stats(os.path.join(save_dir, 'train_reward_stats.jsonl'))
    evals = [r for r in rows if 'eval/accuracy' in r]
    if not evals:
        return None
    train_evals = [r for r in rows if 'eval_train/accuracy' in r]
    return dict(held_out_accuracy=evals[-1]['eval/accuracy'], chance=1 / num_responses, ceiling=ceiling,
                train_accuracy=train_evals[-1]['eval_train/accuracy'] if train_evals else None)


def policy_report(save_dir, hparams):
    """objective/kl at the end of training (mean over the last 10% of PPO batches) against the target."""
    rows = read_stats(os.path.join(save_dir, 'train_policy_stats.jsonl'))
    if not rows:
        return None
    tail = rows[-max(1, len(rows) // 10):]
    adaptive = hparams.rewards.adaptive_kl
    return dict(
        kl=float(np.mean([r['objective/kl'] for r in tail])),
        kl_target=adaptive.target if adaptive is not None else None,
        kl_coef_start=rows[0]['objective/kl_coef'], kl_coef_end=rows[-1]['objective/kl_coef'],
        score_start=rows[0]['objective/score'], score_end=float(np.mean([r['objective/score'] for r in tail])),
        ppo_batches=len(rows))


def format_report(report):
    lines = ['=' * 78, 'DEMO REPORT', '=' * 78,
             f"rule: prefer the response with the most letters '{RULE_LETTER}'"]
    rule = report.get('rule_score')
    if rule:
        before, after = rule['before'], rule['after']
        lines.append(f"rule score of samples on {rule['n']} test queries: "
                     f"{before['mean']:.2f} +- {before['std']:.2f} (initial policy) -> "
                     f"{after['mean']:.2f} +- {after['std']:.2f} (trained policy)")
    ppo = report.get('ppo')
    if ppo:
        target = f"{ppo['kl_target']:g}" if ppo['kl_target'] is not None else 'none (fixed kl_coef)'
        lines.append(f"objective/kl (last 10% of {ppo['ppo_batches']} PPO batches): {ppo['kl']:.2f} nats, "
                     f"adaptive target {target}; kl_coef {ppo['kl_coef_start']:.3f} -> {ppo['kl_coef_end']:.3f}")
        lines.append(f"objective/score (reward model): {ppo['score_start']:+.2f} -> {ppo['score_end']:+.2f}")
    rm = report.get('reward_model')
    if rm:
        ceiling = f", a perfect learner of the rule: {100 * rm['ceiling']:.1f}%" if rm.get('ceiling') else ''
        train = (f"; on its training labels: {100 * rm['train_accuracy']:.1f}%"
                 if rm.get('train_accuracy') is not None else '')
        lines.append(f"reward model held-out accuracy: {100 * rm['held_out_accuracy']:.1f}% "
                     f"(chance {100 * rm['chance']:.0f}%{ceiling}){train}")
    for name, examples in report.get('examples', {}).items():
        lines.append(f'samples of the {name} policy (query | response):')
        lines.extend(f'  {q} | {r}' for q, r in examples)
    if report.get('wall_time_s') is not None:
        lines.append(f"wall time: {report['wall_time_s']:.0f}s")
    lines.append('=' * 78)
    return '\n'.join(lines)


@contextlib.contextmanager
def _cpu_threads():
    """CPU_THREADS intra-op threads while the demo runs on a CPU (restored after)."""
    if utils.get_device().type != 'cpu':
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(CPU_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def rule_panel(rule):
    """A learning-curve panel (utils/plots.py) of the rule score of samples before and after PPO."""
    def draw(ax):
        stats = [rule['before'], rule['after']]
        names = [f"{name}\n{s['mean']:.2f} ± {s['std']:.2f}" for name, s in zip(('initial policy', 'trained policy'), stats)]
        ax.bar(names, [s['mean'] for s in stats], yerr=[s['std'] for s in stats], capsize=6, color=['C7', 'C0'])
        ax.set_ylabel('rule score (mean ± std)')
    return draw, f"demo: rule score of samples on {rule['n']} test queries"


REPORT_FILE = 'demo_report.json'
FIGURE_FILE = 'demo_curves.png'


def plot_report(save_dir, out=None, *, title=None):
    """The demo's figure of a save dir holding its report: every learning curve, the rule score of samples
    before and after PPO, and on the reward model's accuracy the best a perfect learner of the rule can
    reach; at out (default <save_dir>/demo_curves.png, which the README shows as static/demo_curves.png).
    `python sample.py plot` draws it again. Returns its path, or None when save_dir holds no report."""
    path = os.path.join(save_dir, REPORT_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        report = json.load(f)
    extra = [rule_panel(report['rule_score'])] if report.get('rule_score') else []
    ceiling = (report.get('reward_model') or {}).get('ceiling')
    references = dict(accuracy=[(ceiling, f'a perfect learner of the rule {100 * ceiling:.1f}%', 'C1', ':')]) \
        if ceiling else None
    command = 'train_policy' if report.get('ppo') else 'train_reward'
    return plots.plot_combined(
        save_dir, out or os.path.join(save_dir, FIGURE_FILE), extra_panels=extra, references=references,
        title=title or f'python launch.py {command} demo {os.path.basename(os.path.normpath(save_dir))}')


def _finish(report, save_dir):
    """Print the report and, in the save dir, write it and its figure (plot_report)."""
    if utils.is_root():
        print(format_report(report))
        if save_dir:
            with open(os.path.join(save_dir, REPORT_FILE), 'w') as f:
                json.dump(report, f, indent=2)
            print(f'demo: all curves in {plot_report(save_dir)}')
    return report


# ---------------------------------------------------------------------------------------------------
# The commands (launch.py routes the `demo` experiments here)

def train_reward(hparams: train_reward_module.HParams):
    """`launch.py train_reward demo`: prepare, train_reward.train, report the held-out accuracy."""
    with _cpu_threads():
        return _train_reward(hparams)


def train_policy(hparams: train_policy_module.HParams):
    """`launch.py train_policy demo`: prepare, train_policy.train (reward model first), report."""
    with _cpu_threads():
        return _train_policy(hparams)


def _train_reward(hparams):
    started = time.time()
    save_dir = hparams.run.save_dir
    ceiling = prepare_reward_training(hparams, save_dir)
    train_reward_module.train(hparams)
    num_responses = label_types.get(hparams.labels.type).num_responses
    report = dict(reward_model=reward_report(save_dir, ceiling=ceiling, num_responses=num_responses),
                  wall_time_s=time.time() - started)
    return _finish(report, save_dir)


def _train_policy(hparams):
    started = time.time()
    save_dir = hparams.run.save_dir
    if not save_dir:
        raise ValueError('the demo needs run.save_dir: the report compares the saved policy with the initial one')
    reward_hparams = hparams.rewards.train_new_model
    ceiling = None
    resolve_initial_model(hparams.task, *([reward_hparams.task] if reward_hparams is not None else []))
    if reward_hparams is not None:
        ceiling = prepare_reward_training(reward_hparams, save_dir)

    train_policy_module.train(hparams)

    seed = hparams.run.seed or 0
    before, before_examples = sample_rule_scores(hparams.task.policy.initial_model, hparams.task, n=EVAL_QUERIES, seed=seed)
    after, after_examples = sample_rule_scores(os.path.join(save_dir, 'policy'), hparams.task, n=EVAL_QUERIES, seed=seed)
    report = dict(
        rule_score=dict(n=len(before), before=_mean_std(before), after=_mean_std(after)),
        ppo=policy_report(save_dir, hparams),
        examples=dict(initial=before_examples, trained=after_examples),
        wall_time_s=time.time() - started)
    if reward_hparams is not None:
        num_responses = label_types.get(reward_hparams.labels.type).num_responses
        report['reward_model'] = reward_report(save_dir, ceiling=ceiling, num_responses=num_responses)
    return _finish(report, save_dir)
