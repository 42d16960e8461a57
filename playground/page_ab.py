"""`python -m playground.page_ab BASE`: what a page-side change costs the browser, this tree against a commit.

On a 2-core VM whose speed drifts by a third between minutes, `playground.browser_bench`'s page /
engine ratios cannot separate a 10-20 % page-side change (per-repeat ratios ran 0.62-1.35 in
sessions 38-39). This runs both trees side by side instead: a playground server from this working
tree and one from BASE (a `git worktree` of it, removed afterwards), each watched by a headless
Chromium of its own, and alternates single page runs between them at the Generate tab's defaults,
so drift lands on both alike. Per method and tree it prints the medians of: the CPU Chromium spent
from the click to "finished" (that browser's process tree only, from /proc: the steadiest measure
of a page-side change here), the page's decode tok/s (its status line) and time to first token.

Run by hand on a quiet machine (not in CI): `flock -x /tmp/specplay-cpu.lock python -m
playground.page_ab HEAD~1 --methods ar,cactus --runs 8`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from playground.browser_bench import (CHROMIUM, CHROMIUM_ARGS, ROOT, cpu_name, free_port, open_page, page_run,
                                      settle, start_server)
from playground.limits import UI_METHODS

ARM_SWITCH = "--specplay-arm="  # Chromium ignores switches it does not know; its children inherit none


def process_table() -> dict[int, tuple[int, int, bytes]]:
    """pid -> (parent pid, user + system clock ticks, command line) of every live process."""
    table = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            stat, cmdline = (d / "stat").read_text(), (d / "cmdline").read_bytes()
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        table[int(d.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]), cmdline)
    return table


def tree_ticks(table: dict[int, tuple[int, int, bytes]], marker: bytes) -> int:
    """Clock ticks of every process whose command line holds `marker`, and of all their descendants."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(pid)
    todo = [pid for pid, (_, _, cmdline) in table.items() if marker in cmdline]
    seen: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo.extend(children.get(pid, ()))
    return sum(table[pid][1] for pid in seen)


def browser_seconds(arm: str) -> float:
    """CPU seconds so far of the Chromium launched for `arm` (its whole process tree)."""
    return tree_ticks(process_table(), f"{ARM_SWITCH}{arm}".encode()) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="the commit to compare this working tree with (e.g. HEAD~1)")
    ap.add_argument("--pair", default="default", choices=("default", "tiny"))
    ap.add_argument("--methods", default="ar,cactus")
    ap.add_argument("--runs", type=int, default=8, help="page runs per method and tree")
    args = ap.parse_args(argv)
    from playwright.sync_api import sync_playwright

    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(UI_METHODS))
    if unknown:
        ap.error(f"unknown methods {unknown}: choose from {', '.join(UI_METHODS)}")
    logs = ROOT / "artifacts"
    logs.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="page-ab-") as scratch:
        base_tree = Path(scratch) / "base"
        checkout = subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), args.base], cwd=ROOT,
                                  capture_output=True, text=True)
        if checkout.returncode:
            ap.error(f"cannot check out {args.base!r}: {checkout.stderr.strip()}")
        trees = {"base": base_tree, "this": ROOT}
        servers, results = {}, {}
        try:
            for arm, tree in trees.items():
                port = free_port()
                servers[arm] = (start_server(args.pair, port, logs / f"page-ab-{arm}.log", root=tree), port)
            with sync_playwright() as p:
                pages = {}
                for arm, (_, port) in servers.items():
                    browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS + [ARM_SWITCH + arm])
                    pages[arm] = open_page(browser, f"http://127.0.0.1:{port}")
                    for method in methods:  # warm-up: a new page's first run starts with its AR reference run
                        page_run(pages[arm], method)
                settle()
                for i in range(args.runs):
                    for method in methods:
                        for arm in (("base", "this") if i % 2 == 0 else ("this", "base")):
                            r = page_run(pages[arm], method, lambda arm=arm: browser_seconds(arm))
                            results.setdefault((method, arm), []).append(r)
                            print(f"run {i + 1} {method} {arm}: Chromium {r['browser_cpu_ms']:.0f} ms, "
                                  f"page {r['page_tps']:.1f} tok/s", flush=True)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(timeout=30)
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, capture_output=True)
    print(f"this tree against {args.base}, {args.runs} alternated runs each, medians; CPU: {cpu_name()}")
    print(f"{'method':8} {'tree':5} {'Chromium ms/run':>15} {'page tok/s':>10} {'1st token s':>11}  Chromium ms per run")
    for (method, arm), rs in results.items():
        cpu = [r["browser_cpu_ms"] for r in rs]
        print(f"{method:8} {arm:5} {statistics.median(cpu):15.0f} {statistics.median(r['page_tps'] for r in rs):10.1f} "
              f"{statistics.median(r['first_token_s'] for r in rs):11.2f}  " + " ".join(f"{c:.0f}" for c in cpu))
    return 0


if __name__ == "__main__":
    sys.exit(main())
