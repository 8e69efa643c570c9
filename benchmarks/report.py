"""Turns a results JSON of :mod:`benchmarks.run` into a Markdown table and a PNG plot.

``python -m benchmarks.report RESULTS.json`` rewrites ``RESULTS.md`` and ``RESULTS.png`` beside
it; ``--readme`` prints the compact table of the README; ``--merge OUT.json A.json B.json``
joins the runs of one device (e.g. a suite split with --only) into one result; ``--floors
COPY_GBPS GEMM_TFLOPS`` prints the bytes and FLOP floors of the headline shapes.

Derived columns (:func:`derive`), per row with a time:
  ratio_limit  time / the best correct time of the case's limit (GEMM alone; GDPA alone).
  ratio_xla    time / the "xla" implementation's time of the same case.
  hidden       (T_xla − T) / (T_xla − T_limit): the share of the norm's latency hidden.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

OP_TITLES = {
    "gemm": "GEMM alone (the limit of the fused GEMMs)",
    "norm_matmul": "Pre-norm GEMM: norm(x)·γ (+β) @ W",
    "matmul_norm": "Post-norm GEMM: norm(x @ W (+ r))·γ (+β)",
    "gdpa": "GDPA (jagged, dense KV)",
    "flash_norm_attention": "PFFN block: LN → GDPA (+u) → RMSNorm (+q)",
    "rms_norm": "RMSNorm alone",
    "layer_norm": "LayerNorm alone",
    "train_step": "End-to-end train step (Kunlun-style model)",
}


TIMED = ("ok", "imprecise")  # "imprecise": an XLA baseline over the tolerance, still timed


def _best_time(rows: list[dict]) -> float | None:
  times = [r["time_us"] for r in rows if r["status"] in TIMED and r["time_us"] is not None]
  return min(times) if times else None


def derive(rows: list[dict]) -> list[dict]:
  """Adds limit_us, ratio_limit, ratio_xla and hidden to ``rows`` in place (None where the
  quantity does not exist, or where the rows were timed by different timers: a row with its
  own ``timer``, the wall-clock fallback of :func:`benchmarks.run._time_rows`) and returns
  them."""
  by_case: dict[str, list[dict]] = {}
  for r in rows:
    by_case.setdefault(r["case"], []).append(r)
  for r in rows:
    peers = by_case[r["case"]]
    timer = r.get("timer")  # set only on rows timed otherwise than the run (a wall fallback)
    xla = next((p["time_us"] for p in peers if p["impl"] == "xla" and p["status"] in TIMED
                and p.get("timer") == timer), None)
    limit = None if timer else _best_time(by_case.get(r.get("limit_case") or "", []))
    t = r["time_us"] if r["status"] in TIMED else None
    r["limit_us"] = limit
    r["ratio_limit"] = t / limit if t is not None and limit else None
    r["ratio_xla"] = t / xla if t is not None and xla else None
    hidden = None
    if t is not None and r["impl"] != "xla" and xla and limit and xla > limit:
      hidden = (xla - t) / (xla - limit)
    r["hidden"] = hidden
  return rows


def _num(x, fmt="{:.1f}") -> str:
  return "" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _status(r: dict) -> str:
  s = r["status"]
  if s == "ok":
    return "ok" if r.get("rel_err") is None else f"ok ({r['rel_err']:.1e})"
  if s == "wrong":
    return f"**wrong** ({_num(r.get('rel_err'), '{:.2e}')})"
  if s == "imprecise":
    return f"imprecise ({_num(r.get('rel_err'), '{:.2e}')}), timed as the baseline"
  msg = (r.get("message") or "").replace("|", "/")
  if msg.startswith(f"{s}:"):  # e.g. "skipped: time budget ..." already names the status
    msg = msg[len(s) + 1:].strip()
  return f"{s}: {msg[:120]}" if msg and s != "n/a" else s


def _header(results: dict) -> list[str]:
  c = results.get("ceilings") or {}
  selection = ("quick", "only", "interpret", "tiny", "impls")  # what changes the cases run
  flags = ", ".join(f"{k}={v}" if not isinstance(v, bool) else k
                    for k, v in (results.get("flags") or {}).items()
                    if k in selection and v) or "full suite"
  commit = results.get("git_commit", "unknown")
  if results.get("git_dirty"):
    commit += " (with uncommitted changes)"
  run = f"commit {commit}, wall {results.get('wall_s')} s"
  if prev := results.get("resumed_from"):
    # --resume keeps the finished cases of an earlier run: most rows may come from it.
    run = (f"cases kept from a run of commit {prev.get('git_commit')} ({prev.get('date')}, "
           f"wall {prev.get('wall_s')} s), the rest resumed at {run}")
  lines = [f"# Benchmarks on {results.get('device')}", "",
           f"jax {results.get('jax_version')}, {results.get('date')}, {run}, "
           f"timer **{results.get('timer')}** ({results.get('iterations')} iterations, median), "
           f"flags: {flags}.", ""]
  if later := (results.get("merged_from") or [])[1:]:
    lines += [f"Merged with {len(later)} later run(s) whose rows replace this run's for their "
              "cases (commits " + ", ".join(str(r.get("git_commit"))[:7] for r in later)
              + "; each run's date and flags: the JSON's `merged_from`).", ""]
  if results.get("timer") != "cupti":
    lines += ["**Wall-clock timer: these numbers prove that the suite runs, nothing about "
              "speed.**", ""]
  if c:
    lines += [f"Ceilings: copy {c['copy_GBps']:.0f} GB/s (bytes read + written, "
              f"{c['copy_bytes'] / 1e9:.2f} GB), bf16 GEMM {c['gemm_TFLOPs']:.1f} TFLOP/s "
              f"({'x'.join(map(str, c['gemm_shape']))}). Floor = max(FLOPs / GEMM rate, "
              "bytes / copy bandwidth).", ""]
  return lines


def markdown(results: dict) -> str:
  """The full table, one section per op."""
  rows = derive(results["rows"])
  lines = _header(results)
  ops = list(dict.fromkeys(r["op"] for r in rows))
  for op in ops:
    lines += [f"## {OP_TITLES.get(op, op)}", "",
              "| case | mode | impl | time µs | × limit | × XLA | floor µs | hidden | status |",
              "|---|---|---|---:|---:|---:|---:|---:|---|"]
    mode_order = {"fwd": 0, "fwd+bwd": 1}
    section = sorted((r for r in rows if r["op"] == op),  # stable: impls keep their order
                     key=lambda r: (r["variant"], mode_order.get(r["mode"], 2),
                                    tuple(r["dims"].values())))
    for r in section:
      variant = f"{r['variant']} " if r["variant"] else ""
      lines.append(
          f"| {variant}{r['shape']} | {r['mode']} | {r['impl']} | {_num(r['time_us'])} | "
          f"{_num(r['ratio_limit'], '{:.2f}')} | {_num(r['ratio_xla'], '{:.2f}')} | "
          f"{_num(r.get('floor_us'))} | {_num(r['hidden'], '{:.0%}')} | {_status(r)} |")
    lines.append("")
  return "\n".join(lines)


FUSED_GEMMS = ("norm_matmul", "matmul_norm")


def _table_row(cells: list[str]) -> str:
  return "| " + " | ".join(cells) + " |"


def readme_table(results: dict, mode: str = "fwd") -> str:
  """Compact table for the README: per case, the limit, XLA and every other implementation,
  each as µs (× limit). Raises ValueError when ``results`` has no row for it in ``mode``."""
  from benchmarks import cases  # the headline set, at full and at tiny (--tiny) shapes
  quick = [c for c in cases.all_cases() if c.quick]
  headline = {c.name for c in quick} | {cases.tiny(c).name for c in quick}
  rows = derive(results["rows"])
  by_case: dict[str, dict[str, dict]] = {}
  for r in rows:
    # Every shape of the fused GEMMs; the attention and norm sweeps only at the headline shape.
    if r["mode"] == mode and (r["op"] in FUSED_GEMMS or r["case"] in headline):
      by_case.setdefault(r["case"], {})[r["impl"]] = r
  if not by_case:
    modes = sorted({r["mode"] for r in rows}) or ["none"]
    raise ValueError(f"no {mode} rows for the README table (modes in the results: "
                     f"{', '.join(modes)})")
  impls = [i for i in dict.fromkeys(r["impl"] for c in by_case.values() for r in c.values())
           if i != "xla"]
  header = ["op", "shape", "limit µs", "XLA µs (× limit)",
            *(f"{i} µs (× limit)" for i in impls), "hidden"]
  lines = [_table_row(header), "|---|---|" + "---:|" * (len(header) - 2)]

  def cell(r):
    if r is None or r["time_us"] is None:
      return "" if r is None else r["status"]
    ratio = f" ({r['ratio_limit']:.2f}×)" if r["ratio_limit"] else ""
    return f"{r['time_us']:.0f}{ratio}"

  for case_rows in by_case.values():
    first = next(iter(case_rows.values()))
    op = f"{first['op']} {first['variant']}".strip()
    best_hidden = max((r["hidden"] for r in case_rows.values() if r["hidden"] is not None),
                      default=None)
    lines.append(_table_row([op, first["shape"], _num(first["limit_us"], "{:.0f}"),
                             cell(case_rows.get("xla")),
                             *(cell(case_rows.get(i)) for i in impls),
                             _num(best_hidden, "{:.0%}")]))
  return "\n".join(lines) + "\n"


def plot(results: dict, path: pathlib.Path) -> bool:
  """Bar chart of time / limit per shape and implementation, one panel per (op, mode) that has
  a limit. Returns False (and writes nothing) without matplotlib or without such rows."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib missing: no plot", file=sys.stderr)
    return False
  rows = [r for r in derive(results["rows"]) if r["ratio_limit"] is not None]
  panels = list(dict.fromkeys((r["op"], r["mode"]) for r in rows))
  if not panels:
    return False
  fig, axes = plt.subplots(len(panels), 1, figsize=(14, 3.2 * len(panels)), squeeze=False)
  for ax, (op, mode) in zip(axes[:, 0], panels):
    sel = [r for r in rows if r["op"] == op and r["mode"] == mode]
    labels = list(dict.fromkeys(f"{r['variant']} {r['shape']}".strip() for r in sel))
    impls = list(dict.fromkeys(r["impl"] for r in sel))
    width = 0.8 / len(impls)
    for j, impl in enumerate(impls):
      val = {f"{r['variant']} {r['shape']}".strip(): r["ratio_limit"] for r in sel
             if r["impl"] == impl}
      xs = [i + j * width for i, lab in enumerate(labels) if lab in val]
      ax.bar(xs, [val[lab] for lab in labels if lab in val], width, label=impl)
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, rotation=20,
                  ha="right", fontsize=7)
    ax.set_ylabel("time / limit")
    ax.set_title(f"{OP_TITLES.get(op, op)}, {mode}", fontsize=9)
    ax.legend(fontsize=7)
  fig.suptitle(f"{results.get('device')}, timer {results.get('timer')}, "
               f"commit {str(results.get('git_commit'))[:10]}", fontsize=10)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def floors_table(copy_gbps: float, gemm_tflops: float) -> str:
  """Bytes and FLOP floors (µs) of the --quick cases and DESIGN.md's baseline shapes."""
  from benchmarks import cases as C
  from benchmarks import run

  wanted = {C.HEADLINE_MKN, (262144, 128, 128), (262144, 512, 2048), (65536, 2048, 2048),
            (16384, 8192, 8192)}
  lines = ["| case | mode | bytes | FLOPs | bytes floor µs | FLOP floor µs |",
           "|---|---|---:|---:|---:|---:|"]
  for case in C.all_cases():
    if case.op in ("norm_matmul", "matmul_norm"):
      if tuple(v for _, v in case.dims) not in wanted:
        continue
    elif not case.quick:
      continue
    prob = C.build(case)
    nbytes = sum(map(run.nbytes, run.abstract_io(prob, case.mode)))
    flops = prob.flops_fwd + (prob.flops_bwd if case.mode == "fwd+bwd" else 0)
    lines.append(f"| {case.key} | {case.mode} | {nbytes / 1e6:.0f} MB | {flops / 1e12:.3f} T | "
                 f"{nbytes / (copy_gbps * 1e3):.0f} | {flops / (gemm_tflops * 1e6):.0f} |")
  return "\n".join(lines) + "\n"


