"""
nanoGPT-style configuration: module-level defaults in each script, overridden by config
files and --key=value; run_cli, a script's command line (a mistake in its input, a
checks.InputError, prints one line). The input checks every edge shares are checks.py's.

    # sft.py
    lr = 3e-4
    batch_size = 16
    out_dir = "out/sft"
    init_from = None
    # -----------------------------------------------------------------------------
    ...
    if __name__ == "__main__":
        main(configure(globals(), sys.argv[1:], stage="sft"))   # the checked config dict

    $ python sft.py config/qwen_small.py --lr=1e-5 --out_dir=out/run2
    $ python sft.py config/qwen_small.py --help    # the docstring, then every setting's value

    # config/qwen_small.py: one experiment, passed to every stage
    batch_size = 32                            # shared: every script must declare it
    pretrain = dict(lr=1e-3)                   # stage sections: only the running stage's is applied
    sft = dict(lr=3e-5, init_from="out/pretrain")

The script's settings are the names in `globals()` at the time of the call that do not
start with '_' and whose value is exactly one of int, float, bool, str, None, list,
tuple, dict. Modules, functions, classes and dataclass instances are not settings. An
imported plain constant (`from math import pi`) would count, so import those under a '_'
name.

Apply order: each config file's shared top-level names, then its section for the running
stage, then the --key=value arguments. Config files run in a fresh namespace (with
`__file__` set); names starting with '_', names bound by top-level imports, modules,
functions and classes in them are ignored.

Types follow the default: an int is accepted for a float (converted), a bool is not an
int, `true/false` work for bools, a None default accepts any plain literal, and None is
accepted only where the default is None. Command-line values are parsed with
`ast.literal_eval`; for a str setting the text is taken as is unless it is a quoted
string literal (so `--run_name=2024` gives '2024'). Everything is validated first and
applied after: a refused call (ValueError / TypeError) leaves the globals untouched.
"""
import ast
import copy
import difflib
import json
import os
import sys
import types

from checks import BadType, BadValue, InputError

STAGES = ("pretrain", "sft", "grpo", "serve")
SETTING_TYPES = (int, float, bool, str, type(None), list, tuple, dict)

def print0(*args):
    # only rank 0 talks in a multi-process run
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args)

def settings_of(g):
    """the settings of a script's globals: plain values (exact types, so no enums or
    namedtuples), no '_' names"""
    return {k: v for k, v in g.items() if not k.startswith("_") and type(v) in SETTING_TYPES}

# -----------------------------------------------------------------------------
# checking one value against its default

def check_value(key, value, default, source):
    """value converted to the default's type, or a TypeError naming the key, the value and
    the expected type"""
    if default is None:
        if type(value) in SETTING_TYPES:
            return value
        expected = "a plain value (int, float, bool, str, None, list, tuple, dict)"
    elif type(default) is float and type(value) is int:
        return float(value)  # lr=1 means 1.0; bool is not int here since type() is exact
    elif type(value) is type(default):
        return value
    else:
        expected = type(default).__name__
    raise BadType(f"{source}: {key}={value!r} is a {type(value).__name__}, expected {expected}")

def parse_cli_value(key, text, default):
    """the python value of the text after '--key=', before type checking"""
    if type(default) is bool and text in ("true", "false"):
        return text == "true"
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        if default is None or type(default) is str:
            return text  # a bare word: the string itself
        raise BadType(f"--{key}={text}: not a python literal, expected {type(default).__name__}")
    if type(default) is str and value is not None and type(value) is not str:
        return text  # names and paths like 2024 or 1e-5 stay the text that was typed
    return value

# -----------------------------------------------------------------------------
# config files

def load_config_file(path):
    """the settings a config file defines, by name: its plain top-level names, imports and
    helpers left out"""
    if not os.path.isfile(path):
        raise BadValue(f"config file not found: {path!r}")
    with open(path) as f:
        source = f.read()
    tree = ast.parse(source, filename=path)
    imported = {(a.asname or a.name).split(".")[0] for node in tree.body
                if isinstance(node, (ast.Import, ast.ImportFrom)) for a in node.names}
    namespace = {"__file__": os.path.abspath(path), "__name__": "__config__"}
    exec(compile(tree, path, "exec"), namespace)
    return {
        k: v
        for k, v in namespace.items()
        if not k.startswith("_")
        and k not in imported
        and not isinstance(
            v, (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type)
        )
    }

