"""Tests for utils/hyperparams.py: every case of the original utils/test_hyperparams.py, then our additions
(error messages naming the key, JSON files, dump, `int | None` / string annotations)."""
import io
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import pytest

from lm_human_preferences.utils import hyperparams


@dataclass
class Simple(hyperparams.HParams):
    mandatory_nodefault: int = None
    mandatory_withdefault: str = "foo"
    optional_nodefault: Optional[int] = None
    fun: bool = True


# ---- the original's tests ----

def test_simple_works():
    hp = Simple()
    hp.override_from_str("mandatory_nodefault=3,optional_nodefault=None,fun=false")
    hp.validate()
    assert hp.mandatory_nodefault == 3
    assert hp.mandatory_withdefault == "foo"
    assert hp.optional_nodefault is None
    assert not hp.fun


def test_simple_failures():
    hp = Simple()
    with pytest.raises(TypeError):
        hp.validate()  # mandatory_nodefault unset
    with pytest.raises(ValueError):
        hp.override_from_str("mandatory_nodefault=abc")
    with pytest.raises(AttributeError):
        hp.override_from_str("nonexistent_field=7.0")
    with pytest.raises(ValueError):
        hp.override_from_str("fun=?")


@dataclass
class Nested(hyperparams.HParams):
    first: bool = False
    simple_1: Simple = field(default_factory=Simple)
    simple_2: Optional[Simple] = None


def test_nested():
    hp = Nested()
    hp.override_from_str("simple_1.mandatory_nodefault=8,simple_2=on,simple_2.mandatory_withdefault=HELLO")
    with pytest.raises(TypeError):
        hp.validate()  # simple_2.mandatory_nodefault unset
    hp.override_from_dict({'simple_2/mandatory_nodefault': 7, 'simple_1/optional_nodefault': 55}, separator='/')
    hp.validate()
    assert hp.simple_1.mandatory_nodefault == 8
    assert hp.simple_1.mandatory_withdefault == "foo"
    assert hp.simple_1.optional_nodefault == 55
    assert hp.simple_2.mandatory_nodefault == 7
    assert hp.simple_2.mandatory_withdefault == "HELLO"
    assert hp.simple_2.optional_nodefault is None

    hp.override_from_str("simple_2=off")
    hp.validate()
    assert hp.simple_2 is None

    with pytest.raises((TypeError, AttributeError)):
        hp.override_from_str("simple_2.fun=True")
    with pytest.raises(ValueError):
        hp.override_from_str("simple_2=BADVAL")


def test_nested_dict():
    hp = Nested()
    hp.override_from_nested_dict(
        {'simple_1': {'mandatory_nodefault': 8}, 'simple_2': {'mandatory_withdefault': "HELLO"}})
    with pytest.raises(TypeError):
        hp.validate()  # simple_2.mandatory_nodefault unset
    hp.override_from_nested_dict(
        {'simple_2': {'mandatory_nodefault': 7}, 'simple_1': {'optional_nodefault': 55}, 'first': True})
    hp.validate()
    assert hp.to_nested_dict() == {
        'first': True,
        'simple_1': {
            'mandatory_nodefault': 8,
            'mandatory_withdefault': "foo",
            'optional_nodefault': 55,
            'fun': True,
        },
        'simple_2': {
            'mandatory_nodefault': 7,
            'mandatory_withdefault': "HELLO",
            'optional_nodefault': None,
            'fun': True,
        },
    }


def test_nested_order():
    hp = Nested()
    # Either order should work
    hp.override_from_str_dict(OrderedDict([('simple_2.fun', 'True'), ('simple_2', 'on')]))
    hp.override_from_str_dict(OrderedDict([('simple_2', 'on'), ('simple_2.fun', 'True')]))


@dataclass
class Deeply(hyperparams.HParams):
    nested: Nested = None


