#!/usr/bin/env bash
# The README's CPU timings, as a new user meets them, on three kinds of CPU: the offline demo, the sentiment
# miniature's first run (empty caches: the experiments' published initial models and labels, nothing pretrained),
# the fast tier of the tests, `label sentiment_mini`'s wait for its first question (empty caches of its own), and
# on request (PARTS) the miniature's rerun (the same seed, the caches kept: for another seed than 1-3, the labels); on
# this CPU as it is ("native": with native bf16 where it has it), held to AVX512-BF16 without AMX
# ("avx512bf16": ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16, a Sapphire Rapids standing in for a Zen 4; on a CPU without
# AMX, the CPU as it is) and under the AVX2 stand-in for a CPU without native bf16 (ATEN_CPU_CAPABILITY=avx2
# ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2; what each does and how closely it stands in:
# benchmarks/README.md). Prints one table; writes OUT/cpu_kinds.json and each command's output in OUT/<kind>/.
#
#   bash benchmarks/cpu_kinds.sh [OUT]                      # default OUT: $TMPDIR/cpu_kinds
#   KINDS="native avx512bf16 avx2" PARTS="demo mini fast label" SEEDS="1 2 3" bash benchmarks/cpu_kinds.sh OUT
#   bash benchmarks/cpu_kinds.sh --table OUT                # the table of OUT again
#
# Run it where nothing else runs (the load average is recorded beside every timing): wall times taken under load
# mean nothing. The results (the miniature's VADER gain, KL, reward-model accuracy) do not depend on the load:
# SEEDS="1 2 3" gives the README's table rows of a kind (the first seed's first run is the timing).
# Run from the repository root, in the README's install; about 6 min a kind with SEEDS=1.
set -euo pipefail
cd "$(dirname "$0")/.."
TABLE_ONLY=0
if [ "${1:-}" = --table ]; then TABLE_ONLY=1; shift; fi
OUT=$(realpath -m "${1:-${TMPDIR:-/tmp}/cpu_kinds}")
KINDS=${KINDS:-native avx512bf16 avx2}
PARTS=${PARTS:-demo mini fast label}
SEEDS=${SEEDS:-1}
RESULTS="$OUT/parts.jsonl"
if [ $TABLE_ONLY = 0 ]; then mkdir -p "$OUT"; : > "$RESULTS"; else KINDS=""; fi

LIMITS="ATEN_CPU_CAPABILITY ONEDNN_MAX_CPU_ISA DNNL_MAX_CPU_ISA MKL_ENABLE_INSTRUCTIONS LMHP_CPU_BF16 LMHP_CPU_THREADS"
kind_env() {  # the environment of a kind: no limit of the caller's, then the kind's
    for name in $LIMITS; do echo -n "-u $name "; done
    case $1 in
        native) echo ;;
        avx512bf16) echo "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16" ;;
        avx2) echo "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2" ;;
        *) echo "cpu_kinds.sh: unknown kind '$1' (native, avx512bf16, avx2)" >&2; exit 2 ;;
    esac
}

timed() {  # timed KIND PART NAME LOG COMMAND...: runs it in the kind's environment, appends a line to $RESULTS
    local kind=$1 part=$2 name=$3 log=$4; shift 4
    local load_before start end status=0
    load_before=$(cut -d' ' -f1 /proc/loadavg)
    start=$(date +%s.%N)
    env $(kind_env "$kind") "$@" > "$log" 2>&1 || status=$?
    end=$(date +%s.%N)
    python - "$RESULTS" "$kind" "$part" "$name" "$log" "$start" "$end" "$load_before" "$(cut -d' ' -f1 /proc/loadavg)" \
        "$status" <<'EOF'
import json, sys
results, kind, part, name, log, start, end, load_before, load_after, status = sys.argv[1:]
with open(results, 'a') as f:
    f.write(json.dumps(dict(kind=kind, part=part, name=name, log=log, seconds=float(end) - float(start),
                            load=[float(load_before), float(load_after)], status=int(status))) + '\n')
EOF
    echo "cpu_kinds: $kind $part $name: $(python -c "print(f'{$end - $start:.0f}')") s (exit $status; $log)"
}

