"""Run slime's launch scripts against this project's train.py / train_async.py with --dry-run.

    python -m slime.tools.dry_run_scripts --slime-dir DIR [--json OUT] [--as-job] [--set VAR=VALUE]
        [--jobs 2] [--only GLOB] [--script-timeout 20] [--train-timeout 60]

DIR holds a checkout of THUDM/slime's files. Every bash file in it that names train.py or
train_async.py outside a comment is a launch script. Each one runs with bash in DIR, as its users
run it (`bash scripts/run-X.sh`), with a PATH whose first entry is a folder of stand-ins:

- `python`, `python3`, `ray`, `torchrun`: a call whose arguments name train.py or train_async.py
  (`ray job submit ... -- python3 train.py ...` included) is recorded, with the arguments after
  that name, and succeeds. A `python -c CODE` or `python - <<EOF` snippet runs for real only when
  it plainly reads and prints (no file, process or import beyond json/os/sys/math/re: `safe` in
  the stand-in), and the script goes on even when it fails; any other call does nothing.
- `NOOPS` below (`pkill`, `kill`, `nvidia-smi` (so it lists no GPU), `sleep`, `rm`, `cp`, `curl`,
  `git`, `docker`, `sudo`, ...): nothing runs and they succeed. `tee` copies its
  input to its output only; `pip list|show|freeze` read PYTHON's packages, any other `pip` does
  nothing; `nohup` runs its command (through these stand-ins). The shell's own `kill` is a
  function that does nothing (BASH_ENV); `mktemp` makes its file in a temporary folder of the
  tool's, which is also TMPDIR. A redirection (`> /tmp/x.log`) still writes where it says.

No sandbox: a command called by its absolute path (`/bin/rm`), `command kill`, `sh -c '...'`,
`find -delete` and redirections run for real. Run it on scripts you trust (slime's own).

A script that names `/root/slime` (the path slime's images keep the checkout at) runs as a copy,
next to it, that names DIR there instead. A script that stops for a variable it wants from its
environment (`X is not set`, `X: unbound variable`, or a flag left without its value `$X`) runs
again with X set to a placeholder (`placeholder`); `--set X=V` sets one for every script. Rows
say what was rewritten or set; nothing else in a script is changed.

Each recorded call then runs as `PYTHON PROJECT/train.py ARGS --dry-run` in PROJECT (this
checkout, no PYTHONPATH; `--as-job` runs it where the script called it, with the PYTHONPATH its
`--runtime-env-json` gives, as its Ray job would). The exit code and the first problem (or first
error line) make the row. Paths such as `/root/Qwen3-4B` do not exist here, and the dry run says
so: a missing checkpoint or data file is one of its problems (exit 2), not a warning. Scripts
whose every problem is such a missing input are counted apart in the summary.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

# the stand-in for python / python3 / ray / torchrun (RECORDS and PYTHON filled in per script)
from slime.tools.dry_run_recorder import RECORDER as _RECORDER

ENTRIES = ("train.py", "train_async.py")
SLIME_HOME = "/root/slime"
NOOPS = (
    "pkill",
    "killall",
    "kill",
    "nvidia-smi",
    "sleep",
    "rm",
    "cp",
    "mv",
    "ln",
    "mkdir",
    "touch",
    "chmod",
    "chown",
    "ssh",
    "scp",
    "rsync",
    "curl",
    "wget",
    "git",
    "hf",
    "huggingface-cli",
    "docker",
    "sudo",
    "apt",
    "apt-get",
    "systemctl",
)
RECORDERS = ("python", "python3", "ray", "torchrun")
RUN_ENV = {
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "RAY_AUTH_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
}
# A dry-run problem that only says an input is absent on this machine.
MISSING = re.compile(r"no such file|is not a directory|does not exist|not found")
# With --num-epoch the run's optimizer steps (the learning-rate schedule's length) are counted from
# the prompt data: absent, the schedule's problems follow from it.
SCHEDULE = re.compile(r"--lr-decay-iters|--lr-warmup-fraction")


@dataclass
class Row:
    script: str
    exit_code: int | None
    """The dry run's exit code; None when the script recorded no train call."""
    reason: str
    entry: str = ""
    args: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    script_rc: int | None = None
    """The launch script's own exit code (None: it ran past its timeout)."""
    notes: list[str] = field(default_factory=list)

    @property
    def only_missing_inputs(self) -> bool:
        counted = "--num-epoch" in self.args and any(
            p.startswith("--prompt-data") and MISSING.search(p) for p in self.problems
        )
        return (
            self.exit_code == 2
            and bool(self.problems)
            and all(MISSING.search(p) or (counted and SCHEDULE.search(p)) for p in self.problems)
        )


