"""Ours: the launcher's command line (the original used fire): `python launch.py COMMAND ARG... [--option value]
[--dotted.hparam value]`, parsed for utils/launch.py's main; `--help` on every command; --dry_run's listing of the
resolved hparams. A bad command line is one ConfigError line."""

import inspect
import os
import sys



class ConfigError(Exception):
    """A bad command line, experiment name or hyperparameter: reported as one line, without a traceback."""


def print_dry_run(job_name, hparams, *, mpi, procs, bound, command_line, stages):
    """Ours (the original printed the bindings' dict on one line, then the nested hparams): the ranks and
    processes, the save dirs the run will use, then every hparam as `key: value` (repr), one per line, with
    who set it: the experiment, the command line (directly, or through an hparam that sets others too),
    the launcher (run.save_dir: --save_dir/NAME) or the trainer (derived from other hparams). stages: the
    flat hparams after the experiment's bindings and after the command line's."""
    after_bindings, after_command_line = stages
    final = hparams.to_flat_dict()

    def origin(k):
        if k in command_line or after_command_line.get(k) != after_bindings.get(k):
            return 'command line'
        if final[k] != after_command_line.get(k):
            return '--save_dir/NAME' if k == 'run.save_dir' else 'derived'
        return 'experiment' if k in bound else None
    origins = {k: origin(k) for k in final}
    ranks_text = f'{mpi} rank{"s" if mpi != 1 else ""}'
    procs_text = f'{procs} process{"es" if procs != 1 else ""}'
    print(f'{job_name}: {ranks_text} (--mpi {mpi}) in {procs_text} (--procs {procs}); --dry_run: nothing runs')
    print('save dirs, and what the trainer derives from them:')
    for k in sorted(final):
        if k.endswith('save_dir') or origins[k] == 'derived':
            print(f'  {k}: {final[k]}')
    print('hparams (# who set it: the experiment, the command line, or derived from others; no mark: the default):')
    for k in sorted(final):
        print(f'  {k}: {final[k]!r}' + (f'  # {origins[k]}' if origins[k] else ''))


def _parse_command_line(argv, params):
    """argv (after the command) -> (positional args, options). `--key value` and `--key=value`; an option
    that is a bool parameter of the command may be given alone as a flag (`--dry_run`)."""
    positional, options = [], {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith('--'):
            positional.append(arg)
            i += 1
            continue
        key, eq, value = arg[2:].partition('=')
        if not key:
            raise ConfigError(f"malformed option '{arg}'")
        if key in options:
            raise ConfigError(f"option --{key} given twice")
        param = params.get(key)
        is_flag = param is not None and isinstance(param.default, bool)
        if not eq:
            if is_flag and (i + 1 == len(argv) or argv[i + 1].startswith('--')):
                value = 'true'
            elif i + 1 == len(argv):
                raise ConfigError(f'option --{key} needs a value')
            else:
                i += 1
                value = argv[i]
        options[key] = value
        i += 1
    return positional, options


def _convert_option(key, value, param):
    """Command options (not hparams) take the type of their default (bool / int / float); None defaults
    take int for `mpi` and `procs`, str otherwise."""
    default = param.default
    if isinstance(default, bool):
        if value.lower() in ('t', 'true', '1', 'yes'):
            return True
        if value.lower() in ('f', 'false', '0', 'no'):
            return False
        raise ConfigError(f"option --{key}: invalid bool '{value}'")
    if isinstance(default, int) or (default is None and key in ('mpi', 'procs')):
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"option --{key}: invalid int '{value}'") from None
    if isinstance(default, float):
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"option --{key}: invalid float '{value}'") from None
    return value


# A command's options whose default is None say in `--help` what that means (ours: the help printed
# "(set by the command)"): the command's `option_help` dict maps each to a text, or to REQUIRED.
REQUIRED = 'required'


def _option_help(command):
    return getattr(command, 'option_help', {})


def _usage(name, command):
    words = [name]
    for p in inspect.signature(command).parameters.values():
        if p.kind is p.VAR_KEYWORD:
            words.append('[--dotted.hparam VALUE ...]')
        elif p.default is inspect.Parameter.empty:
            words.append(p.name.upper())
        elif _option_help(command).get(p.name) == REQUIRED:
            words.append(f'--{p.name} {p.name.upper()}')
        else:
            words.append(f'[--{p.name} {p.name.upper()}]' if not isinstance(p.default, bool) else f'[--{p.name}]')
    return ' '.join(words)


def usage_or_help(commands_dict, argv):
    """The usage of every command (no command, or -h / --help), or `COMMAND --help`: printed, then exit."""
    program = os.path.basename(sys.argv[0])
    usage = '\n'.join(f'usage: {program} {_usage(name, command)}' for name, command in commands_dict.items())
    if not argv or argv[0] in ('-h', '--help'):
        print(usage + f'\n\n`{program} COMMAND --help` tells more of each command.')
        sys.exit(0 if argv else 2)
    if argv[0] in commands_dict and any(a in ('-h', '--help') for a in argv[1:]):
        print(command_help(program, argv[0], commands_dict[argv[0]]))
        sys.exit(0)


def command_arguments(name, command, args):
    """(positional arguments, keyword arguments) of a command line's args for command (see main)."""
    params = inspect.signature(command).parameters
    positional, options = _parse_command_line(args, params)
    kw = {}
    names = [p.name for p in params.values() if p.default is inspect.Parameter.empty
             and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) != len(names):
        raise ConfigError(f"{name} takes {len(names)} arguments ({' '.join(names).upper()}), "
                          f"got {len(positional)}: {' '.join(positional)}")
    takes_hparams = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for key, value in options.items():
        param = params.get(key)
        if param is not None and param.kind is not param.VAR_KEYWORD:
            kw[key] = _convert_option(key, value, param)
        elif takes_hparams:
            kw[key] = value  # a dotted hparam override: goes to **extra_hparams
        else:
            raise ConfigError(f'{name} has no option --{key}')
    return positional, kw


def _option_default(command, param):
    if param.default is False:  # a switch: --dry_run alone is true
        return '(a switch: on when given)'
    return f'({_option_help(command)[param.name]})' if param.default is None else repr(param.default)


def command_help(program, name, command):
    """`COMMAND --help`: the command's description (its docstring), usage, options with their defaults (or
    for those left unset, their option_help: what happens then, or REQUIRED), and, where the command lists
    them, its experiments and most used hparams."""
    lines = [f'usage: {program} {_usage(name, command)}', '', inspect.cleandoc(command.__doc__ or '')]
    options = [p for p in inspect.signature(command).parameters.values()
               if p.default is not inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD]
    if options:
        lines += ['', 'options:'] + [f'  --{p.name} ' + _option_default(command, p) for p in options]
    extra = getattr(command, 'help_sections', None)
    if extra is not None:
        lines += ['', extra()]
    return '\n'.join(lines).rstrip()
