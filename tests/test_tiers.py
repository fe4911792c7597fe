"""The two tiers of scripts: each tier-2 script `<base>_<variant>_train.py` is a self-contained copy of its tier-1
base plus one variant, so `diff <base>_train.py <base>_<variant>_train.py` is its lesson. The copies cannot drift
apart unseen: the code lines that differ (blank and comment-only lines aside) are bounded per script, at the size
measured when the variant moved plus a margin; and each function, class, method, constant and import a
variant does not declare as its lesson is the same in both, so a fix made in the base and not copied fails. No
script imports another."""
import ast
import difflib
import glob
import os
import re

import pytest

from conftest import REPO

# tier-2 script -> (its tier-1 base, the most code lines its diff may show: measured + about 15%, its lesson: the
# definitions (see definitions()) it changes, +adds and -drops; any other difference is drift, a fix not copied)
TIER2 = {
    "ddp_diloco_train.py": ("ddp_train.py", 265, """
        -GradientBuckets -GradientBuckets.__init__ -GradientBuckets._make_buckets -GradientBuckets._grad_ready
        -GradientBuckets._all_reduce -GradientBuckets.finish_backward -GradientBuckets._rebuild -DDP -DDP.__init__
        -DDP.configure_optimizer -DDP.to_device -DDP.forward_backward -DDP.eval_loss -DDP.clip_grad_norm_
        -DDP.full_state -DDP.describe +DiLoCo +DiLoCo.__init__ +DiLoCo.configure_optimizer +DiLoCo.to_device
        +DiLoCo.forward_backward +DiLoCo.eval_loss +DiLoCo.clip_grad_norm_ +DiLoCo.outer_step +DiLoCo.full_state
        +DiLoCo.describe -TorchDDP -peers.torch_ddp -weakref +held_bytes add_ddp_flags check_ddp_args
        main"""),  # bound: 231 measured
    "fsdp_hsdp_train.py": ("fsdp_train.py", 150, """
        +hsdp_groups +TorchFSDP.__init__ +TorchFSDP.forward_backward +weakref +init_device_mesh
        FlatParamUnit.__init__ FlatParamUnit.unshard FullyShardedGPT FullyShardedGPT.__init__
        FullyShardedGPT._post_backward FullyShardedGPT.finish_backward FSDP FSDP.__init__ FSDP.forward_backward
        FSDP.clip_grad_norm_ FSDP.full_state TorchFSDP add_fsdp_flags check_fsdp_args main"""),  # bound: 129 measured
    "pp_vocab_train.py": ("pp_train.py", 269, """
        +LOSS_CHUNK_ROWS +VocabParallelCrossEntropy +VocabParallelCrossEntropy.forward
        +VocabParallelCrossEntropy.backward +vocab_pass +Pipeline.head_rows Pipeline.__init__
        Pipeline.configure_optimizer Pipeline.run Pipeline.sum_tied_gradient Stage Stage.__init__ Stage.forward
        schedule_actions timetable messages add_pp_flags check_pp_args"""),  # bound: 234 measured
    "pp_zb_train.py": ("pp_train.py", 299, """
        +BLOCK_LINEARS +DeferredWeightGrads +DeferredWeightGrads.__init__ +DeferredWeightGrads.defer
        +DeferredWeightGrads.run +accumulate_grad_ +DeferredLinear +DeferredLinear.forward +DeferredLinear.backward
        +DeferredLinear.backward.weight_grad +defer_weight_grads +zero_bubble_h1 +zero_bubble_v +zero_bubble_v.came
        Pipeline Pipeline.__init__ Pipeline.rank_of Pipeline.stage_of Pipeline.run Pipeline.sum_tied_gradient
        schedule_actions stage_index stage_rank messages timetable p2p_program add_pp_flags check_pp_args
        ZERO_BUBBLE"""),  # bound: 262 measured
    "tp_overlap_train.py": ("tp_train.py", 198, """
        +OVERLAP_CHUNKS +wait +pass_to_next +ring_all_gather +ring_reduce_scatter +autocast_inputs
        +OverlappedColumnParallel +OverlappedColumnParallel.forward +OverlappedColumnParallel.backward
        +OverlappedRowParallel +OverlappedRowParallel.forward +OverlappedRowParallel.backward +column_parallel
        +row_parallel ColumnParallelLinear.forward RowParallelLinear.forward TPGPT.forward TPGroup TPGroup.__init__
        TensorParallel.__init__ add_tp_flags check_tp_args main -TorchTP -peers.torch_tp"""),  # bound: 171 measured
    "zero3_tuning_train.py": ("zero3_train.py", 185, """
        partition print_partition materialize_owned_ gather_full_state OwnedAdamW OwnedAdamW.__init__ ParamFetcher
        ParamFetcher.__init__ ReduceToOwner ReduceToOwner.__init__ ReduceToOwner._grad_ready ZeRO1.__init__
        ZeRO1.assign_owners ZeRO1.build_model ZeRO1.clip_grad_norm_ +ZeRO2.forward_backward
        ZeRO2.reduce_gradients ZeRO3.__init__ ZeRO3.build_model add_zero3_flags check_zero3_args
        -TUNING_KNOBS"""),  # bound: 161 measured
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


DEFINITION = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def definitions(path):
    """{name: its source} for each function, class and method, nested ones too (`Stage.forward`,
    `zero_bubble_v.came`), each without the definitions inside it, which count on their own, so a change is charged
    to one name; each top-level assignment's name (`WTE_NAME`) and import (`peers.torch_tp`, `GPT`); "<module>":
    the other top-level statements. The source is exact, the comment lines above a definition included: a
    corrected comment is a fix to copy too, and the copies have no reason to differ in form. Not compared: blank
    lines, and the module docstring, which describes the variant."""
    text = open(path).read()
    lines = text.splitlines()
    tree = ast.parse(text)
    units = {}

    def nested(node):  # the definitions directly in node's body, also under an if, with, for or try
        for child in ast.iter_child_nodes(node):
            if isinstance(child, DEFINITION):
                yield child
            else:
                yield from nested(child)

    def first_line(node):  # its decorators and the comment lines just above it included
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        while first > 1 and lines[first - 2].strip().startswith("#"):
            first -= 1
        return first

    def source(node):
        inner = {i for child in nested(node) for i in range(first_line(child), child.end_lineno + 1)}
        return "\n".join(lines[i - 1] for i in range(first_line(node), node.end_lineno + 1)
                         if i not in inner and lines[i - 1].strip())

    def visit(node, prefix):
        for child in nested(node):
            units[prefix + child.name] = source(child)
            visit(child, prefix + child.name + ".")

    visit(tree, "")
    rest = []
    for node in tree.body[1 if ast.get_docstring(tree) else 0:]:
        if isinstance(node, (ast.Import, ast.ImportFrom)):  # one unit per name, so each line may import more
            for alias in node.names:
                one = ast.Import([alias]) if isinstance(node, ast.Import) else ast.ImportFrom(node.module, [alias],
                                                                                               node.level)
                units[alias.asname or alias.name] = ast.unparse(one)
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            units[node.targets[0].id] = source(node)
        elif not isinstance(node, DEFINITION):
            rest.append(source(node))
    units["<module>"] = "\n".join(rest)
    return units


def lesson(base, variant):
    """What the variant does to its base's definitions: {name (changed), +name (added), -name (dropped)}, each
    changed name with its diff."""
    old, new = definitions(os.path.join(REPO, base)), definitions(os.path.join(REPO, variant))
    changes = {"+" + name: "" for name in new.keys() - old.keys()}
    changes.update({"-" + name: "" for name in old.keys() - new.keys()})
    for name in old.keys() & new.keys():
        if old[name] != new[name]:
            diff = difflib.unified_diff(old[name].splitlines(), new[name].splitlines(), base, variant, lineterm="")
            changes[name] = "\n".join(diff)
    return changes


def undeclared(base, variant, declared):
    """The differences between base and variant that `declared` does not list, and the declarations that are
    stale (no such difference): an empty list when the variant changes exactly what it declares."""
    changes, declared = lesson(base, variant), set(declared)
    problems = []
    for name in sorted(changes.keys() - declared, key=lambda name: name.lstrip("+-")):
        if name.startswith("+"):
            problems.append(f"{variant}: {name[1:]} is not in {base}: declare +{name[1:]} in TIER2")
        elif name.startswith("-"):
            problems.append(f"{variant}: {name[1:]} of {base} is missing: copy it or declare -{name[1:]} in TIER2")
        else:
            problems.append(f"{variant}: {name} differs from {base}'s: copy the fix across, or, if it is the "
                            f"variant's lesson, declare {name} in TIER2\n{changes[name]}")
    for name in sorted(declared - changes.keys()):
        problems.append(f"{variant}: {name} is declared in TIER2 but the scripts show no such difference: "
                        f"remove the stale declaration")
    return problems


def scripts():
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "*_train.py")))


