#!/usr/bin/env python3
"""Checks that keep the product text and the docs true to the tree. One check per run, named on the command line:

  docs_check.py product_text ROOT   no code, comment, message, help or product doc cites the project's own numbered
                                    history (an issue, session, call or helper with its number): that belongs in
                                    CHANGELOG.md and bench/RESULTS.md
  docs_check.py env_table ROOT      every TANDEM_* environment variable the sources read (getenv, os.environ, a
                                    shell expansion, CMake's $ENV{}) has a row in docs/OPERATIONS.md's table, and
                                    every row names a variable something still reads
  docs_check.py doc_paths ROOT      every repository path README.md, python/README.md and docs/*.md name exists

Each failure is printed as FILE:LINE: what, and the exit code is 1 if any; 0 otherwise. CTest runs all three
(label unit).
"""
import glob
import os
import re
import subprocess
import sys

# History's own homes, where numbered work items and runs are the point.
HISTORY_FILES = {"CHANGELOG.md", "bench/RESULTS.md"}
# The per-topic GPU runners that scripts/gpu-check.sh takes over; they are not product text and go with it.
SELF = "tests/docs_check.py"  # its own patterns and samples
TEXT_SUFFIXES = (".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".cuh", ".py", ".sh", ".yaml", ".yml", ".txt", ".cmake",
                 ".in", ".md", ".proto", ".service", ".socket", ".toml", ".cfg")

# "issue N", "session N", "sessions N and M", "call N", "calls N-M", "stop N", "helper N", "PR #N". "session"
# alone is a product word (a client session); only a number after it makes it history.
HISTORY = re.compile(r"\b(?:issue|session|call|stop|helper|PR)s?\s+#?\d+(?:\s*(?:,|-|and)\s*\d+)*\b(?![.\d])",
                     re.IGNORECASE)

# Variables the sources still read that the table leaves out on purpose: read only to refuse, and being removed.