def find_launch_scripts(slime_dir: Path) -> list[Path]:
    """Bash files under slime_dir that name train.py or train_async.py outside a comment."""
    out = []
    names = "|".join(re.escape(e) for e in ENTRIES)
    pattern = re.compile(rf"(^|[\s/\"'])({names})($|[\s\"'])")
    for path in sorted(slime_dir.rglob("*")):
        if not path.is_file() or path.is_symlink() or ".git" in path.parts:
            continue
        if path.suffix != ".sh":
            try:
                with open(path, "rb") as f:
                    head = f.readline(200)
            except OSError:
                continue
            if not (head.startswith(b"#!") and b"bash" in head):
                continue
        text = path.read_text(errors="replace")
        if any(pattern.search(line.split("#", 1)[0]) for line in text.splitlines()):
            out.append(path)
    return out


def write_shims(folder: Path, records: Path, python: str, tmp: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    recorder = _RECORDER.replace("__RECORDS__", repr(str(records))).replace("__PYTHON__", repr(python))
    for name in RECORDERS:
        (folder / name).write_text(f"#!{python} -IS\n{recorder}")
    for name in NOOPS:
        (folder / name).write_text("#!/bin/sh\nexit 0\n")
    (folder / "tee").write_text("#!/bin/sh\nexec cat\n")
    # mktemp makes its file in the script's own temporary folder, whatever folder it names.
    mktemp = shutil.which("mktemp") or "/bin/mktemp"
    (folder / "mktemp").write_text(
        '#!/bin/sh\nd=; t=tmp.XXXXXXXXXX\nfor a in "$@"; do case "$a" in -d) d=-d;; -*) ;; *) '
        't=$(basename "$a");; esac; done\n'
        f'exec {mktemp} $d -p "{tmp}" "$t"\n'
    )
    (folder / "nohup").write_text('#!/bin/sh\nexec "$@"\n')
    for name in ("pip", "pip3"):  # what is installed may be read, nothing installed
        (folder / name).write_text(
            f'#!/bin/sh\ncase "$1" in list|show|freeze) exec "{python}" -m pip "$@" 2>/dev/null;; '
            "esac\nexit 0\n"
        )
    for p in folder.iterdir():
        p.chmod(0o755)
    (folder / "bash_env.sh").write_text("kill() { :; }\n")


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int | None, str, str]:
    """(exit code or None on timeout, stdout, stderr); the whole process group goes at the timeout."""
    pipe = subprocess.PIPE
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=pipe,
        stderr=pipe,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the session this tool started for it
        try:  # a grandchild in a session of its own may still hold the pipes: do not wait for it
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            out, err = "", ""
        return None, out, err


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


@dataclass
class Options:
    slime_dir: Path
    project: Path
    """The checkout whose train.py / train_async.py run."""
    python: str
    script_timeout: float = 20
    train_timeout: float = 60
    given: dict[str, str] = field(default_factory=dict)
    """Variables set for every script (--set)."""
    as_job: bool = False
    """Dry-run in the call's working folder with the job's runtime-env PYTHONPATH (see --as-job)."""