def test_every_tier2_script_is_declared_with_its_base():
    tier2 = [s for s in scripts() if s.count("_") > 1]
    assert sorted(TIER2) == tier2, "declare each tier-2 script's base and diff bound in TIER2"
    for script, (base, _, _) in TIER2.items():
        assert script.startswith(base[:-len("_train.py")] + "_") and base in scripts(), (script, base)


@pytest.mark.parametrize("script", sorted(TIER2))
def test_tier2_diff_against_its_base_is_bounded(script):
    base, bound, _ = TIER2[script]
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


@pytest.mark.parametrize("script", sorted(TIER2))
def test_tier2_changes_only_what_it_declares(script):
    base, _, declared = TIER2[script]
    problems = undeclared(base, script, declared.split())
    assert not problems, "\n".join(problems)


def test_undeclared_finds_each_kind_of_difference(tmp_path, monkeypatch):
    (tmp_path / "a_train.py").write_text(
        '"""Base."""\nimport os\nN = 1\n\n\nclass C:\n    """C."""\n    def m(self):\n        def inner():\n'
        '            return 1  # one\n        return inner()\n\n    def gone(self):\n        pass\n')
    (tmp_path / "a_x_train.py").write_text(  # another docstring, a comment changed, gone dropped, os replaced
        '"""Variant."""\nimport sys\nN = 1\n\n\nclass C:\n    """C."""\n    def m(self):\n        def inner():\n'
        '            return 1  # two\n        return inner()\n')
    monkeypatch.setitem(globals(), "REPO", str(tmp_path))
    assert set(lesson("a_train.py", "a_x_train.py")) == {"C.m.inner", "-C.gone", "-os", "+sys"}  # not C, C.m
    assert undeclared("a_train.py", "a_x_train.py", ["C.m.inner", "-C.gone", "-os", "+sys"]) == []
    problems = undeclared("a_train.py", "a_x_train.py", ["C.m", "-C.gone", "-os"])
    assert len(problems) == 3 and "C.m.inner differs" in problems[0] and "declare +sys" in problems[1]
    assert "C.m is declared in TIER2 but" in problems[2]


