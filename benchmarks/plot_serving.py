"""Latency vs load from several `benchmarks/serving.py --result-json` runs (one per request rate):
TTFT and ITL p50/p99 against the achieved request throughput, one PNG (needs the `bench` extra).

    for r in 0.05 0.1 0.2; do
      python benchmarks/serving.py --request-rate $r --no-baseline --result-json rate-$r.json
    done
    python benchmarks/plot_serving.py rate-*.json -o latency_vs_load.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", type=Path, help="serving.py --result-json files")
    p.add_argument("-o", "--output", type=Path, default=Path("latency_vs_load.png"))
    args = p.parse_args()

    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    runs = sorted((json.loads(f.read_text()) for f in args.results),
                  key=lambda r: r["serving"]["request_throughput"])
    load = [r["serving"]["request_throughput"] for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, title in ((axes[0], "ttft_s", "time to first token"),
                              (axes[1], "itl_s", "inter-token latency")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(load, [r["serving"][metric][q] * 1000 for r in runs], style, label=q)
        ax.set_xlabel("achieved requests / s")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend()
        ax.grid(alpha=0.3)
    first = runs[0]
    fig.suptitle(f"jaxserve serving, {first['workload']['requests']} requests per point; "
                 f"{first['machine'].split(',')[0]}, {first['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
