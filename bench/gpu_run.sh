#!/usr/bin/env bash
# shellcheck disable=SC2046  # $(pin N): a command prefix, split into words on purpose
# bench/gpu_run.sh — the GPU machine's batches, the same for a developer at a GPU and for a device
# run: one build (scripts/common.sh's, $EPX_BUILD_DIR, default build/; the tests, the GPU
# benchmarks, epx-bench and the Python extension), then the named batches in the order given.
#
#   bash bench/gpu_run.sh BATCH [BATCH...]        e.g.  bash bench/gpu_run.sh tests bench
#
#   build     only the build (every batch builds first, once; htrace and probe alone skip it:
#             they build their own trees; `ab` alone builds only the targets it runs: the ll
#             bench, and the Python extension for EPX_DEEPEP_TESTS or EPX_AB_OVERHEAD)
#   tests     the GPU GoogleTest tier, each binary bounded ($EPX_TEST_LIMIT s, default 400):
#             R = 1 and the one-GPU multi-rank tests (R = 2, 4, 8 on one GPU) of every binary;
#             ht: HtGpu.OneRank*, HtGpu.WorstCaseGraphReplaysOneRank, Ranks/HtOneGpu.*, then
#             Ranks/HtOneGpu.SideStream* with EPX_ONE_GPU_SIDE_STREAMS=1; with >= 2 GPUs also the
#             rest of ht (the multi-GPU cases; the other binaries' multi-GPU cases run in `*`).
#             EPX_GTEST="gpu_ht_test=Ranks/HtOneGpu.*/R2 gpu_ll_gpu_test=*" runs only those
#             (and, with no batch that needs more, the build makes only those binaries);
#             EPX_GTEST_ARGS is added to every binary (e.g. --gtest_repeat=10).
#   pytest    the GPU tier of pytest (-m gpu; R = 1, 2, 4, 8 as the GPUs allow); EPX_PYTEST_K: a
#             -k selection, EPX_REPEAT: runs of it (one line each), EPX_TEST_GC=1 passes through
#   bench     epx-bench ht, ll, a2a on the cuda backend, R = the visible GPUs, each row beside
#             NCCL's all-to-all and the NVLink ceiling of the same bytes; JSON under $OUT;
#             EPX_BENCH_ARGS added (e.g. "--check --iters 20")
#   gpubench  the per-mode GPU benchmarks (bench/*_gpu_bench*): ht T = 4096 at 16, 24, 32 SMs,
#             ll T in 1..512, a2a (R = the visible GPUs, NCCL and ceiling rows), the one-GPU ht
#             proxy (epx_ht_onegpu_bench), ll at one-GPU R = 2, 4, 8 (epx_ll_onegpu_bench), and
#             epx_sync_probe (what each primitive of the ll kernels' fixed chain costs alone),
#             epx_copy_probe (the ll dispatch receive's copy by expert and by message, alone),
#             with >= 2 GPUs epx_store_probe
#   overlap   epx_ll_overlap_bench: the ll combine overlapped with a cuBLAS down GEMM (T = 128,
#             H = 7168, I = 2048, K = 8, 32 local experts; R = 1 and one-GPU R = 2; send SMs 3, 8,
#             16, 32; both signal forms) against the GEMM then the plain combine, and each part
#             alone: one table (docs/design.md §7.6); EPX_OVERLAP_ARGS added
#   ab        a same-run A/B of the ll kernels: epx_ll_gpu_bench built from the commit
#             $EPX_AB_BASE (default HEAD~1; `git archive` into $EPX_BUILD_DIR-ab.src, built in
#             $EPX_BUILD_DIR-ab; or a source tree's directory, for a commit this checkout lacks)
#             and this tree's; first both trees' ll kernels' SASS bytes (ab.size, with
#             cuobjdump: bench/ptx_size.py --cubin), then the two in turn, $EPX_AB_ROUNDS
#             rounds each (default 2; the base first in odd rounds, this tree first in even
#             ones: ab_sides; R = the visible GPUs, --tokens $EPX_AB_TOKENS, default
#             128,1, E = $EPX_AB_EXPERTS, default 256): one labelled line per T; with
#             EPX_DEEPEP_TESTS also DeepEP's test_low_latency.py through each tree's drop-in
#             (the base's extension built in its tree, this tree's bench/peer_deepep.sh with
#             EPX_REPO), alternately, at each
#             --num-tokens of $EPX_AB_PEER_TOKENS (default: the script's own; after
#             EPX_DEEPEP_ARGS, so it wins): its kernel rows; EPX_DEEPEP_ARGS: more arguments for
#             the DeepEP scripts (ab, peer; e.g. "--num-tokens 32"). Lists: commas or spaces.
#             EPX_AB_OVERHEAD=N (default 0): also the ll pair's host time layer by layer
#             (bench_overhead.py --breakdown at T = 128, H = 7168) through each tree's drop-in,
#             the trees alternately in N processes each
#   profile   bench/profile_kernels.py (torch.profiler kernel times of ll / ht / a2a) and
#             bench/engine_timing.py (DeepEP-style timing through the drop-in, ll and ht T = 4096)
#   peer      bench/peer_deepep.sh $EPX_DEEPEP_TESTS [$EPX_PEER_PROCS, default 1]: DeepEP's own
#             test scripts against epx (skipped unless EPX_DEEPEP_TESTS names DeepEP's tests/ or
#             EPX_DEEPEP_SRC a DeepEP checkout; DeepEP 2.x's V1 scripts: tests/legacy/, taken when
#             there); with EPX_DEEPEP_SRC, DeepEP is built there
#             (bench/build_deepep.sh) and each script and bench/engine_timing.py --peer also run
#             with DeepEP itself, in the same run
#   sweep     issue 26's method over T: DeepEP's test_low_latency.py at --num-tokens in
#             $EPX_SWEEP_TOKENS (default "1 32 128 256"), R = $EPX_SWEEP_PROCS processes (default
#             1; one GPU each: EP2 is EPX_SWEEP_PROCS=2 on two GPUs), pinned, $EPX_SWEEP_ROUNDS
#             rounds (default 2), through the drop-in and (with EPX_DEEPEP_SRC, built as for
#             `peer`) through DeepEP itself, DeepEP first in odd rounds and the drop-in first in
#             even ones; then one table of both
#             (bench/deepep_sweep_table.py, rank 0's rows): kernel rows, hooked rows, L2-flushed
#             event pair. Needs EPX_DEEPEP_TESTS or EPX_DEEPEP_SRC
#   trace     a second build ($EPX_BUILD_DIR-trace: -DEPX_LL_TRACE=ON -DEPX_HT_TRACE=ON, options
#             that change the kernels, so never the main build) and the benchmarks' --trace:
#             per-CTA phase stamps of ht (T = 1, 4096, 16 SMs), ll (T in $EPX_TRACE_TOKENS,
#             default 128,1; E = $EPX_TRACE_EXPERTS, default 256; more arguments in
#             $EPX_TRACE_LL_ARGS, e.g. --trace-ctas: one line per CTA, summarised by
#             bench/trace_ctas.py: copy time against rows and SM), the one-GPU proxy,
#             and the overlapped combine's timeline against the GEMMs (epx_ll_overlap_bench
#             --trace --ranks 1 --sms 3,16,32, then EPX_OVERLAP_ARGS: per expert GEMM end, signal
#             seen, rows stored; the tail after the last GEMM; docs/design.md §7.6).
#             EPX_TRACE_PARTS (default "ht ll overlap"; ht: the two ht benches): the parts run
#             and built; "ll" alone builds epx_ll_gpu_bench only and, given alone, skips the main
#             build, which it does not use
#   htrace    the ll kernels' phases inside DeepEP's harness: a copy of this tree built with
#             -DEPX_LL_TRACE=ON and its Python extension ($EPX_BUILD_DIR-htrace); first that
#             build's epx_sync_probe (what each primitive of the fixed chain costs alone); then
#             DeepEP's test_low_latency.py (EPX_DEEPEP_TESTS or EPX_DEEPEP_SRC/tests) through that
#             tree's drop-in at each --num-tokens of $EPX_HTRACE_TOKENS (default 128) with
#             EPX_LL_TRACE_DUMP (every dispatch call's stamps; a stream sync at each next call)
#             and nvidia-smi's SM clock, power and P-state every 100 ms (htrace.smi.t<T>.log),
#             then epx_ll_gpu_bench --trace-file over the newest 20 records per mode: the script
#             ends with its profiled calls (no hook, then hook), so those are the launches its
#             kernel rows time; and the same build's --trace-only (R = 1, E = 288) beside them
#             (docs/perf.md §5 items 56-57)
#   probe     the diagnostics of the ll kernels' parts alone, in a build of their own
#             ($EPX_BUILD_DIR-probe, those two targets only; no main build needed):
#             epx_sync_probe (each primitive of the fixed chain, and the SM's instruction issue
#             and fetch) and epx_send_probe (the dispatch's send half alone, the production code;
#             docs/perf.md §5 item 59); with EPX_PROBE_BASE (other source trees, space-separated,
#             e.g. main's `git archive` in peers/base-main) each tree's epx_send_probe too, all
#             alternately, EPX_PROBE_ROUNDS rounds (default 2)
#   ablate    a diagnostics build ($EPX_BUILD_DIR-diag: -DEPX_DIAGNOSTICS=ON, epx_ll_gpu_bench only)
#             and epx_ll_gpu_bench --ablate (R = the visible GPUs, E = $EPX_AB_EXPERTS, default
#             256, T = 128 and 1): each row again without one stage of the ll kernels (the send's
#             rows, the receive's list and copy, its copy, its scales, the pulls; cuda/tuning.h)
#             and with each candidate variant (outputs exact: the bench's check runs under it);
#             then the same stages left out in the rows engines take: a copy of this tree built
#             with -DEPX_DIAGNOSTICS=ON and its Python extension ($EPX_BUILD_DIR-diagpy), and
#             bench/engine_timing.py --tokens 128 --cold (E as above) through that copy's drop-in,
#             one pinned process per EPX_LL_ABLATE value of $EPX_ABLATE_BITS (default
#             "0 1 2 4 8"; empty: this part skipped; a value given again runs again, its steps
#             named .2, .3, ...); where EPX_DEEPEP_TESTS or EPX_DEEPEP_SRC names DeepEP's tests,
#             after each of those processes DeepEP's test_low_latency.py through the same copy's
#             drop-in with the same value (--num-experts E: its kernel rows per value)
#   ncu       Nsight Compute's warp-state sampling of the ll kernels (skipped without ncu):
#             epx_ll_gpu_bench --ranks 1 at T in $EPX_NCU_TOKENS (default "128 1"), E =
#             $EPX_AB_EXPERTS (default 256), one dispatch and one combine launch profiled
#             (WarpStateStats, SourceCounters, sampling every 32 cycles, --cache-control none,
#             --clock-control none: the clocks as the GPU runs them; SpeedOfLight: the SM
#             frequency and duration it saw, printed); each report's SASS listing as CSV
#             (ncu_ll_tT.csv), the kernels' disassembly with source lines (ncu_ll.disasm: the
#             build has -lineinfo) and one table
#             of the stall reasons' shares with the top instructions and source lines
#             (bench/ncu_stalls.py; docs/perf.md §5 item 32). EPX_NCU_HOOK=1 instead: the
#             hooked receive halves of dispatch and combine as DeepEP's harness runs them
#             (bench/ncu_hook.py: each hook after an 8192^2 matmul; --cache-control all), one
#             launch each per T, with the Python extension's disassembly (item 72);
#             EPX_NCU_HALVES="send recv" (default "recv"): the send halves too (item 75).
#             EPX_NCU_BYTES=1 instead: DRAM and L2 traffic of the fused dispatch and the combine
#             as the harness's kernel rows run them (ncu_hook.py --fused; item 91)
#   overhead  tests/python/bench_overhead.py --device cuda (the host cost of one Python call: tiny
#             shape with the ll pair layer by layer (--breakdown), ll decode shape; the cpu backend
#             beside it) and its pytest
#   main      scripts/run.sh (the README's main job: the demo on every GPU, epx-bench --check)
#
# Host-timed steps (ab's DeepEP harness, profile, peer, overhead) run pinned: `taskset -c` to
# cores $EPX_PIN_FIRST (default 1) .. +P-1 for P processes, as engines pin theirs; unpinned, the
# host time per call varies by tens of µs between processes on the GPU machine (docs/perf.md
# §4.3). EPX_PIN=0 runs them unpinned.
#
# Every process gets NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# (never NVLink multicast on the shared hosts). Logs: $OUT (default /tmp/epx-out), one per step,
# plus env.log (the date, the checkout's HEAD and whether these files are its, the files' git
# tree id, the GPUs and cores). Each step prints its status and duration (and its result rows or
# failure lines); the end, a table of all steps. Exit status: 0 when every step passed (skips
# count as passed), 1 when any failed or timed out, 2 on a usage error.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

