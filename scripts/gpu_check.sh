#!/bin/bash
# The GPU paths on a machine with an NVIDIA GPU: the preflight job, the GPU tests, the mixed-precision
# bench. Run from the repository root with a Python that has torch with CUDA: PY=python3 OUT=/tmp/gpu-check
# bash scripts/gpu_check.sh (writes nvidia-smi -q -x and the preflight log into $OUT).
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 OMP_NUM_THREADS=4
PY=${PY:-python3}
OUT=${OUT:-/tmp/devout}; mkdir -p $OUT
date -u; nvidia-smi -L 2>&1; $PY -c "import torch; print('torch', torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name(0))"
nvidia-smi -q -x > $OUT/nvidia-smi-q-x.xml 2>/dev/null; which dcgmi || echo "no dcgmi"
echo "== preflight job, 1 node"
SECONDS=0
timeout 120 $PY -m torch.distributed.run --nproc-per-node 1 --standalone harness/fitness.py --expect-world-size 1 > $OUT/preflight.log 2>&1; echo "rc=$? in ${SECONDS}s"
tail -3 $OUT/preflight.log | cut -c1-300
$PY - <<'PYEOF'
import json, os
from node import fitness
report = fitness.report_line(open(os.environ.get("OUT", "/tmp/devout") + "/preflight.log").read())
print("report:", json.dumps(report)[:2500] if report else None)
print("verdicts:", json.dumps({k: (v.__dict__ if hasattr(v, "__dict__") else str(v)) for k, v in fitness.judge(report).items()} if report else None, default=str)[:1500])
PYEOF
echo "== the one GPU reader (node/nvml.py, NVML through ctypes) beside nvidia-smi -q -x; a run's sampler for 3 s"
$PY - <<'PYEOF'
import json, os, time
from node import fitness, nvml
through_nvml = nvml.preflight_gpus()
smi = fitness.nvidia_smi_gpus(open(os.environ.get("OUT", "/tmp/devout") + "/nvidia-smi-q-x.xml").read())
print("nvml:", json.dumps(through_nvml)[:1500])
moving = ("sm_clock_mhz", "clock_event_reasons")  # read a moment apart: may differ
print("differ from nvidia-smi:", [(k, a[k], b.get(k)) for a, b in zip(through_nvml or [], smi) for k in a if k not in moving and a[k] != b.get(k)])
found = []
with nvml.Sampler(found.append, "node-0", interval_s=1):
    time.sleep(3.5)
print("sampled:", len(found), "records; last:", json.dumps(found[-1]) if found else None)
PYEOF
echo "== GPU tests"
SECONDS=0
timeout 170 $PY -m pytest -m gpu tests/integration/test_harness.py tests/integration/test_lab.py -q -p no:cacheprovider -o addopts="-ra" 2>&1 | tail -12; echo "in ${SECONDS}s"
echo "== bench gpu"
SECONDS=0
timeout 170 $PY -m bench gpu 2>&1 | tail -20; echo "in ${SECONDS}s"
echo "== the straggler verdict's input on CUDA: the rank monitor's compute entries (CUDA-event forward times)"
rm -rf /tmp/gpu-progress; mkdir -p /tmp/gpu-progress; SECONDS=0
CLUSTER_PROGRESS_DIR=/tmp/gpu-progress TORCH_FR_BUFFER_SIZE=2000 PYTHONPATH="node/rankhook:.:$PYTHONPATH" \
  timeout 120 $PY -m torch.distributed.run --standalone --nproc-per-node 1 examples/ddp_training.py \
  --model transformer --steps 200 --log-every 100 2>&1 | tail -3; echo "in ${SECONDS}s"
$PY -c "
import json; r = json.load(open('/tmp/gpu-progress/rank-0.json'))
c = r.get('compute') or []
print('steps reported', len(c), 'last step', r.get('step'), 'forward ms (last 5):', [round(s * 1000, 3) for _, s in c[-5:]])"
echo "== ddp_training --replicas 2 on CUDA (both groups on this GPU), group 1 killed and started again"
SECONDS=0
timeout 200 $PY scripts/gpu_replicas_check.py --out /tmp/gpu-replicas 2>&1 | grep -v "INFO\|WARN"; echo "in ${SECONDS}s"