@dataclass
class ScriptRun:
    rc: int | None
    out: str
    err: str
    calls: list[dict]
    notes: list[str]


def run_script(o: Options, script: Path, work: Path, extra: dict[str, str]) -> ScriptRun:
    """Run one launch script with the stand-ins and `extra` in its environment."""
    records, shims, tmp, slime_dir = work / "records", work / "bin", work / "tmp", o.slime_dir
    records.mkdir(parents=True)
    tmp.mkdir()
    write_shims(shims, records, o.python, tmp)
    text = script.read_text(errors="replace")
    target, notes = script, []
    home = re.compile(re.escape(SLIME_HOME) + r"(?=$|[/\"'\s:;)])", re.M)
    if home.search(text):
        target = script.with_name(f".dryrun-{os.getpid()}-{script.name}")
        target.write_text(home.sub(str(slime_dir).replace("\\", "\\\\"), text))
        notes.append(f"ran with {SLIME_HOME} read as the slime dir")
    # Not the caller's interpreter variables ($PYTHON would start a real train.py) nor HOME.
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("BASH_ENV", "ENV", "VIRTUAL_ENV", "PYTHONPATH", "HOME") and not k.startswith("PYTHON")
    }
    env.update(extra)
    env.update(
        PATH=f"{shims}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
        BASH_ENV=str(shims / "bash_env.sh"),
        TMPDIR=str(tmp),
        HOME=str(tmp),
    )
    try:
        rc, out, err = _run(["bash", str(target.relative_to(slime_dir))], slime_dir, env, o.script_timeout)
    finally:
        if target != script:
            target.unlink()
    calls = [json.loads(p.read_text()) for p in sorted(records.glob("call-*.json"))]
    notes += [p.read_text() for p in sorted(records.glob("note-*.txt"))]
    return ScriptRun(rc, out, err, calls, notes)


def placeholder(var: str) -> str:
    """A value for a variable a script insists on (its paths do not exist here either way)."""
    if var.endswith(("ADDR", "_IP", "HOST")):
        return "127.0.0.1"
    if var.endswith(("KEY", "TOKEN")):
        return "dry-run-placeholder"
    if var.endswith("PORT"):
        return "6379"
    return "/root"  # the folder slime's images keep checkpoints and data in


def asked_for(run: ScriptRun) -> set[str]:
    """Variables the script stopped for: `X is not set` (its own check) or `X: unbound variable`."""
    found = set(re.findall(r"\b([A-Z][A-Z0-9_]*) is not set\b", run.out + run.err))
    return found | set(re.findall(r"\b([A-Za-z_][A-Za-z0-9_]*): unbound variable", run.err))


def flag_variable(text: str, flag: str) -> str | None:
    """The variable that gives `flag` its value in the script text (`--wandb-key ${WANDB_KEY}`)."""
    m = re.search(re.escape(flag) + r"""[ \t=]+["']?\$\{?([A-Za-z_][A-Za-z0-9_]*)""", text)
    return m.group(1) if m else None


def first_reason(rc: int | None, out: str, err: str) -> tuple[str, list[str]]:
    """The dry run's first problem (and all of them), or its first error line."""
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if re.fullmatch(r"\d+ problems?:", line.strip()):
            problems = [ln.strip()[2:] for ln in lines[i + 1 :] if ln.startswith("  - ")]
            more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
            return (problems[0] + more if problems else line.strip()), problems
    if rc == 0:
        warnings = [ln for ln in lines if ln.startswith("warning:")]
        return (warnings[0] if warnings else ""), []
    if rc is None:
        return "dry run timed out", []
    for line in err.splitlines():
        if "error:" in line and "Traceback" not in line:
            return line.strip(), []
    return _last_line(err) or _last_line(out) or f"exit {rc}", []


def _relative(text: str, slime_dir: Path) -> str:
    return text.replace(f"{slime_dir}/", "")


