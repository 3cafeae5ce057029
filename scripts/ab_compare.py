"""Compare the A/B CSVs of `make gpu-check` with AB=1 (scripts/gpu_check.sh): base vs head, per row.

usage: python scripts/ab_compare.py DIR   (DIR: the unpacked gpu_check.tgz)
For moe_lora_layer the time is chain_ms (per layer of the multi-layer graph; graph_ms where the chain is
off), for lora_linear graph_us; each side's median over its rounds, then head / base. A difference
smaller than the spread between one side's rounds (printed) is noise. Not for lora_linear --sweep runs
(several configs share a key there).
"""

from __future__ import annotations

import csv
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

BENCHES = {"moe_lora_layer": (("shape", "M", "variant"), ("chain_ms", "graph_ms"), 1e3),
           "lora_linear": (("shape", "T", "variant", "mode"), ("graph_us",), 1.0)}


def _time(row: dict, cols: tuple[str, ...]) -> float:
    for c in cols:
        v = float(row.get(c) or "nan")
        if not math.isnan(v):
            return v
    return float("nan")


def load(files: list[Path], key_cols, time_cols, scale) -> dict[tuple, list[float]]:
    out: dict[tuple, list[float]] = defaultdict(list)
    for f in files:
        with f.open() as fh:
            for row in csv.DictReader(fh):
                out[tuple(row[c] for c in key_cols)].append(_time(row, time_cols) * scale)
    return out


def compare(d: Path, bench: str) -> list[str]:
    key_cols, time_cols, scale = BENCHES[bench]
    base = load(sorted(d.glob(f"{bench}_base_r*.csv")), key_cols, time_cols, scale)
    head = load(sorted(d.glob(f"{bench}_r*.csv")), key_cols, time_cols, scale)
    lines = []
    for key in sorted(set(base) & set(head), key=lambda k: [int(x) if x.isdigit() else x for x in k]):
        b, h = statistics.median(base[key]), statistics.median(head[key])
        spread = max(max(v) / min(v) - 1 for v in (base[key], head[key]))
        lines.append(f"{bench:14s} {' '.join(key):40s} base {b:9.1f} us  head {h:9.1f} us  head/base {h / b:6.3f}"
                     f"  (rounds spread {spread * 100:4.1f} %)")
    return lines


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__)
        return 2
    lines = [ln for bench in BENCHES for ln in compare(Path(args[0]), bench)]
    print("\n".join(lines) if lines else f"no A/B CSV pairs under {args[0]}")
    return 0 if lines else 1


if __name__ == "__main__":
    sys.exit(main())