_RUN_KEYS = ("date", "git_commit", "flags", "wall_s")


def _runs_of(part: dict) -> list[dict]:
  """The runs behind one result: its own ``merged_from`` when it is itself a merge (its
  top-level metadata is then its first run's), else its own metadata."""
  return part.get("merged_from") or [{k: part.get(k) for k in _RUN_KEYS}]


def merge(parts: list[dict]) -> dict:
  """One result from several runs on one device: the first run's metadata and ceilings, every
  run's rows (a later run's row replaces an earlier one of the same case and implementation,
  except a row the later run skipped, which keeps the earlier measurement), and
  ``merged_from``: every run behind the parts, in order (a part that is itself a merge
  contributes its whole list, so merging into the main file keeps its history)."""
  devices = {p.get("device") for p in parts}
  if len(devices) != 1:
    raise ValueError(f"cannot merge results of different devices: {sorted(map(str, devices))}")
  merged = dict(parts[0])
  rows: dict[tuple[str, str], dict] = {}
  for p in parts:
    for r in p["rows"]:
      key = (r["case"], r["impl"])
      if r.get("status") == "skipped" and key in rows:
        continue  # a case a later run had no time for is not a new result
      rows[key] = r
  merged["rows"] = list(rows.values())
  merged["merged_from"] = [run for p in parts for run in _runs_of(p)]
  return merged