# -----------------------------------------------------------------------------
# the command line

def split_args(args):
    """the command line's config files, and its --key=value overrides as [key, text]"""
    files, overrides = [], []
    for arg in args:
        if not arg.startswith("-"):
            files.append(arg)
        elif arg.startswith("--") and "=" in arg:
            # the first '=' only: values may contain '='
            overrides.append(arg[2:].split("=", 1))
        else:
            raise BadValue(f"bad argument {arg!r}: expected a config file path or --key=value")
    return files, overrides

def print_help(g, config):
    """-h / --help: the script's docstring, then every setting with the value it would
    run with (its default, unless a config file or --key=value given sets it)"""
    print0((g.get("__doc__") or "").strip())
    print0("\nsettings (the defaults, with the config files and --key=value given applied):")
    for key, value in config.items():
        print0(f"  --{key}={value!r}")

# -----------------------------------------------------------------------------
# the entry point

def configure(g, args, stage):
    """apply config files and --key=value args to the settings in g (a script's
    globals()); returns the config"""
    if isinstance(args, str) or not all(isinstance(a, str) for a in args):
        raise TypeError(f"configure: expected a list of argument strings, got {args!r}")
    if stage not in STAGES:
        raise ValueError(f"configure: unknown stage {stage!r}, expected one of {STAGES}")
    settings = settings_of(g)
    clash = sorted(set(settings) & set(STAGES))
    if clash:
        raise ValueError(f"configure: settings {clash} are named like stage sections; rename them")

    wants_help = "-h" in args or "--help" in args
    files, overrides = split_args([arg for arg in args if arg not in ("-h", "--help")])

    # validated values, and (key, value, source) for the log, in order
    updates, applied = {}, []
    def put(key, value, source):
        if key not in settings:
            close = difflib.get_close_matches(str(key), list(settings), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            owners = scripts_with(str(key), g.get("__file__"))
            if owners:   # e.g. train_grpo_async.py's tis_cap given to train_grpo.py
                hint = f" (a setting of {', '.join(owners)}, not of this script)"
            raise BadValue(f"{source}: unknown config key {key!r}{hint}")
        updates[key] = check_value(key, value, settings[key], source)
        applied.append((key, updates[key], source))

    for path in files:
        cfg = load_config_file(path)
        for name in STAGES:
            if name in cfg and type(cfg[name]) is not dict:
                raise BadType(f"{path}: stage {name!r}: a {type(cfg[name]).__name__}, not a dict")
        for key, value in cfg.items():
            if key not in STAGES:
                put(key, value, path)
        for key, value in cfg.get(stage, {}).items():
            put(key, value, f"{path} [{stage}]")
    for key, text in overrides:
        put(key, parse_cli_value(key, text, settings.get(key)), f"--{key}")

    config = {**settings, **updates}
    for key, value in config.items():
        # the config is logged and checkpointed, so it must be JSON
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise BadType(f"{key}={value!r}: not JSON-serialisable ({e})") from None
    if wants_help:   # what this command line would run with; nothing is applied
        print_help(g, config)
        raise SystemExit(0)

    # everything checked: only now touch the script's globals
    g.update(updates)
    for key, value, source in applied:
        print0(f"config: {key} = {value!r}  ({source})")
    return copy.deepcopy(config)


# -----------------------------------------------------------------------------
# a script's command line

def scripts_with(key, script):
    """The other scripts beside script (the .py files of its folder with a command line,
    run_cli) that have a setting named key, read without importing them: where a key
    this script does not know belongs. [] without a script."""
    if not script:
        return []
    folder, found = os.path.dirname(os.path.abspath(script)), []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not name.endswith(".py") or os.path.abspath(script) == path:
            continue
        with open(path) as f:
            text = f.read()
        if "run_cli(" not in text:
            continue
        tree = ast.parse(text)
        if any(isinstance(t, ast.Name) and t.id == key
               for node in tree.body if isinstance(node, ast.Assign) for t in node.targets):
            found.append(name)
    return found


def run_cli(main, g, stage):
    """a script's command line: main(configure(g, sys.argv[1:], stage)). A mistake in its
    input (an InputError: a bad setting, a missing directory) prints its message alone and
    exits with status 2; a bug still shows its traceback"""
    try:
        return main(configure(g, sys.argv[1:], stage=stage))
    except InputError as e:
        print(f"{os.path.basename(sys.argv[0])}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