def test_deeply_nested():
    hp = Deeply()
    hp.override_from_str("nested.simple_2=on")
    assert hp.nested is not None
    assert hp.nested.simple_2 is not None

    hp = Deeply()
    hp.override_from_dict({'nested.simple_2': 'on'})
    assert hp.nested is not None
    assert hp.nested.simple_2 is not None


def test_set_order():
    hp = Deeply()
    hp.override_from_dict(OrderedDict([('nested.first', True), ('nested.simple_1', 'on')]))
    assert hp.nested.first is True

    hp = Deeply()
    hp.override_from_dict(OrderedDict([('nested.simple_1', 'on'), ('nested.first', True)]))
    assert hp.nested.first is True


# ---- additions ----

def test_bool_none_optional_parsing():
    hp = Simple()
    for s, want in [('t', True), ('true', True), ('True', True), ('f', False), ('false', False), ('False', False)]:
        hp.override_from_str_dict({'fun': s})
        assert hp.fun is want
    for s in ('None', 'none', ''):
        hp.override_from_str_dict({'optional_nodefault': '5'})
        hp.override_from_str_dict({'optional_nodefault': s})
        assert hp.optional_nodefault is None
    hp.override_from_str_dict({'optional_nodefault': '12'})
    assert hp.optional_nodefault == 12
    with pytest.raises(ValueError, match="'fun'"):
        hp.override_from_str_dict({'fun': 'yes'})


@dataclass
class Leaf(hyperparams.HParams):
    target: float = None
    horizon: int = 10000


@dataclass
class Group(hyperparams.HParams):
    kl_coef: float = 0.2
    adaptive_kl: Optional[Leaf] = None
    trained_model: Optional[str] = None
    name: str = None


@dataclass
class Top(hyperparams.HParams):
    group: Group = field(default_factory=Group)
    lr: float = 5e-6
    gamma: float = 1  # an int default for a float field, as the original's ppo.gamma


def test_dotted_overrides_like_the_command_line():
    hp = Top()
    hp.override_from_str_dict({'group.trained_model': '/some/dir', 'lr': '1e-5', 'group.name': 'x'})
    assert hp.group.trained_model == '/some/dir'
    assert hp.lr == 1e-5
    hp.override_from_str_dict({'group.adaptive_kl': 'on', 'group.adaptive_kl.target': '6.0'})
    assert hp.group.adaptive_kl == Leaf(target=6.0)
    hp.validate()
    hp.override_from_str_dict({'group.adaptive_kl': 'off'})
    assert hp.group.adaptive_kl is None
    hp.validate()


def test_turning_on_a_nested_group_keeps_enclosing_group():
    # The original replaced the enclosing group with a fresh default here, losing kl_coef.
    hp = Top()
    hp.override_from_dict({'group.kl_coef': 0.15})
    hp.override_from_str_dict({'group.adaptive_kl': 'on'})
    assert hp.group.kl_coef == 0.15
    assert hp.group.adaptive_kl == Leaf()


def test_unknown_key_lists_closest_keys():
    hp = Top()
    with pytest.raises(AttributeError) as e:
        hp.override_from_str_dict({'group.kl_coeff': '0.1'})
    msg = str(e.value)
    assert "'group.kl_coeff'" in msg and 'closest valid keys: group.kl_coef' in msg
    with pytest.raises(hyperparams.UnknownHParamError, match="'group.adaptive_kl.targt'.*group.adaptive_kl.target"):
        hp.override_from_dict({'group.adaptive_kl.targt': 1.0})
    with pytest.raises(hyperparams.UnknownHParamError, match="'group.nme'.*group.name"):
        hp.override_from_nested_dict({'group': {'nme': 'x'}})


