#!/usr/bin/env bash
# The runs behind the README's "On a GPU" section, one stage per command, each within a ten-minute command:
#   bash benchmarks/on_gpu.sh prepare [BEFORE_COMMIT]   # first, here (PyPI, git, ../shared): what the GPU machine lacks
#   bash benchmarks/on_gpu.sh STAGE OUTDIR [ARGS]        # there, from the tree and the carried folders
# STAGE: env | tests | same_numbers | throughput | memory | timing [BEFORE_REPO] | timing_774M | timing_fp32 |
#        profile | bf16_error | deps (installs .whl, checks what the suite needs) | carry (the folders to carry)
# The GPU machine receives the tracked and untracked-not-ignored files of the tree and the ignored folders named
# in the call's carry, and reaches no network. `prepare` writes three ignored folders of the tree:
#   .whl/     wheels of the packages the suite needs that the GPU image lacks (for its Python 3.12), installed offline
#   .before/  the BEFORE checkout the timing stage compares with (git archive of BEFORE_COMMIT)
#   .shared/  what the suite reads of ../shared (GPT-2 124M's hparams.json and model.ckpt.index)
# Each stage writes its log and JSON into OUTDIR, named after the GPU (e.g. ppo_throughput_h100.json), and starts
# no run after STAGE_LIMIT seconds (default 560) from its start: a run still going then gets SIGINT (a Python
# run stops as after Ctrl-C and still writes what it has), so that what the stage measured comes back.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
stage=${1:?usage: bash benchmarks/on_gpu.sh STAGE OUTDIR [ARGS]}
export PYTHONUNBUFFERED=1
deadline=$((SECONDS + ${STAGE_LIMIT:-560}))
CARRY=(.whl .before .shared)
# the commit before the bf16 mode's own kernels (language/bf16.py), at which the README's H100 timings were taken
BEFORE_COMMIT=6f2d7ba
# The CUDA tier, what `tests` runs (TESTS_ARGS=tests: the whole suite): every test that names a device or takes a
# CUDA path of its own: the bf16 kernels, the samplers (CUDA graphs, no host syncs, the chunked sampler's CPU-only
# switch), the parity with the original's equations on CUDA, the memory plans, processes side by side on one GPU
# (cuBLAS's shapes), the trainers' runs with their CUDA defaults (bf16, the GPU's first line), the question maker
# and one online run (two rounds), the launcher's GPU count, the DPO tiles' CUDA switch. Sized for one GPU in
# under 4 minutes with the default workers (the H200's whole suite ran at ~2.4 tests a second on 14).
CUDA_TIER=(
  tests/test_bf16.py tests/test_sample.py tests/test_vocab_sampling.py tests/test_parity.py tests/test_memory.py
  tests/test_benchmark.py tests/test_on_gpu.py
  tests/test_ranks.py::test_train_reward_same_for_any_number_of_processes
  tests/test_ranks.py::test_train_policy_same_for_any_number_of_processes_and_resumes_under_another
  tests/test_train_policy.py::test_first_minibatch_ratio_is_one tests/test_train_policy.py::test_reward_training
  tests/test_train_reward.py::test_bf16_training_run
  tests/test_labeling.py::test_questions_pass_the_truncation_filter_and_are_the_same_when_made_again
  tests/test_labeling.py::test_validation_questions_set_half_of_pi_beside_half_of_rho_in_shuffled_places
  tests/test_labeling.py::test_questions_are_drawn_on_the_policys_device_whatever_the_command_device
  tests/test_online.py::test_the_rounds_retrain_on_every_label_so_far
  tests/test_run.py::test_the_launcher_refuses_a_save_dir_in_use_before_any_worker_starts
  tests/test_run.py::test_the_first_lines_device_reads_a_cpu_or_a_gpu
  tests/test_run.py::test_progress_summary_and_one_line_missing_heads
  tests/test_run.py::test_reward_progress_and_summary
  tests/test_launch.py::test_rank_and_process_counts_are_checked_at_launch
  tests/test_core_utils.py::test_single_process_distributed_helpers
  tests/test_frontier.py::test_dpo_cpu_tiles_keep_trls_log_probs_and_gradients
)
# what the suite imports that the GPU image lacks, and what those need that it lacks too (the versions the
# project's own environment runs, where the suite passes)
WHEELS=(vaderSentiment==3.3.2 ftfy==6.3.1 wcwidth==0.9.4 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)
NEEDS=(vaderSentiment ftfy datasets)
wheels=${LMHP_GPU_WHEELS:-$root/.whl}
site=${LMHP_GPU_SITE:-/tmp/lmhp_site}

