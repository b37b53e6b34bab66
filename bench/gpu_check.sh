#!/usr/bin/env bash
# End-to-end check of the node agent on a real GPU (docs/gpus.md, "Checked on a real GPU").
#
#   bash bench/gpu_check.sh [--sim] [--wheels]
#
# 1. nvidia-smi: -L, the GPUs' index/uuid/name/memory/driver, topo -m;
# 2. our NVML inventory (agent/gpus.py detect(None, "gpu0")), checked against nvidia-smi;
# 3. blocks up (embedded NATS + Redis, no simulated agents), the gpu-probe component for the
#    process runtime (aios_blocks.examples.gpu_probe: imports torch, answers its GPU env, torch's
#    CUDA device 0 and a matmul on it), `blocks agent --runtime process` on node gpu0, one block
#    of 1 instance x 1 GPU submitted with --wait, one task through the executor (NATS and HTTP):
#    the instance must see exactly the GPU reserved for it; then blocks delete, SIGTERM of the
#    agent and of blocks up, and no process left behind.
#
# Without a GPU (no nvidia-smi, or --sim) the agent offers one simulated GPU (--sim-gpus 1) and
# the real-GPU checks are skipped: every other step runs the same. --wheels installs ../.whl/*.whl
# into $SITE (default /tmp/site) first (the device machine, which has no network).
# Prints CHECK ok / CHECK FAIL / CHECK skip lines; exits 1 on any FAIL. Whole run bounded by
# GPU_CHECK_TIMEOUT seconds (default 300). Log: $OUT/gpu_check.log (OUT default /tmp/gpu_check_out).
# Env: PY (default python3), DATA (default /tmp/aios), SITE, OUT.

if [ -z "${GPU_CHECK_INNER:-}" ]; then
    export GPU_CHECK_INNER=1
    exec timeout -k 60 "${GPU_CHECK_TIMEOUT:-300}" bash "$0" "$@"   # 60 s more for the cleanup
fi
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$OUT"
# tee ignores the total timeout's SIGTERM (sent to the whole process group), so the cleanup's lines are kept
exec 3>&1
exec > >(trap '' TERM INT; exec tee "$OUT/gpu_check.log") 2>&1

MODE=auto WHEELS=0
for a in "$@"; do
    case "$a" in
        --sim) MODE=sim ;;
        --wheels) WHEELS=1 ;;
        *) echo "usage: $0 [--sim] [--wheels]"; exit 2 ;;
    esac
done
if [ "$MODE" = auto ]; then
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then MODE=real; else MODE=sim; fi
fi
PY="$(command -v "${PY:-python3}")"
DATA="${DATA:-/tmp/aios}"
SITE="${SITE:-/tmp/site}"
NODE=gpu0 CLUSTER=gpu BID="gpucheck-$(date +%s)"
AGENT_DIR="$DATA/agent-$NODE"
WORK="$DATA.check"   # logs and files of this script (beside the data dir: blocks up owns that one)
FAILS=0 UP_PID="" AGENT_PID="" INSTANCE_PID=""

ok() { echo "CHECK ok: $*"; }
fail() { echo "CHECK FAIL: $*"; FAILS=$((FAILS + 1)); }
skip() { echo "CHECK skip: $*"; }
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
blocks() { "$PY" -m aios_blocks.cli "$@" --data-dir "$DATA"; }
abort() { fail "$*"; echo "aborting: the steps after this one need it"; exit 1; }

step "setup: mode=$MODE root=$ROOT python=$PY data=$DATA"
date -u +"date %Y-%m-%dT%H:%M:%SZ"; uname -nsrm
if [ "$WHEELS" = 1 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$ROOT"/.whl/*.whl \
        || abort "pip install of .whl into $SITE"
    export PYTHONPATH="$SITE:$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
else
    export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
fi
# the probe: the package in src when this checkout has it, else a copy beside this script (gpu_probe/)
PROBE=aios_blocks.examples.gpu_probe
if ! "$PY" -c "import $PROBE" 2>/dev/null; then
    PROBE=gpu_probe
    export PYTHONPATH="$PYTHONPATH:$(cd "$(dirname "$0")" && pwd)"
fi
"$PY" - "$PROBE" <<'EOF' || abort "imports (aios_blocks, the probe)"
import importlib, sys
import aios_blocks.cli.main  # noqa: F401  (the CLI and every dependency it imports)
probe = importlib.import_module(sys.argv[1])
print("python", sys.version.split()[0], "| aios_blocks from", aios_blocks.cli.main.__file__.rsplit("/cli/", 1)[0])
print("probe module", sys.argv[1], "from", probe.__file__)
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda)
except ImportError as exc:
    print("torch absent:", exc)