def test_bad_value_names_key_value_and_type():
    hp = Top()
    with pytest.raises(ValueError) as e:
        hp.override_from_str_dict({'lr': 'fast'})
    msg = str(e.value)
    assert "'lr'" in msg and "'fast'" in msg and 'float' in msg
    with pytest.raises(hyperparams.HParamValueError, match=r"'group.adaptive_kl'.*'maybe'.*'on' or 'off'"):
        hp.override_from_str_dict({'group.adaptive_kl': 'maybe'})
    with pytest.raises(hyperparams.HParamValueError, match=r"'group.adaptive_kl.horizon'.*'10k'.*int"):
        hp.override_from_str_dict({'group.adaptive_kl.horizon': '10k'})
    # Already-parsed values are type-checked too (the original only noticed in validate()).
    with pytest.raises(hyperparams.HParamValueError, match=r"'group.kl_coef'.*'abc'.*float"):
        hp.override_from_dict({'group.kl_coef': 'abc'})
    with pytest.raises(hyperparams.HParamValueError, match=r"'group.name'.*got a dict"):
        hp.override_from_nested_dict({'group': {'name': {'a': 1}}})
    with pytest.raises(ValueError, match='Malformed'):
        hp.override_from_str('lr')


def test_validate_names_missing_key():
    hp = Top()
    with pytest.raises(TypeError, match=r"missing mandatory value for hyperparameter 'group.name' \(expected str\)"):
        hp.validate()
    hp.group.name = 'n'
    hp.validate()  # gamma = 1 (int) is a valid float, as under typeguard
    hp.override_from_str_dict({'group.adaptive_kl': 'on'})
    with pytest.raises(hyperparams.HParamTypeError, match="'group.adaptive_kl.target'"):
        hp.validate()
    hp.group.adaptive_kl.target = 'high'  # set behind our back: validate still catches it
    with pytest.raises(hyperparams.HParamTypeError, match=r"'group.adaptive_kl.target' has value 'high'.*float"):
        hp.validate()


def test_off_group_cannot_take_fields():
    hp = Top()
    # The fix in the command line's syntax, as the README teaches it.
    with pytest.raises(AttributeError, match=r"'group.adaptive_kl.target'.*'group.adaptive_kl' is off \(None\); "
                                             r"turn it on first: --group.adaptive_kl on$"):
        hp.override_from_str_dict({'group.adaptive_kl.target': '1.0'})


def test_json_file_round_trip(tmp_path):
    hp = Top()
    hp.override_from_str_dict({'group.name': 'a', 'group.adaptive_kl': 'on', 'group.adaptive_kl.target': '3'})
    path = tmp_path / 'hp.json'
    hyperparams.save_json(hp, str(path))
    assert json.loads(path.read_text())['group']['adaptive_kl'] == {'target': 3.0, 'horizon': 10000}
    hp2 = Top()
    hp2.override_from_json_file(str(path))
    assert hp2 == hp
    hp2.validate()

    (tmp_path / 'bad.json').write_text('{"lr": ')
    with pytest.raises(ValueError, match='bad.json'):
        Top().override_from_json_file(str(tmp_path / 'bad.json'))
    (tmp_path / 'unknown.json').write_text('{"group": {"kl": 1}}')
    with pytest.raises(AttributeError, match="'group.kl'"):
        Top().override_from_json_file(str(tmp_path / 'unknown.json'))


def test_dump_is_sorted_and_nested():
    hp = Top()
    hp.group.name = 'n'
    out = io.StringIO()
    hyperparams.dump(hp, name='hp', out=out)
    assert out.getvalue() == (
        'hp:\n'
        '  gamma: 1\n'
        '  group:\n'
        '    adaptive_kl: None\n'
        '    kl_coef: 0.2\n'
        '    name: n\n'
        '    trained_model: None\n'
        '  lr: 5e-06\n'
    )


def test_ambiguous_union_is_refused():
    from typing import Union

    @dataclass
    class Amb(hyperparams.HParams):
        x: Union[int, float] = 0

    with pytest.raises(TypeError, match='unambiguously'):
        Amb().override_from_str_dict({'x': '1'})


