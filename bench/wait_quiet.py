"""Wait until the CPU is quiet (other processes use little of it), so a benchmark starts on an idle machine.

    python bench/wait_quiet.py [--busy 0.15] [--max-wait 300]

Samples /proc/stat over 2 s; returns as soon as the busy share of all cores is below --busy, or after --max-wait
seconds (then it says so on stderr: the numbers that follow were taken on a shared machine). Linux only; elsewhere
it returns at once.
"""

from __future__ import annotations

import argparse
import sys
import time


def busy_share(interval: float = 2.0) -> float:
    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        idle = values[3] + values[4]  # idle + iowait
        return sum(values), idle

    total0, idle0 = read()
    time.sleep(interval)
    total1, idle1 = read()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--busy", type=float, default=0.15)
    parser.add_argument("--max-wait", type=float, default=300)
    args = parser.parse_args()
    try:
        start = time.monotonic()
        while True:
            share = busy_share()
            if share < args.busy:
                return
            if time.monotonic() - start > args.max_wait:
                print(f"wait_quiet: CPU still {share:.0%} busy after {args.max_wait:.0f} s; measuring anyway",
                      file=sys.stderr)
                return
    except OSError:
        return


if __name__ == "__main__":
    main()
