"""Ours: the frontier's runs (`python launch.py frontier EXP`), each in a folder of its own under --out:

    <out>/seed<S>/reward/            the seed's reward model: `launch.py train_reward EXP reward --run.seed S`
                                     (the seed's cached initial model and labels: offline/experiment.py)
    <out>/seed<S>/ppo-kl_coef<C>/    `launch.py train_policy EXP ... --rewards.trained_model <that reward model>
                                     --rewards.train_new_model off --rewards.adaptive_kl off --rewards.kl_coef C`
    <out>/seed<S>/online-kl_coef<C>/ `launch.py train_policy EXP ... --online.retrains 3` on the same labels budget
    <out>/seed<S>/best_of_n/         every n at once (the first n samples of the largest n)
    <out>/seed<S>/initial_hf/        the seed's initial model as a Hugging Face folder, for DPO
    <out>/seed<S>/dpo-beta<B>/       TRL's DPOTrainer (trl/: its checkpoints; policy_hf/: the trained model)

A run is finished when its frontier.json is there (written atomically, last: its points and the command that made
it). A rerun of the sweep skips the finished runs, and a run stopped midway (a kill -9, the end of a session) is
resumed, not started again: the trainers resume from their save dirs, DPOTrainer from its last checkpoint. The
table and the plot are made from the frontier.json files alone (table.py).
"""

import json
import os
import shlex
import time

from lm_human_preferences.frontier import table
from lm_human_preferences.frontier.table import ARMS, DONE, KNOBS
from lm_human_preferences.utils import files
from lm_human_preferences.utils.command_line import ConfigError

# Chosen to span about 2 to 10 nats: for PPO a fixed kl_coef (in 44 batches the adaptive controller moves kl_coef too
# little, or too late, for its target to set the KL: docs/sentiment_mini.md), around the miniature's 0.21, which
# landed at 6 nats offline and at 10-16 online (docs/labeling.md): four for online PPO, ~17 minutes a run;
# for best-of-n up to 2,048 samples, whose bound is 6.63 nats (10 nats would take 60,000 samples a query); for DPO
# (the costliest arm, ~50 minutes a run on one core), three betas: on seed 1 beta 1 went to 2.5 nats and 0.1 to 18.3
# (KL ~ 2.5 beta^-0.87), so 0.4 and 0.2 for about 5.5 and 10 (they landed at 6.3-7.7 and 10.7-13 on seeds 1-3).
# PPO's 0.1 and 0.07 (12 to 16 nats) go on toward where online PPO's 0.15 lands (15 to 38): the two compared at 12 too.
DEFAULT_POINTS = dict(ppo=(0.3, 0.25, 0.21, 0.17, 0.13, 0.1, 0.07), online=(0.4, 0.3, 0.21, 0.15),
                      best_of_n=(4, 16, 64, 256, 1024, 2048), dpo=(1, 0.4, 0.2))
ONLINE_RETRAINS = 3
REWARD_PREFIX = 'rewards.train_new_model.'  # the reward model's hparams, as train_policy names them


def parse_list(option, value, parse, allowed=None):
    """A comma-separated option ('1,2,3') as a list, one line naming the option when it is not one."""
    items = [v.strip() for v in str(value).split(',') if v.strip()]
    try:
        parsed = [parse(v) for v in items]
    except ValueError:
        raise ConfigError(f'--{option} {value}: a comma-separated list of {parse.__name__}s') from None
    if not parsed:
        raise ConfigError(f'--{option} is empty')
    if allowed is not None and set(parsed) - set(allowed):
        raise ConfigError(f"--{option} {value}: {', '.join(sorted(set(parsed) - set(allowed)))} is not an arm "
                          f"(choose from: {', '.join(allowed)})")
    if len(set(parsed)) != len(parsed):
        raise ConfigError(f'--{option} {value}: a value is given twice')
    return parsed


