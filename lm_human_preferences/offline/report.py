"""Ours: an offline experiment's report, printed and written to <save_dir>/<name>_report.json, with every curve in
<save_dir>/<name>_curves.png: the labeler's score of samples on the test queries from the initial and the trained
policy, objective/kl against the adaptive target, the reward model's held-out accuracy against chance and the
best a perfect learner of the labeler can do, samples, the wall time and the time per phase. And best-of-n of
the initial policy beside it (sample.py best_of_n)."""

import json
import os

import numpy as np
import torch

from lm_human_preferences import lm_tasks, rewards
from lm_human_preferences import train_policy as train_policy_module
from lm_human_preferences.offline.labels import frozen_policy, rank_generator
from lm_human_preferences.training.reward_evaluation import best_credit
from lm_human_preferences.training import plots
from lm_human_preferences.utils import distributed, ranks
from lm_human_preferences.utils import core as utils
from lm_human_preferences.utils import files


# Samples per policy shown in the report.
REPORT_EXAMPLES = 5


@torch.no_grad()
def sample_scores(exp, model_name, task, *, seed):
    """The labeler's scores of one response per test query, for exp.eval_queries test queries (the same
    queries for every model); collective. Returns (scores [n] on every process, rank 0's first samples
    as (query, response) text pairs)."""
    policy, encoder = frozen_policy(model_name, task)
    per_rank = utils.exact_div(exp.eval_queries, ranks.get_world_size())
    sampler = lm_tasks.make_query_sampler(hparams=task, encoder=encoder, batch_size=per_rank, mode='test')
    postprocess = lm_tasks.postprocess_fn_from_hparams(task, encoder.padding_token)

    def rank_scores():
        queries = sampler()['tokens']
        sampled = policy.respond(queries, task.response_length, generator=rank_generator(seed),
                                 logprobs=False, chunked_vocab=True)['responses']
        responses = postprocess(sampled)
        examples = [(encoder.decode(q), encoder.decode(r))
                    for q, r in zip(queries[:REPORT_EXAMPLES].tolist(), responses[:REPORT_EXAMPLES].tolist())]
        return exp.labeler.scores(responses, encoder).tolist(), examples

    results = ranks.for_each_rank(rank_scores)
    scores = torch.tensor([s for rank in distributed.all_gather_ranks([r for r, _ in results]) for s in rank])
    return scores, results[0][1]


@torch.no_grad()
def best_of_n_samples(exp, task, *, n, queries, seed):
    """What best-of-n ranks, which no reward model enters: n samples of the initial policy for each of `queries` test
    queries (the seed's stream), postprocessed, and the labeler's scores of them. Returns dict(queries [q, query
    length], responses [q, n, response length], labeler_scores [q, n] float64)."""
    policy, encoder = frozen_policy(task.policy.initial_model, task)
    postprocess = lm_tasks.postprocess_fn_from_hparams(task, encoder.padding_token)
    sampler = lm_tasks.make_query_sampler(hparams=task, encoder=encoder, batch_size=queries, mode='test')
    query_tokens = sampler()['tokens']
    generator = rank_generator(seed)
    responses, labeler_scores = [], []
    for _ in range(n):
        responses.append(postprocess(policy.respond(query_tokens, task.response_length, generator=generator,
                                                    logprobs=False, chunked_vocab=True)['responses']).cpu())
        labeler_scores.append(exp.labeler.scores(responses[-1], encoder))
    return dict(queries=query_tokens.cpu(), responses=torch.stack(responses, dim=1),
                labeler_scores=torch.stack(labeler_scores, dim=1))


