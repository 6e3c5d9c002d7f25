"""CPU seconds of whole commands, paired run by run (benchmarks/RESULTS.md, "Importing the package and `gated-qwen
--help`").

    python benchmarks/import_time.py ROUNDS NAME COMMAND [NAME COMMAND ...]

Each COMMAND (a shell command line) runs once to warm up, then ROUNDS rounds run every command in turn (A B A B ...),
so that a load on the machine falls on all of them alike. A run's CPU seconds are its user + sys time, from
`resource.getrusage(RUSAGE_CHILDREN)` before and after it. Prints, per command, the median CPU and wall seconds and
every run's CPU seconds.
"""

import resource
import statistics
import subprocess
import sys
import time


def run(command: str) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one run of `command`, its output discarded."""
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(command, shell=True, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, wall


def main(argv: list[str]) -> None:
    rounds, pairs = int(argv[0]), list(zip(argv[1::2], argv[2::2], strict=True))
    for _, command in pairs:
        run(command)
    runs = {name: [] for name, _ in pairs}
    for _ in range(rounds):
        for name, command in pairs:
            runs[name].append(run(command))
    for name, measured in runs.items():
        cpu, wall = (statistics.median(r[i] for r in measured) for i in (0, 1))
        print(f"{name}\tcpu {cpu:.3f}\twall {wall:.3f}\t" + " ".join(f"{r[0]:.2f}" for r in measured))


if __name__ == "__main__":
    main(sys.argv[1:])
