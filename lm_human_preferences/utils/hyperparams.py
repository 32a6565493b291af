"""Typed, nested hyperparameter structs (port of the original utils/hyperparams.py).

Every hyperparameter struct is a `@dataclass` subclassing `HParams`. Values can be overridden with
dotted keys from strings (command line: `ppo.lr=1e-5`, `rewards.train_new_model=off`), from already
parsed dicts (launch.py's `bind(...)`), from nested dicts and from JSON files.

Differences from the original (all in PORTING.md):
- The original type-checked with `typeguard`; we check types ourselves (same rules: ints are accepted
  for float fields, `None` in a non-Optional field means "mandatory value not set") so that each error
  names the dotted key, the value and the expected type.
- Unknown keys raise an error listing the closest valid keys; values given to `override_from_dict` /
  `override_from_nested_dict` are type-checked when set (the original only caught them in validate()).
"""

import difflib
import json
import math
import sys
import types
import typing
from dataclasses import fields, is_dataclass
from functools import lru_cache

from lm_human_preferences.utils import files, gcs


# The error classes subclass the builtin exceptions the original raised (the original's tests expect
# AttributeError / ValueError / TypeError), so callers can catch either.
class UnknownHParamError(AttributeError):
    """A dotted key that names no field."""


class HParamValueError(ValueError):
    """A value that cannot be parsed as (or is not of) the field's type."""


class HParamTypeError(TypeError):
    """validate(): a field holds a value of the wrong type, or a mandatory value is missing."""