def _positive_float(text: str) -> float:
  """argparse type: a finite number > 0 (a ceiling divides the bytes and FLOPs)."""
  try:
    x = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
  if not (math.isfinite(x) and x > 0):
    raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
  return x


ROW_KEYS = ("case", "op", "variant", "shape", "dims", "mode", "impl", "status", "time_us")
"""The keys of a suite row that the tables and :func:`derive` read."""


def not_results_reason(part) -> str | None:
  """Why ``part`` (a parsed JSON) is not a results JSON of :mod:`benchmarks.run`, or None: e.g.
  benchmarks.e2e's train-step JSON, whose rows are components, not suite cases. A row without a
  key the tables read raised a KeyError from deep in :func:`derive`."""
  rows = part.get("rows") if isinstance(part, dict) else None
  if not isinstance(rows, list):
    return "no list of 'rows'"
  for i, r in enumerate(rows):
    missing = [k for k in ROW_KEYS if k not in r] if isinstance(r, dict) else list(ROW_KEYS)
    if missing:
      return f"row {i} is not a suite case's: it lacks {', '.join(missing)}"
  return None


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m benchmarks.report",
                              description=__doc__.split("\n")[0])
  p.add_argument("results", nargs="*", type=pathlib.Path, help="results JSON of benchmarks.run")
  p.add_argument("--merge", type=pathlib.Path, metavar="OUT.json",
                 help="merge the given results into OUT.json (then write its md/png)")
  p.add_argument("--readme", action="store_true", help="print the README's performance table")
  p.add_argument("--mode", default="fwd", choices=("fwd", "fwd+bwd"), help="for --readme")
  p.add_argument("--floors", nargs=2, type=_positive_float,
                 metavar=("COPY_GBPS", "GEMM_TFLOPS"),
                 help="print the floors of the headline shapes for these ceilings (> 0)")
  args = p.parse_args(argv)
  if args.floors:
    print(floors_table(*args.floors), end="")
    return
  if not args.results:
    p.error("a results JSON is required (or --floors)")
  parts = []
  for path in args.results:
    try:
      part = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
      p.error(f"cannot read {path}: {e}")
    if problem := not_results_reason(part):
      p.error(f"{path} is not a results JSON of benchmarks.run ({problem}; a train-step JSON "
              "is printed by `python -m benchmarks.e2e --table FILE`)")
    parts.append(part)
  if args.mode != "fwd" and not args.readme:
    p.error("--mode applies to --readme only")
  if args.merge and not args.merge.parent.is_dir():
    p.error(f"--merge: folder {args.merge.parent} does not exist")
  if args.merge:
    try:
      results, path = merge(parts), args.merge
    except ValueError as e:  # e.g. results of different devices
      p.error(f"--merge: {e}")
    path.write_text(json.dumps(results, indent=1) + "\n")
  elif len(parts) == 1:
    results, path = parts[0], args.results[0]
  else:
    p.error("several results need --merge OUT.json")
  if args.readme:
    try:
      table = readme_table(results, args.mode)
    except ValueError as e:  # e.g. --mode fwd+bwd on a forward-only run
      p.error(f"--readme: {path}: {e}")
    print(table, end="")
    return
  md = path.with_suffix(".md")
  md.write_text(markdown(results))
  written = [md]
  png = path.with_suffix(".png")
  if plot(results, png):
    written.append(png)
  print("wrote " + " ".join(map(str, written)))


if __name__ == "__main__":
  main()
