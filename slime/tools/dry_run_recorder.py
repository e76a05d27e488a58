"""The stand-in that slime.tools.dry_run_scripts puts in place of python / python3 / ray / torchrun
while a launch script runs: it records each train.py / train_async.py call (and runs the script's
other Python snippets). RECORDS and PYTHON are filled in per script."""

RECORDER = r"""
import ast, json, os, subprocess, sys, time

RECORDS = __RECORDS__
PYTHON = __PYTHON__
ENTRIES = ("train.py", "train_async.py")
# What a snippet may import and call: reading the environment, computing and printing.
_SAFE_IMPORTS = {"json", "os", "sys", "math", "re"}
_UNSAFE_NAMES = {"open", "exec", "eval", "compile", "__import__", "input", "breakpoint", "getattr", "setattr",
                 "delattr", "vars", "globals", "locals", "memoryview"}
_SAFE_ATTRS = {
    "environ", "get", "getenv", "path", "join", "dirname", "basename", "abspath", "exists", "isdir",
    "isfile", "dumps", "loads", "items", "keys", "values", "append", "extend", "split", "strip", "rstrip",
    "lstrip", "format", "replace", "lower", "upper", "startswith", "endswith", "ceil", "floor", "sqrt",
    "log2", "stdout", "write", "argv", "match", "search", "sub", "findall", "group", "update", "copy",
}


def note(text):
    with open(os.path.join(RECORDS, f"note-{time.time_ns()}-{os.getpid()}.txt"), "w") as f:
        f.write(text)


def safe(code):
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name not in _SAFE_IMPORTS for a in node.names):
            return False
        if isinstance(node, ast.ImportFrom) and node.module not in _SAFE_IMPORTS:
            return False
        if isinstance(node, ast.Name) and node.id in _UNSAFE_NAMES:
            return False
        if isinstance(node, ast.Attribute) and (node.attr.startswith("_") or node.attr not in _SAFE_ATTRS):
            return False
    return True


def main(argv):
    name = os.path.basename(sys.argv[0])
    for i, arg in enumerate(argv):
        if os.path.basename(arg) in ENTRIES:
            record = {"via": name, "argv": argv, "entry": os.path.basename(arg), "args": argv[i + 1:],
                      "cwd": os.getcwd()}
            with open(os.path.join(RECORDS, f"call-{time.time_ns()}-{os.getpid()}.json"), "w") as f:
                json.dump(record, f)
            return 0
    if name not in ("python", "python3"):
        return 0
    code, rest, at = None, [], 0
    while at < len(argv):  # the interpreter's own options, up to the program
        arg = argv[at]
        if arg == "-c" and at + 1 < len(argv):
            code, rest = argv[at + 1], argv[at + 2:]
        elif arg == "-":
            code, rest = sys.stdin.read(), argv[at + 1:]
        elif arg in ("-W", "-X"):
            at += 2
            continue
        elif arg.startswith("-") and arg != "-m":
            at += 1
            continue
        break
    if code is None:  # a module or a program: not run
        return 0
    if not safe(code):
        note(f"{name} snippet not run (not plainly harmless): {code.strip()[:200]}")
        return 0
    done = subprocess.run([PYTHON, "-I", "-c", code, *rest], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
    sys.stdout.write(done.stdout)
    if done.returncode:
        tail = (done.stderr.strip().splitlines() or [""])[-1]
        note(f"{name} snippet failed ({tail}); went on as if it printed the above")
    return 0


sys.exit(main(sys.argv[1:]))
"""
