"""The two tiers of scripts: each tier-2 script `<base>_<variant>_train.py` is a self-contained copy of its tier-1
base plus one variant, so `diff <base>_train.py <base>_<variant>_train.py` is its lesson. The copies cannot drift
apart unseen: the code lines that differ (blank and comment-only lines aside) are bounded per script, at the size
measured when the variant moved plus a margin. No script imports another."""
import ast
import difflib
import glob
import os

import pytest

from conftest import REPO

# tier-2 script -> (its tier-1 base, the most code lines its diff may show: measured + about 15%)
TIER2 = {
    "pp_vocab_train.py": ("pp_train.py", 269),  # 234 measured
    "pp_zb_train.py": ("pp_train.py", 299),  # 262 measured
    "tp_overlap_train.py": ("tp_train.py", 198),  # 171 measured
    "zero3_tuning_train.py": ("zero3_train.py", 185),  # 161 measured
}
MAX_LINES = 800  # a tier-2 script, whole


def code_lines(path):
    """The file's lines that carry code: not blank, not only a comment."""
    lines = open(path).read().splitlines()
    return [line.rstrip() for line in lines if line.strip() and not line.strip().startswith("#")]


def diff_size(base, variant):
    """How many code lines the diff of the two scripts adds or removes."""
    diff = difflib.unified_diff(code_lines(os.path.join(REPO, base)), code_lines(os.path.join(REPO, variant)),
                                lineterm="", n=0)
    return sum(1 for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---")))


def scripts():
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "*_train.py")))


def test_every_tier2_script_is_declared_with_its_base():
    tier2 = [s for s in scripts() if s.count("_") > 1]
    assert sorted(TIER2) == tier2, "declare each tier-2 script's base and diff bound in TIER2"
    for script, (base, _) in TIER2.items():
        assert script.startswith(base[:-len("_train.py")] + "_") and base in scripts(), (script, base)


@pytest.mark.parametrize("script", sorted(TIER2))
def test_tier2_diff_against_its_base_is_bounded(script):
    base, bound = TIER2[script]
    size = diff_size(base, script)
    print(f"{script}: {size} code lines differ from {base} (bound {bound}); "
          f"{len(open(os.path.join(REPO, script)).read().splitlines())} lines")
    assert size <= bound, f"{script} has drifted from {base}: {size} code lines differ (bound {bound})"
    assert len(open(os.path.join(REPO, script)).read().splitlines()) <= MAX_LINES


def test_no_script_imports_another():
    names = {s[:-3] for s in scripts()}
    for script in scripts():
        tree = ast.parse(open(os.path.join(REPO, script)).read())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module}
        assert not imported & names, (script, imported & names)


def test_diff_size_counts_code_lines_only(tmp_path, monkeypatch):
    a, b = tmp_path / "a_train.py", tmp_path / "a_x_train.py"
    a.write_text("x = 1\n# a comment\n\ny = 2\n")
    b.write_text("x = 1\n# another comment\ny = 3\nz = 4\n")
    monkeypatch.setattr(os.path, "join", lambda root, name: str(tmp_path / name))
    assert diff_size("a_train.py", "a_x_train.py") == 3  # -y = 2, +y = 3, +z = 4
