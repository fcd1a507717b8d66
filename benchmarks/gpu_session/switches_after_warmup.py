"""Per benchmark cell of an engine_bench log: the switches and fits logged after its warm-up ended, which
fell in its timed runs (the forty-fourth GPU session had two in every planned cell that re-planned).

    python3 benchmarks/gpu_session/switches_after_warmup.py $OUT/abba.log

A cell ends at its result line ("MODEL ENGINE BUDGET: {...}"); its warm-up at "warm-up done" (a cell
without that line either had nothing to warm, a fixed placement, or ran out of warm-up rounds: its
"warm-up ended" warning is printed).
"""

import re
import sys

RESULT = re.compile(r"^\S+ \S+ (\S+) (\S+) (\S+): \{'placement'")
AFTER = ("reconfigured to", "planning again", "the plan in force goes on", "warm-up ended")


def cells(lines: list[str]) -> list[dict]:
    """Each cell's name and the lines after its warm-up that name a switch, a fit or a kept plan."""
    out, warmed, seen = [], False, []
    for line in lines:
        result = RESULT.match(line)
        if result:
            out.append({"cell": " ".join(result.groups()[1:]), "warmed": warmed, "after": seen})
            warmed, seen = False, []
        elif "warm-up done" in line:
            warmed, seen = True, []
        elif any(marker in line for marker in AFTER) and (warmed or "warm-up ended" in line):
            seen.append(line[:200])
    return out


def main(path: str) -> None:
    for cell in cells(open(path).read().splitlines()):
        switches = sum("reconfigured to" in line for line in cell["after"])
        print(f"{cell['cell']}: {'warm-up done' if cell['warmed'] else 'no warm-up line'}, "
              f"{switches} switch(es) after it")
        for line in cell["after"]:
            print("   ", line)


if __name__ == "__main__":
    main(sys.argv[1])
