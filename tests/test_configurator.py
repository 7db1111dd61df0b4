"""tests for configurator.py: a fake script globals dict, temp config files"""
import copy
import json
import math
import os
import subprocess
import sys

import pytest

from configurator import configure, settings_of

def fake_globals():
    # what a training script's globals() looks like right after its settings block
    return {"__name__": "__main__", "__file__": "sft.py", "_private": 1, "os": os, "math": math,
            "configure": configure, "ValueError": ValueError, "Exception": Exception, "lr": 3e-4,
            "batch_size": 16, "compile": False, "out_dir": "out/sft", "init_from": None,
            "betas": (0.9, 0.95), "layers": [1, 2], "extra": {"a": 1}, "seed": 1337,}

SETTINGS = {"lr", "batch_size", "compile", "out_dir", "init_from", "betas", "layers", "extra",
            "seed"}

@pytest.fixture
def cfg_file(tmp_path):
    def write(text, name="exp.py"):
        p = tmp_path / name
        p.write_text(text)
        return str(p)
    return write

# -----------------------------------------------------------------------------
# which globals count

def test_settings_rule_excludes_modules_functions_classes_and_private():
    assert set(settings_of(fake_globals())) == SETTINGS

def test_returned_config_is_complete_and_json_serialisable():
    g = fake_globals()
    config = configure(g, [], stage="sft")
    assert set(config) == SETTINGS
    assert config["init_from"] is None and config["layers"] == [1, 2]
    assert json.loads(json.dumps(config))["betas"] == [0.9, 0.95]
    # the returned dict is a copy: logging it can't alias the script's state
    config["layers"].append(3)
    assert g["layers"] == [1, 2]

def test_non_json_value_refused():
    g = fake_globals()
    g["extra"] = {(1, 2): "tuple keys"}
    with pytest.raises(TypeError, match="extra"):
        configure(g, [], stage="sft")

def test_a_scripts_settings_are_its_lowercase_names():
    # a module constant (UPPER_CASE) that counted as a setting could be overridden from
    # the command line; constants take a '_' name. The scripts: every module that
    # hands its globals() to configure (run_cli does)
    import importlib, pathlib
    root = pathlib.Path(__file__).resolve().parents[1]
    files = [*root.glob("*.py"), *root.glob("*/*.py")]     # the root and its packages
    scripts = [".".join(p.relative_to(root).with_suffix("").parts) for p in files
               if "run_cli(main, globals()" in p.read_text()
               and p.parent.name != "tests" and p.name != "configurator.py"]
    assert len(scripts) >= 4, scripts     # pretrain, sft, train_grpo, scaleout.serve
    for script in scripts:
        names = settings_of(vars(importlib.import_module(script)))
        assert names and all(name == name.lower() for name in names), (script, sorted(names))

# -----------------------------------------------------------------------------
# --key=value

def test_cli_overrides_and_returned():
    g = fake_globals()
    config = configure(g,
                       ["--batch_size=32", "--out_dir=out/x", "--layers=[4, 5]",
                        "--betas=(0.8, 0.9)", "--extra={'b': 2}"], stage="sft")
    assert g["batch_size"] == 32 and type(g["batch_size"]) is int
    assert g["out_dir"] == "out/x" and g["layers"] == [4, 5] and g["betas"] == (0.8, 0.9)
    assert g["extra"] == {"b": 2}
    assert config["batch_size"] == 32 and config["layers"] == [4, 5]

def test_split_on_first_equals_only():
    g = fake_globals()
    configure(g, ["--out_dir=a=b=c"], stage="sft")
    assert g["out_dir"] == "a=b=c"
    configure(g, ["--init_from=x=1"], stage="sft")
    assert g["init_from"] == "x=1"

def test_int_for_float_is_converted():
    g = fake_globals()
    configure(g, ["--lr=1"], stage="sft")
    assert g["lr"] == 1.0 and type(g["lr"]) is float

def test_float_for_int_refused():
    g = fake_globals()
    with pytest.raises(TypeError, match="batch_size"):
        configure(g, ["--batch_size=1.5"], stage="sft")

@pytest.mark.parametrize("text, expected",
                         [("True", True), ("true", True), ("False", False), ("false", False)])
def test_bool_parsing(text, expected):
    g = fake_globals()
    g["compile"] = not expected
    configure(g, [f"--compile={text}"], stage="sft")
    assert g["compile"] is expected