EOF
rm -rf "$DATA" "$WORK"; mkdir -p "$WORK"

# -- stop everything on the way out (normal end, failure, or the total timeout's SIGTERM) -------
cleanup() {
    trap - EXIT INT TERM
    step "cleanup"
    if [ -n "$UP_PID" ] && kill -0 "$UP_PID" 2>/dev/null && [ -n "${PLACED:-}" ] && [ -z "${DELETED:-}" ]; then
        blocks delete "$BID" --timeout 30 || true
    fi
    [ -n "$UP_PID$AGENT_PID" ] && snapshot_tree
    for p in $AGENT_PID $UP_PID; do
        kill -0 "$p" 2>/dev/null && kill -TERM "$p"
    done
    for p in $AGENT_PID $UP_PID; do  # at most 15 s + 25 s, then leftovers (10 s) kills what is left
        for _ in $(seq 1 $([ "$p" = "$UP_PID" ] && echo 250 || echo 150)); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    done
    leftovers
    if [ "$FAILS" -gt 0 ]; then
        echo; echo "--- logs (on failure)"
        tail -n 30 "$WORK/up.log" "$WORK/agent.log" "$WORK/instance.log" 2>/dev/null
        tail -n 15 "$DATA"/logs/*.log 2>/dev/null
    fi
    echo
    if [ "$FAILS" -eq 0 ]; then echo "RESULT: all checks passed (mode $MODE)"; else echo "RESULT: $FAILS check(s) FAILED (mode $MODE)"; fi
    exit $((FAILS > 0))
}
trap cleanup EXIT
# on a signal the cleanup also goes to a log of its own (and the original stdout), whatever became of the first tee
trap 'exec > >(trap "" TERM INT; exec tee "$OUT/gpu_check_interrupted.log" >&3) 2>&1
      echo "interrupted (signal): cleaning up"; FAILS=$((FAILS + 1)); exit 1' INT TERM

# the processes of this run (blocks up's and the agent's trees, the instance), for the leftover check
snapshot_tree() {
    "$PY" - "$WORK/pids.json" "$UP_PID" "$AGENT_PID" "$INSTANCE_PID" <<'EOF' || true
import json, sys, psutil
seen = {}
for pid in filter(None, sys.argv[2:]):
    try:
        p = psutil.Process(int(pid))
        for q in [p, *p.children(recursive=True)]:
            seen[q.pid] = [q.create_time(), " ".join(q.cmdline())[:160]]
    except psutil.Error:
        continue
old = json.load(open(sys.argv[1])) if __import__("os").path.exists(sys.argv[1]) else {}
old.update({str(k): v for k, v in seen.items()})
json.dump(old, open(sys.argv[1], "w"))
EOF
}

leftovers() {
    "$PY" - "$WORK/pids.json" "$DATA" "$AGENT_DIR" "$NODE" <<'EOF'
import json, os, sys, time, psutil
from aios_blocks.agent.runtime_process import LABELS_ENV, process_scope
pids_file, data, agent_dir, node = sys.argv[1:]
ours = json.load(open(pids_file)) if os.path.exists(pids_file) else {}
scope = process_scope(agent_dir)
me = {os.getpid(), os.getppid()}

def alive():
    left = []
    for p in psutil.process_iter(["pid", "cmdline", "create_time"]):
        if p.pid in me:
            continue
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            known = ours.get(str(p.pid))
            mine = known is not None and abs(known[0] - p.info["create_time"]) < 0.01
            if not mine and data.rstrip("/") + "/" in cmd:
                mine = True
            if not mine:
                labels = json.loads(p.environ().get(LABELS_ENV) or "{}")
                mine = labels.get("aios.node") == node and labels.get("aios.scope") == scope
            if mine and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {cmd[:140]}")
        except (psutil.Error, ValueError, OSError):
            continue
    return left

for _ in range(100):  # up to 10 s more
    left = alive()
    if not left:
        break
    time.sleep(0.1)
print(f"processes of this run seen before shutdown: {len(ours)}")
if left:
    print("CHECK FAIL: processes left after SIGTERM of blocks up and the agent (now killed):", *left, sep="\n  ")
    for line in left:
        try:
            psutil.Process(int(line.split()[0])).kill()
        except psutil.Error:
            pass
    sys.exit(1)
print("CHECK ok: no process left (blocks up, its servers and workers, the agent, the instance)")
EOF
    [ $? -eq 0 ] || FAILS=$((FAILS + 1))
}

# -- 1. nvidia-smi ---------------------------------------------------------------------------------
step "1. nvidia-smi"
if [ "$MODE" = real ]; then
    nvidia-smi -L
    nvidia-smi --query-gpu=index,uuid,name,memory.total,driver_version --format=csv | tee "$WORK/smi.csv"
    nvidia-smi topo -m || echo "(topo -m failed: $?)"
    [ "$(grep -c '^[0-9]' "$WORK/smi.csv")" -ge 1 ] && ok "nvidia-smi lists $(grep -c '^[0-9]' "$WORK/smi.csv") GPU(s)" \
        || fail "nvidia-smi lists no GPU"
else
    echo "(mode sim: no nvidia-smi / GPU here)"; : > "$WORK/smi.csv"
fi

# -- 2. our inventory ------------------------------------------------------------------------------
step "2. NVML inventory: detect(None, \"$NODE\")"
"$PY" - "$MODE" "$NODE" "$WORK/smi.csv" "$WORK/inventory.json" <<'EOF'
import csv, json, sys
from aios_blocks.agent.gpus import detect
mode, node, smi_csv, out = sys.argv[1:]
fails = 0
def check(cond, what):
    global fails
    print(("CHECK ok: " if cond else "CHECK FAIL: ") + what)
    fails += not cond

src = detect(None, node)
gpus = src.gpus()
util = src.utilization()
print(f"kind: {src.kind.value}")
for g in gpus:
    print(f"  GpuInfo(id={g.id!r}, model={g.model!r}, memory={g.memory} MiB, index={g.index})  utilization={util.get(g.id)}")
print(f"utilization: {util}")
if mode == "real":
    rows = [{k.strip(): v.strip() for k, v in r.items()} for r in csv.DictReader(open(smi_csv), skipinitialspace=True)]
    smi = [(int(r["index"]), r["uuid"], r["name"], int(r["memory.total [MiB]"].split()[0])) for r in rows]
    ours = [(g.index, g.id, g.model, g.memory) for g in gpus]
    check(src.kind.value == "nvml", f"the inventory comes from NVML (kind {src.kind.value})")
    check(len(ours) == len(smi), f"{len(ours)} GPU(s) from NVML, {len(smi)} from nvidia-smi")
    for o, s in zip(ours, smi):
        check(o[1] == s[1], f"GPU {o[0]}: UUID {o[1]} == nvidia-smi's {s[1]}")
        check(o[3] == s[3], f"GPU {o[0]}: memory {o[3]} MiB == nvidia-smi's {s[3]} MiB")
        check(o[2] == s[2], f"GPU {o[0]}: model {o[2]!r} == nvidia-smi's {s[2]!r}")
        check(o[0] == s[0], f"GPU index {o[0]} == nvidia-smi's {s[0]}")
    check(all(0.0 <= u <= 1.0 for u in util.values()) and set(util) == {g.id for g in gpus},
          f"utilization read for every GPU, in 0..1: {util}")
else:
    print("CHECK skip: NVML inventory vs nvidia-smi (mode sim: no NVML here)")
    src = detect(1, node)
    gpus = src.gpus()
    print(f"simulated instead: kind {src.kind.value}: {gpus}")
json.dump([g.__dict__ for g in gpus], open(out, "w"))
sys.exit(fails)
EOF
FAILS=$((FAILS + $?))

# -- 2b. the topology NVML gives ---------------------------------------------------------------
step "2b. NVML topology: each call agent/topology.py makes, raw, then read_topology"
if [ "$MODE" = real ]; then
"$PY" - <<'EOF'
import pynvml as n
from aios_blocks.agent.topology import read_topology
n.nvmlInit()
count = n.nvmlDeviceGetCount()
handles = [n.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
print("driver", n.nvmlSystemGetDriverVersion(), "| NVML_NVLINK_MAX_LINKS", getattr(n, "NVML_NVLINK_MAX_LINKS", None))
def call(f, *a):
    try:
        return repr(f(*a))
    except Exception as exc:
        return f"raises {type(exc).__name__}: {exc}"
for i, h in enumerate(handles):
    pci = n.nvmlDeviceGetPciInfo(h)
    print(f"GPU {i}: pci {pci.domain:04x}:{pci.bus:02x}:{pci.device:02x} busId {pci.busId!r}")
    for link in range(int(getattr(n, "NVML_NVLINK_MAX_LINKS", 18))):
        state = call(n.nvmlDeviceGetNvLinkState, h, link)
        kind = call(getattr(n, "nvmlDeviceGetNvLinkRemoteDeviceType", lambda *_: "absent"), h, link)
        print(f"  link {link:2d}: state {state}; remote type {kind}")
        if state.startswith("raises"):
            break
    for j in range(i + 1, count):
        print(f"  common ancestor with GPU {j}:", call(n.nvmlDeviceGetTopologyCommonAncestor, h, handles[j]))
topo = read_topology(n, handles)
print("read_topology:", topo.model_dump_json() if topo is not None else None)
print(("CHECK ok: " if topo is not None and topo.source == "nvml" and topo.gpus == count else "CHECK FAIL: ")
      + f"read_topology reads the {count} GPU(s) from NVML (pairs: {len(topo.links) if topo else '-'})")
sys_exit = 0 if topo is not None else 1
raise SystemExit(sys_exit)
EOF
FAILS=$((FAILS + $?))
else
    skip "NVML topology (mode sim)"
fi

# -- 3. the control plane --------------------------------------------------------------------------
step "3a. blocks up --data-dir $DATA --agents 0"
"$PY" -m aios_blocks.cli up --data-dir "$DATA" --agents 0 > "$WORK/up.log" 2>&1 &
UP_PID=$!
for _ in $(seq 1 600); do
    grep -q '^tasks:' "$WORK/up.log" 2>/dev/null && break
    kill -0 "$UP_PID" 2>/dev/null || break
    sleep 0.1
done
cat "$WORK/up.log"
grep -q '^tasks:' "$WORK/up.log" && ok "blocks up started (pid $UP_PID)" || abort "blocks up did not start within 60 s"
cat "$DATA/endpoints.json"; echo

step "3b. the gpu-probe component (process runtime)"
probe_component() {  # NAME RESOURCES RESOURCE_ALLOCATOR_SETTINGS COMMENT: the GPU probe as a component
    cat <<EOF
# $4
componentURI: aios://examples/$1
componentInputProtocol: {type: http, path: /infer, method: POST}
tags: [gpu, check]
resources: $2
launch:
  command: [$PY, -m, $PROBE]
  ports: [http]
  probe: {type: http, port: http, path: /health, intervalS: 1, failureThreshold: 3, startTimeoutS: 120}
  stopGraceS: 10
policies:
  - {name: clusterAllocator, policyRuleURI: "builtin:cluster-rank"}
  - {name: resourceAllocator, policyRuleURI: "builtin:binpack", settings: $3}
EOF
}
probe_component gpu-probe "{gpus: 1, cpu: 1, memory: 2048}" "{}" \
    "The GPU probe (aios_blocks.examples.gpu_probe) for the process runtime: 1 GPU, one HTTP port." > "$WORK/gpu_probe_component.yaml"
cat "$WORK/gpu_probe_component.yaml"
blocks component add "$WORK/gpu_probe_component.yaml" && ok "component registered" || abort "blocks component add"

step "3c. blocks agent --node-id $NODE --cluster $CLUSTER --runtime process"
SIM_ARGS=()
[ "$MODE" = sim ] && SIM_ARGS=(--sim-gpus 1)
"$PY" -m aios_blocks.cli agent --node-id "$NODE" --cluster "$CLUSTER" --runtime process "${SIM_ARGS[@]}" \
    --cpu 4 --memory 8192 --heartbeat-s 1 --agent-dir "$AGENT_DIR" --data-dir "$DATA" > "$WORK/agent.log" 2>&1 &
AGENT_PID=$!
for _ in $(seq 1 120); do
    blocks node list --json 2>/dev/null > "$WORK/nodes.json" && grep -q "\"$NODE\"" "$WORK/nodes.json" && break
    kill -0 "$AGENT_PID" 2>/dev/null || break
    sleep 0.5
done
head -n 3 "$WORK/agent.log"
cat "$WORK/nodes.json"
"$PY" - "$WORK/nodes.json" "$WORK/inventory.json" "$NODE" <<'EOF' || abort "the node did not register with its GPUs"
import json, sys
nodes, inv, node = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), sys.argv[3]
mine = [n for n in nodes if n["node_id"] == node]
if not mine:
    print(f"CHECK FAIL: node {node} not registered"); sys.exit(1)
got = [(g["id"], g["model"], g["memory"]) for g in mine[0]["gpus"]]
want = [(g["id"], g["model"], g["memory"]) for g in inv]
if got != want or not got:
    print(f"CHECK FAIL: node {node} registered GPUs {got}, the inventory has {want}"); sys.exit(1)
print(f"CHECK ok: node {node} registered (healthy={mine[0]['healthy']}) with its GPU(s) {got}")
EOF

echo "blocks node get $NODE:"
blocks node get "$NODE" | tee "$WORK/node_get.txt"
if [ "$MODE" = real ]; then
    grep -q "read from nvml" "$WORK/node_get.txt" && ok "blocks node get shows the topology read from NVML" \
        || fail "blocks node get does not show a topology read from NVML"
fi

step "3d. submit block $BID: 1 instance, resources {gpus: 1}, --wait"
cat > "$WORK/block.yaml" <<EOF
blockId: $BID
blockComponentURI: aios://examples/gpu-probe
minInstances: 1
maxInstances: 1
resources: {gpus: 1, cpu: 1, memory: 2048}
affinity:   # on the agent's node
  - {category: Resource, strength: Required, target: {type: NodeId, value: $NODE}}
EOF
cat "$WORK/block.yaml"
PLACED=1
blocks submit "$WORK/block.yaml" --wait --timeout 150 && ok "block $BID ready" || abort "block $BID not ready (exit $?)"

step "3e. blocks get $BID --json"
blocks get "$BID" --json | tee "$WORK/block.json"
INST_INFO="$("$PY" - "$WORK/block.json" "$WORK/inventory.json" <<'EOF'
import json, sys
b, inv = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
(iid, inst), = b["instances"].items()
gpus = inst["gpus"]
ok = inst["status"] == "running" and len(gpus) == 1 and gpus[0] in {g["id"] for g in inv}
print(("CHECK ok: " if ok else "CHECK FAIL: ") + f"instance {iid} {inst['status']} on {inst['node']} with reserved GPU {gpus} (one of the node's)")
print(f"INST {iid} {gpus[0] if gpus else '-'} {inst['endpoint']}")
EOF
)"
echo "$INST_INFO" | grep '^CHECK'
echo "$INST_INFO" | grep -q '^CHECK ok' || FAILS=$((FAILS + 1))
read -r _ IID RESERVED ENDPOINT <<< "$(echo "$INST_INFO" | grep '^INST')"
echo "instance $IID, reserved GPU $RESERVED, endpoint $ENDPOINT"

step "3f. one task through the executor: NATS (blocks task) and HTTP (POST /blocks/$BID/tasks)"
blocks task "$BID" --data '{"n": 1024}' --timeout 60 > "$WORK/answer_nats.json"
RC=$?
cat "$WORK/answer_nats.json"; echo
[ $RC -eq 0 ] && ok "task over NATS answered" || fail "blocks task exit $RC"
HTTP_URL="$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["http"])' "$DATA/endpoints.json")"
"$PY" - "$HTTP_URL/blocks/$BID/tasks" "$WORK/answer_http.json" "$DATA" <<'EOF'
import base64, json, os, sys, urllib.request
headers = {"Content-Type": "application/json"}
secrets = os.path.join(sys.argv[3], "auth", "secrets.json")
if os.path.exists(secrets):  # auth on: the HTTP port asks for an upstream client's credentials (HTTP Basic)
    password = json.load(open(secrets))["nats"]["upstream"]
    headers["Authorization"] = "Basic " + base64.b64encode(f"upstream:{password}".encode()).decode()
req = urllib.request.Request(sys.argv[1], data=b'{"n": 256}', headers=headers, method="POST")
with urllib.request.urlopen(req, timeout=60) as r:
    body = r.read()
    print(f"HTTP {r.status} from {sys.argv[1]} (Aios-Instance: {r.headers.get('Aios-Instance')})")
open(sys.argv[2], "wb").write(body)
print(body.decode())
EOF
[ $? -eq 0 ] && ok "task over HTTP answered" || fail "task over HTTP"
INSTANCE_PID="$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["pid"])' "$WORK/answer_nats.json" 2>/dev/null)"
WHOLE_TFLOPS=0
if [ "$MODE" = real ]; then  # the whole GPU's bf16 throughput, for the sharing instances' (step 4)
    blocks task "$BID" --data '{"n": 64, "tflops": 8192}' --timeout 120 > "$WORK/answer_tflops.json" \
        && WHOLE_TFLOPS="$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["throughput"]["tflops"])' "$WORK/answer_tflops.json")"
    echo "the instance holding the whole GPU: bf16 8192x8192 matmuls at $WHOLE_TFLOPS TFLOP/s"
fi
[ "$MODE" = real ] && { echo "nvidia-smi compute apps:"; nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader | tee "$WORK/apps.csv"; }
cp "$(find "$AGENT_DIR" -name instance.log | head -n 1)" "$WORK/instance.log" 2>/dev/null
echo "instance.log:"; sed 's/^/  /' "$WORK/instance.log" 2>/dev/null | tail -n 20
snapshot_tree

step "3g. what the instance saw == what was reserved for it"
"$PY" - "$MODE" "$WORK/answer_nats.json" "$WORK/answer_http.json" "$WORK/inventory.json" "$RESERVED" "$IID" "$WORK/apps.csv" <<'EOF'
import json, os, sys
mode, a_nats, a_http, inv, reserved, iid, apps = sys.argv[1:]
fails = 0
def check(cond, what):
    global fails
    print(("CHECK ok: " if cond else "CHECK FAIL: ") + what)
    fails += not cond

def norm(u):  # NVML: GPU-xxxxxxxx-...; torch: xxxxxxxx-... (no prefix)
    u = (u or "").strip().lower()
    return u[4:] if u.startswith("gpu-") else u

try:
    a, h = json.load(open(a_nats)), json.load(open(a_http))
except (OSError, ValueError) as exc:
    print(f"CHECK FAIL: no answer to check ({exc})"); sys.exit(1)
gpu = {g["id"]: g for g in json.load(open(inv))}[reserved]
env = a["env"]
check(a["instance_id"] == iid and h["instance_id"] == iid, f"both tasks answered by the instance {iid}")
check(env["CUDA_VISIBLE_DEVICES"] == reserved, f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} == reserved {reserved}")
check(env["AIOS_GPUS"] == reserved, f"AIOS_GPUS={env['AIOS_GPUS']} == reserved")
check(env["NVIDIA_VISIBLE_DEVICES"] == reserved, f"NVIDIA_VISIBLE_DEVICES={env['NVIDIA_VISIBLE_DEVICES']} == reserved")
check(env["AIOS_GPU_INDICES"] == str(gpu["index"]), f"AIOS_GPU_INDICES={env['AIOS_GPU_INDICES']} == the GPU's host (NVML) index {gpu['index']}")
if mode == "real":
    check(a["torch"] is not None, f"torch {a['torch']} imported in the instance ({a.get('torch_error')})")
    check(a["cuda_available"] and a["device_count"] == 1, f"torch.cuda.device_count() == 1 (got {a['device_count']})")
    if a["device_count"] >= 1:
        check(norm(a["device_uuid"]) == norm(reserved),
              f"torch's device 0 UUID {a['device_uuid']} == reserved {reserved} (GPU- prefix aside)")
        check(a["device_name"] == gpu["model"], f"torch.cuda.get_device_name(0) {a['device_name']!r} == NVML model {gpu['model']!r}")
        m = a.get("matmul") or {}
        check(m.get("device") == "cuda:0" and m.get("max_abs_err", 1e9) < 0.05,
              f"matmul {m.get('n')}x{m.get('n')} float32 on {m.get('device')}: {m.get('ms')} ms, max |GPU - CPU| = {m.get('max_abs_err')}")
    rows = [r.split(",") for r in open(apps).read().splitlines() if r.strip()] if os.path.exists(apps) else []
    procs = {int(r[0]): r[1].strip() for r in rows if r[0].strip().isdigit()}
    if not procs:
        print("CHECK skip: nvidia-smi lists no compute process (cannot see the instance's pid here)")
    else:
        check(procs.get(a["pid"]) == reserved, f"nvidia-smi: the instance's pid {a['pid']} runs on {procs.get(a['pid'])} (reserved {reserved})")
else:
    print(f"CHECK skip: torch / CUDA checks (mode sim; the instance says torch={a['torch']}: {a.get('torch_error')})")
sys.exit(fails)
EOF
FAILS=$((FAILS + $?))

step "3h. blocks delete $BID"
blocks delete "$BID" --timeout 60 && { DELETED=1; ok "block $BID deleted"; } || fail "blocks delete exit $?"
if [ -n "$INSTANCE_PID" ]; then
    for _ in $(seq 1 150); do kill -0 "$INSTANCE_PID" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$INSTANCE_PID" 2>/dev/null && fail "the instance (pid $INSTANCE_PID) still runs after delete" \
        || ok "the instance process (pid $INSTANCE_PID) is gone"
fi
sleep 1.5  # a heartbeat
blocks node list --json > "$WORK/nodes_after.json"
"$PY" - "$WORK/nodes_after.json" "$NODE" <<'EOF'
import json, sys
(n,) = [n for n in json.load(open(sys.argv[1])) if n["node_id"] == sys.argv[2]]
free = all(g["instances"] == 0 and g["memory_used"] == 0 for g in n["gpus"])
print(("CHECK ok: " if free else "CHECK FAIL: ") + f"the node's GPUs are free again: {[(g['id'], g['instances']) for g in n['gpus']]}")
sys.exit(0 if free else 1)
EOF
FAILS=$((FAILS + $?))

# -- 4. sharing the GPU -------------------------------------------------------------------------
SHARE_BID="$BID-share" SHARE_MIB=20000
step "4. two instances of one sharing block on the one GPU: $SHARE_BID (gpuShare 0.5, gpuMemory $SHARE_MIB MiB)"
probe_component gpu-probe-shared "{gpus: 1, gpuShare: 0.5, gpuMemory: $SHARE_MIB, cpu: 1, memory: 2048}" "{gpuSharing: true}" \
    "The GPU probe sharing its GPU: half its compute (gpuShare), $SHARE_MIB MiB of its memory." > "$WORK/gpu_probe_shared.yaml"
blocks component add "$WORK/gpu_probe_shared.yaml" && ok "sharing component registered" || fail "blocks component add (sharing)"
cat > "$WORK/block_shared.yaml" <<EOF
blockId: $SHARE_BID
blockComponentURI: aios://examples/gpu-probe-shared
minInstances: 2
maxInstances: 2
resources: {gpus: 1, gpuShare: 0.5, gpuMemory: $SHARE_MIB, cpu: 1, memory: 2048}
affinity:
  - {category: Resource, strength: Required, target: {type: NodeId, value: $NODE}}
EOF
# with CUDA MPS here, its control daemon runs (default pipe directory, which the instances reach)
# while the sharing instances run, so CUDA itself holds each to CUDA_MPS_PINNED_DEVICE_MEM_LIMIT
MPS=0
if [ "$MODE" = real ] && command -v nvidia-cuda-mps-control >/dev/null; then
    nvidia-cuda-mps-control -d && MPS=1 && echo "MPS control daemon started (default pipe directory)" \
        || echo "nvidia-cuda-mps-control -d failed: the instances share without MPS"
fi
if blocks submit "$WORK/block_shared.yaml" --wait --timeout 180; then
    ok "sharing block $SHARE_BID ready"
    blocks get "$SHARE_BID" --json > "$WORK/block_shared.json"
    # each instance directly (its endpoint, named by Aios-Instance): the matmul, then a buffer over its figure and one under
    "$PY" - "$MODE" "$WORK/block_shared.json" "$WORK/inventory.json" "$SHARE_MIB" "$WORK/shared_answers.json" "$MPS" "$WHOLE_TFLOPS" <<'EOF'
import json, sys, urllib.request
mode, block, inv, share_mib, out = sys.argv[1], json.load(open(sys.argv[2])), json.load(open(sys.argv[3])), int(sys.argv[4]), sys.argv[5]
mps, whole = sys.argv[6] == "1", float(sys.argv[7])
fails = 0
def check(cond, what):
    global fails
    print(("CHECK ok: " if cond else "CHECK FAIL: ") + what)
    fails += not cond
insts = block["instances"]
gpus = {g["id"]: g for g in inv}
check(len(insts) == 2 and all(i["status"] == "running" for i in insts.values()), f"2 instances running: {[(k, i['status'], i['gpus']) for k, i in insts.items()]}")
held = {tuple(i["gpus"]) for i in insts.values()}
check(len(held) == 1 and len(next(iter(held))) == 1 and next(iter(held))[0] in gpus, f"both hold the same one GPU: {held}")
answers = {}
for iid, inst in insts.items():
    url = inst["endpoint"].rstrip("/") + "/infer"
    for alloc in (share_mib + 5000, share_mib // 2):  # one instance at a time: each alone on the GPU
        ask = {"n": 2048, "alloc_mib": alloc, "tflops": 8192 if mode == "real" and alloc < share_mib else 0}
        req = urllib.request.Request(url, data=json.dumps(ask).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Aios-Instance": iid})
        with urllib.request.urlopen(req, timeout=120) as r:
            a = json.loads(r.read())
        answers.setdefault(iid, []).append(a)
        print(iid, json.dumps({k: a.get(k) for k in ("pid", "env", "device_name", "cuda_free_mib", "memory_fraction", "matmul", "alloc", "throughput")}))
json.dump(answers, open(out, "w"))
for iid, (over, under) in answers.items():
    env = over["env"]
    check(over["instance_id"] == iid, f"{iid} answered for itself")
    check(env["AIOS_GPU_MEMORY_LIMIT_MIB"] == str(share_mib) and env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={share_mib}M",
          f"{iid}: AIOS_GPU_MEMORY_LIMIT_MIB={env['AIOS_GPU_MEMORY_LIMIT_MIB']}, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={env['CUDA_MPS_PINNED_DEVICE_MEM_LIMIT']}")
    check(env["AIOS_GPU_SHARE"] == "0.500" and env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50",
          f"{iid}: AIOS_GPU_SHARE={env['AIOS_GPU_SHARE']}, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={env['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE']}")
    if mode == "real":
        m = over.get("matmul") or {}
        check(over["device_count"] == 1 and m.get("device") == "cuda:0" and m.get("max_abs_err", 1e9) < 0.05,
              f"{iid}: torch sees 1 device ({over.get('device_name')}), 2048x2048 matmul {m.get('ms')} ms, err {m.get('max_abs_err')}")
        check(over["memory_fraction"] is not None and over["alloc"]["ok"] is False and under["alloc"]["ok"] is True,
              f"{iid}: keeps to its {share_mib} MiB (fraction {over['memory_fraction']}): {over['alloc']['mib']} MiB refused "
              f"({over['alloc']['error']}), {under['alloc']['mib']} MiB held")
        if mps:
            check(0 < over["cuda_free_mib"] <= share_mib,
                  f"{iid}: under MPS, CUDA says {over['cuda_free_mib']} MiB free to it (<= its {share_mib} MiB: CUDA enforces the figure)")
            got = (under.get("throughput") or {}).get("tflops", 0)
            check(whole > 0 and 0 < got <= 0.75 * whole,
                  f"{iid}: under MPS at 50 % of the SMs, alone on the GPU: {got} TFLOP/s bf16, {got / whole if whole else 0:.2f} x "
                  f"the whole-GPU instance's {whole} (its gpuShare 0.5 reaches CUDA)")
        else:
            print(f"CHECK skip: {iid}: no MPS here: CUDA says {over['cuda_free_mib']} MiB free to it (only torch's cap holds it)")
sys.exit(fails)
EOF
    FAILS=$((FAILS + $?))
    if [ "$MODE" = real ]; then
        echo "nvidia-smi compute apps (both instances on one GPU):"
        nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader | tee "$WORK/apps_shared.csv"
        nvidia-smi | sed -n '/Processes:/,$p'
    fi
    blocks node get "$NODE"
    blocks delete "$SHARE_BID" --timeout 60 && ok "sharing block deleted" || fail "blocks delete $SHARE_BID"
else
    fail "sharing block $SHARE_BID not ready"
    blocks get "$SHARE_BID" || true
    blocks delete "$SHARE_BID" --timeout 60 || true
fi
[ "$MPS" = 1 ] && { echo quit | nvidia-cuda-mps-control; echo "MPS control daemon stopped"; }

# -- 5. MPS on this host -------------------------------------------------------------------------
step "5. CUDA MPS: is the control daemon here, and does it enforce the pinned memory limit?"
if [ "$MODE" = real ] && command -v nvidia-cuda-mps-control >/dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY="$WORK/mps-pipe" CUDA_MPS_LOG_DIRECTORY="$WORK/mps-log"
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d; then
        sleep 1
        CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2000M CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 timeout 120 "$PY" - <<'EOF'
import torch
small = torch.empty(1000 * 2**20, dtype=torch.uint8, device="cuda:0")
try:
    torch.empty(4000 * 2**20, dtype=torch.uint8, device="cuda:0")
    over = "held (MPS did not enforce the 2000 MiB limit)"
except Exception as exc:
    over = f"refused: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
print(f"under MPS with CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2000M: 1000 MiB held; 4000 MiB {over}")
EOF
        echo "MPS client exit $?"; echo quit | nvidia-cuda-mps-control; tail -n 5 "$CUDA_MPS_LOG_DIRECTORY"/control.log 2>/dev/null
    else
        echo "nvidia-cuda-mps-control -d failed ($?)"
    fi
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
else
    skip "MPS: no nvidia-cuda-mps-control on this host (mode $MODE)"
fi

step "3i. SIGTERM the agent and blocks up"
snapshot_tree
kill -TERM "$AGENT_PID"
for _ in $(seq 1 200); do kill -0 "$AGENT_PID" 2>/dev/null || break; sleep 0.1; done
kill -0 "$AGENT_PID" 2>/dev/null && fail "the agent still runs 20 s after SIGTERM" || { wait "$AGENT_PID"; ok "the agent exited (status $?)"; }
kill -TERM "$UP_PID"
for _ in $(seq 1 300); do kill -0 "$UP_PID" 2>/dev/null || break; sleep 0.1; done
kill -0 "$UP_PID" 2>/dev/null && fail "blocks up still runs 30 s after SIGTERM" || { wait "$UP_PID"; ok "blocks up exited (status $?)"; }
tail -n 3 "$WORK/up.log"
# cleanup (the EXIT trap) checks that nothing is left and prints the result