BATCHES="build tests pytest bench gpubench overlap ab profile peer sweep trace htrace probe ablate ncu overhead main"
usage() {
  sed -n '3,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 2
}
[ $# -gt 0 ] || usage
for b in "$@"; do
  [[ " $BATCHES " == *" $b "* ]] || { echo "gpu_run.sh: unknown batch '$b' (one of: $BATCHES)" >&2; usage; }
done

# shellcheck source=scripts/common.sh
source scripts/common.sh
epx_setup_env  # EPX_BUILD_DIR, EPX_PYTHON, PATH, and the no-multicast environment below
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN} PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/epx-out}
mkdir -p "$OUT"
B=$EPX_BUILD_DIR
GEN=""  # the generator of the extra builds (trace, ab): ninja where it exists
command -v ninja >/dev/null && GEN="-G Ninja"
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  G=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
else
  G=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
fi
# The files this run builds, as a git tree id: a copied checkout may carry another commit's .git
# (its HEAD is then not these files), and `git rev-parse <commit>^{tree}` names the commit whose
# files they are. A throw-away index, so the checkout's own is not touched.
tree_id() {
  local idx
  idx=$(mktemp -u)
  GIT_INDEX_FILE=$idx git add -A . 2>/dev/null && GIT_INDEX_FILE=$idx git write-tree 2>/dev/null
  rm -f "$idx"
}
TREE=$(tree_id)
# env.log's head line: the checkout's .git HEAD and whether these files are that commit's ($1:
# their tree id); a copied checkout may carry an older .git, whose HEAD is then no commit of
# this run (the tree id names the files).
head_line() {
  local head
  head=$(git log -1 --oneline 2>/dev/null) || { echo "head: none"; return; }
  if [ -n "$1" ] && [ "$(git rev-parse 'HEAD^{tree}' 2>/dev/null)" = "$1" ]; then
    echo "head: $head (these files)"
  else
    echo "head: $head (not these files: see the tree below)"
  fi
}
{ date -u; head_line "$TREE"; echo "files: tree ${TREE:-unknown}"
  echo "batches: $*"; echo "GPUs visible: $G"
  nvidia-smi -L; nvidia-smi topo -m; echo "cores: $(nproc)"; } > "$OUT/env.log" 2>&1