for kind in $KINDS; do
    dir="$OUT/$kind"
    rm -rf "$dir"; mkdir -p "$dir/tmp" "$dir/saved_models" "$dir/datasets"
    # Empty caches and save dirs of the kind's own: a fresh clone's first hour.
    export TMPDIR="$dir/tmp" LMHP_SAVED_MODELS_DIR="$dir/saved_models" LMHP_DATASETS_DIR="$dir/datasets"
    for part in $PARTS; do
        case $part in
            demo) timed "$kind" demo first-run "$dir/demo.log" python launch.py train_policy demo first-run ;;
            mini) for seed in $SEEDS; do
                      timed "$kind" mini "seed$seed" "$dir/mini-seed$seed.log" \
                          python launch.py train_policy sentiment_mini "seed$seed" --run.seed "$seed"
                  done ;;
            rerun) seed=${SEEDS%% *}
                   timed "$kind" rerun "seed$seed-rerun" "$dir/mini-seed$seed-rerun.log" \
                       python launch.py train_policy sentiment_mini "seed$seed-rerun" --run.seed "$seed" ;;
            fast) timed "$kind" fast fast-tier "$dir/fast.log" python -m pytest -q -p no:cacheprovider -m "not slow" tests ;;
            label) mkdir -p "$dir/label/tmp" "$dir/label/saved_models" "$dir/label/datasets"  # empty caches of its own
                   TMPDIR="$dir/label/tmp" LMHP_SAVED_MODELS_DIR="$dir/label/saved_models" \
                   LMHP_DATASETS_DIR="$dir/label/datasets" timed "$kind" label first-question "$dir/label.log" \
                       python benchmarks/first_session.py --first_question --out "$dir/label" ;;
            *) echo "cpu_kinds.sh: unknown part '$part' (demo, mini, rerun, fast, label)" >&2; exit 2 ;;
        esac
    done
done

python - "$OUT" "$RESULTS" <<'EOF'
"""The table: each part's wall time (the command's; for the offline experiments also their report's phases), the
load average before and after it, and the miniature's results."""
import json, os, re, sys
out, results = sys.argv[1:]
rows = [json.loads(line) for line in open(results)]


def report(row):
    save = os.path.join(out, row['kind'], 'tmp', 'save', 'train_policy', row['name'])
    path = os.path.join(save, ('demo' if row['part'] == 'demo' else 'sentiment_mini') + '_report.json')
    return json.load(open(path)) if os.path.isfile(path) else None


def m_s(seconds):
    return f'{int(seconds // 60)}m{seconds % 60:02.0f}s'


print(f'\n{"kind":10s} {"part":6s} {"run":12s} {"wall":>8s}  {"load":>9s}  phases (report) / result')
for row in rows:
    extra = ''
    r = report(row) if row['part'] != 'fast' else None
    if r is not None:
        phases = ', '.join(f'{k} {v:.0f}s' for k, v in r.get('phase_times_s', {}).items())
        extra = f'{phases}; on {r.get("runs_on", "?")}'
        if row['part'] != 'demo':
            extra += (f"; VADER gain {r['vader_gain_initial_stds']:+.2f} sd, KL {r['kl']:.2f}, "
                      f"RM {100 * r['rm_heldout_accuracy']:.1f} % (bag of words "
                      f"{100 * r['rm_bag_of_words_accuracy']:.1f} %)")
        else:
            extra += f"; rule gain {r['rule_gain_initial_stds']:+.2f} sd, KL {r['kl']:.2f}"
    elif row['part'] == 'label':
        lines = [line for line in open(row['log']) if line.startswith('{')]
        extra = json.loads(lines[-1]) if lines else ''
        if extra:
            extra = (f"the page up at {extra['page_ready_s']:.0f}s, the first question at {extra['first_question_s']:.0f}s "
                     f"(empty caches)")
    elif row['part'] == 'fast':
        last = [line for line in open(row['log']).read().splitlines() if ' in ' in line][-1:]
        extra = last[0].strip('= ') if last else ''
    status = '' if row['status'] == 0 else f' (exit {row["status"]})'
    print(f'{row["kind"]:10s} {row["part"]:6s} {row["name"]:12s} {m_s(row["seconds"]):>8s}  '
          f'{row["load"][0]:4.1f}-{row["load"][1]:<4.1f}  {extra}{status}')
json.dump(dict(out=out, rows=rows), open(os.path.join(out, 'cpu_kinds.json'), 'w'), indent=1)
print(f'\ncpu_kinds: {os.path.join(out, "cpu_kinds.json")}')
EOF
