#!/usr/bin/env bash
# The runs behind the README's "On a GPU" section, one stage per command so that each fits a short slot:
#   bash benchmarks/on_gpu.sh STAGE OUTDIR
# STAGE: env | tests | same_numbers | throughput | memory | timing [BEFORE_REPO] | profile | bf16_error
# Each stage writes its log and JSON into OUTDIR, named after the GPU (e.g. ppo_throughput_h100.json).
set -uo pipefail
cd "$(dirname "$0")/.."
stage=$1; out=$(realpath -m "$2"); mkdir -p "$out"
export PYTHONUNBUFFERED=1
gpu=$(python3 -c "import torch; n=torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'; print(n.split()[1].lower() if n.startswith('NVIDIA') else n.replace(' ', '_').lower())")
case $stage in
  env)
    nvidia-smi | tee "$out/env_$gpu.txt"
    python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory // 2**20, 'MiB')" | tee -a "$out/env_$gpu.txt";;
  tests)
    # The whole suite: the trainers pick CUDA (utils.get_device) and bf16 (run.bf16 auto) there; the tests
    # that name a device run on both. LMHP_TEST_PARITY_ORIGINALS: see tests/test_parity.py (no TF here).
    # SIGINT at the limit: pytest stops as after Ctrl-C and still prints its summary and writes the XML.
    timeout -s INT "${TESTS_TIMEOUT:-480}" python3 -m pytest -q -rfEs -p no:cacheprovider -n "${TESTS_WORKERS:-6}" tests \
      --junitxml "$out/pytest_$gpu.xml" 2>&1 | tee "$out/pytest_$gpu.log";;
  same_numbers)
    # train_policy test and train_reward test with the paper's --mpi 4 on CUDA and on the CPU, both in fp32
    # (TF32 off: NVIDIA_TF32_OVERRIDE=0 whatever torch's flags say): weights, Adam moments, normalization.
    tmp=$(mktemp -d)
    for dev in cuda cpu; do
      vis=$([ $dev = cpu ] && echo "" || echo "${CUDA_VISIBLE_DEVICES:-0}")
      CUDA_VISIBLE_DEVICES=$vis NVIDIA_TF32_OVERRIDE=0 python3 launch.py train_policy test run --mpi 4 --save_dir "$tmp/$dev/policy" \
        --ppo.batch_size 32 --ppo.total_episodes 96 --run.bf16 false >> "$out/same_numbers_$gpu.log" 2>&1
      CUDA_VISIBLE_DEVICES=$vis NVIDIA_TF32_OVERRIDE=0 python3 launch.py train_reward test run --mpi 4 --save_dir "$tmp/$dev/reward" \
        --run.bf16 false >> "$out/same_numbers_$gpu.log" 2>&1
    done
    python3 benchmarks/compare_runs.py "$tmp/cpu" "$tmp/cuda" --atol 1e-5 --json "$out/same_numbers_$gpu.json" 2>&1 | tee -a "$out/same_numbers_$gpu.log";;
  throughput)
    python3 benchmarks/ppo_throughput.py --batch 64 --tldr --json "$out/ppo_throughput_$gpu.json" 2>&1 | tee "$out/ppo_throughput_$gpu.log";;
  memory)
    # MEMORY_ARGS narrows it (e.g. "--shapes tldr"): each measurement is a fresh process, ~20 s on an H100
    timeout "${MEMORY_TIMEOUT:-3000}" python3 benchmarks/memory.py --dtypes bf16 fp32 ${MEMORY_ARGS:-} \
      --json "$out/memory_$gpu.json" > "$out/memory_$gpu.log" 2>&1;;
  timing)
    # The paper's experiments on random weights, 8 ranks in one process (benchmarks/train_timing.py); with a
    # third argument, the same of another checkout too (e.g. the commit before the ranks-at-GPU-speed work).
    before=${3:-}
    runs=("--exp sentiment --model 124M" "--exp tldr --model 124M")
    [ -n "$before" ] && runs+=("--exp sentiment --model 124M --repo $before" "--exp tldr --model 124M --repo $before")
    runs+=("--exp sentiment --model 774M" "--exp sentiment --model 774M --microbatch 64"
           "--exp sentiment --model 124M --bf16 false" "--exp tldr --model 124M --bf16 false")
    for args in "${runs[@]}"; do
      python3 benchmarks/train_timing.py $args --updates "${UPDATES:-3}" --json "$out/t.json" >> "$out/train_timing_$gpu.log" 2>&1 \
        && python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))))" "$out/t.json" >> "$out/train_timing_$gpu.jsonl"
      tail -1 "$out/train_timing_$gpu.log"
    done; rm -f "$out/t.json";;
  profile)
    # One update of books and of tldr (124M, bf16) under torch.profiler: where the time goes, kernel by kernel.
    for exp in sentiment tldr; do
      python3 benchmarks/train_timing.py --exp $exp --model 124M --updates 4 --profile 3 > "$out/profile_${exp}_$gpu.txt" 2>&1
      grep -A3 '^profiled update' "$out/profile_${exp}_$gpu.txt"
    done;;
  bf16_error)
    # bf16 mode against fp32 mode on the same rollouts: |delta logprob| per token and the controller's KL,
    # with this GPU's TF32 n_vocab products (the CPU measures TF32 only emulated).
    python3 benchmarks/bf16_error.py --json "$out/bf16_error_$gpu.json" 2>&1 | tee "$out/bf16_error_$gpu.log";;
  *) echo "unknown stage $stage"; exit 2;;
esac
