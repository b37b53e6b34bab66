"""Mutation run over the modules whose decisions users rely on (``make mutate``; not in ``make test``).

mutmut 3 (configured in pyproject.toml, ``[tool.mutmut]``) copies the package into ``mutants/``,
mutates the listed files, learns once which test reaches which function, then runs each mutant
against only those tests. This driver picks each module's functions, runs them and prints, per
module, the mutants, how many the tests killed, the score and every survivor (file:line and the
diff). Exit 1 when a module is under ``--fail-under``.

    python tools/mutate.py                        # every module
    python tools/mutate.py -m scaling -m sampling  # some (a name fragment each)
    python tools/mutate.py --survivors             # re-run only what survived last time
    python tools/mutate.py --report                # print the last results, run nothing
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PKG = "src/aios_blocks"
#: the reservation Lua's callers in state/: who writes the capacity the scripts check, who calls
#: them, who reads back what they wrote (the policies' view of a node)
STORE_RESERVATION = ("put_node", "read_nodes", "reserve_gang", "release", "reservation",
                     "reservations_of", "reservations")


@dataclass
class Module:
    name: str
    path: str  # under src/aios_blocks
    globs: list[str]
    results: dict[str, str] = field(default_factory=dict)  # mutant -> status


def modules() -> list[Module]:
    def whole(path: str) -> Module:
        dotted = "aios_blocks." + path.removesuffix(".py").replace("/", ".")
        return Module(path, path, [f"{dotted}.*"])

    store = "aios_blocks.state.store."
    return [
        whole("policies/capacity.py"),
        whole("policies/affinity.py"),
        whole("policies/sampling.py"),
        whole("handlers/lifecycle.py"),
        whole("handlers/scaling.py"),
        Module("state/store.py (reservations)", "state/store.py",
               [f"{store}xǁStoreǁ{f}__mutmut_*" for f in STORE_RESERVATION] + [f"{store}x_node_view__mutmut_*"]),
    ]


#: what the tests did to a mutant; a timeout is a kill (the mutant hung a test), "no tests" is not
DETECTED = {"killed", "timeout", "segfault", "caught by type check"}


def load(mods: list[Module]) -> None:
    from fnmatch import fnmatchcase

    from mutmut.stats import status_by_exit_code

    for m in mods:
        meta = ROOT / "mutants" / PKG / (m.path + ".meta")
        codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
        m.results = {k: status_by_exit_code[v] for k, v in codes.items()
                     if any(fnmatchcase(k, g) for g in m.globs)}


def sync() -> None:
    """mutmut copies the package into mutants/ once and then only re-mutates the mutated files:
    bring every other file there up to date with the tree (the tests are copied anew each run)."""
    import filecmp
    import shutil

    mutated = {str(Path(p)) for p in _config().only_mutate}
    for src in (ROOT / PKG).rglob("*"):
        rel = src.relative_to(ROOT)
        dst = ROOT / "mutants" / rel
        if not src.is_file() or "__pycache__" in rel.parts or str(rel) in mutated:
            continue
        if not dst.exists() or not filecmp.cmp(src, dst, shallow=False):
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


def _config() -> Any:
    import os

    from mutmut.configuration import config

    os.chdir(ROOT)
    return config()


def run(mods: list[Module], max_children: int, survivors_only: bool) -> int:
    names: list[str] = []
    for m in mods:
        if survivors_only and m.results:
            names += [k for k, s in m.results.items() if s not in DETECTED]
        else:
            names += m.globs
    if not names:
        print("nothing to run: no survivors")
        return 0
    cmd = [str(Path(sys.executable).parent / "mutmut"), "run", "--max-children", str(max_children), *names]
    log = ROOT / "mutants" / "mutmut-run.log"
    print("$ mutmut run --max-children", max_children, f"<{len(names)} mutant names or patterns>  (output: {log})",
          flush=True)
    log.parent.mkdir(exist_ok=True)
    with log.open("w") as out:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    tail = [t.strip() for t in log.read_text(errors="replace").replace("\r", "\n").splitlines()]
    print("\n".join(t for t in tail if "mutations/second" in t or "Traceback" in t or "Error" in t or "Failed" in t))
    return rc


def _function_lines(path: Path) -> dict[str, int]:
    """mutmut's mangled function name (x_f, xǁClassǁm) -> the line of its ``def``."""
    out: dict[str, int] = {}
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out[f"x_{node.name}"] = node.lineno
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                    out[f"xǁ{node.name}ǁ{sub.name}"] = sub.lineno
    return out


