"""Tests of hypercli.params: the sampling rule (Hyper paper, section II-C) and shell-safe rendering."""

from __future__ import annotations

import itertools
import json
import math
import random
import shlex
import shutil
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hypercli.params import (
    Continuous,
    Discrete,
    count_samples,
    format_value,
    grid_size,
    placeholders,
    render,
    sample,
)

SETTINGS = settings(deadline=None, max_examples=60)
SHELLS = ["/bin/sh"] + ([shutil.which("bash")] if shutil.which("bash") else [])

# 6 significant digits: a rounded value is within this relative distance of the exact draw.
REL = 5e-6


# ----------------------------------------------------------------------------- strategies

@st.composite
def discrete_specs(draw, max_params=3, max_values=4):
    """name → Discrete with distinct values of one type per parameter (no bool/int mixing)."""
    n_params = draw(st.integers(1, max_params))
    names = draw(st.lists(st.from_regex(r"[a-z][a-z0-9_]{0,5}", fullmatch=True),
                          min_size=n_params, max_size=n_params, unique=True))
    params = {}
    for name in names:
        kind = draw(st.sampled_from(["int", "str", "float"]))
        elem = {"int": st.integers(-50, 50),
                "str": st.text(min_size=0, max_size=4),
                "float": st.floats(-10, 10, allow_nan=False).filter(lambda x: x != 0.0)}[kind]
        values = draw(st.lists(elem, min_size=1, max_size=max_values, unique=True))
        params[name] = Discrete(tuple(values))
    return params


def combo_key(d: dict, names: list[str]) -> tuple:
    return tuple(d[n] for n in names)


def product_list(params: dict) -> list[tuple]:
    return list(itertools.product(*(p.values for p in params.values())))


# ----------------------------------------------------------------------------- 1. grid completeness

def test_grid_full_product_in_product_order():
    params = {"b": Discrete((3, 6, 9)), "a": Discrete(("x", "y")), "c": Discrete((True, False))}
    out = sample(params)
    assert len(out) == 12 == grid_size(params) == count_samples(params, "grid", None)
    assert [list(d) for d in out] == [["b", "a", "c"]] * 12
    assert [combo_key(d, ["b", "a", "c"]) for d in out] == product_list(params)
    # last parameter varies fastest
    assert out[0] == {"b": 3, "a": "x", "c": True}
    assert out[1] == {"b": 3, "a": "x", "c": False}
    assert out[2] == {"b": 3, "a": "y", "c": True}
    assert out[-1] == {"b": 9, "a": "y", "c": False}


@SETTINGS
@given(params=discrete_specs(), seed=st.integers(0, 2**32))
def test_grid_full_product_property(params, seed):
    names = list(params)
    out = sample(params, seed=seed)
    assert [list(d) for d in out] == [names] * len(out)
    keys = [combo_key(d, names) for d in out]
    assert keys == product_list(params)
    assert len(set(map(repr, keys))) == len(keys)  # each combination once


def test_grid_without_discrete_params_is_one_empty_set():
    assert sample({}) == [{}]


# ----------------------------------------------------------------------------- 2. minimal repetition

@SETTINGS
@given(params=discrete_specs(), n=st.integers(1, 40), mode=st.sampled_from(["grid", "random"]),
       seed=st.integers(0, 2**32), with_range=st.booleans())