def _no_call_reason(run: ScriptRun, o: Options) -> str:
    if run.rc is None:
        return f"script ran past {o.script_timeout:g} s without calling train.py"
    last = _last_line(run.err)
    if not last or last.startswith("+ exit"):  # the script's own message, on stdout
        last = _last_line(run.out) or last
    return _relative(f"script exited {run.rc} without calling train.py: {last}", o.slime_dir)


def measure_script(o: Options, script: Path) -> list[Row]:
    """One script's rows. A script that stops only for a variable it wants from its environment
    (`X is not set`, `X: unbound variable`, or a flag left without the value `$X` gives it) runs
    again with that variable set (`placeholder`); its rows name what was set."""
    name = str(script.relative_to(o.slime_dir))
    text = script.read_text(errors="replace")
    extra = dict(o.given)
    for _ in range(8):  # each pass sets at least one more variable, of the few the script names
        # The folder stays until the dry runs end: they may read files the script made in it (mktemp).
        with tempfile.TemporaryDirectory(prefix="dry-run-script-") as tmp:
            run = run_script(o, script, Path(tmp), extra)
            notes = run.notes + (
                [f"set for the script: {' '.join(f'{k}={v}' for k, v in extra.items())}"] if extra else []
            )
            if not run.calls:
                need = asked_for(run) - extra.keys()
                if not need or run.rc is None:
                    return [Row(name, None, _no_call_reason(run, o), script_rc=run.rc, notes=notes)]
            else:
                rows = [_dry_run(o, call) for call in run.calls]
                need = (
                    {v for r in rows if (v := _value_variable(text, r.reason))}
                    - extra.keys()
                    - os.environ.keys()
                )
                if not need:
                    for i, row in enumerate(rows):
                        row.script = name if len(rows) == 1 else f"{name} [{i + 1}/{len(rows)}]"
                        row.script_rc, row.notes = run.rc, notes
                    return rows
        extra.update({v: placeholder(v) for v in sorted(need)})
    raise RuntimeError(f"{name}: still asks for variables after {' '.join(extra)} were set")


def _value_variable(text: str, reason: str) -> str | None:
    """The variable whose emptiness left a flag without its value (argparse's complaint)."""
    m = re.search(r"argument (--[\w-]+): expected (one|at least one) argument", reason)
    return flag_variable(text, m.group(1)) if m else None


def _dry_run(o: Options, call: dict) -> Row:
    env = {**os.environ, **RUN_ENV}
    env.pop("PYTHONPATH", None)
    cwd = Path(call.get("cwd", o.slime_dir)) if o.as_job else o.project
    if o.as_job:  # train.py's own folder stays first on sys.path: this project's slime is the one imported
        env["PYTHONPATH"] = os.pathsep.join([*job_python_path(call, o.slime_dir), str(cwd)])
    argv = [o.python, str(o.project / call["entry"]), *call["args"], "--dry-run"]
    code, out, err = _run(argv, cwd, env, o.train_timeout)
    reason, problems = first_reason(code, out, err)
    return Row("", code, _relative(reason, o.slime_dir), call["entry"], call["args"], problems)


def job_python_path(call: dict, slime_dir: Path) -> list[str]:
    """PYTHONPATH of `ray job submit --runtime-env-json` (with /root/slime read as the slime dir)."""
    argv, found = call.get("argv", []), None
    for i, arg in enumerate(argv):
        if arg.startswith("--runtime-env-json="):
            found = arg.split("=", 1)[1]
        elif arg == "--runtime-env-json" and i + 1 < len(argv):
            found = argv[i + 1]
    try:
        path = json.loads(found or "{}").get("env_vars", {}).get("PYTHONPATH", "")
    except (ValueError, AttributeError):
        return []
    return [str(slime_dir) if p.rstrip("/") == SLIME_HOME else p for p in path.split(os.pathsep) if p]