@torch.no_grad()
def best_of_n_rows(exp, hparams, *, n, queries, seed, samples=None):
    """Ours, a diagnostic of how much of the labeler a run's reward model holds and how much of it PPO's
    score keeps: n samples of the initial policy for each of `queries` test queries (best_of_n_samples, or `samples`
    as it returns them). For k = 1, 2, 4, ... n:
    the labeler's mean score of the sample ranked first among the first k by the reward model (on the
    postprocessed sample), by PPO's score (the same, with penalty_reward_value for the samples the task's
    filter rejects) and by the labeler itself, beside best-of-k's KL from the initial policy, at most
    log k - (k - 1) / k nats (Stiennon et al. 2020; Beirami et al. 2024), against PPO's objective/kl. One process.
    Returns (rows, the labeler's scores [queries, n])."""
    task = hparams.task
    if samples is None:
        samples = best_of_n_samples(exp, task, n=n, queries=queries, seed=seed)
    device = utils.get_device()
    reward_model = rewards.TrainedRewardModel(hparams.rewards.trained_model, exp.encoding).to(device)
    score_fn = train_policy_module.make_score_fn(task, reward_model)
    query_tokens = samples['queries'].to(device)
    rankings = dict(reward_model=[], ppo_score=[])
    # Each column of samples as one batch, as they were drawn: the scores are those of a reward model that scored
    # them as they came (postprocessing them again, in score_fn, leaves them as they are).
    for responses in samples['responses'][:, :n].to(device).unbind(dim=1):
        ppo_scores, postprocessed, _ = score_fn(query_tokens, responses)
        rankings['reward_model'].append(reward_model.score_fn(query_tokens, postprocessed).float().cpu())
        rankings['ppo_score'].append(ppo_scores.float().cpu())
    labeler_scores = samples['labeler_scores'][:, :n]
    rankings = {name: torch.stack(columns, dim=1) for name, columns in rankings.items()}  # [q, n] each
    rows, k = [], 1
    while k <= n:
        row = dict(k=k, kl_bound=float(np.log(k) - (k - 1) / k))
        for name, ranking in rankings.items():
            picked = labeler_scores.gather(1, ranking[:, :k].argmax(dim=1, keepdim=True))
            row[f'{name}_pick'] = float(picked.mean())
            row[f'{name}_pick_std'] = float(picked.std(unbiased=False))  # over the queries
        row['labeler_pick'] = float(labeler_scores[:, :k].max(dim=1).values.mean())
        rows.append(row)
        k *= 2
    return rows, labeler_scores


def read_stats(path):
    """The rows of a stats JSONL file (utils.core.record_stats), one a step (the online loop logs its round's stats
    at a PPO step in a row of their own: merged), [] when it does not exist."""
    if not os.path.isfile(path):
        return []
    by_step = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                by_step.setdefault(row['step'], {}).update(row)
    return [by_step[step] for step in sorted(by_step)]


def score_report(labeler, before, after):
    """The labeler's scores [n] of the initial and the trained policy's samples: mean and std of each, and
    the gain in standard deviations of the initial policy's scores (the unit of the experiments' bars) with
    its standard error (the two samples independent: one response per query from each policy)."""
    def mean_std(when, scores):
        return {f'{labeler.name}_{when}_mean': float(scores.mean()),
                f'{labeler.name}_{when}_std': float(scores.std(unbiased=False))}
    unit = float(before.std(unbiased=False)) or float('nan')  # no unit when the initial scores are all equal
    gain = float(after.mean() - before.mean()) / unit
    gain_se = float((before.var() / len(before) + after.var() / len(after)).sqrt()) / unit
    return dict(eval_queries=len(before), **mean_std('initial', before), **mean_std('trained', after),
                **{f'{labeler.name}_gain_initial_stds': gain, f'{labeler.name}_gain_initial_stds_se': gain_se})


def reward_report(save_dir, *, references, num_responses):
    """The reward model part of the report, from <save_dir>/train_reward_stats.jsonl ({} before any eval):
    its accuracy on the held-out labels, on its training labels (eval_train_labels) when measured, and the
    references of experiment.prepare_reward_training (a perfect learner of the labeler, a bag-of-words model)."""
    rows = read_stats(os.path.join(save_dir, 'train_reward_stats.jsonl'))
    evals = [r for r in rows if 'eval/accuracy' in r]
    if not evals:
        return {}
    train_evals = [r for r in rows if 'eval_train/accuracy' in r]
    return dict(rm_heldout_accuracy=evals[-1]['eval/accuracy'], rm_chance_accuracy=1 / num_responses,
                rm_ceiling_accuracy=references.get('ceiling'), rm_bag_of_words_accuracy=references.get('bag_of_words'),
                rm_train_accuracy=train_evals[-1]['eval_train/accuracy'] if train_evals else None)