install_wheels() {
  # The carried wheels, installed offline into $site (which the caller puts first on the path); prints what.
  compgen -G "$wheels/*.whl" > /dev/null || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$wheels"/*.whl || { echo "on_gpu.sh: could not install the wheels of $wheels into $site"; return 1; }
  echo "on_gpu.sh: installed $(cd "$wheels" && ls -- *.whl | tr '\n' ' ')into $site"
}

check_needs() {
  # One line naming what the suite needs and this machine still lacks, or where each is.
  python3 - "${NEEDS[@]}" <<'PY'
import importlib.util, sys
# (the tree's datasets/ folder, the data cache, is a namespace package to Python, not the package datasets)
found = {name: getattr(importlib.util.find_spec(name), 'origin', None) for name in sys.argv[1:]}
missing = [name for name, origin in found.items() if origin is None]
if missing:
    sys.exit(f"on_gpu.sh: the suite needs {', '.join(missing)}, which this machine lacks: run `bash "
             "benchmarks/on_gpu.sh prepare` where PyPI is reachable, and carry .whl")
print('on_gpu.sh: ' + ', '.join(f'{name} {origin}' for name, origin in found.items()))
PY
}

if [ "$stage" = prepare ]; then
  before=${2:-$BEFORE_COMMIT}
  rm -rf .whl .before .shared && mkdir -p .whl .before .shared/gpt2-124M
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}" || exit 1
  git archive --format=tar "$before" | tar -x -C .before || exit 1
  git rev-parse "$before" > .before/COMMIT
  cp ../shared/gpt2-124M/hparams.json ../shared/gpt2-124M/model.ckpt.index .shared/gpt2-124M/ || exit 1
  for path in "${CARRY[@]}"; do
    git check-ignore -q "$path/x" || { echo "on_gpu.sh: $path is not ignored by git (.gitignore)"; exit 1; }
  done
  du -sh "${CARRY[@]}"
  echo "carry: ${CARRY[*]} (BEFORE: $(cat .before/COMMIT))"
  exit 0
elif [ "$stage" = carry ]; then
  echo "${CARRY[@]}"
  exit 0
fi

out=$(realpath -m "${2:?usage: bash benchmarks/on_gpu.sh STAGE OUTDIR [ARGS]}"); mkdir -p "$out"
installed=$(install_wheels) || { echo "$installed"; exit 1; }
[ -z "$installed" ] || export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
if [ "$stage" = deps ]; then
  [ -z "$installed" ] || echo "$installed"; check_needs; exit
fi
gpu=$(python3 -c "import torch; n=torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'; print(n.split()[1].lower() if n.startswith('NVIDIA') else n.replace(' ', '_').lower())" 2> /dev/null) || gpu=unknown

# run LOG CMD...: one run of a stage, appended to LOG, stopped at the stage's deadline (SIGINT, then SIGKILL 10 s
# later); none starts within 20 s of it
run() {
  local log=$1; shift
  local left=$((deadline - SECONDS))
  if [ $left -lt 20 ]; then echo "on_gpu.sh: out of time, not run: $*" | tee -a "$log"; return 1; fi
  timeout -s INT -k 10 $left "$@" >> "$log" 2>&1
}

collected() {
  # How many tests pytest collects from its arguments
  python3 -m pytest --collect-only -q -p no:cacheprovider "$@" 2> /dev/null | grep -c '::'
}

timing() {
  # train_timing.py rows (ARGS each), one process each, into train_timing_<gpu>.jsonl
  for args in "$@"; do
    run "$out/train_timing_$gpu.log" python3 benchmarks/train_timing.py $args --updates "${UPDATES:-3}" --json "$out/t.json" \
      && python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))))" "$out/t.json" >> "$out/train_timing_$gpu.jsonl"
    tail -1 "$out/train_timing_$gpu.log"
  done; rm -f "$out/t.json"
}

