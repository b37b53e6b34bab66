"""Run every bench module present, raw limit first, print one table, write results/latest.json;
after a full run of every module (``make bench``) also put the table into README.md
("Performance") and docs/benchmarks.md ("Latest run"), between ``<!-- bench:begin -->`` and
``<!-- bench:end -->``.

    .venv/bin/python -m bench.run_all [--quick] [--only raw placement ...]
    .venv/bin/python -m bench.run_all --docs    # only re-render the docs from results/latest.json

A module that fails is reported as a row with its error; the others still run. Figures only:
nothing here passes or fails on time.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback

try:
    from . import common
except ImportError:  # run as a script
    import common  # type: ignore[no-redef]

if str(common.HERE) not in sys.path:  # modules written as scripts (`import common`) load too
    sys.path.append(str(common.HERE))

#: in order; the raw limit first so every other figure can be put against it
#: (affinity and policies are in process and take seconds: next to scaling, the other in-process cost)
MODULES = ["raw", "placement", "targets", "scaling", "affinity", "policies", "scaleout", "recovery", "agent", "instances", "peer", "executor", "sidecars",
           "metrics", "autoscale", "health", "scale_down", "footprint"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small sizes (a minute or two)")
    ap.add_argument("--only", nargs="*", default=None, help="module names to run (raw always runs)")
    ap.add_argument("--docs", action="store_true", help="run nothing: re-render README.md and docs/benchmarks.md from results/latest.json")
    args = ap.parse_args()
    if args.docs:
        saved = json.loads((common.RESULTS / "latest.json").read_text())
        if saved.get("quick") or saved.get("only") is not None:
            sys.exit(f"bench/results/latest.json is from `{saved.get('command')}`, not a full `make bench`: docs left alone")
        rows = saved.pop("rows")
        print("updated " + ", ".join(str(p.relative_to(common.ROOT)) for p in common.publish_docs(rows, saved)), file=sys.stderr)
        return
    started = time.time()
    rows: list[common.Row] = []
    timing: dict[str, float] = {}
    errors: dict[str, str] = {}
    for name in MODULES:
        if args.only is not None and name != "raw" and name not in args.only:
            continue
        if not (common.HERE / f"{name}.py").exists():
            continue
        t = time.time()
        print(f"-- bench.{name} ({'quick' if args.quick else 'full'})", file=sys.stderr, flush=True)
        try:
            mod = importlib.import_module(f"bench.{name}")
            out = mod.figures(quick=args.quick)
            if name == "raw":
                common.set_raw(out)
            rows += out
        except Exception as exc:  # one module's failure must not hide the others' figures
            errors[name] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            traceback.print_exc()
            rows.append(common.row(name, "module failed", float("nan"), "", None, errors[name][:300]))
        timing[name] = round(time.time() - t, 1)
    common.print_table(rows, title=f"aios-blocks benchmarks ({'quick' if args.quick else 'full'}, `make bench{'-quick' if args.quick else ''}`)")
    meta = {
        "machine": common.machine_info(),
        "quick": args.quick,
        "command": ("make bench-quick" if args.quick else "make bench") if args.only is None
        else f"python -m bench.run_all {'--quick ' if args.quick else ''}--only {' '.join(args.only)}",
        "only": args.only,
        "seconds": round(time.time() - started, 1),
        "module_seconds": timing,
        "errors": errors,
    }
    path = common.write_results(rows, meta)
    print(f"wrote {path.relative_to(common.ROOT)} ({meta['seconds']} s)", file=sys.stderr)
    if not args.quick and args.only is None:  # only a full run of everything stands for `make bench`
        for doc in common.publish_docs(rows, meta):
            print(f"updated the table in {doc.relative_to(common.ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