class HParams:
    """Used as a base class for hyperparameter structs. They also need to be annotated with @dataclass."""

    # Ours: what the class's own fields allow, written beside them: {rule of RULES: (field name, ...)}; validate()
    # refuses a value outside in one line naming the field (a check needing more: the class's validate()).
    rules = {}

    def override_from_json_file(self, filename):
        if '://' in filename:
            # The original read gs:// files through the GCS client; we fetch URLs over http(s).
            filename = gcs.download_file_cached(filename)
        with open(filename) as f:
            hparams_str = f.read()
        try:
            self.parse_json(hparams_str)
        except json.JSONDecodeError as e:
            raise HParamValueError(f"hyperparameter file {filename} is not valid JSON: {e}") from None

    def override_from_str(self, hparam_str):
        """Overrides values from a string like 'x.y=1,name=foobar'.

        Like tensorflow.contrib.training.HParams, this method does not allow specifying string values containing commas.
        """
        flat_dict = {}
        for kvp_str in hparam_str.split(','):
            k, sep, v = kvp_str.partition('=')
            if not sep:
                raise HParamValueError(f"Malformed hyperparameter value: '{kvp_str}' (expected key=value)")
            flat_dict[k] = v
        self.override_from_str_dict(flat_dict)

    def override_from_str_dict(self, flat_dict, separator='.'):
        """Overrides values from a dict like {'x.y': "1", 'name': "foobar"}.

        Treats keys with dots as paths into nested HParams.
        Parses values according to the types in the HParams classes.
        """
        typemap = _type_map(type(self), separator=separator)
        parsed = {}
        for flat_k, s in flat_dict.items():
            _check_known_key(type(self), typemap, flat_k)
            try:
                parsed[flat_k] = _parse_typed_value(typemap[flat_k], s)
            except ValueError as e:
                raise HParamValueError(
                    f"bad value for hyperparameter '{flat_k}': {s!r} ({e}; expected {_type_name(typemap[flat_k])})"
                ) from None
        self.override_from_dict(parsed, separator=separator)

    def parse_json(self, s: str):
        self.override_from_nested_dict(json.loads(s))

    def override_from_dict(self, flat_dict, separator='.'):
        """Overrides values from a dict like {'x.y': 1, 'name': "foobar"}.

        Treats keys with dots as paths into nested HParams.
        Values should be parsed already; nested HParams fields take 'on' (a default instance) or 'off' (None).
        """
        typemap = _type_map(type(self), separator=separator)

        # Parse 'on' and 'off' values; type-check the others (None stays allowed: validate() reports it
        # as a missing mandatory value, exactly when the original did).
        flat_dict_parsed = {}
        for flat_k, v in flat_dict.items():
            _check_known_key(type(self), typemap, flat_k)
            cls = _type_to_class(typemap[flat_k])
            if is_hparam_type(cls) and v == 'on':
                parsed_v = cls()
            elif is_hparam_type(cls) and v == 'off':
                parsed_v = None
            else:
                if v is not None and not _matches_type(v, typemap[flat_k]):
                    raise HParamValueError(
                        f"bad value for hyperparameter '{flat_k}': {v!r} of type {type(v).__name__}, "
                        f"expected {_type_name(typemap[flat_k])}")
                parsed_v = v
            flat_dict_parsed[flat_k] = parsed_v

        # Expand implicit nested 'on' values. For instance, {'x.y': 'on'} should mean {'x': 'on', 'x.y': 'on'}.
        # Unlike the original, an enclosing group that is already on is left alone: the original replaced
        # it by a fresh default instance, so `--rewards.adaptive_kl on` wiped the experiment's other
        # `rewards.*` values.
        flat_dict_expanded = {}
        for flat_k, v in flat_dict_parsed.items():
            flat_dict_expanded[flat_k] = v
            cls = _type_to_class(typemap[flat_k])
            if is_hparam_type(cls) and v is not None:
                parts = flat_k.split(separator)
                for i in range(1, len(parts)):
                    prefix = separator.join(parts[:i])
                    if prefix not in flat_dict_expanded and self._get_path(parts[:i]) is None:
                        flat_dict_expanded[prefix] = _type_to_class(typemap[prefix])()

        # Set all the values. The sort ensures that outer classes get initialized before their fields.
        for flat_k in sorted(flat_dict_expanded.keys()):
            v = flat_dict_expanded[flat_k]
            *ks, f = flat_k.split(separator)
            hp = self
            for i, k in enumerate(ks):
                hp = getattr(hp, k)
                if hp is None:
                    group = separator.join(ks[:i + 1])
                    raise UnknownHParamError(
                        f"cannot set hyperparameter '{flat_k}': '{group}' is off (None); "
                        f"turn it on first: --{group} on")
            setattr(hp, f, v)

    def _get_path(self, keys):
        """The value at a list of field names, or None if it (or any group on the way) is None."""
        hp = self
        for k in keys:
            hp = getattr(hp, k)
            if hp is None:
                return None
        return hp

    def override_from_nested_dict(self, nested_dict, *, prefix=''):
        hints = _field_types(type(self))
        for k, v in nested_dict.items():
            key = prefix + k
            if k not in hints:
                _raise_unknown(type(self), list(hints), k, prefix=prefix)
            cls = _type_to_class(hints[k])
            if isinstance(v, dict):
                if not is_hparam_type(cls):
                    raise HParamValueError(
                        f"bad value for hyperparameter '{key}': got a dict, expected {_type_name(hints[k])}")
                # A dict for a group that is off turns it on (as the original).
                if getattr(self, k) is None:
                    setattr(self, k, cls())
                getattr(self, k).override_from_nested_dict(v, prefix=key + '.')
            else:
                if v is not None and not _matches_type(v, hints[k]):
                    raise HParamValueError(
                        f"bad value for hyperparameter '{key}': {v!r} of type {type(v).__name__}, "
                        f"expected {_type_name(hints[k])}")
                setattr(self, k, v)

    def to_nested_dict(self):
        d = {}
        for f in fields(self):
            fieldval = getattr(self, f.name)
            if isinstance(fieldval, HParams):
                fieldval = fieldval.to_nested_dict()
            d[f.name] = fieldval
        return d

    def to_flat_dict(self, prefix=''):
        """Ours: {dotted key: value} of every field, a nested group's by its path (as core.flatten_dict of
        to_nested_dict(), without importing torch: the launcher's --help reads it)."""
        d = {}
        for f in fields(self):
            fieldval = getattr(self, f.name)
            d.update(fieldval.to_flat_dict(prefix + f.name + '.') if isinstance(fieldval, HParams)
                     else {prefix + f.name: fieldval})
        return d

    def validate(self, *, prefix=''):
        if not is_dataclass(self):
            raise HParamTypeError(f"You forgot to annotate {type(self).__name__} with @dataclass")
        hints = _field_types(type(self))
        for f in fields(self):
            fieldval = getattr(self, f.name)
            ty = hints[f.name]
            if fieldval is None and not _is_optional(ty):
                raise HParamTypeError(
                    f"missing mandatory value for hyperparameter '{prefix + f.name}' (expected {_type_name(ty)})")
            if not _matches_type(fieldval, ty):
                raise HParamTypeError(
                    f"hyperparameter '{prefix + f.name}' has value {fieldval!r} of type "
                    f"{type(fieldval).__name__}, expected {_type_name(ty)}")
            if isinstance(fieldval, HParams):
                fieldval.validate(prefix=prefix + f.name + '.')
        for cls in reversed(type(self).__mro__):  # ours: each class's own rules, a base class's first
            for rule, names in vars(cls).get('rules', {}).items():
                ok, allowed = RULES[rule]
                for name in names:
                    require(ok(getattr(self, name)), prefix + name, getattr(self, name), allowed)