ENV_READS = [
    # C and C++: getenv and the small env helpers built on it (envU64("TANDEM_AG_CTAS", 0)).
    ((".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".cuh"),
     re.compile(r"(?<![\w:])(?:std::)?(?:secure_)?getenv\s*\(\s*\"(TANDEM_[A-Z0-9_]+)\"|"
                r"(?<!\w)env[A-Z]\w*\s*\(\s*\"(TANDEM_[A-Z0-9_]+)\"")),
    # Python: os.environ.get / os.getenv / os.environ[...] read.
    ((".py",), re.compile(r"(?:environ\.get|getenv|environ\.pop|environ\.setdefault)\(\s*[\"'](TANDEM_[A-Z0-9_]+)|"
                          r"environ\[\s*[\"'](TANDEM_[A-Z0-9_]+)[\"']\s*\](?!\s*=[^=])")),
    # Shell: an expansion ($TANDEM_X, ${TANDEM_X:-...}).
    ((".sh",), re.compile(r"\$\{?(TANDEM_[A-Z0-9_]+)")),
    # CMake: $ENV{TANDEM_X} / DEFINED ENV{TANDEM_X}.
    ((".cmake", "CMakeLists.txt"), re.compile(r"ENV\{(TANDEM_[A-Z0-9_]+)\}")),
]
ENV_DOC = "docs/OPERATIONS.md"
ENV_SECTION = re.compile(r"^## Environment variables\b")

PATH_DOCS = ["README.md", "python/README.md"]  # plus docs/*.md


def repo_files(root):
    """The tracked files and the untracked ones git does not ignore (so build trees are left out)."""
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-co", "--exclude-standard", "-z"], check=True,
                             capture_output=True).stdout.decode()
        files = [f for f in out.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for d, dirs, names in os.walk(root):
            dirs[:] = [x for x in dirs if not x.startswith((".git", "build")) and x != "__pycache__"]
            files += [os.path.relpath(os.path.join(d, n), root) for n in names]
    return sorted(f for f in files if os.path.isfile(os.path.join(root, f)))


def is_text(rel, root):
    if rel.endswith(TEXT_SUFFIXES) or os.path.basename(rel) == "CMakeLists.txt":
        return True
    try:  # scripts without a suffix (.ci/run)
        with open(os.path.join(root, rel), "rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return False


def read_lines(root, rel):
    with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
        return f.read().splitlines()


def check_product_text(root):
    # The pattern must catch what it is for, or this check passes without checking anything.
    for bad in ("iss" + "ue 18", "Sess" + "ion 6, ca" + "ll 2", "sess" + "ions 9 and 11", "(cal" + "l 3)"):
        assert HISTORY.search(bad), bad
    # Product words that must not trip it: a client session, issuing work, calling a function.
    for good in ("torch 2.11", "one session per process", "GPUs issue their transfers", "calls it twice"):
        assert not HISTORY.search(good), good
    failures = []
    for rel in repo_files(root):
        if rel in HISTORY_FILES or not is_text(rel, root):
            continue
        for n, line in enumerate(read_lines(root, rel), 1):
            m = HISTORY.search(line)
            if m:
                failures.append(f"{rel}:{n}: cites project history ('{m.group(0)}'); say the product fact, and put "
                                "the history in CHANGELOG.md or bench/RESULTS.md")
    return failures


def env_table(root):
    """{name: line} of the variables docs/OPERATIONS.md's table lists (first column)."""
    names, inside = {}, False
    for n, line in enumerate(read_lines(root, ENV_DOC), 1):
        if line.startswith("## "):
            inside = bool(ENV_SECTION.match(line))
        elif inside and line.startswith("|"):
            first = line.split("|")[1]
            for name in re.findall(r"`(TANDEM_[A-Z0-9_]+)", first):
                names[name] = n
    return names


def check_env_table(root):
    # The patterns must catch what they are for, or this check passes without checking anything.
    for (_, pattern), text in zip(ENV_READS, ('std::getenv("TANDEM_X")', 'os.environ.get("TANDEM_X")',
                                              '"${TANDEM_X:-1}"', "$ENV{TANDEM_X}")):
        assert pattern.search(text), text
    if not os.path.exists(os.path.join(root, ENV_DOC)):
        return [f"{ENV_DOC}: missing (it holds the table of TANDEM_* environment variables)"]
    documented = env_table(root)
    if not documented:
        return [f"{ENV_DOC}: no '## Environment variables' table with `TANDEM_*` names in its first column"]
    read = {}
    for rel in repo_files(root):
        if rel in HISTORY_FILES or rel == SELF:
            continue
        for suffixes, pattern in ENV_READS:
            if rel.endswith(suffixes) or os.path.basename(rel) in suffixes:
                for n, line in enumerate(read_lines(root, rel), 1):
                    for m in pattern.finditer(line):
                        name = next(g for g in m.groups() if g)
                        read.setdefault(name, f"{rel}:{n}")
    failures = [f"{where}: {name} is read from the environment but has no row in {ENV_DOC}'s table"
                for name, where in sorted(read.items()) if name not in documented]
    failures += [f"{ENV_DOC}:{line}: {name} is documented but nothing reads it (remove the row)"
                 for name, line in sorted(documented.items()) if name not in read]
    return failures


PATH_TOKEN = re.compile(r"`([^`\n]+)`|\]\(([^)\s]+)\)")


def path_words(line):
    """Candidate repository paths on a line: words of inline code spans and link targets."""
    for m in PATH_TOKEN.finditer(line):
        if m.group(2) is not None:
            yield m.group(2), True
        else:
            for word in m.group(1).split():
                yield word, False


def check_doc_paths(root):
    top = set(os.listdir(root)) - {"build"}
    docs = PATH_DOCS + sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "docs", "*.md")))
    failures = []
    for rel in docs:
        base = os.path.dirname(rel)
        fenced = False
        for n, line in enumerate(read_lines(root, rel), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            words = ((w, False) for w in line.split()) if fenced else path_words(line)
            for word, is_link in words:
                word = word.strip(".,;:()'\"").split("#")[0]
                if word.startswith("./"):
                    word = word[2:]
                if not word or "://" in word or any(c in word for c in "<>$~{}@=") or word.startswith("/"):
                    continue
                if is_link:
                    target = os.path.normpath(os.path.join(base, word))
                elif "/" in word and word.split("/")[0] in top:
                    target = word
                else:
                    continue
                if target.startswith(".."):
                    continue  # outside the repository
                pattern = os.path.join(root, target)
                if not (glob.glob(pattern) if any(c in target for c in "*?[") else os.path.exists(pattern)):
                    failures.append(f"{rel}:{n}: names {word}, which does not exist")
    return failures


CHECKS = {"product_text": check_product_text, "env_table": check_env_table, "doc_paths": check_doc_paths}


def main(argv):
    if len(argv) != 3 or argv[1] not in CHECKS:
        print(f"usage: {argv[0]} {'|'.join(CHECKS)} ROOT", file=sys.stderr)
        return 2
    failures = CHECKS[argv[1]](os.path.abspath(argv[2]))
    for f in failures:
        print(f)
    print(f"{argv[1]}: {len(failures)} problem(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
