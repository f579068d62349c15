"""docs/switches.md lists every MLA_ATTN_* environment variable the package reads, with its default and the module
attribute that holds the choice; this keeps the page and the code in step."""
import importlib
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "switches.md").read_text()
# `name` and the default as the code reads them, through mla_attn/ops/_env.py: _env.flag("MLA_ATTN_X", True),
# _env.choice("MLA_ATTN_X", "auto", ...), _env.tristate("MLA_ATTN_X", None), _env.number("MLA_ATTN_X", 8e10), ...
READ = re.compile(r'_env\.(flag|choice|tristate|auto_or_count|number)\(\s*"(MLA_ATTN_\w+)"\s*(?:,\s*([^,)]+))?')
RAW_READ = re.compile(r'os\.environ(?:\.get\(|\[)\s*"(MLA_ATTN_\w+)"')  # unchecked: values outside the choices pass
ROW = re.compile(r"^\| `(MLA_ATTN_\w+)` \| `?([^`|]*?)`? \|.*\| ([^|]+) \|$", re.M)
MODULES = {  # the short module names the page uses
    "ops._launch": "mla_attn.ops._launch",
    "ops._gluon_compat": "mla_attn.ops._gluon_compat",
    "function": "mla_attn.ops.attention.function",
    "triton_fwd": "mla_attn.ops.attention.triton_fwd",
    "triton_bwd": "mla_attn.ops.attention.triton_bwd",
    "gluon_fwd": "mla_attn.ops.attention.gluon_fwd",
    "gluon_bwd": "mla_attn.ops.attention.gluon_bwd",
    "gluon_bwd_fused": "mla_attn.ops.attention.gluon_bwd_fused",
    "triton_decode": "mla_attn.ops.decode.triton_decode",
    "gluon_mla": "mla_attn.ops.decode.gluon_mla",
}


def _default(kind, arg):
    """The default of an _env call as docs/switches.md writes it."""
    if kind == "flag":
        return {"True": "1", "False": "0"}[arg]
    if kind == "tristate":
        return {"None": "unset", "False": "0", "True": "1"}[arg]
    if kind == "auto_or_count":
        return "auto"
    return arg.strip().strip('"')  # choice: the string; number: the literal


def _read_in_code():
    found = {}
    for path in (ROOT / "mla_attn").rglob("*.py"):
        for kind, name, arg in READ.findall(path.read_text()):
            found.setdefault(name, set()).add(_default(kind, arg.strip()))
    return found


def test_no_variable_read_unchecked():
    """Every MLA_ATTN_* variable goes through ops/_env.py, which rejects values outside its choices."""
    raw = {str(p.relative_to(ROOT)): RAW_READ.findall(p.read_text()) for p in (ROOT / "mla_attn").rglob("*.py")}
    assert {p: names for p, names in raw.items() if names} == {}


def _rows():
    return {name: (default.strip(), attrs) for name, default, attrs in ROW.findall(DOC)}


def test_every_variable_read_is_documented_with_its_default():
    code, rows = _read_in_code(), _rows()
    assert len(code) >= 30  # the scan itself works (31 variables when this test was written)
    assert sorted(set(code) - set(rows)) == [], "read by the package, missing from docs/switches.md"
    assert sorted(set(rows) - set(code)) == [], "in docs/switches.md, no longer read by the package"
    for name, defaults in code.items():
        assert defaults == {rows[name][0]}, (name, defaults, rows[name][0])


def test_documented_attributes_exist():
    for name, (_, attrs) in _rows().items():
        for attr in re.findall(r"`([\w.]+)`", attrs):
            mod, _, field = attr.rpartition(".")
            assert mod in MODULES, (name, attr)
            assert hasattr(importlib.import_module(MODULES[mod]), field), (name, attr)