def is_hparam_type(ty):
    if isinstance(ty, type) and issubclass(ty, HParams):
        assert is_dataclass(ty), f"You forgot to annotate {ty.__name__} with @dataclass"
        return True
    else:
        return False


def _is_union_type(ty):
    # `Optional[int]` is a typing.Union; `int | None` (Python 3.10+) is a types.UnionType.
    return typing.get_origin(ty) in (typing.Union, types.UnionType)


def _is_optional(ty):
    return _is_union_type(ty) and type(None) in typing.get_args(ty)


def dump(hparams, *, name='hparams', out=None):
    out = sys.stdout if out is None else out  # resolved at call time so redirected stdout is honoured
    out.write('%s:\n' % name)
    def dump_nested(hp, indent):
        for f in sorted(fields(hp), key=lambda f: f.name):
            v = getattr(hp, f.name)
            if isinstance(v, HParams):
                out.write('%s%s:\n' % (indent, f.name))
                dump_nested(v, indent=indent+'  ')
            else:
                out.write('%s%s: %s\n' % (indent, f.name, v))
    dump_nested(hparams, indent='  ')


def require(ok, name, value, allowed):
    """Ours: a one-line ValueError naming the hyperparameter, its value and what is allowed, unless ok
    (the trainers' validate() methods check the values this way, at launch)."""
    if not ok:
        raise HParamValueError(f"hyperparameter '{name}' is {value!r}: {allowed}")


def require_valid(name, check, *args):
    """Ours: check(*args); its ValueError (or OSError: a file the value names) one line naming the hyperparameter."""
    try:
        return check(*args)
    except (ValueError, OSError) as e:
        raise HParamValueError(f"hyperparameter '{name}': {e}") from None


def positive(value):
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def nonnegative(value):
    """Ours, for require(): a finite number >= 0 (nan and inf are not)."""
    return isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


def fraction(value):
    """Ours, for require(): a number from 0 to 1, both included (nan is not)."""
    return nonnegative(value) and value <= 1


# Ours: the rules an HParams class's `rules` name, each a test and what it allows.
RULES = dict(
    at_least_1=(lambda value: value > 0, 'it must be at least 1'),
    at_least_0=(lambda value: value >= 0, 'it must be at least 0'),
    positive=(positive, 'it must be a positive number'),
    nonnegative=(nonnegative, 'it must be a number at least 0'),
    fraction=(fraction, 'it must be a number from 0 to 1'),
)


def save_json(hparams, path):
    """Write hparams.to_nested_dict() as JSON, atomically (the trainers save their hparams with this)."""
    files.atomic_write(path, json.dumps(hparams.to_nested_dict(), indent=2).encode())


def _can_distinguish_unambiguously(type_set):
    """Whether it's always possible to tell which type in type_set a certain value is supposed to be"""
    if len(type_set) == 1:
        return True
    if type(None) in type_set:
        return True
    if str in type_set:
        return False
    if int in type_set and float in type_set:
        return False
    if any(_is_union_type(ty) for ty in type_set):
        # Nested unions *might* be unambiguous, but don't support for now
        return False
    return True