echo "== gpu_run.sh $* — $G GPU(s), build $B, logs $OUT, files: tree ${TREE:-unknown}"
T0=$(date +%s)
results=()
failed=()

# step NAME LIMIT_S SHOW CMD...: CMD bounded by LIMIT_S, its output in $OUT/NAME.log; prints the
# status and duration, then the log lines matching the extended regex SHOW (none when empty) and,
# when CMD failed, its failure lines. Status 0 when CMD passed.
step() {
  local name=$1 limit=$2 show=$3 s rc d st
  shift 3
  s=$(date +%s)
  timeout -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  d=$(( $(date +%s) - s ))
  case $rc in
    0) st=ok ;;
    124 | 137) st="TIMEOUT (${limit} s)" ;;
    *) st="FAILED rc=$rc" ;;
  esac
  echo "== $name: $st ($d s)"
  results+=("$(printf '%-34s %-18s %6d s' "$name" "$st" "$d")")
  [ -n "$show" ] && grep -E "$show" "$OUT/$name.log" | cut -c1-200 | head -60
  if [ $rc -ne 0 ]; then
    failed+=("$name")
    grep -E "FAILED|Failure|[Ee]rror|mismatch|differ|waited|[Tt]imeout|exception|Expected|rank [0-9]" \
      "$OUT/$name.log" | cut -c1-300 | head -25
  fi
  return $rc
}

# skip NAME REASON: a step that cannot run here.
skip() {
  echo "== $1: SKIPPED ($2)"
  results+=("$(printf '%-34s %-18s %6s' "$1" SKIPPED -) $2")
}

have_gpu() { [ "$G" -ge 1 ]; }

# The CUDA toolkit's bin directory (nvcc's, else /usr/local/cuda/bin): cuobjdump and nvdisasm.
cuda_bin() { dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"; }

# pin P: the command prefix that pins a step's command to P cores from $EPX_PIN_FIRST (see the
# header; `step` runs its command under `timeout`, so the prefix is a program, not a function):
# `taskset -c A-B`, or `env` with EPX_PIN=0 or without taskset. Used unquoted: $(pin 1) CMD...
pin() {
  local first=${EPX_PIN_FIRST:-1}
  if [ "${EPX_PIN:-1}" = 0 ] || ! command -v taskset >/dev/null; then
    echo env
  else
    echo "taskset -c $first-$((first + $1 - 1))"
  fi
}

# ab_targets: what `ab` builds of a tree: the ll bench, and the Python extension when DeepEP's
# harness (EPX_DEEPEP_TESTS) or the host-time rows (EPX_AB_OVERHEAD) run through the drop-in.
ab_targets() {
  if [ -z "${EPX_DEEPEP_TESTS:-}" ] && [ "${EPX_AB_OVERHEAD:-0}" = 0 ]; then
    echo epx_ll_gpu_bench
  else
    echo "epx_ll_gpu_bench _epx"
  fi
}

# main_targets BATCH...: the main build's targets for the batches given (empty: every target):
# `ab` needs only ab_targets of this tree, `tests` with EPX_GTEST only the binaries it names,
# `ncu` the ll bench (and with EPX_NCU_HOOK=1 the Python extension); any other batch (or `tests`
# without EPX_GTEST) builds every target.
main_targets() {
  local b t words=() targets=() out=()
  for b in "$@"; do
    case "$b" in
      build) ;;
      ab)
        read -ra words <<<"$(ab_targets)"
        targets+=("${words[@]}")
        ;;
      tests)
        [ -n "${EPX_GTEST:-}" ] || return 0
        read -ra words <<<"$EPX_GTEST"  # (no glob expansion of the filters)
        for t in "${words[@]}"; do targets+=("${t%%=*}"); done
        ;;
      ncu)
        targets+=(epx_ll_gpu_bench)
        [ "${EPX_NCU_HOOK:-0}" != 1 ] && [ "${EPX_NCU_BYTES:-0}" != 1 ] || targets+=(_epx)
        ;;
      *) return 0 ;;
    esac
  done
  for t in "${targets[@]}"; do  # each target once
    case " ${out[*]} " in *" $t "*) ;; *) out+=("$t") ;; esac
  done
  echo "${out[*]}"
}

do_build() {
  local targets
  targets=$(main_targets "$@")
  [ -z "$targets" ] || echo "== build: only $targets (the batches given use no other target)"
  # shellcheck disable=SC2016  # $1 is the inner shell's: the targets
  step build 1200 "" bash -c 'source scripts/common.sh && epx_setup_env &&
    epx_configure_and_build "$1"' _ "$targets" || { tail -40 "$OUT/build.log"; return 1; }
}

# side_build NAME LIMIT SRC DIR TARGETS [CMAKE_OPTION...]: step NAME, a Release CUDA build of the
# source tree SRC in DIR (the extra builds: ab's base, trace, ablate; options that differ from the
# main build's, so never in it), only TARGETS (space-separated); the log's tail on failure.
side_build() {
  local name=$1 limit=$2 src=$3 dir=$4 targets=$5
  shift 5
  # shellcheck disable=SC2016  # $1.. expand in the inner shell
  step "$name" "$limit" "" bash -c 'src=$1 dir=$2 targets=$3 gen=$4 jobs=$5
    shift 5
    # shellcheck disable=SC2086  # gen and targets: lists of words
    cmake -S "$src" -B "$dir" $gen -DCMAKE_BUILD_TYPE=Release -DEPX_WITH_CUDA=ON "$@" &&
      cmake --build "$dir" -j "$jobs" --target $targets' \
    side_build "$src" "$dir" "$targets" "$GEN" "$(nproc)" "$@" ||
    { tail -40 "$OUT/$name.log"; return 1; }
}

# ab_sides REV ROUND: the order in which round ROUND of an A/B runs the two trees: the base first
# in odd rounds, this tree first in even ones, so that an even number of rounds puts each tree
# first as often (whatever the first process of a pair gains or loses over the second cancels in
# the mean; docs/perf.md §5 item 70).
ab_sides() {
  if [ $(($2 % 2)) -eq 1 ]; then echo "$1 head"; else echo "head $1"; fi
}

# gtest NAME BINARY FILTER [VAR=VALUE...]: one bounded run of a GPU test binary.
GTEST_SHOW='^\[  (PASSED|FAILED|SKIPPED) \]|^\[  FAILED  \]'
gtest() {
  local name=$1 bin=$2 filter=$3
  shift 3
  # shellcheck disable=SC2086
  step "tests.$name" "${EPX_TEST_LIMIT:-400}" "$GTEST_SHOW" env "$@" "$B/tests/gpu/$bin" \
    --gtest_filter="$filter" ${EPX_GTEST_ARGS:-}
}