@pytest.mark.parametrize("text", ["1", "0", "yes", "'True'"])
def test_non_bool_for_bool_refused(text):
    with pytest.raises(TypeError, match="compile"):
        configure(fake_globals(), [f"--compile={text}"], stage="sft")

@pytest.mark.parametrize("text", ["True", "false"])
def test_bool_for_int_refused(text):
    with pytest.raises(TypeError, match="seed"):
        configure(fake_globals(), [f"--seed={text}"], stage="sft")

def test_wrong_type_message_names_key_value_and_type():
    with pytest.raises(TypeError) as e:
        configure(fake_globals(), ["--batch_size=abc"], stage="sft")
    msg = str(e.value)
    assert "batch_size" in msg and "abc" in msg and "int" in msg
    with pytest.raises(TypeError) as e:
        configure(fake_globals(), ["--layers=(1, 2)"], stage="sft")
    msg = str(e.value)
    assert "layers" in msg and "(1, 2)" in msg and "list" in msg and "tuple" in msg

@pytest.mark.parametrize("text, expected", [
    ("5", 5), ("out/pretrain", "out/pretrain"),  # not a literal: the raw string
    ("[1, 'a']", [1, "a"]), ("True", True), ("'q'", "q"), ("None", None),
])
def test_none_default_accepts_any_literal_and_none(text, expected):
    g = fake_globals()
    configure(g, [f"--init_from={text}"], stage="sft")
    assert g["init_from"] == expected and type(g["init_from"]) is type(expected)

@pytest.mark.parametrize("key", ["lr", "batch_size", "compile", "out_dir", "layers"])
def test_none_refused_unless_default_is_none(key):
    with pytest.raises(TypeError, match=key):
        configure(fake_globals(), [f"--{key}=None"], stage="sft")

def test_str_setting_keeps_the_typed_text():
    g = fake_globals()
    configure(g, ["--out_dir=2024"], stage="sft")
    assert g["out_dir"] == "2024"
    configure(g, ["--out_dir='quoted'"], stage="sft")
    assert g["out_dir"] == "quoted"

def test_unknown_cli_key():
    with pytest.raises(ValueError, match="batch_sise.*did you mean 'batch_size'"):
        configure(fake_globals(), ["--batch_sise=3"], stage="sft")
    with pytest.raises(ValueError, match="_private"):
        configure(fake_globals(), ["--_private=3"], stage="sft")
    with pytest.raises(ValueError, match="'math'"):  # a module is not a setting
        configure(fake_globals(), ["--math=3"], stage="sft")

@pytest.mark.parametrize("arg", ["--lr", "-lr=1", "--", "-x"])
def test_malformed_argument(arg):
    with pytest.raises(ValueError, match="bad argument"):
        configure(fake_globals(), [arg], stage="sft")

def test_later_cli_wins():
    g = fake_globals()
    configure(g, ["--seed=1", "--seed=2"], stage="sft")
    assert g["seed"] == 2

def test_bad_call_arguments():
    with pytest.raises(ValueError, match="stage"):
        configure(fake_globals(), [], stage="rl")
    with pytest.raises(TypeError):
        configure(fake_globals(), "--lr=1", stage="sft")
    g = fake_globals()
    g["sft"] = 1  # a setting named like a stage section could never be set from a file
    with pytest.raises(ValueError, match="sft"):
        configure(g, [], stage="sft")

@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_prints_the_docstring_and_every_setting(capsys, flag):
    g = {**fake_globals(), "__doc__": "Fine-tune on demonstrations.\n\n    python sft.py\n"}
    with pytest.raises(SystemExit) as exit_:
        configure(g, ["--lr=5", flag, "--seed=7"], stage="sft")   # shown, not applied
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and g["lr"] == 3e-4 and g["seed"] == 1337
    assert out.startswith("Fine-tune on demonstrations.")
    assert "--lr=5.0" in out and "--seed=7" in out
    assert all(f"--{key}={g[key]!r}" in out for key in SETTINGS - {"lr", "seed"})

# every script with a command line: --help answers with its usage (exit 0, or a usage
# line), never a traceback, and writes nothing (make_arith once wrote a file named
# '--help'). The peers' and verifiers' scripts run in their own venvs and are left out.
SCRIPTS = ["pretrain", "sft", "train_grpo", "train_grpo_async", "scaleout.serve",
           "tasks.evaluate", "tasks.make_arith", "tasks.make_gsm8k_like", "bench.bench",
           "bench.report", "bench.off_policy_lab", "bench.pass_at_k", "bench.forks_check"]