def parse_points(value, arms):
    """--points 'ppo=2,6,10;dpo=0.1,0.03': the knob's values of the arms named (the others keep DEFAULT_POINTS)."""
    points = {arm: list(DEFAULT_POINTS[arm]) for arm in arms}
    for part in (value or '').split(';'):
        if not part.strip():
            continue
        arm, _, values = part.partition('=')
        arm = arm.strip()
        if arm not in ARMS or not values:
            raise ConfigError(f"--points {value}: each part is ARM=V1,V2,... with ARM one of {', '.join(ARMS)}")
        if arm not in arms:
            raise ConfigError(f'--points {value}: {arm} is not in --arms')
        parse = int if arm == 'best_of_n' else float
        points[arm] = parse_list(f'points {arm}', values, parse)
        if not all(v > 0 for v in points[arm]) or (arm == 'best_of_n' and any(v & (v - 1) for v in points[arm])):
            raise ConfigError(f'--points {arm}={values}: {KNOBS[arm]} must be positive'
                              + (' powers of 2' if arm == 'best_of_n' else ''))
    return points


class Sweep:
    """The runs of one frontier, in order, each done once (see the module's docstring). train_policy / train_reward:
    launch.py's commands (called as the command line calls them); bound: the experiment's train_policy bindings
    {key: value}; extra: the command line's hparams, for every run (train_policy's names)."""

    def __init__(self, exp_name, out, *, arms, seeds, points, train_policy, train_reward, bound, extra,
                 best_of_n_queries, dpo_options):
        from lm_human_preferences import offline_experiments
        self.exp_name, self.out, self.arms, self.seeds, self.points = exp_name, out, arms, seeds, points
        self.exp = offline_experiments.experiment(exp_name)
        self.train_policy_command, self.train_reward_command = train_policy, train_reward
        self.extra = dict(extra)
        self.best_of_n_queries, self.dpo_options = best_of_n_queries, dpo_options
        num_train = int(self.extra.get(REWARD_PREFIX + 'labels.num_train', bound[REWARD_PREFIX + 'labels.num_train']))
        batch = int(self.extra.get(REWARD_PREFIX + 'batch_size', bound[REWARD_PREFIX + 'batch_size']))
        self.num_train = num_train
        if 'online' in arms and (num_train % (4 * batch)):
            raise ConfigError(f'the online arm trains on a quarter of labels.num_train ({num_train}) first: it must be '
                              f'a multiple of 4 x the reward batch_size ({batch})')
        if 'dpo' in arms:
            from lm_human_preferences.frontier import dpo
            dpo.check_installed()

    # ---- the plan
    def runs(self):
        """(arm, seed, value) of every run, in the order they run: arm by arm (the cheapest first), value by value,
        seed by seed, so that a partial sweep already holds every seed of the first points; best-of-n is one run a
        seed (all its n)."""
        order = [arm for arm in ('ppo', 'best_of_n', 'online', 'dpo') if arm in self.arms]
        plan = []
        for arm in order:
            values = [None] if arm == 'best_of_n' else self.points[arm]
            plan += [(arm, seed, value) for value in values for seed in self.seeds]
        return plan

    def seed_dir(self, seed):
        return os.path.join(self.out, f'seed{seed}')

    def run_name(self, arm, value):
        return arm if value is None else f'{arm}-{KNOBS[arm]}{value:g}'

    def reward_dir(self, seed):
        return os.path.join(self.seed_dir(seed), 'reward')

    # ---- the sweep
    def run_all(self):
        plan = self.runs()
        started = time.time()
        for i, (arm, seed, value) in enumerate(plan, 1):
            run_dir = os.path.join(self.seed_dir(seed), self.run_name(arm, value))
            what = f'[frontier {i}/{len(plan)}] {arm} seed {seed}' + ('' if value is None else f' {KNOBS[arm]} {value:g}')
            done = read_done(run_dir)
            if done is None:
                run_started = time.time()
                done = self.run(arm, seed, value, run_dir)
                done['seconds'] = time.time() - run_started
                files.atomic_write(os.path.join(run_dir, DONE), json.dumps(done, indent=2).encode())
                when = f'{table.minutes(done["seconds"])}'
            else:
                self.check_same(done, arm, seed, value, run_dir)
                when = 'done earlier'
            print(f'{what}: {table.points_line(done["points"])} ({when}; {run_dir})', flush=True)
        print(f'frontier: {len(plan)} runs in {self.out}, {table.minutes(time.time() - started)} this time', flush=True)

    def check_same(self, done, arm, seed, value, run_dir):
        """A finished run of other settings (another experiment, hparams or labels budget) is not this sweep's."""
        expected = self.identity(arm, seed, value)
        if done.get('identity') != expected:
            raise ValueError(f'{os.path.join(run_dir, DONE)} is a run of other settings ({done.get("identity")}, this '
                             f'sweep: {expected}): give this sweep another --out, or remove that run')

    def identity(self, arm, seed, value):
        return dict(experiment=self.exp_name, arm=arm, seed=seed, value=value, hparams=self.extra,
                    **({'best_of_n_queries': self.best_of_n_queries} if arm == 'best_of_n' else {}),
                    **({'dpo': self.dpo_options} if arm == 'dpo' else {}))

    def run(self, arm, seed, value, run_dir):
        if arm in ('ppo', 'best_of_n', 'dpo'):
            self.ensure_reward_model(seed)
        command, points = getattr(self, f'run_{arm}')(seed, value, run_dir)
        return dict(identity=self.identity(arm, seed, value), command=command, points=points)

    # ---- the seed's reward model
    def ensure_reward_model(self, seed):
        reward_dir = self.reward_dir(seed)
        if read_done(reward_dir) is not None:
            return
        hparams = {k[len(REWARD_PREFIX):]: v for k, v in self.extra.items() if k.startswith(REWARD_PREFIX)}
        hparams['run.seed'] = str(seed)
        print(f'[frontier] seed {seed}: training its reward model into {reward_dir}', flush=True)
        self.train_reward_command(self.exp_name, 'reward', save_dir=self.seed_dir(seed), **hparams)
        files.atomic_write(os.path.join(reward_dir, DONE), json.dumps(dict(
            identity=dict(experiment=self.exp_name, seed=seed, hparams=hparams),
            command=launch_line('train_reward', self.exp_name, 'reward', self.seed_dir(seed), hparams),
            points=[])).encode())

    def policy_hparams(self, seed, **more):
        """train_policy's hparams for a run of this seed: the command line's, the seed, then the arm's."""
        return {**self.extra, 'run.seed': str(seed), **{k: str(v) for k, v in more.items()}}

    # ---- the arms
    def run_ppo(self, seed, kl_coef, run_dir):
        hparams = {k: v for k, v in self.policy_hparams(seed).items() if not k.startswith(REWARD_PREFIX)}
        hparams.update({'rewards.trained_model': os.path.join(self.reward_dir(seed), 'reward_model'),
                        'rewards.train_new_model': 'off', 'rewards.adaptive_kl': 'off',
                        'rewards.kl_coef': str(kl_coef)})
        return self.trained_policy_point(seed, run_dir, hparams)

    def run_online(self, seed, kl_coef, run_dir):
        # The same labels budget as offline: a quarter first, the rest over the rounds (docs/labeling.md).
        hparams = self.policy_hparams(seed, **{'online.retrains': ONLINE_RETRAINS,
                                               'online.num_labels': self.num_train - self.num_train // 4,
                                               REWARD_PREFIX + 'labels.num_train': self.num_train // 4,
                                               'rewards.adaptive_kl': 'off', 'rewards.kl_coef': kl_coef})
        return self.trained_policy_point(seed, run_dir, hparams)

    def trained_policy_point(self, seed, run_dir, hparams):
        from lm_human_preferences.frontier import evaluate
        from lm_human_preferences.offline import experiment as offline_engine
        from lm_human_preferences.offline.report import report_file
        name = os.path.basename(run_dir)
        self.train_policy_command(self.exp_name, name, save_dir=self.seed_dir(seed), **hparams)
        with open(report_file(self.exp, run_dir)) as f:
            report = json.load(f)
        run_hparams = saved_policy_hparams(run_dir)
        with offline_engine.cpu_threads(self.exp):
            point = evaluate.policy_point(self.exp, run_hparams, os.path.join(run_dir, 'policy'), run_dir, seed=seed,
                                          report=report)
        value = float(hparams['rewards.kl_coef'])
        return launch_line('train_policy', self.exp_name, name, self.seed_dir(seed), hparams), [dict(value=value, **point)]

    def seed_hparams(self, seed):
        """train_policy's hparams of this seed's runs against its reward model, resolved (the task with its initial
        model's dir), for the arms that run no trainer."""
        from lm_human_preferences import train_policy
        from lm_human_preferences.offline.pretrain import model_dir
        hparams = train_policy.HParams()
        reward = _load_hparams('train_reward', os.path.join(self.reward_dir(seed), 'train_reward_hparams.json'))
        hparams.task = reward.task  # the seed's task, its initial model resolved to the cached model's dir
        hparams.rewards.trained_model = os.path.join(self.reward_dir(seed), 'reward_model')
        assert hparams.task.policy.initial_model == model_dir(self.exp, seed), hparams.task.policy.initial_model
        return hparams

    def run_best_of_n(self, seed, _, run_dir):
        from lm_human_preferences.frontier import evaluate
        from lm_human_preferences.offline import experiment as offline_engine
        os.makedirs(run_dir, exist_ok=True)
        with offline_engine.cpu_threads(self.exp):
            points = evaluate.best_of_n_points(self.exp, self.seed_hparams(seed), self.points['best_of_n'], run_dir,
                                               queries=self.best_of_n_queries, seed=seed)
        command = (f"python sample.py best_of_n --save_dir <a train_policy run of seed {seed} with "
                   f"--rewards.trained_model {os.path.join(self.reward_dir(seed), 'reward_model')}> "
                   f"--n {max(self.points['best_of_n'])} --queries {self.best_of_n_queries} --seed {seed}")
        return command, points

    def run_dpo(self, seed, beta, run_dir):
        from lm_human_preferences.frontier import dpo, evaluate
        from lm_human_preferences.language import hf_export
        from lm_human_preferences.offline import experiment as offline_engine
        hparams = self.seed_hparams(seed)
        initial_hf = os.path.join(self.seed_dir(seed), 'initial_hf')
        if read_done(initial_hf) is None:
            hf_export.export(hparams.task.policy.initial_model, initial_hf, task=hparams.task, force=True)
            files.atomic_write(os.path.join(initial_hf, DONE), b'{}')
        reward = _load_hparams('train_reward', os.path.join(self.reward_dir(seed), 'train_reward_hparams.json'))
        with open(os.path.join(self.reward_dir(seed), f'{self.exp.name}_labels.json')) as f:
            records = json.load(f)[:reward.labels.num_train]  # the held-out labels stay held out
        rows = dpo.preference_rows(records, hparams.task, self.exp.encoding.name, reward.labels.type)
        policy_hf = os.path.join(run_dir, 'policy_hf')
        with offline_engine.cpu_threads(self.exp):
            dpo.train(initial_hf, rows, policy_hf, os.path.join(run_dir, 'trl'), beta=beta, seed=seed,
                      **self.dpo_options)
            point = evaluate.policy_point(self.exp, hparams, policy_hf, run_dir, seed=seed)
        command = (f'TRL DPOTrainer (frontier/dpo.py) on {len(rows["prompt"])} pairs of '
                   f'{os.path.join(self.reward_dir(seed), self.exp.name + "_labels.json")} from {initial_hf}, '
                   f'beta {beta:g}; evaluated as --task.policy.initial_model {policy_hf}')
        return command, [dict(value=beta, **point)]


def _load_hparams(command, path):
    from lm_human_preferences import train_policy, train_reward
    hparams = (train_policy if command == 'train_policy' else train_reward).HParams()
    hparams.override_from_json_file(path)
    return hparams


def saved_policy_hparams(run_dir):
    return _load_hparams('train_policy', os.path.join(run_dir, 'train_policy_hparams.json'))


def read_done(run_dir):
    """The run's frontier.json (None before it is finished)."""
    path = os.path.join(run_dir, DONE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def launch_line(command, exp, name, save_dir, hparams):
    return ' '.join(['python launch.py', command, exp, name, '--save_dir', shlex.quote(save_dir)]
                    + [f'--{k} {shlex.quote(str(v))}' for k, v in hparams.items()])