def test_minimal_repetition(params, n, mode, seed, with_range):
    names = list(params)
    if with_range:
        params = {**params, "zz_lr": Continuous(1e-4, 1e-1, log=True)}
    out = sample(params, sampling=mode, samples=n, seed=seed)
    assert len(out) == n
    assert all(list(d) == list(params) for d in out)
    combos = product_list({k: params[k] for k in names})
    p = len(combos)
    index = {c: i for i, c in enumerate(combos)}
    counts = Counter(index[combo_key(d, names)] for d in out)
    # every combination appears n // p or n // p + 1 times (absent ones count as 0)
    for i in range(p):
        assert counts.get(i, 0) in (n // p, n // p + 1), (i, counts, n, p)
    assert sum(counts.values()) == n
    if n <= p:
        assert len(counts) == n  # all distinct
    if mode == "grid" and n < p:
        picked = [index[combo_key(d, names)] for d in out]
        assert picked == sorted(picked)  # the random subset is kept in product order


def test_grid_subset_is_seeded_random():
    params = {"a": Discrete(tuple(range(10))), "b": Discrete(tuple(range(10)))}
    subsets = {tuple((d["a"], d["b"]) for d in sample(params, samples=5, seed=s)) for s in range(20)}
    assert len(subsets) > 10  # a seeded random subset, not always the first n combinations


@pytest.mark.parametrize("seed", range(5))
def test_grid_subset_kept_in_product_order(seed):
    params = {"a": Discrete(tuple(range(10))), "b": Discrete(tuple("xyz"))}
    out = sample(params, samples=17, seed=seed, sampling="grid")
    picked = [d["a"] * 3 + "xyz".index(d["b"]) for d in out]
    assert len(set(picked)) == 17
    assert picked == sorted(picked)


def test_random_mode_discrete_is_not_product_order():
    params = {"a": Discrete(tuple(range(6))), "b": Discrete(tuple(range(5)))}
    out = sample(params, sampling="random", samples=30, seed=0)
    keys = [(d["a"], d["b"]) for d in out]
    assert sorted(keys) == product_list(params)  # each exactly once
    assert keys != product_list(params)  # but shuffled


# ----------------------------------------------------------------------------- 3. continuous ranges

@SETTINGS
@given(low=st.floats(-1e6, 1e6, allow_nan=False), width=st.floats(1e-9, 1e6),
       n=st.integers(1, 60), mode=st.sampled_from(["grid", "random"]), seed=st.integers(0, 2**32))
def test_linear_range_within_bounds(low, width, n, mode, seed):
    high = low + width
    assume(low < high)
    out = sample({"x": Continuous(low, high)}, sampling=mode, samples=n, seed=seed)
    vals = [d["x"] for d in out]
    assert len(vals) == n
    assert all(type(v) is float for v in vals)
    assert all(low <= v <= high for v in vals), (low, high, vals)
    assert all(float(f"{v:.6g}") == v or v in (low, high) for v in vals)  # 6 significant digits


@SETTINGS
@given(low_exp=st.floats(-12, 6), decades=st.floats(1e-6, 8), n=st.integers(1, 60),
       mode=st.sampled_from(["grid", "random"]), seed=st.integers(0, 2**32))
def test_log_range_within_bounds(low_exp, decades, n, mode, seed):
    low, high = 10.0 ** low_exp, 10.0 ** (low_exp + decades)
    assume(low < high)
    vals = [d["x"] for d in sample({"x": Continuous(low, high, log=True)},
                                   sampling=mode, samples=n, seed=seed)]
    assert all(low <= v <= high for v in vals), (low, high, vals)


@pytest.mark.parametrize("mode", ["grid", "random"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_log_range_is_uniform_per_decade(mode, seed):
    n = 3000
    vals = [d["lr"] for d in sample({"lr": Continuous(1e-4, 1e-1, log=True)},
                                    sampling=mode, samples=n, seed=seed)]
    assert all(1e-4 <= v <= 1e-1 for v in vals)
    decades = Counter(min(max(math.floor(math.log10(v)), -4), -2) for v in vals)
    # expected 1000 per decade (sd ~26 for random); linear sampling would put ~90 % in [1e-2, 1e-1)
    for d in (-4, -3, -2):
        assert 850 <= decades[d] <= 1150, decades
    mean_log = sum(math.log10(v) for v in vals) / n
    assert abs(mean_log - (-2.5)) < 0.1  # standard error ~0.016


def test_linear_range_is_not_log():
    vals = [d["x"] for d in sample({"x": Continuous(1e-4, 1e-1)}, sampling="random",
                                   samples=2000, seed=0)]
    assert sum(v >= 1e-2 for v in vals) > 1600  # ~90 % in the top decade
    assert abs(sum(vals) / len(vals) - 0.05) < 0.005


@pytest.mark.parametrize("mode", ["grid", "random"])
@pytest.mark.parametrize("log", [False, True])
def test_integer_range_covers_both_ends(mode, log):
    low, high = (1, 20)
    vals = [d["k"] for d in sample({"k": Continuous(low, high, log=log, integer=True)},
                                   sampling=mode, samples=1000, seed=3)]
    assert all(type(v) is int for v in vals)
    assert all(low <= v <= high for v in vals)
    assert min(vals) == low and max(vals) == high
    assert set(vals) == set(range(low, high + 1))


@SETTINGS
@given(low=st.integers(-100, 100), span=st.integers(0, 60), seed=st.integers(0, 2**32))
def test_integer_grid_with_one_draw_per_integer_is_a_permutation(low, span, seed):
    high = low + span + 1
    n = high - low + 1
    vals = [d["k"] for d in sample({"k": Continuous(low, high, integer=True)}, samples=n, seed=seed)]
    assert sorted(vals) == list(range(low, high + 1))


@SETTINGS
@given(low=st.integers(1, 50), span=st.integers(1, 200), n=st.integers(1, 80),
       mode=st.sampled_from(["grid", "random"]), seed=st.integers(0, 2**32))
def test_integer_log_range_within_bounds(low, span, n, mode, seed):
    high = low + span
    vals = [d["k"] for d in sample({"k": Continuous(low, high, log=True, integer=True)},
                                   sampling=mode, samples=n, seed=seed)]
    assert all(type(v) is int and low <= v <= high for v in vals)


def _assert_one_per_stratum(vals, lo, hi, to_space, tol_of):
    """Sorted values: the k-th lies in the k-th of n equal strata of [lo, hi) (in to_space)."""
    n = len(vals)
    width = (hi - lo) / n
    for k, v in enumerate(sorted(vals)):
        t = to_space(v)
        tol = tol_of(v) + 1e-12 * max(abs(lo), abs(hi), 1.0)
        assert lo + k * width - tol <= t <= lo + (k + 1) * width + tol, (k, v, lo, hi, n)


@SETTINGS
@given(low=st.floats(-1e3, 1e3, allow_nan=False), width=st.floats(1e-3, 1e3),
       n=st.integers(1, 80), seed=st.integers(0, 2**32))
def test_grid_stratification_linear(low, width, n, seed):
    high = low + width
    vals = [d["x"] for d in sample({"x": Continuous(low, high)}, samples=n, seed=seed)]
    _assert_one_per_stratum(vals, low, high, lambda v: v, lambda v: REL * abs(v))


@SETTINGS
@given(low_exp=st.floats(-8, 3), decades=st.floats(0.01, 6), n=st.integers(1, 80),
       seed=st.integers(0, 2**32))
def test_grid_stratification_log(low_exp, decades, n, seed):
    low, high = 10.0 ** low_exp, 10.0 ** (low_exp + decades)
    vals = [d["x"] for d in sample({"x": Continuous(low, high, log=True)}, samples=n, seed=seed)]
    _assert_one_per_stratum(vals, math.log(low), math.log(high), math.log, lambda v: 2 * REL)


def test_random_mode_is_not_stratified():
    """The stratification check above can fail: plain uniform draws violate it."""
    vals = [d["x"] for d in sample({"x": Continuous(0.0, 1.0)}, sampling="random",
                                   samples=200, seed=0)]
    with pytest.raises(AssertionError):
        _assert_one_per_stratum(vals, 0.0, 1.0, lambda v: v, lambda v: REL * abs(v))


def test_grid_draws_are_shuffled_and_matched_with_discrete():
    params = {"opt": Discrete(("sgd", "adam")), "lr": Continuous(0.0, 1.0)}
    out = sample(params, samples=50, seed=0)
    lrs = [d["lr"] for d in out]
    assert lrs != sorted(lrs)
    assert [list(d) for d in out] == [["opt", "lr"]] * 50
    assert Counter(d["opt"] for d in out) == {"sgd": 25, "adam": 25}


def test_bounds_with_many_digits_stay_in_range():
    """Rounding to 6 significant digits must not push a draw outside [low, high]."""
    low, high = 0.1234561, 0.1234569
    for mode in ("grid", "random"):
        vals = [d["x"] for d in sample({"x": Continuous(low, high)}, sampling=mode,
                                       samples=100, seed=1)]
        assert all(low <= v <= high for v in vals), vals


# ----------------------------------------------------------------------------- 4. determinism

@st.composite
def mixed_specs(draw):
    params = dict(draw(discrete_specs(max_params=2)))
    lo = draw(st.integers(-100, 100))
    params["r_lin"] = Continuous(float(lo), float(lo + draw(st.integers(1, 100))))
    params["r_log"] = Continuous(1e-5, 1.0, log=True)
    params["r_int"] = Continuous(1, 1000, integer=True)
    return params


@SETTINGS
@given(params=mixed_specs(), n=st.integers(20, 60), mode=st.sampled_from(["grid", "random"]),
       seed=st.integers(0, 2**32), other=st.integers(0, 2**32))
def test_determinism(params, n, mode, seed, other):
    assume(seed != other)
    a = sample(params, sampling=mode, samples=n, seed=seed)
    random.seed(12345)  # the global generator must not matter
    random.random()
    b = sample(params, sampling=mode, samples=n, seed=seed)
    assert a == b
    assert [list(d) for d in a] == [list(d) for d in b]
    c = sample(params, sampling=mode, samples=n, seed=other)
    assert c != a


# ----------------------------------------------------------------------------- 5. errors

def test_count_samples():
    disc = {"a": Discrete((1, 2, 3)), "b": Discrete(("x", "y"))}
    rng = {**disc, "lr": Continuous(0.1, 0.2)}
    assert count_samples(disc, "grid", None) == 6
    assert count_samples(disc, "grid", 4) == 4
    assert count_samples(disc, "random", 9) == 9
    assert count_samples(rng, "grid", 7) == 7
    with pytest.raises(ValueError, match="samples"):
        count_samples(disc, "random", None)
    with pytest.raises(ValueError, match="samples"):
        count_samples(rng, "grid", None)
    with pytest.raises(ValueError, match="samples"):
        count_samples({"lr": Continuous(0.1, 0.2)}, "grid", None)


def test_sample_errors():
    disc = {"a": Discrete((1, 2))}
    for bad in (0, -1, -10):
        with pytest.raises(ValueError, match="at least 1"):
            sample(disc, samples=bad)
        with pytest.raises(ValueError, match="at least 1"):
            sample(disc, sampling="random", samples=bad)
    for mode in ("latin", "Grid", "", "lhs"):
        with pytest.raises(ValueError, match="sampling"):
            sample(disc, sampling=mode, samples=2)
    with pytest.raises(ValueError, match="samples"):
        sample(disc, sampling="random")
    with pytest.raises(ValueError, match="samples"):
        sample({"lr": Continuous(0.1, 0.2)})


# ----------------------------------------------------------------------------- 6. injection safety

def run_shell(shell: str, command: str, cwd) -> bytes:
    proc = subprocess.run([shell, "-c", command], capture_output=True, cwd=cwd, timeout=10)
    assert proc.returncode == 0, (command, proc.stderr)
    return proc.stdout


NASTY = [
    "x; echo INJECTED",
    "$(echo INJECTED)",
    "`echo INJECTED`",
    "${HOME}",
    "$HOME",
    "it's",
    "'; echo INJECTED; '",
    'say "hi"',
    '"; echo INJECTED; "',
    "line1\nline2\n",
    "\n",
    "*",
    "~",
    "~/x",
    "a b  c\td",
    "",
    " ",
    "-n",
    "--help",
    "%s %d \\n",
    "back\\slash",
    "a|b&c>d<e",
    "(sub)",
    "{a,b}",
    "!!",
    "#comment",
    "ü 漢字 🎉",
    "\x01\x7f\x1b[31m",
    "{{v}}",
]


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("value", NASTY + [True, False, 0, -7, 0.05, 1e-5, 3.0, 1e20])
def test_render_reaches_program_literally(shell, value, tmp_path):
    (tmp_path / "somefile").write_text("")  # something for * to glob
    cmd = render("printf '%s' {{v}}", {"v": value})
    out = run_shell(shell, cmd, tmp_path)
    assert out.decode("utf-8") == format_value(value)
    assert b"INJECTED" not in out or "INJECTED" in format_value(value)


@settings(deadline=None, max_examples=80)
@given(value=st.text(st.characters(codec="utf-8", exclude_characters="\x00")), shell=st.sampled_from(SHELLS))
def test_render_hypothesis_text(value, shell):
    cmd = render("printf '%s' {{v}}", {"v": value})
    assert run_shell(shell, cmd, None).decode("utf-8") == value


@settings(deadline=None, max_examples=15)
@given(a=st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=20),
       b=st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=20))
def test_render_preserves_argument_boundaries(a, b, tmp_path_factory):
    """Each value is exactly one argv word, also when glued to other text."""
    prog = shlex.quote(sys.executable) + " -c 'import sys, json; print(json.dumps(sys.argv[1:]))'"
    cmd = render(prog + " {{a}} --opt={{b}} {{a}}x", {"a": a, "b": b})
    out = run_shell("/bin/sh", cmd, tmp_path_factory.mktemp("argv"))
    assert json.loads(out) == [a, f"--opt={b}", f"{a}x"]


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("template, naive", [
    ("x; touch {f}", "printf '%s' {{v}}"),
    ("$(touch {f})", "printf '%s' {{v}}"),
    ("`touch {f}`", "printf '%s' {{v}}"),
    ("x\ntouch {f}", "printf '%s' {{v}}"),
    ("x && touch {f}", "printf '%s' {{v}}"),
    ("x | touch {f}", "printf '%s' {{v}}"),
    ("'; touch {f}; '", "printf '%s' '{{v}}'"),  # breaks out of naive single quotes
    ('"; touch {f}; "', 'printf "%s" "{{v}}"'),  # breaks out of naive double quotes
    ("$(touch {f})", 'printf "%s" "{{v}}"'),
])
def test_injected_command_does_not_run(shell, template, naive, tmp_path):
    target = tmp_path / "PWNED"
    value = template.format(f=target)
    # sanity: naive substitution of the value would create the file
    unsafe = render(naive + " >/dev/null", {"v": value}, quote=False)
    subprocess.run([shell, "-c", unsafe], capture_output=True, cwd=tmp_path, timeout=10)
    assert target.exists()
    target.unlink()
    out = run_shell(shell, render("printf '%s' {{v}}", {"v": value}), tmp_path)
    assert out.decode() == value
    assert not target.exists()


def test_render_unquoted_and_missing():
    assert render("a={{v}} b={{ w }}", {"v": "x y", "w": 2.0}, quote=False) == "a=x y b=2.0"
    assert render("--lr {{lr}} --on {{on}}", {"lr": 1e-05, "on": True}) == "--lr 1e-05 --on true"
    assert render("{{v}}", {"v": "{{w}}", "w": "no"}, quote=False) == "{{w}}"  # no re-substitution
    assert render("no placeholders", {}) == "no placeholders"
    with pytest.raises(KeyError):
        render("{{missing}}", {"v": 1})


# ----------------------------------------------------------------------------- 7. format_value, placeholders

@pytest.mark.parametrize("value, text", [
    (True, "true"), (False, "false"),
    (0, "0"), (42, "42"), (-3, "-3"), (10**20, "100000000000000000000"),
    (0.05, "0.05"), (1e-05, "1e-05"), (1.0, "1.0"), (3.0, "3.0"), (-2.0, "-2.0"), (0.0, "0.0"),
    (2.5, "2.5"), (1e15, "1000000000000000.0"), (1e16, "1e+16"), (1e20, "1e+20"),
    (0.1 + 0.2, "0.30000000000000004"),
    (float("inf"), "inf"), (float("-inf"), "-inf"),
    ("abc", "abc"), ("", ""), ("True", "True"),
])
def test_format_value(value, text):
    assert format_value(value) == text


@SETTINGS
@given(x=st.floats(allow_nan=False, allow_infinity=False))
def test_format_value_float_roundtrip(x):
    text = format_value(x)
    assert float(text) == x
    assert "e" in text or "." in text  # always reads back as a float, never as an int


def test_placeholders_order():
    assert placeholders("run {{b}} --x {{ a }} {{b}} {{c_1}}") == ["b", "a", "b", "c_1"]
    assert placeholders("{{1x}} {x} {{ }} {{a-b}} plain") == []
    assert placeholders("{{_z}}{{Y9}}") == ["_z", "Y9"]
    assert placeholders("") == []