# runs each script as `python -m SCRIPT --help` would, one after the other in one process (a
# process each would spend 2 to 3 s importing torch again): its exit code, stdout, stderr
HELP_RUNNER = """
import contextlib, io, json, runpy, sys, traceback
answers = {}
for script in sys.argv[1:]:
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = [script, "--help"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        except SystemExit as e:   # sys.exit("text") prints it and exits 1, as Python does
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            code = 1
            traceback.print_exc()
    answers[script] = [code, out.getvalue(), err.getvalue()]
print(json.dumps(answers))
"""


@pytest.fixture(scope="module")
def help_answers(tmp_path_factory):
    import subprocess, sys
    tmp = tmp_path_factory.mktemp("help")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, WANDB_MODE="disabled")
    done = subprocess.run([sys.executable, "-c", HELP_RUNNER, *SCRIPTS], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return tmp, json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help(script, help_answers):
    tmp, answers = help_answers
    code, out, err = answers[script]
    assert code in (0, 1, 2) and "Traceback" not in err, err
    assert "usage" in (out + err).lower() or code == 0
    assert not list(tmp.iterdir())   # nothing written


# -----------------------------------------------------------------------------
# config files and stage sections

def test_config_file_shared_settings(cfg_file):
    g = fake_globals()
    path = cfg_file("import os\nfrom math import pi\nimport os.path as _p\n_hidden = 3\n"
                    "def helper(x):\n    return 2 * x\n"
                    "batch_size = helper(4)\nout_dir = os.path.join('out', 'exp')\nlr = 1\n")
    config = configure(g, [path], stage="sft")
    assert g["batch_size"] == 8 and g["out_dir"] == os.path.join("out", "exp")
    assert g["lr"] == 1.0 and type(g["lr"]) is float
    assert config["batch_size"] == 8

def test_config_file_has_its_own_file(cfg_file):
    g = fake_globals()
    path = cfg_file("import os\nout_dir = os.path.dirname(__file__)\n")
    configure(g, [path], stage="sft")
    assert g["out_dir"] == os.path.dirname(os.path.abspath(path))
    assert g["__file__"] == "sft.py"  # the script's own __file__ is untouched

def test_unknown_key_in_file(cfg_file):
    g = fake_globals()
    path = cfg_file("lr = 1e-3\nnum_rollouts = 4\n")
    with pytest.raises(ValueError, match="num_rollouts") as e:
        configure(g, [path], stage="sft")
    assert path in str(e.value)
    assert g["lr"] == 3e-4  # the known key before it was not applied either

def test_wrong_type_in_file(cfg_file):
    path = cfg_file("batch_size = '16'\n")
    with pytest.raises(TypeError, match="batch_size.*'16'.*str.*int"):
        configure(fake_globals(), [path], stage="sft")
    path = cfg_file("compile = 1\n")
    with pytest.raises(TypeError, match="compile"):
        configure(fake_globals(), [path], stage="sft")

def test_stage_section_applied_and_others_ignored(cfg_file):
    path = cfg_file("lr = 1e-3\nseed = 7\n"
                    # unknown to sft, but not sft's section
                    "pretrain = dict(lr=1e-2, tokens_per_step=1024)\n"
                    "sft = dict(lr=3e-5, init_from='out/pretrain')\n"
                    "grpo = dict(group_size=8)\n")
    g = fake_globals()
    config = configure(g, [path], stage="sft")
    assert g["lr"] == 3e-5 and g["init_from"] == "out/pretrain" and g["seed"] == 7
    assert "pretrain" not in config and "grpo" not in config and "sft" not in config

def test_unknown_key_in_stage_section(cfg_file):
    path = cfg_file("sft = dict(lr=3e-5, group_size=8)\n")
    g = fake_globals()
    with pytest.raises(ValueError, match=r"\[sft\].*group_size"):
        configure(g, [path], stage="sft")
    assert g["lr"] == 3e-4
    configure(g, [path], stage="pretrain")  # the same file is fine for a stage it doesn't configure

def test_stage_sections_must_be_dicts(cfg_file):
    path = cfg_file("grpo = 3\n")
    with pytest.raises(TypeError, match="grpo.*dict"):
        configure(fake_globals(), [path], stage="sft")

def test_order_file_then_section_then_cli(cfg_file):
    path = cfg_file("lr = 1e-3\nseed = 1\nbatch_size = 2\nsft = dict(lr=2e-3, seed=2)\n")
    g = fake_globals()
    configure(g, ["--seed=3", path], stage="sft")  # the cli wins wherever it is on the line
    assert (g["lr"], g["seed"], g["batch_size"]) == (2e-3, 3, 2)

def test_later_file_wins(cfg_file):
    a = cfg_file("seed = 1\nsft = dict(lr=1e-1)\n", "a.py")
    b = cfg_file("seed = 2\n", "b.py")
    g = fake_globals()
    configure(g, [a, b], stage="sft")
    assert g["seed"] == 2 and g["lr"] == 1e-1

def test_missing_config_file(tmp_path):
    path = str(tmp_path / "nope.py")
    with pytest.raises(ValueError, match="nope.py"):
        configure(fake_globals(), [path], stage="sft")

# -----------------------------------------------------------------------------
# nothing is applied unless everything is valid

@pytest.mark.parametrize("args", [
    ["--lr=1e-2", "--batch_size=abc"],
    ["--lr=1e-2", "--nope=1"],
    ["--lr=1e-2", "--seed"],
    ["--lr=1e-2", "CONFIG"],
    ["--lr=1e-2", "missing_config.py"],
])
def test_refused_call_leaves_globals_untouched(args, cfg_file):
    path = cfg_file("seed = 5\nout_dir = 'x'\nsft = dict(batch_size=1.5)\n")
    args = [path if a == "CONFIG" else a for a in args]
    g = fake_globals()
    before = copy.deepcopy({k: v for k, v in g.items() if k in SETTINGS})
    with pytest.raises((ValueError, TypeError)):
        configure(g, args, stage="sft")
    assert {k: v for k, v in g.items() if k in SETTINGS} == before

def test_overrides_are_printed(capsys, cfg_file):
    path = cfg_file("seed = 5\n")
    configure(fake_globals(), [path, "--lr=0.1"], stage="sft")
    out = capsys.readouterr().out
    assert "seed = 5" in out and "lr = 0.1" in out and "--lr" in out and "batch_size" not in out

def test_none_default_refuses_non_plain_literal():
    with pytest.raises(TypeError, match="init_from"):
        configure(fake_globals(), ["--init_from={1, 2}"], stage="sft")  # a set is not JSON

def test_real_script_end_to_end(tmp_path, cfg_file):
    # a real module's globals(): imports, a dataclass, a function, then the settings block
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, json\nfrom dataclasses import dataclass\nfrom configurator import configure\n"
        "@dataclass(frozen=True)\nclass Cfg:\n    x: int = 1\n"
        "def helper():\n    pass\n"
        "lr = 3e-4\nbatch_size = 16\ninit_from = None\n"
        "config = configure(globals(), sys.argv[1:], stage='grpo')\n"
        "print('RESULT', json.dumps(config, sort_keys=True))\n")
    path = cfg_file("batch_size = 4\ngrpo = dict(lr=1e-5)\nsft = dict(lr=1.0)\n")
    import subprocess, sys
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, str(script), path, "--init_from=out/sft"],
                         capture_output=True, text=True, env=env, check=True).stdout
    result = json.loads(out.split("RESULT ", 1)[1])
    assert result == {"lr": 1e-5, "batch_size": 4, "init_from": "out/sft"}


def test_a_mistake_on_the_command_line_is_one_line_and_status_2(tmp_path):
    # a user's mistake (an unknown setting, a directory no stage has written) prints its
    # message alone, no traceback, and exits with status 2
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for args, says in ((["--prompts_per_stepp=3"], "unknown config key 'prompts_per_stepp'"),
                       # the fork's setting: where it belongs
                       (["--tis_cap=2"], "'tis_cap' (a setting of train_grpo_async.py, not of"),
                       ([f"--init_from={tmp_path / 'none'}", f"--out_dir={tmp_path / 'out'}"],
                        "run that stage first")):
        run = subprocess.run([sys.executable, "train_grpo.py", "config/qwen_small.py", *args],
                             capture_output=True, text=True, cwd=root, timeout=300)
        assert run.returncode == 2, run.stderr[-2000:]
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0] and "Traceback" not in run.stderr, lines
    run = subprocess.run([sys.executable, "-m", "scaleout.serve"], capture_output=True,
                         text=True, cwd=root, timeout=300)
    assert run.returncode == 2 and "model_path is required" in run.stderr.strip().splitlines()[-1]
