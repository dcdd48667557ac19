#!/usr/bin/env bash
# Regenerates every figure quoted in README.md and benchmarks/README.md (CPU, this machine):
# the default 2-rank sweep, the DESIGN.md section 5 sizes at 4 ranks, the agreement-check cost and
# the training-step comparison, and the cross-node bytes of the flat and hierarchical rings
# (simulated nodes), and the latency breakdown (twice: the VM is noisy). Run it on an otherwise
# idle machine; it takes about 35 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results
mkdir -p "$out"
python -m ringreduce.bench --json "$out/cpu-2ranks.json" --plot "$out/cpu-2ranks.png" | tee "$out/cpu-2ranks.txt"
python -m ringreduce.bench -b 1M -e 64M -f 4 --nproc 4 --json "$out/cpu-4ranks.json" \
  --plot "$out/cpu-4ranks.png" | tee "$out/cpu-4ranks.txt"
python -m ringreduce.bench -b 8 -e 1M -f 4 --check-cost --seconds 3 \
  --json "$out/cpu-2ranks-check-cost.json" | tee "$out/cpu-2ranks-check-cost.txt"
python -m ringreduce.bench.train_step --json "$out/train-step-2ranks.json" | tee "$out/train-step-2ranks.txt"
python -m ringreduce.bench.traffic --nproc 4 --local-size 2 --size 16M \
  --json "$out/traffic_4x2.json" | tee "$out/traffic_4x2.txt"
python -m ringreduce.bench.traffic --nproc 8 --local-size 4 --size 4M --iters 3 \
  --json "$out/traffic_8x4.json" | tee "$out/traffic_8x4.txt"
python benchmarks/latency_breakdown.py "$out/latency_breakdown.json" | tee "$out/latency_breakdown.txt"
python benchmarks/latency_breakdown.py "$out/latency_breakdown_run2.json" | tee "$out/latency_breakdown_run2.txt"
# Note [Receives before the verdict] (csrc/torch/cpu_group.cpp): the first segment before the
# verdict (default) against after it (RINGREDUCE_LEAD=0), alternating, 3 runs each.
bash benchmarks/ab_env.sh RINGREDUCE_LEAD 0 2 3 -b 1K -e 1M -f 32 --seconds 2 | tee "$out/lead-ab-2ranks.txt"
bash benchmarks/ab_env.sh RINGREDUCE_LEAD 0 2 3 -b 1M -e 1M --seconds 3 --nproc 4 | tee "$out/lead-ab-4ranks.txt"
# CPU time per call by thread (main, ringreduce's worker, gloo's threads), 4 ranks on this machine's
# CPUs: docs/algorithm.md, "What bounds the rest".
for round in 1 2; do
  for impl in "gloo" "rr --check 1" "rr --check 0"; do
    python benchmarks/profile_loop.py --impl $impl --nproc 4 --size 1M --iters 300 --cpu-by-thread
  done
done | tee "$out/cpu-by-thread-4ranks.txt"
# Python's share of a call: ringreduce.all_reduce_avg with the native submit stubbed out.
python benchmarks/python_overhead.py | tee "$out/python-overhead.txt"
# Where single barrier-aligned calls lose their time (RINGREDUCE_TRACE=1), 4 and 2 ranks, check off.
{ python benchmarks/trace_calls.py --nproc 4 --size 1M --calls 30 --check 0
  python benchmarks/trace_calls.py --nproc 2 --size 1M --calls 30 --check 0; } | tee "$out/trace-calls.txt"
# Note [Staging slots] (csrc/core/plan.h) and the interleaving effects (benchmarks/README.md,
# "Interleaving"): barrier-aligned calls with the CPU split, this build against 14a95a7 (the build
# before the automatic slots) and against 4 slots; the interleaved stream split by predecessor; gloo's
# mode after ringreduce's calls and after its own.
bash benchmarks/ab_script.sh 14a95a7 3 benchmarks/cpu_split.py --nproc 4 --size 1M --iters 120 \
  | tee "$out/cpu-split-ab-4ranks.txt"
python benchmarks/cpu_split.py --nproc 4 --size 1M --iters 120 --variant slots4=RINGREDUCE_SLOTS=4 \
  --variant slots4-nocheck=RINGREDUCE_SLOTS=4,RINGREDUCE_CHECK=0 | tee "$out/cpu-split-slots-4ranks.txt"
bash benchmarks/ab_script.sh 14a95a7 3 benchmarks/interleave_split.py --nproc 4 --size 1M \
  | tee "$out/interleave-split-ab-4ranks.txt"
{ bash benchmarks/ab_script.sh 14a95a7 2 benchmarks/gloo_mode.py --nproc 4 --size 1M --calls 600
  for round in 1 2; do python benchmarks/gloo_mode.py --nproc 4 --size 1M --calls 600 --between gloo; done
} | tee "$out/gloo-mode-4ranks.txt"