batch_tests() {
  local one='HtGpu.OneRank*:HtGpu.WorstCaseGraphReplaysOneRank:Ranks/HtOneGpu.*' t bin
  if [ -n "${EPX_GTEST:-}" ]; then
    local i=0 words=()
    read -ra words <<<"$EPX_GTEST"  # (no glob expansion of the filters)
    for t in "${words[@]}"; do
      i=$((i + 1))
      gtest "$i.${t%%=*}" "${t%%=*}" "${t#*=}"
    done
    return
  fi
  for bin in "$B"/tests/gpu/gpu_*test; do
    [ -x "$bin" ] || continue
    bin=$(basename "$bin")
    if [ "$bin" = gpu_ht_test ]; then
      gtest ht_test gpu_ht_test "$one"
      gtest ht_test.side_streams gpu_ht_test 'Ranks/HtOneGpu.SideStream*' EPX_ONE_GPU_SIDE_STREAMS=1
      if [ "$G" -ge 2 ]; then
        gtest ht_test.multi_gpu gpu_ht_test "*-$one"
      else
        skip tests.ht_test.multi_gpu "the multi-GPU ht cases need 2 GPUs, $G visible"
      fi
    else
      gtest "${bin#gpu_}" "$bin" '*'
    fi
  done
}

batch_pytest() {
  local k=() i
  [ -n "${EPX_PYTEST_K:-}" ] && k=(-k "$EPX_PYTEST_K")
  for i in $(seq 1 "${EPX_REPEAT:-1}"); do
    step "pytest.$i" "${EPX_PYTEST_LIMIT:-540}" "passed|failed|^FAILED|^ERROR" "$EPX_PYTHON" -m pytest -q -rs \
      -m gpu "${k[@]}" tests/python
  done
}

batch_bench() {
  local mode extra
  for mode in ht ll a2a; do
    extra=()
    [ "$mode" = a2a ] && extra=(--tokens "1,128,4096")  # the standard a2a workloads
    # shellcheck disable=SC2086
    step "bench.$mode" 300 "^op|^$mode\.|PASS|FAIL|SKIPPED" "$B/bench/epx-bench" "$mode" \
      --backend cuda --json "$OUT/bench-$mode.json" "${extra[@]}" ${EPX_BENCH_ARGS:-}
  done
}

batch_gpubench() {
  local rows="^SMs|^ +[0-9]+ |dispatch|combine|NCCL|ceiling|target|check"
  step gpubench.ht 240 "$rows" "$B/bench/epx_ht_gpu_bench" --ranks "$G" --iters 20 --tokens 4096 \
    --sms 16,24,32
  step gpubench.ll 150 "$rows" "$B/bench/epx_ll_gpu_bench" --ranks "$G" --tokens 1,32,128,256,512 \
    --iters 20
  step gpubench.a2a 150 "$rows" "$B/bench/epx_a2a_gpu_bench" --ranks "$G" --iters 20
  step gpubench.ht_onegpu 150 "dispatch|combine" "$B/bench/epx_ht_onegpu_bench" --sms 16
  step gpubench.ll_onegpu 150 "^\|" "$B/bench/epx_ll_onegpu_bench" --ranks 2,4,8
  step gpubench.sync_probe 120 "." "$B/bench/epx_sync_probe"
  step gpubench.copy_probe 60 "." "$B/bench/epx_copy_probe"
  if [ "$G" -ge 2 ]; then
    step gpubench.store_probe 60 "." "$B/bench/epx_store_probe" --ctas 128 --tokens-per-cta 1
  else
    skip gpubench.store_probe "needs 2 GPUs, $G visible"
  fi
}

batch_overlap() {
  if [ ! -x "$B/bench/epx_ll_overlap_bench" ]; then
    skip overlap "epx_ll_overlap_bench was not built (no cuBLAS in the CUDA toolkit)"
    return
  fi
  # shellcheck disable=SC2086
  step overlap 120 "^ll combine|^\|" "$B/bench/epx_ll_overlap_bench" --ranks 1 \
    ${EPX_OVERLAP_ARGS:-}
}

