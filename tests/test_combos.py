"""Tests for utils/combos.py (the original had none): each combinator on small inputs."""
import pytest

from lm_human_preferences.utils.combos import (bind, bind_nested, combos, each, foreach, label, labels, options,
                                               options_shortdesc, options_vardesc, repeat)


def _trial(*bindings):
    return tuple((k, v, {'descriptor': d} if d else {}) for k, v, d in bindings)


def test_bind_and_label():
    assert bind('lr', 0.1) == [(('lr', 0.1, {}),)]
    assert bind('lr', 0.1, 'fast') == [(('lr', 0.1, {'descriptor': 'fast'}),)]
    assert label('x') == [((None, None, {'descriptor': 'x'}),)]
    assert labels('a', 'b') == label('a') + label('b')


def test_combos_is_a_cartesian_product_in_order():
    got = combos(options('a', [(1, 'a1'), (2, 'a2')]), bind('b', 3), options('c', [(4, 'c4'), (5, 'c5')]))
    assert got == [
        _trial(('a', 1, 'a1'), ('b', 3, ''), ('c', 4, 'c4')),
        _trial(('a', 1, 'a1'), ('b', 3, ''), ('c', 5, 'c5')),
        _trial(('a', 2, 'a2'), ('b', 3, ''), ('c', 4, 'c4')),
        _trial(('a', 2, 'a2'), ('b', 3, ''), ('c', 5, 'c5')),
    ]
    assert combos() == [()]
    assert combos(bind('a', 1), []) == []


def test_each_is_a_union():
    assert each(bind('a', 1), bind('a', 2)) == [(('a', 1, {}),), (('a', 2, {}),)]
    assert each() == []


def test_options_shortdesc_and_vardesc():
    assert [t[0][2]['descriptor'] for t in options_shortdesc('ppo.lr', 'lr', [1e-5, 0.25, 3, 'x'])] == \
        ['lr1e-05', 'lrx25', 'lr3', 'lrx']
    assert options_vardesc('seed', [1, 2]) == [(('seed', 1, {'descriptor': 'seed1'}),),
                                               (('seed', 2, {'descriptor': 'seed2'}),)]


def test_repeat():
    # label(0) gets no descriptor: bind drops a falsy one (as the original).
    assert repeat(3) == [((None, None, {}),), ((None, None, {'descriptor': 1}),), ((None, None, {'descriptor': 2}),)]


def test_foreach_passes_descriptors():
    inputs = options('size', [(1, 'small'), (2, 'big')])
    got = foreach(inputs, lambda size_desc: bind('lr', 0.1 if size_desc == 'small' else 0.01))
    assert got == [_trial(('size', 1, 'small'), ('lr', 0.1, '')), _trial(('size', 2, 'big'), ('lr', 0.01, ''))]
    with pytest.raises(KeyError):  # every binding of the inputs needs a descriptor
        foreach(bind('a', 1), lambda d: bind('b', 2))


def test_bind_nested():
    inner = combos(bind('lr', 0.1, 'x'), label('y'))
    assert bind_nested('rewards.train_new_model', inner) == [
        (('rewards.train_new_model.lr', 0.1, {'descriptor': 'x'}), (None, None, {'descriptor': 'y'}))]
