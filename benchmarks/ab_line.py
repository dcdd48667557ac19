"""One line of an alternating A/B run (benchmarks/ab_env.sh, benchmarks/ab_commits.sh): for each size
of a `python -m ringreduce.bench --json` file, ringreduce's and the stock backend's median time and
their ratio, measured side by side in that run.

    python benchmarks/ab_line.py RUN.json LABEL ROUND
"""
import json
import sys


def main() -> None:
    path, label, round_index = sys.argv[1:4]
    with open(path) as f:
        d = json.load(f)
    rr = {x["size"]: x["time_us"] for x in d["rows"] if x["impl"] == "ringreduce"}
    st = {x["size"]: x["time_us"] for x in d["rows"] if x["impl"] == d["stock"]}
    cells = "  ".join(f"{s}: {rr[s]:.0f}/{st[s]:.0f} = {rr[s] / st[s]:.3f}" for s in sorted(rr))
    print(f"{label:<20} round {round_index} ({d['world_size']} ranks)  {cells}", flush=True)


if __name__ == "__main__":
    main()