def _parse_typed_value(ty, s):
    if ty is str:
        return s
    elif ty in (int, float):
        try:
            return ty(s)
        except ValueError:
            raise ValueError(f"invalid {ty.__name__} '{s}'") from None
    elif ty is bool:
        if s in ('t', 'true', 'True'):
            return True
        elif s in ('f', 'false', 'False'):
            return False
        else:
            raise ValueError(f"Invalid bool '{s}'")
    elif ty is type(None):
        if s in ('None', 'none', ''):
            return None
        else:
            raise ValueError(f"Invalid None value '{s}'")
    elif is_hparam_type(ty):
        if s in ('on', 'off'):
            # The class will be constructed later
            return s
        else:
            raise ValueError(f"Invalid hparam class value '{s}' (use 'on' or 'off')")
    elif typing.get_origin(ty) is typing.Literal:
        # Ours: a fixed word a field accepts besides its type (run.microbatch_size 'auto')
        for option in typing.get_args(ty):
            if s == str(option):
                return option
        raise ValueError(f"'{s}' is not one of {', '.join(map(repr, typing.get_args(ty)))}")
    elif _is_union_type(ty):
        args = typing.get_args(ty)
        if not _can_distinguish_unambiguously(args):
            raise TypeError(f"Can't always unambiguously parse a value of union '{ty}'")
        # Same order as the original: the first option that parses wins (so for Optional[str] the
        # string 'None' stays a string).
        for ty_option in args:
            try:
                return _parse_typed_value(ty_option, s)
            except ValueError:
                continue
        raise ValueError(f"Couldn't parse '{s}' as any of the types in '{_type_name(ty)}'")
    else:
        raise ValueError(f"Unsupported hparam type '{ty}'")


def _matches_type(value, ty):
    """isinstance for the field types HParams supports (what the original checked with typeguard)."""
    if _is_union_type(ty):
        return any(_matches_type(value, t) for t in typing.get_args(ty))
    if ty is type(None):
        return value is None
    if ty is typing.Any:
        return True
    if ty is float:
        # typeguard follows PEP 484's numeric tower: an int is a valid float (e.g. `gamma: float = 1`).
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if ty is int:
        return isinstance(value, int) and not isinstance(value, bool)
    origin = typing.get_origin(ty)
    if origin is typing.Literal:
        return value in typing.get_args(ty)
    if origin is not None:  # e.g. List[int], Dict[str, int]: check only the container
        return isinstance(value, origin)
    return isinstance(value, ty)


def _type_name(ty):
    if _is_union_type(ty):
        args = typing.get_args(ty)
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1 and len(args) == 2:
            return f'Optional[{_type_name(non_none[0])}]'
        return ' | '.join(_type_name(a) for a in args)
    if ty is type(None):
        return 'None'
    if is_hparam_type(ty):
        return f"{ty.__name__} ('on' or 'off')"
    if typing.get_origin(ty) is typing.Literal:
        return ' | '.join(map(repr, typing.get_args(ty)))
    return getattr(ty, '__name__', str(ty))


@lru_cache()
def _field_types(cls):
    """Field name -> type, with string annotations (`from __future__ import annotations`) resolved."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def _update_disjoint(dst: dict, src: dict):
    for k, v in src.items():
        assert k not in dst, f"duplicate hyperparameter key {k}"
        dst[k] = v


@lru_cache()
def _type_map(ty, separator):
    """Flat dotted key -> field type, for every field of ty and (recursively) of its nested HParams."""
    typemap = {}
    for name, fty in _field_types(ty).items():
        typemap[name] = fty
        if is_hparam_type(fty):
            nested = _type_map(fty, separator=separator)
        elif _is_union_type(fty):
            nested = {}
            for ty_option in typing.get_args(fty):
                if is_hparam_type(ty_option):
                    _update_disjoint(nested, _type_map(ty_option, separator=separator))
        else:
            nested = {}
        _update_disjoint(typemap, {f'{name}{separator}{k}': t for k, t in nested.items()})
    return typemap


def _check_known_key(cls, typemap, flat_k):
    if flat_k not in typemap:
        _raise_unknown(cls, list(typemap), flat_k)


def _raise_unknown(cls, valid_keys, k, prefix=''):
    close = difflib.get_close_matches(k, valid_keys, n=5, cutoff=0.5)
    hint = f"; closest valid keys: {', '.join(prefix + c for c in close)}" if close else ''
    raise UnknownHParamError(f"unknown hyperparameter '{prefix + k}' (no such field in {cls.__name__}){hint}")


def _type_to_class(ty):
    """Extract a constructible class from a type. For instance, `typing.Optional[int]` gives `int`; a union
    of several value types (ours: `Optional[Union[int, Literal['auto']]]`) has none and stays as it is."""
    if _is_union_type(ty):
        args = [a for a in typing.get_args(ty) if a is not type(None)]
        # An optional group of hparams is the only union with a class to construct: Optional[SomeHParams]
        assert len(args) == 1 or not any(is_hparam_type(a) for a in args), f"unsupported union {ty}"
        return args[0] if len(args) == 1 else ty
    else:
        return ty
