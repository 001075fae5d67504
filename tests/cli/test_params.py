"""One `Param` declaration per method hyperparameter: flags, checks and the README table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvchat.cli.options import cache_options
from kvchat.cli.parser import build_parser
from kvchat.compress import available, get
from kvchat.compress.base import Param
from kvchat.settings import readme_with_table

README = Path(__file__).resolve().parents[2] / "README.md"

# The user-facing contract: every flag and its default (changing one is a breaking
# change). subgen's mode is kcenter, since stream writes broken text at ordinary budgets
# (docs/methods.md).
FLAGS = {
    "--h2o-aggregate": "sum",
    "--subgen-mode": "kcenter",
    "--subgen-delta": None,
    "--subgen-value-samples": 256,
    "--subgen-key-samples": 16,
    "--subgen-kcenter-weights": "none",
    "--balancekv-mode": "code",
    "--balancekv-schedule": "stream",
    "--balancekv-den-weight": "count",
    "--balancekv-batch": 256,
    "--balancekv-block": 128,
    "--balancekv-gamma": 4.0,
    "--balancekv-temperature": 1.0,
    "--balancekv-beta": 0.0,
    "--balancekv-c0": 0.025,
    "--balancekv-delta": 0.01,
    "--bumblebee-lam": 0.5,
    "--bumblebee-phi": "power",
    "--bumblebee-alpha": 0.5,
    "--bumblebee-beta": 1.0,
    "--bumblebee-normalize": "none",
    "--bumblebee-greedy-max": 4096,
    "--chelsea-g": 64,
    "--chelsea-chunk": 256,
    "--chelsea-r-init": 0.35,
    "--chelsea-r-step": 0.1,
    "--chelsea-r-steps": 2,
    "--chelsea-r-min": 0.05,
    "--chelsea-outlier-heads": "",
    "--chelsea-outlier-cache": "recent",  # the paper's full cache is "full"
}


def declared() -> dict[str, Param]:
    return {p.flag(m): p for m in available() for p in get(m).hyperparameters}


def test_every_flag_keeps_its_name_and_default():
    assert {flag: p.default for flag, p in declared().items()} == FLAGS


def test_every_default_passes_its_own_check_and_the_derived_dicts_agree():
    for method in available():
        cls = get(method)
        for p in cls.hyperparameters:
            assert p.check(p.default) == p.default, p.name
            assert cls.defaults[p.name] == p.default and p.help in cls.param_help[p.name]


def test_a_flag_value_reaches_the_method_settings_typed():
    args = build_parser({}).parse_args(
        [
            "ask",
            "hi",
            "--chelsea-r-init",
            "0.25",
            "--chelsea-g",
            "32",
            "--subgen-delta",
            "auto",
            "--h2o-aggregate",
            "mean",
        ]
    )
    options = cache_options(args)
    assert options.for_method("chelsea").params == {"r_init": 0.25, "g": 32}
    assert options.for_method("subgen").params.get("delta") is None  # "auto" is the automatic default
    assert options.for_method("h2o").params == {"aggregate": "mean"}
    assert options.for_method("window").params == {}


@pytest.mark.parametrize(
    ("flag", "text", "says"),
    [
        ("--chelsea-r-init", "0.9", "in (0, 0.5]"),
        ("--chelsea-g", "1.5", "an integer"),
        ("--subgen-mode", "fast", "one of kcenter, stream"),
        ("--bumblebee-greedy-max", "-1", "at least 0"),
        ("--balancekv-delta", "1", "in (0, 1)"),
    ],
)
def test_a_value_outside_the_declaration_is_refused_with_the_rule(flag, text, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        declared()[flag].parse(text)


def test_the_compressor_checks_values_given_in_code_against_the_declaration():
    import torch

    from kvchat.compress.base import LayerSpec

    spec = LayerSpec(0, 2, 1, 8, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="chelsea: r_init must be in"):
        get("chelsea")(spec, 64, r_init=0.75)
    assert get("chelsea")(spec, 64, r_init=1 / 4).params["r_init"] == 0.25
    assert get("bumblebee")(spec, 64, beta=2).params["beta"] == 2.0  # an int where a float is declared


def test_the_readme_table_is_generated_from_the_declarations():
    readme = README.read_text(encoding="utf-8")
    assert readme == readme_with_table(readme), "run `python -m kvchat.settings --write-readme`"
    for flag, param in declared().items():
        assert f"| `{flag}` | {param.shown_default} |" in readme
