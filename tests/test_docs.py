"""README.md and docs/: every relative link and #anchor resolves, every --flag written next to a script's name is
one that script's own parser accepts, and every repository path they name exists.

- Anchors are GitHub's: a heading's text, lowercased, without punctuation but '-' and '_', spaces as '-'; a
  repeated heading gets -1, -2, ...
- A flag belongs to a script when it follows the script's name in one command: a code span or a line of a code
  block (torchrun's flags before the name are torchrun's); in prose, when it comes right after the name
  ("`tp_train.py`'s `--sequence_parallel`"); in a table row whose first cell names a script, a flag spelled as
  ours (snake_case) belongs to one of the scripts the row names, or to torchrun. Each script's parser is built
  by its own main(), stopped before it parses anything: no launch. A flag a tier-1 script keeps only to refuse
  it ("moved: ...") is not accepted.
- A path is a repository path when its first folder is one of the checkout's (common/, docs/, tests/, ...; not
  the data/, out/ and runs/ the scripts write), or when it names a *_train.py script. A link's path is checked
  with its anchor.
"""
import argparse
import glob
import importlib
import os
import re
import shlex
import subprocess
import urllib.parse

import pytest
import torch.distributed.run

from conftest import REPO


def top_folders():
    """The checkout's own top-level folders: git's, or (outside git) those on disk but the data/, out/ and runs/
    that the scripts and run_all.sh write."""
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
        return {path.split("/")[0] for path in listed.splitlines() if "/" in path}
    except (OSError, subprocess.CalledProcessError):
        return {name for name in os.listdir(REPO) if os.path.isdir(os.path.join(REPO, name))
                and name not in ("data", "out", "runs") and not name.startswith(("_", "."))}


TOP_FOLDERS = top_folders()
SCRIPTS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "*.py")))
SCRIPTS += ["run_all.sh"]
TORCHRUN_FLAGS = set(torch.distributed.run.get_args_parser()._option_string_actions)

FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
SCRIPT_NAME = re.compile(r"(?<![\w/.-])(?:\./)?(" + "|".join(re.escape(s) for s in SCRIPTS) + r")(?![\w-])")
PLACEHOLDER = re.compile(r"[*<>{}$\[\]|]|\.\.\.")
# prose: a script's name, then flags right after it ("`tp_train.py`'s `--sequence_parallel` `--loss_parallel`")
RIGHT_AFTER = re.compile(SCRIPT_NAME.pattern + r"`?(?:'s)?((?:\s*`?--[A-Za-z][\w-]*`?)+)")


def documents():
    """{path relative to the checkout: text} of README.md and every Markdown file under docs/, as they are now."""
    paths = [os.path.join(REPO, "README.md")] + glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True)
    texts = {}
    for path in sorted(paths):
        with open(path, encoding="utf-8") as f:
            texts[os.path.relpath(path, REPO)] = f.read()
    return texts


def parse(text):
    """[(line number, language or None for prose, line)]: a code block's lines carry its language ("" for none),
    a line continued with a trailing backslash joined to the next."""
    lines, fence, language = [], None, None
    raw = text.splitlines()
    i = 0
    while i < len(raw):
        number, line = i + 1, raw[i]
        i += 1
        opening = FENCE.match(line)
        if fence is None and opening:
            fence, language = opening.group(1), opening.group(2)
            continue
        if fence is not None and line.strip().startswith(fence[0] * len(fence)) and not line.strip(fence[0]).strip():
            fence = None
            continue
        if fence is not None:
            while line.endswith("\\") and i < len(raw):
                line, i = line[:-1] + " " + raw[i], i + 1
        lines.append((number, None if fence is None else language, line))
    return lines