@dataclass
class NewStyle(hyperparams.HParams):
    # PEP 604 unions and string annotations must behave like Optional[...]
    a: 'int | None' = None
    b: 'Simple | None' = None


def test_pep604_and_string_annotations():
    hp = NewStyle()
    hp.override_from_str_dict({'a': '4', 'b': 'on', 'b.mandatory_nodefault': '2'})
    assert hp.a == 4 and hp.b.mandatory_nodefault == 2
    hp.validate()
    hp.override_from_str_dict({'a': 'None', 'b': 'off'})
    assert hp.a is None and hp.b is None


@pytest.mark.parametrize('value, is_positive, is_nonnegative, is_fraction', [
    (0.5, True, True, True), (1, True, True, True), (0, False, True, True), (0.0, False, True, True),
    (2.0, True, True, False), (-0.1, False, False, False), (float('nan'), False, False, False),
    (float('inf'), False, False, False), (float('-inf'), False, False, False), ('1', False, False, False),
    (None, False, False, False),
])
def test_number_checks_for_require(value, is_positive, is_nonnegative, is_fraction):
    """The checks validate() passes to require(): finite numbers only (nan fails every comparison)."""
    assert hyperparams.positive(value) is is_positive
    assert hyperparams.nonnegative(value) is is_nonnegative
    assert hyperparams.fraction(value) is is_fraction


@dataclass
class Ruled(hyperparams.HParams):
    n: int = 1
    lr: float = 0.1
    rules = dict(at_least_1=('n',), positive=('lr',))


@dataclass
class MoreRuled(Ruled):
    share: float = 0.5
    rules = dict(fraction=('share',))


@dataclass
class HoldsRuled(hyperparams.HParams):
    inner: MoreRuled = field(default_factory=MoreRuled)


@pytest.mark.parametrize('key, value, message', [
    ('inner.n', 0, "hyperparameter 'inner.n' is 0: it must be at least 1"),
    ('inner.lr', float('nan'), "hyperparameter 'inner.lr' is nan: it must be a positive number"),
    ('inner.share', 1.5, "hyperparameter 'inner.share' is 1.5: it must be a number from 0 to 1"),
])
def test_a_class_rules_apply_to_its_fields_and_its_bases_too(key, value, message):
    """An HParams class's `rules` beside its fields: validate() refuses a value outside in one line naming the
    dotted key; a subclass's rules add to its base's (MoreRuled keeps Ruled's)."""
    hp = HoldsRuled()
    hp.validate()
    hp.override_from_dict({key: value})
    with pytest.raises(hyperparams.HParamValueError) as e:
        hp.validate()
    assert str(e.value) == message


def test_require_valid_names_the_hyperparameter():
    def parse(s):
        if s != 'ok':
            raise ValueError(f'{s!r} is not ok')
        return 3
    assert hyperparams.require_valid('a.b', parse, 'ok') == 3
    with pytest.raises(hyperparams.HParamValueError, match=r"^hyperparameter 'a.b': 'no' is not ok$"):
        hyperparams.require_valid('a.b', parse, 'no')


def test_to_flat_dict_is_the_flattened_nested_dict():
    """Every key and value of core.flatten_dict(to_nested_dict()), a group that is off (None) included."""
    from lm_human_preferences import train_policy
    from lm_human_preferences.utils import core
    hp = train_policy.HParams()
    hp.override_from_dict({'rewards.train_new_model': 'on', 'rewards.adaptive_kl': 'on', 'task.query_length': 3})
    assert hp.to_flat_dict() == core.flatten_dict(hp.to_nested_dict(), sep='.')
    assert hp.to_flat_dict()['rewards.train_new_model.task.query_length'] == 3
    hp.override_from_dict({'rewards.train_new_model': 'off'})
    assert hp.to_flat_dict()['rewards.train_new_model'] is None
    assert list(hp.to_flat_dict()) == list(core.flatten_dict(hp.to_nested_dict(), sep='.'))