case $stage in
  env)
    nvidia-smi | tee "$out/env_$gpu.txt"
    python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory // 2**20, 'MiB')" | tee -a "$out/env_$gpu.txt"
    python3 -m pip list 2>/dev/null | grep -i -E '^(numpy|pyarrow|fsspec|huggingface.hub|transformers|tiktoken|pytest|pytest-xdist) ' | tee -a "$out/env_$gpu.txt"
    { [ -z "$installed" ] || echo "$installed"; check_needs; } | tee -a "$out/env_$gpu.txt";;
  tests)
    # The CUDA tier (CUDA_TIER above; TESTS_ARGS: other tests, e.g. `tests`, the whole suite): the trainers pick
    # CUDA (utils.get_device) and bf16 (run.bf16 auto) there; the tests that name a device run on both.
    # LMHP_TEST_PARITY_ORIGINALS: see tests/test_parity.py (no TF here). At the deadline pytest stops as after
    # Ctrl-C, and still prints its summary and writes the XML. Then the share of the suite's tests it ran.
    { [ -z "$installed" ] || echo "$installed"; check_needs; } > "$out/pytest_$gpu.log" 2>&1 || { cat "$out/pytest_$gpu.log"; exit 1; }
    [ ! -d .shared ] || export LMHP_TEST_SHARED_DIR=$root/.shared
    workers=${TESTS_WORKERS:-6}  # pytest-xdist's workers (the image has it); 0: none
    selected=${TESTS_ARGS:-${CUDA_TIER[*]}}
    run "$out/pytest_$gpu.log" python3 -m pytest -q -rfEs -p no:cacheprovider $([ "$workers" = 0 ] || echo "-n $workers") \
      $selected --junitxml "$out/pytest_$gpu.xml"
    tail -25 "$out/pytest_$gpu.log"
    covered=$(collected $selected) suite=$(collected tests)
    echo "on_gpu.sh: these tests are $covered of the suite's $suite ($((100 * covered / (suite > 0 ? suite : 1))) %)" \
      | tee -a "$out/pytest_$gpu.log";;
  same_numbers)
    # train_policy test and train_reward test with the paper's --mpi 4 on CUDA and on the CPU, both in fp32
    # (TF32 off: NVIDIA_TF32_OVERRIDE=0 whatever torch's flags say): weights, Adam moments, normalization.
    tmp=$(mktemp -d)
    for dev in cuda cpu; do
      vis=$([ $dev = cpu ] && echo "" || echo "${CUDA_VISIBLE_DEVICES:-0}")
      run "$out/same_numbers_$gpu.log" env CUDA_VISIBLE_DEVICES=$vis NVIDIA_TF32_OVERRIDE=0 python3 launch.py train_policy test run \
        --mpi 4 --save_dir "$tmp/$dev/policy" --ppo.batch_size 32 --ppo.total_episodes 96 --run.bf16 false
      run "$out/same_numbers_$gpu.log" env CUDA_VISIBLE_DEVICES=$vis NVIDIA_TF32_OVERRIDE=0 python3 launch.py train_reward test run \
        --mpi 4 --save_dir "$tmp/$dev/reward" --run.bf16 false
    done
    python3 benchmarks/compare_runs.py "$tmp/cpu" "$tmp/cuda" --atol 1e-5 --json "$out/same_numbers_$gpu.json" 2>&1 | tee -a "$out/same_numbers_$gpu.log";;
  throughput)
    run "$out/ppo_throughput_$gpu.log" python3 benchmarks/ppo_throughput.py --batch 64 --tldr --json "$out/ppo_throughput_$gpu.json"
    tail -30 "$out/ppo_throughput_$gpu.log";;
  memory)
    # MEMORY_ARGS narrows it (e.g. "--shapes tldr"): each measurement is a fresh process, ~20 s on an H100, and
    # the JSON is written after each, so a stage stopped at its deadline keeps what it measured
    run "$out/memory_$gpu.log" python3 benchmarks/memory.py --dtypes bf16 fp32 ${MEMORY_ARGS:-} --json "$out/memory_$gpu.json"
    tail -20 "$out/memory_$gpu.log";;
  timing)
    # The paper's experiments on random weights, 8 ranks in one process (benchmarks/train_timing.py), GPT-2 124M
    # in bf16: books, then tldr, each right before the BEFORE checkout's same run (default .before: prepare's).
    before=$(realpath -m "${3:-$root/.before}")
    [ -f "$before/launch.py" ] || { echo "on_gpu.sh: no BEFORE checkout at $before: run bash benchmarks/on_gpu.sh prepare here, and carry .before"; exit 1; }
    timing "--exp sentiment --model 124M" "--exp sentiment --model 124M --repo $before" \
           "--exp tldr --model 124M" "--exp tldr --model 124M --repo $before";;
  timing_774M)
    timing "--exp sentiment --model 774M" "--exp sentiment --model 774M --microbatch 64";;
  timing_fp32)
    timing "--exp sentiment --model 124M --bf16 false" "--exp tldr --model 124M --bf16 false";;
  profile)
    # One update of books and of tldr (124M, bf16) under torch.profiler: where the time goes, kernel by kernel.
    for exp in sentiment tldr; do
      run "$out/profile_${exp}_$gpu.txt" python3 benchmarks/train_timing.py --exp $exp --model 124M --updates 4 --profile 3
      grep -A3 '^profiled update' "$out/profile_${exp}_$gpu.txt"
    done;;
  bf16_error)
    # bf16 mode against fp32 mode on the same rollouts: |delta logprob| per token and the controller's KL,
    # with this GPU's TF32 n_vocab products (the CPU measures TF32 only emulated).
    run "$out/bf16_error_$gpu.log" python3 benchmarks/bf16_error.py --json "$out/bf16_error_$gpu.json"
    tail -20 "$out/bf16_error_$gpu.log";;
  *) echo "unknown stage $stage"; exit 2;;
esac
