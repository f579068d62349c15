"""The environment switches' reader (mla_attn/ops/_env.py): defaults, accepted values, and a ValueError naming the
variable for anything else, in the helpers and at the import of every module that reads one."""
import pathlib
import re
import subprocess
import sys

import pytest

from mla_attn.ops import _env

ROOT = pathlib.Path(__file__).resolve().parents[2]
NAME = "MLA_ATTN_TEST_SWITCH"  # read by no module


def test_unset_and_empty_take_the_default(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert _env.flag(NAME, True) is True and _env.flag(NAME, False) is False
    assert _env.choice(NAME, "auto", _env.AUTO_ON_OFF) == "auto"
    assert _env.tristate(NAME, None) is None and _env.tristate(NAME, False, none="auto") is False
    assert _env.auto_or_count(NAME) == "auto" and _env.number(NAME, 8e10) == 8e10
    monkeypatch.setenv(NAME, "")
    assert _env.flag(NAME, True) is True and _env.tristate(NAME, None) is None and _env.number(NAME, 2.0) == 2.0


@pytest.mark.parametrize("value,flag,tri,tri_auto", [("1", True, True, True), ("0", False, False, False),
                                                     (" 1 ", True, True, True)])
def test_accepted_values(monkeypatch, value, flag, tri, tri_auto):
    monkeypatch.setenv(NAME, value)
    assert _env.flag(NAME, not flag) is flag
    assert _env.tristate(NAME, None) is tri
    assert _env.tristate(NAME, False, none="auto") is tri_auto
    assert _env.choice(NAME, "auto", _env.AUTO_ON_OFF) == value.strip()


def test_auto_where_allowed(monkeypatch):
    monkeypatch.setenv(NAME, "auto")
    assert _env.tristate(NAME, False, none="auto") is None
    assert _env.choice(NAME, "0", _env.AUTO_ON_OFF) == "auto" and _env.auto_or_count(NAME) == "auto"
    with pytest.raises(ValueError, match=f"{NAME}='auto': expected one of 0, 1"):
        _env.flag(NAME, True)
    with pytest.raises(ValueError, match=f"{NAME}='auto'"):
        _env.tristate(NAME, None)  # auto is not one of SPLIT_TAIL's values
    monkeypatch.setenv(NAME, "4")
    assert _env.auto_or_count(NAME) == "4"
    monkeypatch.setenv(NAME, "1.5e9")
    assert _env.number(NAME, 0.0) == 1.5e9


@pytest.mark.parametrize("value", ["true", "false", "on", "yes", "2", "-1", "O"])
def test_rejected_values_name_the_variable(monkeypatch, value):
    monkeypatch.setenv(NAME, value)
    for read in (lambda: _env.flag(NAME, True), lambda: _env.tristate(NAME, None),
                 lambda: _env.choice(NAME, "auto", _env.AUTO_ON_OFF)):
        with pytest.raises(ValueError, match=re.escape(f"{NAME}={value!r}")):
            read()
    if not value.isdigit():
        with pytest.raises(ValueError, match=re.escape(f"{NAME}={value!r}: expected auto or a whole number")):
            _env.auto_or_count(NAME)


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "lots"])
def test_number_rejects(monkeypatch, value):
    monkeypatch.setenv(NAME, value)
    with pytest.raises(ValueError, match=re.escape(f"{NAME}={value!r}: expected a finite number >= 0")):
        _env.number(NAME, 8e10)


# Each documented variable set to a bad value, then every module that reads switches imported afresh, in one child
# process (the switches are read at import): each must raise a ValueError that names it.
_SWEEP = r"""
import importlib, os, sys
modules = ["mla_attn.ops._launch", "mla_attn.ops.attention.function", "mla_attn.ops.attention.gluon_bwd_fused",
           "mla_attn.ops.decode.triton_decode", "mla_attn.ops.decode.gluon_mla"]
for name in sys.argv[1:]:
    os.environ[name] = "bogus"
    for m in [m for m in sys.modules if m.startswith("mla_attn")]:
        del sys.modules[m]
    try:
        for m in modules:
            importlib.import_module(m)
    except ValueError as e:
        print(name, "raised" if f"{name}='bogus'" in str(e) else "other: " + str(e))
    except ImportError as e:  # Gluon absent from this Triton: its modules' switches are not read
        print(name, "import-error: " + str(e))
    else:
        from mla_attn.ops.attention import gluon_fwd
        print(name, "accepted" if gluon_fwd.AVAILABLE else "no-gluon")
    del os.environ[name]
"""


def test_every_documented_variable_rejects_a_bad_value_at_import():
    names = re.findall(r"^\| `(MLA_ATTN_\w+)` \|", (ROOT / "docs" / "switches.md").read_text(), re.M)
    assert len(names) >= 30
    out = subprocess.run([sys.executable, "-c", _SWEEP, *names], capture_output=True, text=True, timeout=600,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert list(seen) == names
    from mla_attn.ops.attention import gluon_fwd

    gluon_only = {n for n, r in seen.items() if r == "no-gluon"}
    assert not gluon_fwd.AVAILABLE or not gluon_only
    assert {n: r for n, r in seen.items() if r != "raised" and n not in gluon_only} == {}
