#!/usr/bin/env bash
# Issue 4's read-only H100 measurements in one device call (a few minutes):
#     device tool: run(command="bash benchmarks/device_h100.sh", timeout_s=600)
# Writes env.txt, h100.txt, h100.json, p2p.txt and p2p.csv to $OUT (default ./h100-out).
#
# Nothing on the GPU is changed: h100_measure.py reaches NVML through ReadOnlyNVML and hands
# clocks to a dry-run controller; profile-p2p only reads energy; nvidia-smi only queries.
# It needs nothing the device image lacks (torch, nvidia-ml-py, click, msgpack; no Redis,
# pydantic or lowtime). PERSEUS_DEVICE_SIMULATE=1 runs the same steps, short, on the simulated
# GPU (tests/test_device_script.py does, with those packages made unimportable).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-h100-out}"
mkdir -p "$out"
# PYTHON: the interpreter to use (a venv's, say); the device image's python3 by default.
python="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [[ "${PERSEUS_DEVICE_SIMULATE:-0}" == 1 ]]; then
    measure=(--simulate --reps 20 --singles 8 --counter-calls 50 --probe-seconds 1.0)
    p2p=(--gpu simulated --seconds 1.0 --repeats 1 --sample-interval 0.01)
    : >"$out/env.txt"
else
    measure=(--require-gpu)
    p2p=(--gpu nvml --devices 0,0 --seconds 2 --repeats 5)
    nvidia-smi --format=csv --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu \
        | tee "$out/env.txt"
fi
{
    date -u +%FT%TZ
    "$python" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())'
} | tee -a "$out/env.txt"

echo "== benchmarks/h100_measure.py ${measure[*]}"
"$python" benchmarks/h100_measure.py "${measure[@]}" --json "$out/h100.json" 2>&1 | tee "$out/h100.txt"

echo "== perseus profile-p2p ${p2p[*]}"
"$python" -c 'from worker_client.gpu.cli import profile_p2p_command as c; c()' \
    "${p2p[@]}" --csv "$out/p2p.csv" 2>&1 | tee "$out/p2p.txt"
