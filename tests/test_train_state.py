"""Tests for training/train_state.py, state_files.py and run_compatibility.py: training-state round trip (modules, Adam, RNGs, sampler position),
keep-last-K, corruption fallback, full-disk saves, hparams compatibility, pickle refusal, non-finite
checks, and the gather / per-rank restore of every rank's random streams (2 processes carrying 4 ranks)."""
import errno
import hashlib
import json
import os
import pickle
import random
import stat
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Optional

import numpy as np
import pytest
import torch

from lm_human_preferences.training import run_compatibility, state_files
from lm_human_preferences.training import train_state as ckpt
from lm_human_preferences.training.adam import AdamTF
from lm_human_preferences.utils import core, files, hyperparams, launch, ranks


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.head = torch.nn.Linear(3, 1)
        self.register_buffer('gain', torch.ones(()))


def make(seed=0):
    torch.manual_seed(seed)
    net = Net()
    return net, AdamTF(net.parameters(), lr=1e-2)


def counter_sampler():
    """A query stream whose batches depend on their position and on the calling rank's torch stream (as
    the `test` dataset's texts depend on the rank's `random`)."""
    position = {}

    def sampler():
        rank = ranks.get_rank()
        position[rank] = position.get(rank, 0) + 1
        return torch.full((2, 4), float(position[rank] + 10 * rank)) + torch.rand(2, 4)
    return ckpt.CountingSampler(sampler)


def train_steps(net, opt, sampler, n):
    """n steps, each rank of this process drawing its batch and noise from its own streams (sampler,
    torch, numpy, random), which the state must restore."""
    for _ in range(n):
        def rank_loss():
            x = sampler()
            noise = torch.randn(2, 4) * float(np.random.rand()) * random.random()
            return net.head(net.lin(x + noise)).square().mean()
        opt.zero_grad()
        for loss in ranks.for_each_rank(rank_loss):
            loss.backward()
        opt.step()


def draws():
    """Each rank's next random numbers, and the process's own."""
    def draw():
        return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]
    return ranks.for_each_rank(draw), draw()


def state_of(net, opt):
    return {k: v.clone() for k, v in net.state_dict().items()}, opt.state_dict()


def test_round_trip_resumes_exactly(tmp_path):
    with ranks.carry(2):  # one process carrying two ranks, each with its own streams
        core.set_mpi_seed(5)
        net, opt = make()
        sampler = counter_sampler()
        train_steps(net, opt, sampler, 3)
        perm = np.random.permutation(10)
        path = ckpt.save_train_state(tmp_path, 3, modules=dict(net=net), optimizer=opt, samplers=dict(query=sampler),
                                     extra=dict(kl_coef=0.1234567891234, perm=perm, t=torch.arange(3), done=False))
        assert path == str(tmp_path / 'train_state' / 'state-3.json')
        assert sorted(os.listdir(tmp_path / 'train_state')) == ['state-3.json', 'state-3.safetensors']
        # The uninterrupted run goes on.
        train_steps(net, opt, sampler, 2)
        want_params, want_opt = state_of(net, opt)
        want_draws = draws()

    # A fresh process: other init, other RNG states, a new sampler at position 0.
    with ranks.carry(2):
        core.set_mpi_seed(99)
        net2, opt2 = make(seed=1)
        sampler2 = counter_sampler()
        state = ckpt.load_latest_train_state(tmp_path, modules=dict(net=net2), optimizer=opt2,
                                             samplers=dict(query=sampler2))
        assert state.step == 3 and sampler2.drawn == {0: 3, 1: 3}
        assert state.extra['kl_coef'] == 0.1234567891234 and state.extra['done'] is False
        assert isinstance(state.extra['perm'], np.ndarray) and (state.extra['perm'] == perm).all()
        assert torch.equal(state.extra['t'], torch.arange(3))
        train_steps(net2, opt2, sampler2, 2)
        got_params, got_opt = state_of(net2, opt2)
        for k in want_params:
            assert torch.equal(got_params[k], want_params[k]), k
        for i, s in want_opt['state'].items():
            for k in s:
                assert torch.equal(got_opt['state'][i][k], s[k])
        assert got_opt['param_groups'] == want_opt['param_groups']  # includes TF Adam's beta powers
        got_draws = draws()
    assert got_draws == want_draws
    assert want_draws[0][0] != want_draws[0][1]  # the two ranks' streams differ