def measure(o: Options, jobs: int = 2, only: str | None = None) -> list[Row]:
    o.slime_dir = o.slime_dir.resolve()
    scripts = find_launch_scripts(o.slime_dir)
    if only:
        scripts = [s for s in scripts if fnmatch.fnmatch(str(s.relative_to(o.slime_dir)), only)]
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        return [row for rows in pool.map(lambda script: measure_script(o, script), scripts) for row in rows]


def _script_of(row: Row) -> str:
    return row.script.split(" [", 1)[0]


def summary(rows: list[Row]) -> str:
    scripts: dict[str, list[Row]] = {}
    for row in rows:
        scripts.setdefault(_script_of(row), []).append(row)
    ok = sum(1 for rs in scripts.values() if all(r.exit_code == 0 for r in rs))
    missing = sum(
        1
        for rs in scripts.values()
        if any(r.exit_code for r in rs) and all(r.exit_code == 0 or r.only_missing_inputs for r in rs)
    )
    line = f"{ok} of {len(scripts)} scripts exit 0"
    if missing:
        line += f"; {missing} more fail only for inputs absent on this machine (checkpoints, data)"
    return line


def table(rows: list[Row], width: int = 160) -> str:
    """One line per row; a script's notes (what was set or rewritten for it) follow as [n]."""
    name_w = max([len("script"), *(len(r.script) + 4 for r in rows)])
    out = [f"{'script':<{name_w}}  exit  reason", f"{'-' * name_w}  ----  ------"]
    notes: list[str] = []
    for r in rows:
        code = "-" if r.exit_code is None else str(r.exit_code)
        reason = r.reason if len(r.reason) <= width else r.reason[: width - 3] + "..."
        mark = ""
        if r.notes:
            text = "; ".join(r.notes)
            if text not in notes:
                notes.append(text)
            mark = f" [{notes.index(text) + 1}]"
        out.append(f"{r.script + mark:<{name_w}}  {code:>4}  {reason}")
    out += [f"[{i + 1}] {text}" for i, text in enumerate(notes)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slime-dir", required=True, type=Path, help="a checkout of THUDM/slime's files")
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument(
        "--project-dir",
        type=Path,
        default=Path(__file__).resolve().parents[2],
        help="the checkout whose train.py runs (default: this one)",
    )
    p.add_argument("--python", default=sys.executable, help="the interpreter that runs train.py")
    p.add_argument("--script-timeout", type=float, default=20, help="seconds per launch script")
    p.add_argument("--train-timeout", type=float, default=60, help="seconds per dry run")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="scripts run at once")
    p.add_argument("--only", help="glob on the script's path in --slime-dir")
    p.add_argument("--width", type=int, default=160, help="trim reasons to this many characters")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="VAR=VALUE",
        help="set this variable for every script (repeatable)",
    )
    p.add_argument(
        "--as-job",
        action="store_true",
        help="dry-run in the folder the script called train.py from, with the PYTHONPATH of its "
        "--runtime-env-json and that folder, as its Ray job would (default: in --project-dir, "
        "no PYTHONPATH)",
    )
    a = p.parse_args(argv)
    given = {}
    for item in a.set:
        var, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", var):
            p.error(f"--set {item}: expected VAR=VALUE")
        given[var] = value
    if not a.slime_dir.is_dir():
        p.error(f"--slime-dir {a.slime_dir}: not a directory")
    if shutil.which("bash") is None:
        p.error("bash is not on PATH")
    o = Options(a.slime_dir, a.project_dir, a.python, a.script_timeout, a.train_timeout, given, a.as_job)
    rows = measure(o, a.jobs, a.only)
    print(table(rows, a.width))
    print(summary(rows))
    if a.json:
        a.json.write_text(
            json.dumps([{**asdict(r), "only_missing_inputs": r.only_missing_inputs} for r in rows], indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