def heading_anchor(heading):
    """GitHub's anchor of a heading's text: code spans keep their text, links and images their text, then
    lowercase, no punctuation but '-' and '_', spaces as '-'."""
    text = ""
    for i, part in enumerate(re.split(r"(`+[^`]*?`+)", heading)):
        if i % 2:
            text += part.strip("`")
        else:
            part = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", part)
            part = re.sub(r"<[^>]+>", "", part)
            text += re.sub(r"(?<!\w)_+(.+?)_+(?!\w)", r"\1", part)  # _emphasis_
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text):
    seen, found = {}, set()
    for _, language, line in parse(text):
        heading = HEADING.match(line) if language is None else None
        if heading:
            anchor = heading_anchor(heading.group(2))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def link_problems(name, text, texts):
    """A relative link to a missing file, or to an anchor its Markdown file (this one when the path is empty) lacks."""
    problems = []
    for number, language, line in parse(text):
        if language is not None:
            continue
        masked = CODE_SPAN.sub(lambda m: "_" * len(m.group(0)), line)
        targets = [m.group(1) for m in LINK.finditer(masked)]
        reference = REFERENCE.match(masked)
        if reference:
            targets.append(reference.group(1))
        for target in targets:
            if re.match(r"[a-zA-Z][\w+.-]*:|//", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            path = urllib.parse.unquote(path)
            if path.startswith("/"):
                resolved = os.path.normpath(path.lstrip("/"))
            else:
                resolved = os.path.normpath(os.path.join(os.path.dirname(name), path)) if path else name
            where = f"{name}:{number}: ({target})"
            exists = resolved in texts or os.path.exists(os.path.join(REPO, resolved))
            if resolved.startswith("..") or not exists:
                problems.append(f"{where} {resolved} does not exist in the checkout")
                continue
            if not anchor:
                continue
            if resolved.endswith(".md"):
                if resolved in texts:
                    target_text = texts[resolved]
                else:
                    with open(os.path.join(REPO, resolved), encoding="utf-8") as f:
                        target_text = f.read()
                if anchor not in anchors(target_text):
                    problems.append(f"{where} {resolved} has no heading with the anchor #{anchor}")
            elif not re.fullmatch(r"L\d+(-L\d+)?", anchor):  # GitHub's line anchors of a source file
                problems.append(f"{where} #{anchor} is no anchor of {resolved}")
    return problems


def parser_flags(script):
    """{flag: argparse action} that the script's own parser accepts, without the flags it keeps only to refuse."""
    if script.endswith(".sh"):  # run_all.sh: its `case $arg in --bench) ...` branches
        with open(os.path.join(REPO, script)) as f:
            return {flag: None for flag in re.findall(r"^\s*(--[\w-]+)\)", f.read(), re.M)}

    class Built(Exception):
        pass

    def stop(parser, *args, **kwargs):
        raise Built(parser)

    module = importlib.import_module("plan_report" if script == "plan.py" else script[:-3])  # its command line
    with pytest.MonkeyPatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", stop)
        try:
            module.main([])
        except Built as built:
            parser = built.args[0]
        else:
            raise AssertionError(f"{script}: main() parsed no arguments")
    flags = {flag: action for flag, action in parser._option_string_actions.items()
             if not (action.help or "").startswith("moved:")}
    if script == "plan.py":  # --search passes the model's flags on to every script's parser
        flags.update(dict.fromkeys(importlib.import_module("plan_search").MODEL_FLAGS))
    return flags


def command_flags(command):
    """[(script, flag, value)] for each --flag after a script's name in one shell command; value: the word after
    it (or after '='), or None."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # an unclosed quote: plain words
        tokens = command.split()
    found, script = [], None
    for i, token in enumerate(tokens):
        if re.fullmatch(r"[;&|()<>]+", token):  # the next command
            script = None
        elif SCRIPT_NAME.fullmatch(token):
            script = SCRIPT_NAME.fullmatch(token).group(1)
        elif script is not None and FLAG.fullmatch(token.partition("=")[0]):
            flag, equals, value = token.partition("=")
            if not equals:
                value = tokens[i + 1] if i + 1 < len(tokens) else None
            found.append((script, flag, value))
    return found


def flag_problems(name, text, flags_of):
    """A --flag written next to a script's name that the script's parser refuses, or a value outside its choices.
    flags_of(script): parser_flags(script)."""
    problems = []

    def check(number, scripts, flag, value, row=False):
        """row: a flag in a table row, which may be torchrun's"""
        accepting = [s for s in scripts if flag in flags_of(s)]
        if not accepting:
            if not (row and flag in TORCHRUN_FLAGS):
                problems.append(f"{name}:{number}: {flag} is not a flag of {' or '.join(scripts)}")
            return
        action = flags_of(accepting[0])[flag]
        if value is None or action is None or not action.choices or not re.fullmatch(r"[\w.-]+", value):
            return
        try:
            choice = action.type(value) if callable(action.type) else value
        except (ValueError, argparse.ArgumentTypeError):
            choice = value
        if choice not in action.choices:
            choices = ", ".join(str(c) for c in action.choices)
            problems.append(f"{name}:{number}: {accepting[0]} {flag} {value}: not one of {choices}")

    for number, language, line in parse(text):
        if language is not None:
            if language.lower() not in ("python", "py", "pycon"):
                for script, flag, value in command_flags(line):
                    check(number, [script], flag, value)
            continue
        in_commands = set()  # (script, flag)
        for span in CODE_SPAN.finditer(line):
            if SCRIPT_NAME.search(span.group(2)):
                for script, flag, value in command_flags(span.group(2)):
                    check(number, [script], flag, value)
                    in_commands.add((script, flag))
        for after in RIGHT_AFTER.finditer(line):
            for flag in FLAG.findall(after.group(2)):
                if (after.group(1), flag) not in in_commands:
                    check(number, [after.group(1)], flag, None)
        cells = line.strip().strip("|").split("|")
        if line.lstrip().startswith("|") and SCRIPT_NAME.search(cells[0]):
            named = sorted({m.group(1) for m in SCRIPT_NAME.finditer(line)})
            for flag in FLAG.findall(line):
                if flag not in {f for _, f in in_commands} and re.fullmatch(r"--[a-z]+(_[a-z0-9]+)*", flag):
                    check(number, named, flag, None, row=True)
    return problems


def path_problems(name, text):
    """A repository path named in a code span or a code block that does not exist."""
    candidates = []
    for number, language, line in parse(text):
        if language is None:  # (a link's path: link_problems)
            words = [w for span in CODE_SPAN.finditer(line) for w in span.group(2).split()]
        else:
            words = line.split()
        candidates += [(number, word) for word in words]
    problems = []
    for number, word in candidates:
        word = word.partition("=")[2] if word.startswith("-") else word  # --out_dir=PATH
        word = word.strip("'\"(),;`").rstrip(".:")
        word = re.sub(r"(:\d+(-\d+)?(,\d+(-\d+)?)*|::\S*|#.*)$", "", word)  # a line, a test, an anchor
        word = word[2:] if word.startswith("./") else word
        if not word or PLACEHOLDER.search(word) or re.match(r"[a-zA-Z][\w+.-]*:", word):
            continue
        first = word.split("/")[0]
        repository_path = ("/" in word and first in TOP_FOLDERS) or re.fullmatch(r"\w+_train\.py", word)
        if repository_path and not os.path.exists(os.path.join(REPO, word)):
            problems.append(f"{name}:{number}: {word} does not exist in the checkout")
    return problems


@pytest.fixture(scope="module")
def flags_of():
    cache = {}

    def flags(script):
        if script not in cache:
            cache[script] = parser_flags(script)
        return cache[script]
    return flags


def test_links_and_anchors_resolve():
    texts = documents()
    problems = [p for name, text in texts.items() for p in link_problems(name, text, texts)]
    assert not problems, "\n".join(problems)


def test_flags_next_to_a_script_are_its_own(flags_of):
    problems = [p for name, text in documents().items() for p in flag_problems(name, text, flags_of)]
    assert not problems, "\n".join(problems)


def test_named_paths_exist():
    problems = [p for name, text in documents().items() for p in path_problems(name, text)]
    assert not problems, "\n".join(problems)


def test_the_checks_catch_a_broken_link_a_bogus_flag_and_a_missing_path(flags_of):
    """Each check on a page written to fail it, next to the same lines written right."""
    page = "\n".join([
        "# Title",
        "## The `--compile` flag: on CUDA",
        "## The `--compile` flag: on CUDA",
        "[ok](#the---compile-flag-on-cuda-1) [ok](../README.md) [ok](other.md#its-part_2) [ok](../common/model.py#L3)",
        "[broken](missing.md) [broken](#no-such-heading) [broken](other.md#its-part-2)",
        "Run `torchrun --nproc_per_node=2 tp_train.py --sequence_parallel --tensor_parallel_size 2`.",
        "Run `torchrun --nproc_per_node=2 tp_train.py --bogus_flag`, or `pp_zb_train.py --schedule zb9`.",
        "`tp_overlap_train.py` adds `--tp_overlap`; `--nproc_per_node=4` starts 4 ranks of tp_train.py.",
        "`tp_train.py`'s `--sequence_parallel` `--tp_overlap` are gone; `--nonsense` in prose is not checked.",
        "`zero3_train.py --stage 3` is ZeRO-3, `zero3_train.py --stage 4` is not.",
        "| `tp_train.py` | `--sequence_parallel --loss_parallel`, Megatron's `--tp-comm-overlap` | `--nnodes` |",
        "| `tp_overlap_train.py` | as tp_train.py, and `--n_microbatches` |",
        "See `common/model.py:12`, `tests/test_docs.py::test_named_paths_exist`, `docs/` and `out/ddp/x.pt`.",
        "See `common/no_such_module.py` and [this](../tests/no_such_test.py).",
        "```bash",
        "python sample.py --out_dir out/ddp && NPROC=4 ./run_all.sh --bench",
        "torchrun --standalone --nproc_per_node=2 ddp_train.py --max_iters 10 \\",
        "  --no_such_flag 1 --out_dir out/ddp",
        "./run_all.sh --fast",
        "```",
    ])
    name = os.path.join("docs", "example.md")
    texts = {name: page, os.path.join("docs", "other.md"): "# Other page\n\n## Its *part_2*\n"}
    assert link_problems(name, page, texts) == [
        "docs/example.md:5: (missing.md) docs/missing.md does not exist in the checkout",
        "docs/example.md:5: (#no-such-heading) docs/example.md has no heading with the anchor #no-such-heading",
        "docs/example.md:5: (other.md#its-part-2) docs/other.md has no heading with the anchor #its-part-2",
        "docs/example.md:14: (../tests/no_such_test.py) tests/no_such_test.py does not exist in the checkout"]
    assert flag_problems(name, page, flags_of) == [
        "docs/example.md:7: --bogus_flag is not a flag of tp_train.py",
        "docs/example.md:7: pp_zb_train.py --schedule zb9: not one of gpipe, 1f1b, interleaved, zb1p, zbv",
        "docs/example.md:9: --tp_overlap is not a flag of tp_train.py",
        "docs/example.md:10: zero3_train.py --stage 4: not one of 1, 2, 3",
        "docs/example.md:12: --n_microbatches is not a flag of tp_overlap_train.py or tp_train.py",
        "docs/example.md:17: --no_such_flag is not a flag of ddp_train.py",
        "docs/example.md:19: --fast is not a flag of run_all.sh"]
    assert path_problems(name, page) == ["docs/example.md:14: common/no_such_module.py does not exist in the checkout"]


def readme_commands(text):
    """The install and test commands of the README's code blocks, in order, their comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    lines = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith(("python3 -m pip install", "python3 -m pytest"))]


def ci_commands(text, pin="torch==2.13.0"):
    """.ci/run's commands but its shell set-up (set, cd), each install's torch pin taken out (and required)."""
    lines = [line.strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not line.startswith(("#", "set ", "cd "))]
    for line in lines:
        assert " pip install " not in line or line.endswith(" " + pin), f".ci/run: {line!r} lacks {pin}"
    return [line.removesuffix(" " + pin) for line in lines]


def test_ci_runs_exactly_the_readmes_install_and_test_commands():
    """A green CI means a new user's commands work: .ci/run runs the README's pip installs and its test command, in
    the README's order, with torch pinned and nothing else (a missing install hid behind an extra line before)."""
    readme = readme_commands(open(os.path.join(REPO, "README.md")).read())
    assert readme[-1] == "python3 -m pytest -q tests" and len(readme) >= 3, readme
    assert ci_commands(open(os.path.join(REPO, ".ci", "run")).read()) == readme
    extra = "python3 -m pip install -r requirements-data.txt torch==2.13.0\n"  # a line the README lacks
    assert ci_commands(open(os.path.join(REPO, ".ci", "run")).read() + extra) != readme