def test_no_state_and_keep_last_k(tmp_path):
    net, opt = make()
    assert ckpt.load_latest_train_state(tmp_path, modules=dict(net=net), optimizer=opt) is None
    for step in range(1, 6):
        ckpt.save_train_state(tmp_path, step, modules=dict(net=net), optimizer=opt, keep=3)
    assert state_files.train_state_steps(tmp_path) == [5, 4, 3]
    assert len(os.listdir(tmp_path / 'train_state')) == 6
    # Re-saving an existing step replaces it.
    ckpt.save_train_state(tmp_path, 5, modules=dict(net=net), optimizer=opt, extra=dict(x=1), keep=3)
    assert ckpt.load_latest_train_state(tmp_path, modules=dict(net=net), optimizer=opt).extra == dict(x=1)


def _save_three(tmp_path):
    net, opt = make()
    for step in (1, 2, 3):
        with torch.no_grad():
            net.gain.fill_(step)
        ckpt.save_train_state(tmp_path, step, modules=dict(net=net), optimizer=opt)
    return net, opt


def _truncate(path):
    with open(path, 'r+b') as f:
        f.truncate(os.path.getsize(path) // 2)


def _flip_last_byte(path):
    data = bytearray(open(path, 'rb').read())
    data[-1] ^= 0x01
    open(path, 'wb').write(bytes(data))


def _edit_json_number(path):
    # A changed digit keeps the JSON valid: only the checksum can tell.
    sidecar = json.load(open(path))
    sidecar['extra']['kl'] = 0.5
    json.dump(sidecar, open(path, 'w'))


@pytest.mark.parametrize('damage,which', [
    (_truncate, 'safetensors'), (_flip_last_byte, 'safetensors'), (_truncate, 'json'), (_edit_json_number, 'json'),
    (os.remove, 'safetensors'),
])
def test_corrupt_state_falls_back_with_a_warning(tmp_path, damage, which):
    net, opt = _save_three(tmp_path)
    damage(str(tmp_path / 'train_state' / f'state-3.{which}'))
    with pytest.warns(state_files.TrainStateWarning, match='skipping training state 3'):
        state = ckpt.load_latest_train_state(tmp_path, modules=dict(net=net), optimizer=opt)
    assert state.step == 2 and net.gain.item() == 2


def test_all_states_corrupt_is_an_error(tmp_path):
    net, opt = _save_three(tmp_path)
    for step in (1, 2, 3):
        _flip_last_byte(str(tmp_path / 'train_state' / f'state-{step}.safetensors'))
    with pytest.warns(state_files.TrainStateWarning), pytest.raises(state_files.CheckpointError, match='no valid training state'):
        ckpt.load_latest_train_state(tmp_path, modules=dict(net=net), optimizer=opt)


def test_uncommitted_tensors_are_ignored_and_removed(tmp_path):
    net, opt = _save_three(tmp_path)
    # A save killed between its two renames: tensors of step 4, no .json; and a killed temporary file.
    (tmp_path / 'train_state' / 'state-4.safetensors').write_bytes(b'partial')
    (tmp_path / 'train_state' / 'state-4.safetensors.tmp-12345').write_bytes(b'partial')
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # not corrupt: simply never committed, no warning
        assert ckpt.load_latest_train_state(tmp_path, modules=dict(net=net), optimizer=opt).step == 3
    ckpt.save_train_state(tmp_path, 5, modules=dict(net=net), optimizer=opt)
    assert sorted(os.listdir(tmp_path / 'train_state')) == [
        f'state-{s}.{e}' for s in (2, 3, 5) for e in ('json', 'safetensors')]


def _full_disk_after(n_bytes, starting_with=b''):
    """An os.write that writes at most n_bytes in all into regular files whose data starts with
    starting_with, then fails with ENOSPC (short writes first, as a filling disk does). Pipes and
    sockets (e.g. multiprocessing's) are left alone."""
    real_write = os.write
    budget = [n_bytes]

    def write(fd, data):
        data = bytes(data)
        if not stat.S_ISREG(os.fstat(fd).st_mode) or (not data.startswith(starting_with) and budget[0] == n_bytes):
            return real_write(fd, data)
        if budget[0] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = real_write(fd, data[:min(len(data), budget[0], 64)])
        budget[0] -= n
        return n
    return write


@pytest.mark.parametrize('fail_in', ['safetensors', 'json'])
def test_full_disk_keeps_earlier_states(tmp_path, monkeypatch, fail_in):
    net, opt = _save_three(tmp_path)
    before = {p: open(tmp_path / 'train_state' / p, 'rb').read() for p in os.listdir(tmp_path / 'train_state')}
    with torch.no_grad():
        net.gain.fill_(4)
    # The JSON sidecar starts with '{'; the safetensors file with its 8-byte header length.
    monkeypatch.setattr(os, 'write', _full_disk_after(100, b'{' if fail_in == 'json' else b''))
    with pytest.raises(state_files.CheckpointWriteError) as e:
        ckpt.save_train_state(tmp_path, 4, modules=dict(net=net), optimizer=opt)
    monkeypatch.undo()
    msg = str(e.value)
    assert '\n' not in msg and 'No space left on device' in msg and '[Errno 28]' in msg and e.value.errno == errno.ENOSPC
    assert str(tmp_path / 'train_state' / f'state-4.{fail_in}') in msg
    after = {p: open(tmp_path / 'train_state' / p, 'rb').read() for p in os.listdir(tmp_path / 'train_state')}
    assert after == before  # no temporary file, no half state 4, states 1-3 byte for byte the same
    net2, opt2 = make()
    assert ckpt.load_latest_train_state(tmp_path, modules=dict(net=net2), optimizer=opt2).step == 3
    assert net2.gain.item() == 3


def test_atomic_write_failure_leaves_old_content(tmp_path, monkeypatch):
    path = tmp_path / 'f.bin'
    files.atomic_write(str(path), b'old')
    monkeypatch.setattr(os, 'write', _full_disk_after(2))
    with pytest.raises(OSError) as e:
        files.atomic_write(str(path), b'new content')
    assert e.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert path.read_bytes() == b'old' and os.listdir(tmp_path) == ['f.bin']
    files.atomic_write(str(path), b'x' * 100_000)
    assert path.read_bytes() == b'x' * 100_000


class Boom:
    """Unpickling this sets a flag: proof that a loader ran code from the file."""
    def __reduce__(self):
        return (_mark_unpickled, ())


UNPICKLED = []


def _mark_unpickled():
    UNPICKLED.append(True)
    return 'boom'


def _commit_fake_state(tmp_path, step, tensors_bytes):
    """A .json that vouches (valid checksums) for arbitrary tensor-file bytes, as an attacker could write."""
    net, opt = make()
    real = ckpt.save_train_state(tmp_path, step, modules=dict(net=net), optimizer=opt)
    (tmp_path / 'train_state' / f'state-{step}.safetensors').write_bytes(tensors_bytes)
    sidecar = json.load(open(real))
    del sidecar['sha256']
    sidecar.update(tensors_sha256=hashlib.sha256(tensors_bytes).hexdigest(), tensors_bytes=len(tensors_bytes))
    sidecar['sha256'] = hashlib.sha256(json.dumps(sidecar, sort_keys=True, separators=(',', ':')).encode()).hexdigest()
    json.dump(sidecar, open(real, 'w'))


@pytest.mark.parametrize('kind', ['torch.save', 'pickle'])
def test_pickle_bearing_state_is_refused(tmp_path, kind):
    import io
    buf = io.BytesIO()
    if kind == 'torch.save':
        torch.save({'modules.net.gain': torch.ones(()), 'payload': Boom()}, buf)
    else:
        pickle.dump({'payload': Boom()}, buf)
    _save_three(tmp_path)
    _commit_fake_state(tmp_path, 7, buf.getvalue())
    net, opt = make()
    with pytest.warns(state_files.TrainStateWarning, match='refusing to load .*state-7.safetensors: it is a pickle'):
        state = ckpt.load_latest_train_state(tmp_path, modules=dict(net=net), optimizer=opt)
    assert state.step == 3 and not UNPICKLED
    with pytest.raises(ValueError, match='it is a pickle'):
        files.refuse_pickle(str(tmp_path / 'train_state' / 'state-7.safetensors'))


def test_mismatched_run_is_refused_on_load(tmp_path):
    net, opt = _save_three(tmp_path)
    bigger = torch.nn.Module()
    bigger.lin, bigger.head = torch.nn.Linear(4, 5), torch.nn.Linear(5, 1)
    bigger.register_buffer('gain', torch.ones(()))
    with pytest.raises(state_files.CheckpointError, match=r"'lin.weight' has shape \[3, 4\], this run expects \[5, 4\]"):
        ckpt.load_latest_train_state(tmp_path, modules=dict(net=bigger), optimizer=AdamTF(bigger.parameters(), lr=1))
    with pytest.raises(state_files.CheckpointError, match=r"holds modules \['net'\], this run saves \['policy'\]"):
        ckpt.load_latest_train_state(tmp_path, modules=dict(policy=net), optimizer=opt)
    with pytest.raises(state_files.CheckpointError, match='has positions of samplers'):
        ckpt.load_latest_train_state(tmp_path, modules=dict(net=net), optimizer=opt,
                                     samplers=dict(query=counter_sampler()))


@dataclass
class Run(hyperparams.HParams):
    seed: Optional[int] = None
    save_dir: Optional[str] = None


@dataclass
class Toy(hyperparams.HParams):
    run: Run = field(default_factory=Run)
    lr: float = 1e-5
    trained_model: Optional[str] = None


def test_check_resume_compatible(tmp_path):
    old = Toy()
    old.override_from_dict({'run.save_dir': str(tmp_path), 'run.seed': 1,
                            'trained_model': os.path.join(str(tmp_path), 'reward_model')})
    assert run_compatibility.check_resume_compatible(str(tmp_path), old.to_nested_dict(), 'toy_hparams.json') is False
    hyperparams.save_json(old, str(tmp_path / 'toy_hparams.json'))
    assert run_compatibility.check_resume_compatible(str(tmp_path), old.to_nested_dict(), 'toy_hparams.json') is True

    # The same run from a moved save dir: save_dir and paths inside it do not count.
    moved = tmp_path.parent / (tmp_path.name + '-moved')
    os.rename(tmp_path, moved)
    same = Toy()
    same.override_from_dict({'run.save_dir': str(moved), 'run.seed': 1,
                             'trained_model': os.path.join(str(moved), 'reward_model')})
    assert run_compatibility.check_resume_compatible(str(moved), same.to_nested_dict(), 'toy_hparams.json') is True

    other = Toy()
    other.override_from_dict({'run.save_dir': str(moved), 'run.seed': 1, 'lr': 2e-5,
                              'trained_model': os.path.join(str(moved), 'reward_model')})
    with pytest.raises(run_compatibility.IncompatibleRunError) as e:
        run_compatibility.check_resume_compatible(str(moved), other.to_nested_dict(), 'toy_hparams.json')
    msg = str(e.value)
    assert '\n' not in msg
    assert 'lr=1e-05' in msg and 'lr=2e-05' in msg and 'same hyperparameters' in msg and '--save_dir' in msg


# ---- two ranks: RNG states of every rank gathered, each rank restores its own; a failed save stops both ----

def _two_process_worker(save_dir, out_dir):
    core.set_mpi_seed(3)
    net, opt = make()
    core.sync_params(net)
    ranks.for_each_rank(lambda: torch.rand(ranks.get_rank() + 1))  # the ranks' streams differ
    ckpt.save_train_state(save_dir, 1, modules=dict(net=net), optimizer=opt)
    result = dict(want=draws())
    core.set_mpi_seed(1234)
    ckpt.load_latest_train_state(save_dir, modules=dict(net=net), optimizer=opt)
    result['got'] = draws()
    if ranks.is_root():
        os.write = _full_disk_after(0)  # rank 0's disk is full (this worker process only)
    try:
        ckpt.save_train_state(save_dir, 2, modules=dict(net=net), optimizer=opt)
    except state_files.CheckpointWriteError as e:
        result['error'] = str(e)
    with open(os.path.join(out_dir, f'process{ranks.process_index()}.json'), 'w') as f:
        json.dump(result, f)


@pytest.mark.slow
def test_two_processes(tmp_path, monkeypatch):
    monkeypatch.setenv('LMHP_DIST_BACKEND', 'gloo')
    # 4 ranks in 2 processes: every rank's streams are gathered to process 0, and each restores its own.
    launch.launch('ckpt', partial(_two_process_worker, str(tmp_path / 'save'), str(tmp_path)), mpi=4, procs=2)
    p0, p1 = (json.loads((tmp_path / f'process{p}.json').read_text()) for p in range(2))
    assert p0['got'] == p0['want'] and p1['got'] == p1['want']
    rank_draws = p0['want'][0] + p1['want'][0]
    assert all(rank_draws[i] != rank_draws[j] for i in range(4) for j in range(i))
    sidecar = json.load(open(tmp_path / 'save' / 'train_state' / 'state-1.json'))
    assert sidecar['world_size'] == 4 and len(sidecar['rng']['ranks']) == 4
    # Process 0's full disk: both processes raise (process 1 does not go on alone into the next collective).
    assert p0['error'] == p1['error'] and 'No space left on device' in p0['error'] and 'state-2' in p0['error']
    assert state_files.train_state_steps(tmp_path / 'save') == [1]


@pytest.mark.parametrize('fail_in', ['safetensors', 'json'])
def test_full_disk_on_a_resave_keeps_the_committed_state(tmp_path, monkeypatch, fail_in):
    """A rerun saves its last state again: a write that fails then must not uncommit the state it replaces."""
    net, opt = _save_three(tmp_path)
    before = {p: open(tmp_path / 'train_state' / p, 'rb').read() for p in os.listdir(tmp_path / 'train_state')}
    with torch.no_grad():
        net.gain.fill_(4)  # other tensors than the committed state 3's
    monkeypatch.setattr(os, 'write', _full_disk_after(100, b'{' if fail_in == 'json' else b''))
    with pytest.raises(state_files.CheckpointWriteError, match='No space left on device'):
        ckpt.save_train_state(tmp_path, 3, modules=dict(net=net), optimizer=opt)
    monkeypatch.undo()
    after = {p: open(tmp_path / 'train_state' / p, 'rb').read() for p in os.listdir(tmp_path / 'train_state')}
    assert after == before  # state 3 as committed, nothing staged left beside it
    net2, opt2 = make()
    assert ckpt.load_latest_train_state(tmp_path, modules=dict(net=net2), optimizer=opt2).step == 3
    assert net2.gain.item() == 3
    # and a re-save that succeeds replaces it
    ckpt.save_train_state(tmp_path, 3, modules=dict(net=net), optimizer=opt)
    assert ckpt.load_latest_train_state(tmp_path, modules=dict(net=net2), optimizer=opt2).step == 3
    assert net2.gain.item() == 4