def test_a_fix_not_copied_to_the_tier2_twin_fails(tmp_path, monkeypatch):
    # The mutant: a fix in one line of zero3_train.py's ZeRO1.forward_backward, which zero3_tuning_train.py shares
    base, variant = "zero3_train.py", "zero3_tuning_train.py"
    line = "(loss / (self.args.grad_accum_steps * self.world_size)).backward()"
    text = open(os.path.join(REPO, base)).read()
    assert text.count(line) == 1
    fixed = "loss.div(self.args.grad_accum_steps * self.world_size).backward()"
    (tmp_path / base).write_text(text.replace(line, fixed))
    (tmp_path / variant).write_text(open(os.path.join(REPO, variant)).read())
    monkeypatch.setitem(globals(), "REPO", str(tmp_path))
    problems = undeclared(base, variant, TIER2[variant][2].split())
    print("\n".join(problems))
    assert len(problems) == 1 and problems[0].startswith(f"{variant}: ZeRO1.forward_backward differs from {base}'s")


# Pieces that several scripts write out, each from its own lesson (no script imports another), which must read the
# same wherever they appear: name -> the scripts that hold it. A fix to one copy is a fix to copy to the others.
SHARED_COPIES = {
    "VocabParallelCrossEntropy": ["tp_train.py", "tp_overlap_train.py", "hybrid_train.py", "pp_vocab_train.py"],
}


@pytest.mark.parametrize("name", sorted(SHARED_COPIES))
def test_shared_copies_are_identical(name):
    """Each definition of SHARED_COPIES, its methods and the comments above it included, is the same text in every
    script that holds it."""
    copies = {}
    for script in SHARED_COPIES[name]:
        units = definitions(os.path.join(REPO, script))
        copies[script] = {unit: text for unit, text in units.items() if unit == name or unit.startswith(name + ".")}
        assert name in copies[script], f"{script} has no {name}"
    first, *others = SHARED_COPIES[name]
    for script in others:
        for unit in sorted(copies[first].keys() | copies[script].keys()):
            a, b = copies[first].get(unit, ""), copies[script].get(unit, "")
            assert a == b, "\n".join(difflib.unified_diff(a.splitlines(), b.splitlines(), first, script,
                                                          f"{unit} ({first})", f"{unit} ({script})", lineterm=""))


def test_every_script_writes_its_own_out_dir_by_default(capsys):
    """A tier-2 script writes its checkpoint and metrics beside its base's, never over them: --out_dir defaults to
    out/<the script's name less _train.py> (the default --help prints)."""
    import importlib
    defaults = {}
    for script in scripts():
        with pytest.raises(SystemExit):
            importlib.import_module(script[:-3]).main(["--help"])
        text = " ".join(capsys.readouterr().out.split())
        defaults[script] = re.search(r"--out_dir OUT_DIR [^(]*\(default: ([^)]*)\)", text).group(1)
    assert defaults == {script: os.path.join("out", script[:-len("_train.py")]) for script in scripts()}