def policy_report(save_dir, hparams):
    """objective/kl at the end of training (mean over the last 10% of PPO batches) against the target
    ({} before any PPO batch)."""
    rows = read_stats(os.path.join(save_dir, 'train_policy_stats.jsonl'))
    if not rows:
        return {}
    tail = rows[-max(1, len(rows) // 10):]
    adaptive = hparams.rewards.adaptive_kl
    return dict(
        kl=float(np.mean([r['objective/kl'] for r in tail])),
        kl_target=adaptive.target if adaptive is not None else None,
        kl_coef_start=rows[0]['objective/kl_coef'], kl_coef_end=rows[-1]['objective/kl_coef'],
        score_start=rows[0]['objective/score'], score_end=float(np.mean([r['objective/score'] for r in tail])),
        ppo_batches=len(rows))


def online_report(save_dir):
    """The online loop's rounds (online/loop.py; {} without them): each round's step, labels so far, pi beats rho
    and the retrained reward model's held-out accuracy; the last one's as the final reward model's."""
    rounds = []
    k = 1
    while os.path.isfile(os.path.join(save_dir, 'online', f'round-{k}', 'done.json')):
        with open(os.path.join(save_dir, 'online', f'round-{k}', 'done.json')) as f:
            done = json.load(f)
        rounds.append(dict(step=done['step'], **{key.split('/', 1)[1]: v for key, v in done['stats'].items()}))
        k += 1
    return dict(online_rounds=rounds) if rounds else {}


def final_reward_dir(save_dir, hparams):
    """The reward model PPO scored with last: the online loop's last round's, else rewards.trained_model."""
    rounds = online_report(save_dir).get('online_rounds', [])
    if rounds:
        return os.path.join(save_dir, 'online', f'reward-{rounds[-1]["round"]}', 'reward_model')
    return hparams.rewards.trained_model


@torch.no_grad()
def reward_model_on_samples(exp, hparams, save_dir, *, seed, trained=None):
    """The paper's distributional shift, measured: the final reward model's accuracy on best-of-N questions (the
    label type's N) of exp.eval_queries test queries, answered by the experiment's labeler (ties at random), with
    responses of the initial policy (the samples an offline reward model learns from) and of the trained one
    (those PPO asks it about at the end), each beside the labeler's ceiling (a perfect learner's accuracy). trained:
    the trained policy's model (default <save_dir>/policy; the frontier's DPO policies are Hugging Face folders). Rank
    0 alone; collective (the query data). Returns {rm_accuracy_<initial|trained>_samples, ..._ceiling}."""
    from lm_human_preferences.labeling.questions import QuestionSource
    from lm_human_preferences.offline.labels import labeler_ceiling
    from lm_human_preferences.labeling.programs import label_best
    task = hparams.task
    label_type = hparams.rewards.train_new_model.labels.type if hparams.rewards.train_new_model else 'best_of_4'
    reward_model = rewards.TrainedRewardModel(final_reward_dir(save_dir, hparams), exp.encoding,
                                              allow_untrained_head=hparams.rewards.allow_untrained_head)
    reward_model = reward_model.to(utils.get_device())
    results = {}
    trained = os.path.join(save_dir, 'policy') if trained is None else trained
    for when, model in (('initial', task.policy.initial_model), ('trained', trained)):
        policy, encoder = frozen_policy(model, task)
        source = QuestionSource(task=task, label_type=label_type, policy=policy, size=exp.eval_queries, seed=seed,
                                filtered=False, mode='test')
        if not ranks.is_root():
            continue
        questions = source.batch(0)
        keys = source.keys
        samples = torch.tensor([[q[k] for k in keys] for q in questions], device=utils.get_device())  # [n, N, length]
        queries = torch.tensor([q['query'] for q in questions], device=utils.get_device())
        best = torch.from_numpy(label_best(exp.labeler, samples.cpu(), encoder, np.random.RandomState(seed)))
        logits = torch.stack([reward_model.score_fn(queries, samples[:, j]) for j in range(len(keys))], dim=1)
        records = [dict(q, best=int(b)) for q, b in zip(questions, best)]
        results[f'rm_accuracy_{when}_samples'] = float(
            best_credit(logits.float().cpu(), best).mean())
        results[f'rm_accuracy_{when}_samples_ceiling'] = labeler_ceiling(exp.labeler, records, encoder)
    return utils.mpi_bcast(results)


def format_report(exp, report):
    labeler = exp.labeler
    lines = ['=' * 78, f'{exp.name.upper()} REPORT', '=' * 78]
    # Who labelled and who scores: the same program, unless the labels came from elsewhere (people).
    labels_from = report.get('labels_from', labeler.description)
    lines += [f'labeler: {labeler.description}'] if labels_from == labeler.description else \
        [f'labels from: {labels_from}', f'samples scored by: {labeler.description}']
    if 'seed' in report:
        reward_seed = report.get('reward_seed')
        other = reward_seed not in (None, report['seed'])
        lines.append(f"seed (run.seed): {report['seed']}"
                     + (f" (the reward model's and its labels': {reward_seed})" if other else ''))
    key = labeler.name
    if f'{key}_initial_mean' in report:
        lines.append(f"{labeler.score_name} of {report['eval_queries']} samples on test queries: "
                     f"{report[f'{key}_initial_mean']:.2f} +- {report[f'{key}_initial_std']:.2f} (initial policy) -> "
                     f"{report[f'{key}_trained_mean']:.2f} +- {report[f'{key}_trained_std']:.2f} (trained policy)")
        lines.append(f"  gain: {report[f'{key}_gain_initial_stds']:+.2f} standard deviations of the initial policy's "
                     f"scores (standard error {report[f'{key}_gain_initial_stds_se']:.2f})")
    if 'kl' in report:
        target = f"{report['kl_target']:g}" if report['kl_target'] is not None else 'none (fixed kl_coef)'
        lines.append(f"objective/kl (last 10% of {report['ppo_batches']} PPO batches): {report['kl']:.2f} nats, "
                     f"adaptive target {target}; kl_coef {report['kl_coef_start']:.3f} -> {report['kl_coef_end']:.3f}")
        lines.append(f"objective/score (reward model): {report['score_start']:+.2f} -> {report['score_end']:+.2f}")
    if 'rm_heldout_accuracy' in report:
        ceiling = report.get('rm_ceiling_accuracy')
        ceiling = f', a perfect learner of {labeler.title}: {100 * ceiling:.1f}%' if ceiling else ''
        bow = report.get('rm_bag_of_words_accuracy')
        bow = f', a bag-of-words model trained on the same labels: {100 * bow:.1f}%' if bow is not None else ''
        train = report.get('rm_train_accuracy')
        train = f'; on its training labels: {100 * train:.1f}%' if train is not None else ''
        lines.append(f"reward model held-out accuracy: {100 * report['rm_heldout_accuracy']:.1f}% "
                     f"(chance {100 * report['rm_chance_accuracy']:.0f}%{bow}{ceiling}){train}")
    if 'rm_accuracy_trained_samples' in report:
        lines.append(f"final reward model on best-of-N questions of test queries: "
                     f"{100 * report['rm_accuracy_initial_samples']:.1f}% with the initial policy's samples "
                     f"(ceiling {100 * report['rm_accuracy_initial_samples_ceiling']:.1f}%), "
                     f"{100 * report['rm_accuracy_trained_samples']:.1f}% with the trained policy's "
                     f"(ceiling {100 * report['rm_accuracy_trained_samples_ceiling']:.1f}%)")
    for r in report.get('online_rounds', []):
        wins = f", pi beats rho {100 * r['pi_beats_rho']:.0f}% of {r['pi_beats_rho_labels']} validation labels" \
            if 'pi_beats_rho' in r else ''
        accuracy = f", held-out accuracy {100 * r['reward_model_accuracy']:.1f}%" if 'reward_model_accuracy' in r else ''
        lines.append(f"online round {r['round']} at PPO batch {r['step']}: reward model retrained on {r['labels']} "
                     f"labels{accuracy}{wins}")
    for name, examples in report.get('examples', {}).items():
        lines.append(f'samples of the {name} policy (query | response):')
        lines.extend(f'  {q} | {r}' for q, r in examples)
    phases = ', '.join(f'{phase} {seconds:.0f}s' for phase, seconds in report.get('phase_times_s', {}).items())
    lines.append(f"wall time: {report['wall_time_s']:.0f}s" + (f' ({phases})' if phases else '')
                 + (f" on {report['runs_on']}" if report.get('runs_on') else ''))
    lines.append('=' * 78)
    return '\n'.join(lines)


def score_panel(exp, report):
    """A learning-curve panel (training/plots.py) of the labeler's score of samples before and after PPO."""
    key = exp.labeler.name
    def draw(ax):
        stats = [(report[f'{key}_{when}_mean'], report[f'{key}_{when}_std']) for when in ('initial', 'trained')]
        names = [f'{name}\n{mean:.2f} ± {std:.2f}'
                 for name, (mean, std) in zip(('initial policy', 'trained policy'), stats)]
        ax.bar(names, [mean for mean, _ in stats], yerr=[std for _, std in stats], capsize=6, color=['C7', 'C0'])
        ax.set_ylabel(f'{exp.labeler.score_name} (mean ± std)')
    # two lines: one is too wide
    return draw, f"{exp.labeler.score_name} of {report['eval_queries']} samples\non test queries"


def report_file(exp, save_dir):
    return os.path.join(save_dir, f'{exp.name}_report.json')


def plot_report(exp, save_dir, out=None, *, title=None):
    """The experiment's figure of a save dir holding its report: every learning curve, the labeler's score
    of samples before and after PPO, and on the reward model's accuracy the best a perfect learner of the
    labeler can reach and a bag-of-words model's; at out (default <save_dir>/<name>_curves.png, which the README
    shows from static/).
    `python sample.py plot` draws it again. Returns its path, or None when save_dir holds no report."""
    path = report_file(exp, save_dir)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        report = json.load(f)
    extra = [score_panel(exp, report)] if f'{exp.labeler.name}_initial_mean' in report else []
    ceiling, bow = report.get('rm_ceiling_accuracy'), report.get('rm_bag_of_words_accuracy')
    lines = ([(ceiling, f'a perfect learner of {exp.labeler.title} {100 * ceiling:.1f}%', 'C1', ':')] if ceiling else []
             ) + ([(bow, f'bag of words, same labels {100 * bow:.1f}%', 'C2', '-.')] if bow is not None else [])
    references = dict(accuracy=lines) if lines else None
    command = 'train_policy' if 'kl' in report else 'train_reward'
    return plots.plot_combined(
        save_dir, out or os.path.join(save_dir, f'{exp.name}_curves.png'), extra_panels=extra, references=references,
        title=title or f'python launch.py {command} {exp.name} {os.path.basename(os.path.normpath(save_dir))}')


def finish(exp, report, save_dir, next_steps=()):
    """Print the report and, in the save dir, write it (<save_dir>/<name>_report.json) and its figure
    (plot_report), then where they are and next_steps (lines: a command each), the run's last lines."""
    if ranks.is_root():
        print(format_report(exp, report))
        if save_dir:
            files.atomic_write(report_file(exp, save_dir), json.dumps(report, indent=2).encode())
            figure = plot_report(exp, save_dir)
            print(f'{exp.name}: the report in {report_file(exp, save_dir)}, all curves in {figure}')
            for line in next_steps:
                print(f'  {line}')
    return report