def survivor_lines(m: Module, mutant: str, lines: dict[str, int]) -> tuple[int, str]:
    """file line of the change and the diff (mutmut's, function-relative)."""
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    diff = get_diff_for_mutant(mutant, path=Path(PKG) / m.path)
    func = mutant.rsplit(".", 1)[-1].split("__mutmut_")[0]
    start = lines.get(func, 0)
    line = start
    hunk = re.search(r"^@@ -(\d+)", diff, re.M)
    if hunk:
        at = int(hunk.group(1))
        for text in diff[hunk.end():].splitlines()[1:]:
            if text.startswith("-"):
                break
            if not text.startswith("+"):
                at += 1
        line = start + at - 1
    body = "\n".join(t for t in diff.splitlines() if t[:1] in "+-" and not t.startswith(("+++", "---")))
    return line, body


def report(mods: list[Module], show_diffs: bool) -> list[tuple[str, float]]:
    rows: list[tuple[str, float]] = []
    print(f"\n{'module':34} {'mutants':>8} {'killed':>7} {'no tests':>9} {'survived':>9} {'score':>7}")
    for m in mods:
        total = len(m.results)
        killed = sum(s in DETECTED for s in m.results.values())
        no_tests = sum(s == "no tests" for s in m.results.values())
        pending = sum(s == "not checked" for s in m.results.values())
        score = 100.0 * killed / total if total else 0.0
        extra = f"  ({pending} not run)" if pending else ""
        print(f"{m.name:34} {total:8} {killed:7} {no_tests:9} {total - killed - no_tests:9} {score:6.1f}%{extra}")
        rows.append((m.name, score))
    for m in mods:
        left = sorted((k for k, s in m.results.items() if s not in DETECTED),
                      key=lambda k: (k.split("__mutmut_")[0], int(k.rsplit("_", 1)[1])))
        if not left:
            continue
        print(f"\n== {m.name}: {len(left)} not killed")
        lines = _function_lines(ROOT / PKG / m.path)
        for k in left:
            line, body = survivor_lines(m, k, lines) if show_diffs else (0, "")
            print(f"-- {PKG}/{m.path}:{line}  {k.rsplit('.', 1)[-1]}  [{m.results[k]}]")
            if body:
                print("   " + body.replace("\n", "\n   "))
    return rows


def write_docs(mods: list[Module]) -> None:
    """The figures table between docs/testing.md's markers (a full run's; the run's date, commit)."""
    import datetime

    doc = ROOT / "docs" / "testing.md"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    lines = [f"Run {datetime.date.today().isoformat()}, commit {commit}, `make mutate` (mutmut 3, two children):", "",
             "| module | mutants | killed | no test reaches it | survived | score |", "|---|---:|---:|---:|---:|---:|"]
    for m in mods:
        total = len(m.results)
        killed = sum(s in DETECTED for s in m.results.values())
        no_tests = sum(s == "no tests" for s in m.results.values())
        score = 100.0 * killed / total if total else 0.0
        lines.append(f"| `{m.name}` | {total} | {killed} | {no_tests} | {total - killed - no_tests} | {score:.1f} % |")
    text = doc.read_text()
    start, end = "<!-- mutate:start -->", "<!-- mutate:end -->"
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    doc.write_text(head + start + "\n" + "\n".join(lines) + "\n" + end + tail)
    print(f"figures written to {doc.relative_to(ROOT)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--module", action="append", default=[],
                    help="a module to run (a fragment of its name: capacity, store...); repeatable")
    ap.add_argument("--max-children", type=int, default=2, help="mutants tested at once (default 2)")
    ap.add_argument("--survivors", action="store_true", help="re-run only the mutants not killed last time")
    ap.add_argument("--report", action="store_true", help="print the last results, run nothing")
    ap.add_argument("--no-diff", action="store_true", help="list survivors without their diffs")
    ap.add_argument("--fail-under", type=float, default=80.0, help="exit 1 when a module scores less (%%)")
    ap.add_argument("--write-docs", action="store_true", help="write the figures into docs/testing.md (every module)")
    args = ap.parse_args(argv)
    mods = [m for m in modules() if not args.module or any(f in m.name for f in args.module)]
    if not mods:
        ap.error(f"no module matches {args.module}")
    sys.path.insert(0, str(ROOT))
    load(mods)
    if not args.report:
        if (ROOT / "mutants").exists():
            sync()
        rc = run(mods, args.max_children, args.survivors)
        if rc not in (0, 1):  # mutmut exits 0 when done; anything else: it could not run the tests
            print(f"mutmut failed (exit {rc})")
            return rc
        load(mods)
    import os

    os.chdir(ROOT)
    rows = report(mods, show_diffs=not args.no_diff)
    if args.write_docs:
        write_docs(mods)
    low = [name for name, score in rows if score < args.fail_under]
    print(f"\nunder {args.fail_under:.0f} %: {', '.join(low)}" if low else f"\nevery module at or over {args.fail_under:.0f} %")
    return 1 if low else 0


if __name__ == "__main__":
    sys.exit(main())
