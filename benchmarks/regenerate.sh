#!/usr/bin/env bash
# Regenerates every file in benchmarks/results/ (the figures README.md and benchmarks/README.md quote)
# on this machine with the CPU ranks' transports: the library's default and gloo point-to-point
# (--transport tcp), 2 and 4 ranks; the agreement check's cost; the training step; the cross-node
# bytes of the flat and hierarchical all-reduce (simulated nodes). Run it on an otherwise idle machine
# (about an hour on 2 vCPUs), then copy the ratios into README.md's table.
# Usage: bash benchmarks/regenerate.sh [extra arguments for every python -m ringreduce.bench run]
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results
mkdir -p "$out"
python -c "import ringreduce; print('# ringreduce', ringreduce.build_info())"

sweep() {  # NAME ARGS...: one sweep, its table, JSON and plot
  local name=$1; shift
  python -m ringreduce.bench "$@" --json "$out/$name.json" --plot "$out/$name.png" | tee "$out/$name.txt"
}

# All-reduce sweeps: the default sizes at 2 ranks, the target sizes (1, 16, 64 MiB) at 4 ranks.
sweep cpu-2ranks "${@}"
sweep cpu-4ranks -b 1M -e 64M -f 4 --nproc 4 "${@}"
sweep cpu-2ranks-tcp --transport tcp "${@}"
sweep cpu-4ranks-tcp -b 1K -e 64M -f 4 --nproc 4 --transport tcp "${@}"
# A 16-bit wire (--wire-dtype bf16) beside float32 ringreduce and DDP's bf16_compress_hook, shared
# memory, the sizes of its target (docs/design.md section 5), 2 and 4 ranks.
sweep cpu-2ranks-wire-bf16 -b 16M -e 64M -f 4 --wire-dtype bf16 "${@}"
sweep cpu-4ranks-wire-bf16 -b 16M -e 64M -f 4 --nproc 4 --wire-dtype bf16 "${@}"
# The same over gloo point-to-point, where the wire's bytes travel.
sweep cpu-2ranks-tcp-wire-bf16 -b 16M -e 64M -f 4 --wire-dtype bf16 --transport tcp --seconds 3 "${@}"
sweep cpu-4ranks-tcp-wire-bf16 -b 16M -e 64M -f 4 --nproc 4 --wire-dtype bf16 --transport tcp --seconds 3 "${@}"
# What the agreement check costs (ringreduce with and without it, beside gloo), gloo transport.
python -m ringreduce.bench -b 8 -e 1M -f 4 --check-cost --seconds 3 --transport tcp "${@}" \
  --json "$out/cpu-2ranks-check-cost.json" | tee "$out/cpu-2ranks-check-cost.txt"
# Training step: DDP, DDP + ddp_comm_hook, GradientAverager and the hand-written loops, 2 ranks.
python -m ringreduce.bench.train_step --json "$out/train-step-2ranks.json" | tee "$out/train-step-2ranks.txt"
# Cross-node bytes of the flat and the hierarchical all-reduce on simulated nodes.
python -m ringreduce.bench.traffic --nproc 4 --local-size 2 --size 16M \
  --json "$out/traffic_4x2.json" | tee "$out/traffic_4x2.txt"
python -m ringreduce.bench.traffic --nproc 8 --local-size 4 --size 4M --iters 3 \
  --json "$out/traffic_8x4.json" | tee "$out/traffic_8x4.txt"