# ab_sizes SIDE BINARY: the SASS bytes of the ll dispatch and combine kernels in BINARY's cubins
# (code that DeepEP's harness runs cold: docs/perf.md §5 item 36), one line per kernel.
ab_sizes() {
  local side=$1 bin cu
  bin=$(realpath "$2")
  cu=$(cuda_bin)
  if [ ! -x "$cu/cuobjdump" ]; then
    skip "ab.size.$side" "no cuobjdump beside nvcc"
    return 0
  fi
  # shellcheck disable=SC2016  # expanded by the inner shell
  step "ab.size.$side" 60 "" bash -c 'tmp=$(mktemp -d) && cd "$tmp" &&
    "$1/cuobjdump" -xelf all "$2" > /dev/null && "$3" "$4" --cubin ./*.cubin \
      --kernel "^_ZN3epx2ll(8dispatch|7combine)"; rc=$?; rm -rf "$tmp"; exit $rc' \
    _ "$cu" "$bin" "$EPX_PYTHON" "$(pwd)/bench/ptx_size.py" &&
    sed "s/^/  [$side] /" "$OUT/ab.size.$side.log"
}

# src_stamp DIR: one hash of every file's path and bytes under DIR (not their times).
src_stamp() {
  (cd "$1" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha1sum | sha1sum | cut -c1-40)
}

# ab_keep_build SRC DIR: keeps the build DIR of the last base only when SRC holds the same files,
# else removes it. The base's sources come out of `git archive` / tar with their commit's times,
# which may be older than a previous base's objects in DIR: ninja would then rebuild nothing and
# run the previous base's binaries under this base's name (docs/perf.md §5 item 70, run 182).
ab_keep_build() {
  local stamp
  stamp=$(src_stamp "$1")
  [ "$(cat "$2/.epx-ab-src" 2>/dev/null)" = "$stamp" ] || rm -rf "$2"
  mkdir -p "$2" && echo "$stamp" > "$2/.epx-ab-src.new"
}

batch_ab() {
  local base=${EPX_AB_BASE:-HEAD~1} dir="$B-ab" rev
  rm -rf "$dir.src" && mkdir -p "$dir.src"
  if [ -d "$base" ] && [ -f "$base/CMakeLists.txt" ]; then
    # A source tree (e.g. `git archive <commit> | tar -x -C peers/base`, carried to a machine
    # whose checkout lacks that commit).
    rev=base
    tar -C "$base" --exclude='./build*' -cf - . | tar -x -C "$dir.src"
  else
    rev=$(git rev-parse --short "$base" 2>/dev/null) || {
      skip ab "EPX_AB_BASE '$base' is neither a commit of this checkout nor a source tree"
      return
    }
    git archive "$rev" | tar -x -C "$dir.src"
  fi
  local py=OFF targets tests=${EPX_DEEPEP_TESTS:-} overhead=${EPX_AB_OVERHEAD:-0}
  targets=$(ab_targets)
  [[ " $targets " != *" _epx "* ]] || py=ON
  ab_keep_build "$dir.src" "$dir"
  side_build ab.build 600 "$dir.src" "$dir" "$targets" -DEPX_BUILD_PYTHON="$py" \
    -DPython3_EXECUTABLE="$EPX_PYTHON" || return 1
  mv "$dir/.epx-ab-src.new" "$dir/.epx-ab-src"  # a build of these sources is complete
  ab_sizes "$rev" "$dir/bench/epx_ll_gpu_bench"
  ab_sizes head "$B/bench/epx_ll_gpu_bench"
  local round side bin toks ntoks
  toks=${EPX_AB_TOKENS:-128,1}
  toks=${toks// /,}  # commas or spaces
  ntoks=$(tr ',' '\n' <<<"$toks" | grep -c .)
  for round in $(seq "${EPX_AB_ROUNDS:-2}"); do
    for side in $(ab_sides "$rev" "$round"); do
      bin="$B/bench/epx_ll_gpu_bench"
      [ "$side" = head ] || bin="$dir/bench/epx_ll_gpu_bench"
      step "ab.$side.$round" 120 "" "$bin" --ranks "$G" --experts "${EPX_AB_EXPERTS:-256}" \
        --tokens "$toks" --iters 30 || continue
      grep -E "^ +T \|" "$OUT/ab.$side.$round.log" | head -1 | sed "s/^/  [$side] /"
      # each row as measured (the benchmark prints them again, sorted, in its closing table)
      grep -E "^ +[0-9]+ \|" "$OUT/ab.$side.$round.log" | head -n "$ntoks" | sed "s/^/  [$side] /"
    done
  done
  [ "$overhead" = 0 ] || ab_overhead "$rev" "$dir.src" "$overhead"
  [ -n "$tests" ] || return 0
  # DeepEP's own harness through each tree's drop-in (the kernel rows engines compare), the two
  # trees alternately.
  local root t name args label
  local peer_tokens=${EPX_AB_PEER_TOKENS:--}  # "-": the script's own token count
  for t in ${peer_tokens//,/ }; do
    for round in $(seq "${EPX_AB_ROUNDS:-2}"); do
      for side in $(ab_sides "$rev" "$round"); do
        root=$(pwd)
        [ "$side" = head ] || root=$(cd "$dir.src" && pwd)
        name="ab.peer.$side.$round" args=${EPX_DEEPEP_ARGS:-} label=$side
        [ "$t" = - ] || { name="$name.t$t" args="$args --num-tokens $t" label="$side T=$t"; }
        step "$name" 150 "" $(pin 1) env EPX_REPO="$root" EPX_DEEPEP_ARGS="$args" \
          bash bench/peer_deepep.sh "$tests" 1 test_low_latency.py || continue
        grep -E "avg_t|send/recv" "$OUT/$name.log" | sed "s/^/  [$label] /"
      done
    done
  done
}

# ab_overhead REV SRC N: the ll pair's host time through each tree's drop-in (this tree's
# bench_overhead.py --breakdown with the tree's own package first on PYTHONPATH; the harness's
# shape, E = $EPX_AB_EXPERTS), the trees alternately in N processes each, pinned. The harness's
# event pair follows each process's host speed (docs/perf.md §4.5, runs 166-167); this
# alternates the trees within seconds, so it ranks their host code.
ab_overhead() {
  local rev=$1 src=$2 n=$3 round side pp name
  local rows='^T=|^\| (compat pair|deep_ep layer|epx.Buffer layer|bindings|output allocations \(us\)'
  rows+='|C\+\+ op)'
  for round in $(seq "$n"); do
    for side in $(ab_sides "$rev" "$round"); do
      pp=$PWD/python
      [ "$side" = head ] || pp=$(cd "$src" && pwd)/python
      name="ab.overhead.$side.$round"
      step "$name" 240 "" $(pin 1) env PYTHONPATH="$pp" "$EPX_PYTHON" \
        tests/python/bench_overhead.py --device cuda --iters 300 --repeats 2 --breakdown 5 \
        --tokens 128 --hidden 7168 --experts "${EPX_AB_EXPERTS:-256}" --max-tokens 128 || continue
      # (the T= line names the torch bridge's path: the columns are ATen's and the attribute
      # path's only where both trees loaded their ATen module)
      grep -E "$rows" "$OUT/$name.log" | sed "s/^/  [$side] /"
    done
  done
}

batch_profile() {
  # shellcheck disable=SC2086
  step profile.kernels 300 "^(op|ll|ht|a2a|profile)" $(pin 1) "$EPX_PYTHON" \
    bench/profile_kernels.py ${EPX_PROFILE_ARGS:-}
  # shellcheck disable=SC2086
  step profile.engine_timing 300 "^ *(epx|DeepEP) |^module|^engine|^ht" $(pin 1) \
    "$EPX_PYTHON" bench/engine_timing.py --ht-tokens 4096 ${EPX_ENGINE_TIMING_ARGS:-}
}

# deepep_tests_dir: the directory of DeepEP's V1 test scripts, from EPX_DEEPEP_TESTS or
# EPX_DEEPEP_SRC's tests/ (empty when neither is set); DeepEP 2.x keeps them in tests/legacy/
# (peer_deepep.sh finds their helpers).
deepep_tests_dir() {
  local dir=${EPX_DEEPEP_TESTS:-}
  [ -n "$dir" ] || [ -z "${EPX_DEEPEP_SRC:-}" ] || dir=$EPX_DEEPEP_SRC/tests
  [ ! -e "$dir/legacy/test_low_latency.py" ] || dir=$dir/legacy
  echo "$dir"
}

# deepep_inputs BATCH: DeepEP's tests/ into DEEPEP_TESTS and, with EPX_DEEPEP_SRC, DeepEP built
# there (step BATCH.build_deepep) into DEEPEP_SELF (empty when not built); status 1 (the batch
# skipped) when neither EPX_DEEPEP_TESTS nor EPX_DEEPEP_SRC names them.
deepep_inputs() {
  DEEPEP_TESTS=$(deepep_tests_dir)
  DEEPEP_SELF=""
  if [ -z "$DEEPEP_TESTS" ]; then
    skip "$1" "set EPX_DEEPEP_TESTS to a directory holding DeepEP's tests/, or EPX_DEEPEP_SRC to \
a DeepEP checkout (bench/peer_deepep.sh)"
    return 1
  fi
  if [ -n "${EPX_DEEPEP_SRC:-}" ] &&
    step "$1.build_deepep" 400 "" bash bench/build_deepep.sh "$EPX_DEEPEP_SRC"; then
    DEEPEP_SELF=$EPX_DEEPEP_SRC
  fi
}

batch_peer() {
  deepep_inputs peer || return 0
  step peer 540 "^== |passed|failed|Error|bandwidth|send/recv" $(pin "${EPX_PEER_PROCS:-1}") \
    env EPX_DEEPEP_SELF="$DEEPEP_SELF" \
    bash bench/peer_deepep.sh "$DEEPEP_TESTS" "${EPX_PEER_PROCS:-1}"
  if [ -n "$DEEPEP_SELF" ]; then
    step peer.engine_timing 300 "^ *(epx|DeepEP) |^module|^engine|^cold" $(pin 1) "$EPX_PYTHON" \
      bench/engine_timing.py --tokens 128 --experts 288 --cold --peer "$DEEPEP_SELF"
  fi
}

batch_sweep() {
  local procs=${EPX_SWEEP_PROCS:-1}
  if [ "$procs" -gt "$G" ]; then
    skip sweep "EPX_SWEEP_PROCS=$procs needs $procs GPUs, $G visible"
    return 0
  fi
  deepep_inputs sweep || return 0
  local round T logs=()
  for round in $(seq "${EPX_SWEEP_ROUNDS:-2}"); do
    for T in ${EPX_SWEEP_TOKENS:-1 32 128 256}; do
      # DeepEP itself first in odd rounds, the drop-in first in even ones (as ab_sides).
      step "sweep.T$T.$round" 300 "" $(pin "$procs") env EPX_DEEPEP_SELF="$DEEPEP_SELF" \
        EPX_DEEPEP_SELF_AFTER=$(( 1 - round % 2 )) \
        EPX_DEEPEP_ARGS="--num-tokens $T${EPX_DEEPEP_ARGS:+ $EPX_DEEPEP_ARGS}" \
        bash bench/peer_deepep.sh "$DEEPEP_TESTS" "$procs" test_low_latency.py
      logs+=("$OUT/sweep.T$T.$round.log")
    done
  done
  "$EPX_PYTHON" bench/deepep_sweep_table.py "${logs[@]}" | tee "$OUT/sweep.table.md"
}

# trace_parts: EPX_TRACE_PARTS as " part part ... " (for matching " part ").
trace_parts() { echo " ${EPX_TRACE_PARTS:-ht ll overlap} "; }

batch_trace() {
  local T="$B-trace" parts targets="" p
  parts=$(trace_parts)
  for p in $parts; do
    case $p in
      ht | ll | overlap) ;;
      *) skip trace "EPX_TRACE_PARTS: unknown part '$p' (ht, ll, overlap)"; return 0 ;;
    esac
  done
  [[ $parts == *" ht "* ]] && targets="epx_ht_gpu_bench epx_ht_onegpu_bench"
  [[ $parts == *" ll "* ]] && targets="$targets epx_ll_gpu_bench"
  # The overlap bench exists where the main build found cuBLAS.
  [[ $parts == *" overlap "* ]] && [ -x "$B/bench/epx_ll_overlap_bench" ] &&
    targets="$targets epx_ll_overlap_bench"
  if [ -z "$targets" ]; then
    skip trace "nothing to build for EPX_TRACE_PARTS='${EPX_TRACE_PARTS:-}'"
    return 0
  fi
  side_build trace.build 900 . "$T" "$targets" -DEPX_LL_TRACE=ON -DEPX_HT_TRACE=ON \
    -DEPX_BUILD_PYTHON=OFF || return 1
  local rows="^\[trace|graph of 10|empty kernel|16 B per|zero-copy, graph\)"
  if [[ $parts == *" ht "* ]]; then
    step trace.ht_t1 120 "$rows" "$T/bench/epx_ht_gpu_bench" --trace --ranks "$G" --iters 20 \
      --tokens 1 --sms 16
    step trace.ht_t4096 120 "$rows" "$T/bench/epx_ht_gpu_bench" --trace --ranks "$G" --iters 20 \
      --tokens 4096 --sms 16
  fi
  if [[ $parts == *" ll "* ]]; then
    # shellcheck disable=SC2086
    step trace.ll 120 "^\[trace|^ +[0-9]+ \|" "$T/bench/epx_ll_gpu_bench" --trace --ranks "$G" \
      --tokens "${EPX_TRACE_TOKENS:-128,1}" --experts "${EPX_TRACE_EXPERTS:-256}" --iters 20 \
      ${EPX_TRACE_LL_ARGS:-}
    if grep -q "^  cta T=" "$OUT/trace.ll.log"; then  # --trace-ctas: the copy per CTA, summarised
      step trace.ctas 60 "" "$EPX_PYTHON" bench/trace_ctas.py "$OUT/trace.ll.log" &&
        cat "$OUT/trace.ctas.log"
    fi
  fi
  [[ $parts == *" ht "* ]] &&
    step trace.ht_onegpu 150 "^\[trace|dispatch|combine" "$T/bench/epx_ht_onegpu_bench" \
      --trace --sms 16
  [[ $parts == *" overlap "* ]] || return 0
  if [ -x "$T/bench/epx_ll_overlap_bench" ]; then
    # shellcheck disable=SC2086
    step trace.overlap 300 "^\[trace|^\|" "$T/bench/epx_ll_overlap_bench" --trace --ranks 1 \
      --sms 3,16,32 ${EPX_OVERLAP_ARGS:-}
  else
    skip trace.overlap "epx_ll_overlap_bench was not built (no cuBLAS in the CUDA toolkit)"
  fi
}

# tree_copy DIR: DIR emptied, then this tree as it is (tracked or not) copied into it, without
# builds, .git or peers/: the source of a side build whose Python extension (built into the
# copy's python/epx) must not replace this tree's.
tree_copy() {
  rm -rf "$1" && mkdir -p "$1" &&
    tar --exclude='./build*' --exclude=./.git --exclude=./peers -cf - . | tar -x -C "$1"
}

batch_htrace() {
  deepep_inputs htrace || return 0
  local dir="$B-htrace" t dump
  tree_copy "$dir.src"  # (its extension is built into the copy's python/epx)
  side_build htrace.build 900 "$dir.src" "$dir" "epx_ll_gpu_bench _epx epx_sync_probe" \
    -DEPX_LL_TRACE=ON -DEPX_BUILD_PYTHON=ON -DPython3_EXECUTABLE="$EPX_PYTHON" || return 1
  # What the chain's primitives cost alone on this GPU (the phases' yardstick).
  step htrace.sync_probe 120 "." "$dir/bench/epx_sync_probe"
  for t in ${EPX_HTRACE_TOKENS:-128}; do
    dump=/tmp/epx-htrace.t$t
    rm -f "$dump.rank"*
    # The SM clock and power as nvidia-smi samples them (every 100 ms) while the harness runs,
    # beside the clock each traced launch ran at (--trace-file's "SM clock" rows).
    local smi=""
    if command -v nvidia-smi > /dev/null; then
      nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,pstate,utilization.gpu \
        --format=csv -lms 100 > "$OUT/htrace.smi.t$t.log" 2>&1 &
      smi=$!
    fi
    step "htrace.peer.t$t" 300 "avg_t|send/recv" $(pin 1) env EPX_REPO="$(cd "$dir.src" && pwd)" \
      EPX_LL_TRACE_DUMP="$dump" EPX_DEEPEP_ARGS="--num-tokens $t${EPX_DEEPEP_ARGS:+ $EPX_DEEPEP_ARGS}" \
      bash bench/peer_deepep.sh "$DEEPEP_TESTS" 1 test_low_latency.py
    if [ -n "$smi" ]; then
      kill "$smi" 2> /dev/null
      wait "$smi" 2> /dev/null
      # The SM clocks seen, by how often (MHz), and the P-states.
      echo "htrace.smi.t$t: SM MHz (samples): $(awk -F', ' 'NR > 1 {print $2}' \
        "$OUT/htrace.smi.t$t.log" | sort | uniq -c | sort -rn | head -8 | tr -s ' \n' ' ')"
    fi
    step "htrace.t$t" 120 "" "$dir/bench/epx_ll_gpu_bench" --trace-file "$dump.rank0" \
      --trace-last 20 && cat "$OUT/htrace.t$t.log"
    # The same build's own loop beside it (E = 288 as the script's default).
    step "htrace.bench.t$t" 120 "^\[trace|^  [a-z]|^    [a-zA-Z+]" "$dir/bench/epx_ll_gpu_bench" \
      --trace-only --ranks 1 --tokens "$t" --experts 288 --iters 20
  done
}

batch_probe() {
  local D="$B-probe" bases=() t i round
  side_build probe.build 600 . "$D" "epx_sync_probe epx_send_probe" -DEPX_BUILD_PYTHON=OFF ||
    return 1
  step probe.sync 180 "." "$D/bench/epx_sync_probe"
  # EPX_PROBE_BASE: source trees with the probes (space-separated), each one's send probe beside
  # this tree's, alternately, EPX_PROBE_ROUNDS rounds (a kernel change's effect on the send alone).
  for t in ${EPX_PROBE_BASE:-}; do
    if [ -f "$t/bench/send_probe.cu" ]; then
      bases+=("$t")
    else
      skip probe.base "EPX_PROBE_BASE '$t' is not a source tree with bench/send_probe.cu"
    fi
  done
  if [ ${#bases[@]} -eq 0 ]; then
    step probe.send 180 "." "$D/bench/epx_send_probe"
    return
  fi
  for i in "${!bases[@]}"; do
    echo "== probe.base$((i + 1)): ${bases[$i]}"
    side_build "probe.base$((i + 1)).build" 600 "${bases[$i]}" "$D-base$((i + 1))" \
      epx_send_probe -DEPX_BUILD_PYTHON=OFF || return 1
  done
  for round in $(seq "${EPX_PROBE_ROUNDS:-2}"); do
    for i in "${!bases[@]}"; do
      step "probe.send.base$((i + 1)).$round" 180 "." "$D-base$((i + 1))/bench/epx_send_probe"
    done
    step "probe.send.head.$round" 180 "." "$D/bench/epx_send_probe"
  done
}

batch_ablate() {
  local D="$B-diag"
  side_build ablate.build 600 . "$D" epx_ll_gpu_bench -DEPX_DIAGNOSTICS=ON -DEPX_BUILD_PYTHON=OFF ||
    return 1
  step ablate.ll 240 "^ +T \||^ +(1|128) \||without|variant|^check" "$D/bench/epx_ll_gpu_bench" \
    --ranks "$G" --experts "${EPX_AB_EXPERTS:-256}" --tokens 128,1 --iters 30 --ablate
  local bits_list=${EPX_ABLATE_BITS-0 1 2 4 8} E="$B-diagpy" bits
  [ -n "$bits_list" ] || return 0
  # The extension is built into the copy's python/epx: this tree's stays the default build's.
  tree_copy "$E.src"
  side_build ablate.pybuild 900 "$E.src" "$E" _epx -DEPX_DIAGNOSTICS=ON -DEPX_BUILD_PYTHON=ON \
    -DPython3_EXECUTABLE="$EPX_PYTHON" || return 1
  local root tests args name n
  root=$(cd "$E.src" && pwd)
  tests=$(deepep_tests_dir)
  args="--num-experts ${EPX_AB_EXPERTS:-256}${EPX_DEEPEP_ARGS:+ $EPX_DEEPEP_ARGS}"
  declare -A seen=()
  for bits in $bits_list; do
    # A value given again gets its round in its step's name (its log is not overwritten).
    n=$(( ${seen[$bits]:-0} + 1 )) && seen[$bits]=$n
    name=b$bits && [ "$n" = 1 ] || name=$name.$n
    step "ablate.engine.$name" 300 "^ *epx |^cold|^engine" $(pin 1) env EPX_LL_ABLATE="$bits" \
      PYTHONPATH="$root/python" "$EPX_PYTHON" bench/engine_timing.py \
      --tokens 128 --experts "${EPX_AB_EXPERTS:-256}" --cold
    # DeepEP's own test_low_latency.py through the same copy's drop-in, where its tests are given.
    [ -n "$tests" ] || continue
    step "ablate.harness.$name" 150 "" $(pin 1) env EPX_LL_ABLATE="$bits" EPX_REPO="$root" \
      EPX_DEEPEP_ARGS="$args" \
      bash bench/peer_deepep.sh "$tests" 1 test_low_latency.py || continue
    grep -E "avg_t|send/recv" "$OUT/ablate.harness.$name.log" | sed "s/^/  [bits $bits] /"
  done
}

# ncu_disasm STEP BINARY FILE: the ll kernels' disassembly with source lines (the builds have
# -lineinfo), for ncu_stalls.py's --lines: every cubin of BINARY, the functions
# epx::ll::dispatch / combine kept, into FILE. Status 0 when FILE was written.
ncu_disasm() {
  local tmp rc
  tmp=$(mktemp -d)
  # shellcheck disable=SC2016  # expanded by the inner shell
  step "$1" 120 "" bash -c 'cd "$1" && "$2/cuobjdump" -xelf all "$3" > /dev/null &&
    for c in *.cubin; do "$2/nvdisasm" -gi -c "$c"; done |
    awk "/^[[:space:]]*\\.text\\./ { keep = /ll8dispatch|ll7combine/ } keep" > "$4" && [ -s "$4" ]' \
    _ "$tmp" "$(cuda_bin)" "$(realpath "$2")" "$3"
  rc=$?
  rm -rf "$tmp"
  return $rc
}

# ncu_sample NCU STEP REP SHOW ARGS...: step STEP runs NCU's warp-state sampling with ARGS (the
# kernel filter, the launches, the cache control, then the command) into REP.ncu-rep, prints the
# SM frequency and the duration ncu saw, and exports the SASS listing as REP.csv (status 0 when it
# did). --clock-control none: the GPU's clocks as they are (ncu's default locks them to base; the
# machines' rules leave clocks alone).
ncu_sample() {
  local ncu=$1 name=$2 rep=$3 show=$4
  shift 4
  step "$name" 240 "$show" "$ncu" --clock-control none --section SpeedOfLight \
    --section WarpStateStats --section SourceCounters --warp-sampling-interval 0 -f -o "$rep" \
    "$@" || return 1
  "$ncu" --import "$rep.ncu-rep" --page details --section SpeedOfLight 2>&1 |
    grep -E "^  [a-z_]+.*\(|SM Frequency|Duration" | head -12
  # shellcheck disable=SC2016  # expanded by the inner shell
  step "$name.export" 120 "" bash -c '"$1" --import "$2.ncu-rep" --page source \
    --print-source sass --csv > "$2.csv"' _ "$ncu" "$rep"
}

batch_ncu() {
  local ncu
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  if [ ! -x "$ncu" ]; then
    skip ncu "Nsight Compute (ncu) not found on PATH or in /usr/local/cuda/bin"
    return 0
  fi
  if [ "${EPX_NCU_HOOK:-0}" = 1 ]; then
    batch_ncu_hook "$ncu"
    return
  fi
  if [ "${EPX_NCU_BYTES:-0}" = 1 ]; then
    batch_ncu_bytes "$ncu"
    return
  fi
  local lines=() t rep csvs=()
  ncu_disasm ncu.disasm "$B/bench/epx_ll_gpu_bench" "$OUT/ncu_ll.disasm" &&
    lines=(--lines "$OUT/ncu_ll.disasm")
  for t in ${EPX_NCU_TOKENS:-128 1}; do
    rep="$OUT/ncu_ll_t$t"
    ncu_sample "$ncu" "ncu.ll_t$t" "$rep" "" -k regex:'^(dispatch|combine)' --launch-skip 8 \
      --launch-count 2 --cache-control none "$B/bench/epx_ll_gpu_bench" --ranks 1 \
      --experts "${EPX_AB_EXPERTS:-256}" --tokens "$t" --iters 5 && csvs+=("$rep.csv")
  done
  [ ${#csvs[@]} -gt 0 ] || return 1
  step ncu.table 60 "^\|" "$EPX_PYTHON" bench/ncu_stalls.py "${csvs[@]}" --top 12 "${lines[@]}"
}

# The Python extension the build made (python/epx/_epx.*.so), or nothing.
epx_extension() {
  find python/epx -maxdepth 1 -name '_epx.*.so' | head -1
}

# EPX_NCU_HOOK=1: the hooked receive halves as DeepEP's harness runs them (bench/ncu_hook.py: a
# hooked pair after warm-up pairs, each hook after an 8192^2 matmul), one launch of each profiled
# per T, with --cache-control all (every replay pass starts with flushed caches, as the harness's
# hook starts after its matmul); the disassembly of the Python extension for the table's --lines.
# EPX_NCU_HALVES: the halves sampled, "recv" (default), "send" or both; the last pair's send half
# is launch 2 * W of its kernel name, its receive 2 * W + 1 (ncu_hook.py). A send half follows the
# previous hook with no matmul between, as in the harness; ncu flushes the caches all the same.
batch_ncu_hook() {
  local ncu=$1 lines=() t k h name rep csvs=() so w=4 skip_n halves=${EPX_NCU_HALVES:-recv}
  for h in $halves; do
    case $h in
      send | recv) ;;
      *) skip ncu.hook "EPX_NCU_HALVES: '$h' is neither send nor recv"; return 0 ;;
    esac
  done
  so=$(epx_extension)
  [ -n "$so" ] || { skip ncu.hook "python/epx/_epx.*.so not built (the build batch makes it)"; return 0; }
  ncu_disasm ncu.hook.disasm "$so" "$OUT/ncu_hook.disasm" && lines=(--lines "$OUT/ncu_hook.disasm")
  for t in ${EPX_NCU_TOKENS:-128 1}; do
    for k in dispatch combine; do
      for h in $halves; do
        case $h in
          recv) skip_n=$((2 * w + 1)) name="${k}_t$t" ;;
          send) skip_n=$((2 * w)) name="${k}_send_t$t" ;;
        esac
        rep="$OUT/ncu_hook_$name"
        ncu_sample "$ncu" "ncu.hook_$name" "$rep" "ncu_hook:" -k regex:"^$k" \
          --launch-skip "$skip_n" --launch-count 1 --cache-control all \
          "$EPX_PYTHON" bench/ncu_hook.py --tokens "$t" --warmup "$w" \
          --experts "${EPX_AB_EXPERTS:-288}" && csvs+=("$rep.csv")
      done
    done
  done
  [ ${#csvs[@]} -gt 0 ] || return 1
  step ncu.hook.table 60 "^\|" "$EPX_PYTHON" bench/ncu_stalls.py "${csvs[@]}" --top 12 "${lines[@]}"
}

# EPX_NCU_BYTES=1: the memory traffic of the fused dispatch and of the combine as the harness's
# kernel rows run them (bench/ncu_hook.py --fused: pairs back to back after a matmul), one launch
# of each per T: DRAM bytes read and written, L2 sectors read and written and their hit rates,
# and the duration, with --cache-control none (the caches as the pairs before left them) and
# --replay-mode application (every pass reruns the script, so no pass starts from a restore);
# then the dispatch again with no combines between the dispatches (dispatch_alone).
NCU_BYTES_METRICS=dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_op_read.sum,\
lts__t_sectors_op_write.sum,lts__t_sector_op_read_hit_rate.pct,\
lts__t_sector_op_write_hit_rate.pct,gpu__time_duration.sum
batch_ncu_bytes() {
  local ncu=$1 t k rep w=4
  [ -n "$(epx_extension)" ] ||
    { skip ncu.bytes "python/epx/_epx.*.so not built (the build batch makes it)"; return 0; }
  for t in ${EPX_NCU_TOKENS:-128 1}; do
    for k in dispatch combine dispatch_alone; do
      local extra=()
      [ "$k" != dispatch_alone ] || extra=(--no-combine)
      rep="$OUT/ncu_bytes_${k}_t$t"
      step "ncu.bytes_${k}_t$t" 300 "ncu_hook:" "$ncu" --clock-control none --cache-control none \
        --replay-mode application --metrics "$NCU_BYTES_METRICS" -k regex:"^${k%_alone}" \
        --launch-skip $((w + 1)) --launch-count 1 -f -o "$rep" \
        "$EPX_PYTHON" bench/ncu_hook.py --fused "${extra[@]}" --tokens "$t" --warmup "$w" \
        --experts "${EPX_AB_EXPERTS:-288}" || continue
      "$ncu" --import "$rep.ncu-rep" --page raw --csv 2>&1 | tee "$rep.csv" |
        "$EPX_PYTHON" -c 'import csv, sys
rows = list(csv.reader(sys.stdin))
for name, unit, value in zip(rows[0], rows[1], rows[2]):
    if name.startswith(("dram__", "lts__", "gpu__time")):
        print(f"  {name:40s} {value:>14s} {unit}")' || true
    done
  done
}

batch_overhead() {
  local rows="^T=|^\||skipped"
  step overhead.cuda_tiny 200 "$rows" $(pin 1) "$EPX_PYTHON" tests/python/bench_overhead.py \
    --device cuda \
    --iters 3000 --parts --alloc-ab --breakdown 10 --primitives 15
  step overhead.cuda_decode 200 "$rows" $(pin 1) "$EPX_PYTHON" tests/python/bench_overhead.py \
    --device cuda --iters 1000 --tokens 128 --hidden 7168 --experts 256 --max-tokens 128
  step overhead.cpu_tiny 200 "$rows" $(pin 1) "$EPX_PYTHON" tests/python/bench_overhead.py \
    --iters 3000 \
    --parts --alloc-ab --breakdown 10 --primitives 15
  step overhead.pytest 240 "passed|failed" "$EPX_PYTHON" -m pytest -q -rs \
    tests/python/test_overhead_script.py
}

batch_main() {
  step main 540 "^== |^(ht|ll|a2a)\.|check:|PASS|FAIL" bash scripts/run.sh
}

# The main build, unless no batch given uses it (htrace and probe build their own trees, and so
# does trace with EPX_TRACE_PARTS=ll).
main_build() {
  local b
  for b in "$@"; do
    case "$b" in
      htrace | probe) ;;
      trace) [ "$(trace_parts)" = " ll " ] || { do_build "$@"; return; } ;;
      *) do_build "$@"; return ;;
    esac
  done
  skip build "the batches given build their own trees (htrace, probe, trace of ll alone)"
}

if main_build "$@"; then
  for b in "$@"; do
    case $b in
      build) ;;
      peer | sweep | pytest | profile | overhead | main | tests | bench | gpubench | overlap | ab | trace | htrace | probe | ablate | ncu)
        if have_gpu || [ "$b" = main ]; then
          "batch_$b"
        else
          skip "$b" "no GPU visible"
        fi
        ;;
    esac
  done
fi

echo
echo "== summary ($(( $(date +%s) - T0 )) s; logs in $OUT)"
printf '%s\n' "${results[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "== FAILED: ${failed[*]}"
  exit 1
fi
echo "== all steps passed"
