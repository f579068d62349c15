#!/usr/bin/env bash
# One call on a CUDA machine: the GPU tests, the benchmarks and the demo on the GPU.
#   bash scripts/gpu_check.sh [OUTDIR]      (default OUTDIR: $OUT, else ./gpu_check_out)
#   ONLY=gluon bash scripts/gpu_check.sh [OUTDIR]   the Gluon forward's tests and variant bench only
#   ONLY=pair bash scripts/gpu_check.sh [OUTDIR]   the Gluon forward's head pairs (GQA): tests and bench
#   ONLY=dkdv bash scripts/gpu_check.sh [OUTDIR]   the Gluon dK/dV pass's TMA stores: tests and fwd+bwd bench
#   ONLY=fusedbwd bash scripts/gpu_check.sh [OUTDIR]   the one-pass backward: its tests, then fwd+bwd against two
#     passes; the dK/dV pass with fresh descriptors: its tests and bench
#   ONLY=fusedbulk bash scripts/gpu_check.sh [OUTDIR]   the one-pass backward with dQ out by TMA reduce-add:
#     tests, probe, fwd+bwd against two passes
#   ONLY=hsplit bash scripts/gpu_check.sh [OUTDIR]   the dK/dV pass's heads split (MQA, large groups): tests, bench
#   ONLY=odd bash scripts/gpu_check.sh [OUTDIR]   stride units and the value-head split (d 72, 40, 96, ...): Triton attention tests, bench;
#     the decode's stride units (GQA d 72): tests, bench
#   ONLY=decodeodd bash scripts/gpu_check.sh [OUTDIR]   the Triton decode at GQA widths 72/80/96/160 (stride
#     units, head split, tiles across pages): its GPU tests, the odd-widths decode bench, paged 64 variants
#   ONLY=gluonodd bash scripts/gpu_check.sh [OUTDIR]   the Gluon forward and dK/dV pass at odd head widths (ODD_WIDTHS,
#     DKDV_ODD: 72, 80, 96, 40, 160 as power-of-two TMA blocks, two value accumulators): their GPU tests
#   ONLY=gluonoddbench bash scripts/gpu_check.sh [OUTDIR]   fwd / fwd+bwd at odd widths, Triton / Gluon / SDPA
#   ONLY=occupancy bash scripts/gpu_check.sh [OUTDIR]   narrow heads (64-96), two Gluon programs an SM (forward:
#     NARROW; dK/dV: DKDV_NARROW): their tests, the forward's tiles against the one in use, --dkdv-narrow
#   ONLY=spread bash scripts/gpu_check.sh [OUTDIR]   the 192/128 and GQA issue rows against SDPA over rounds of fresh
#     inputs: each round's ratio, median, range (scripts/bench_row_repeat.py); the GQA decode rows the same way
#     (scripts/decode_rounds.py)
#   ONLY=gqaprobe bash scripts/gpu_check.sh [OUTDIR]   large-batch GQA decode: SDPA's kernels (profiler), and a minimal
#     copy of our kernel with and without per-tile key masks, against gqa_decode with and without SPLIT_TAIL
#     (scripts/probe_gqa_decode.py); then the decode GPU tests with SPLIT_TAIL forced on
#   ONLY=tailpipe bash scripts/gpu_check.sh [OUTDIR]   SPLIT_TAIL's partial tile pipelined (TAIL_PIPELINED), through
#     registers and every tile masked, on the MLA H 16 and GQA B 32 rows; then the decode GPU tests with both forced on,
#     and the seeded random decode cases (tests/ops/test_random_cases.py: tiles and switches drawn per case)
#   ONLY=fwd192 bash scripts/gpu_check.sh [OUTDIR]   the Gluon forward's schedules at Dqk 192; the one-pass
#     backward's probe (its bulk adds unordered / counters only: timing diagnostics)
#   ONLY=bwdprobe bash scripts/gpu_check.sh [OUTDIR]   fwd+bwd against SDPA in deterministic mode, and the
#     backward's per-kernel times (scripts/profile_attention_bwd.py)
#   ONLY=host bash scripts/gpu_check.sh [OUTDIR]   the host side of a training step: launches, cProfile
#     (scripts/profile_launch.py --train), fwd+bwd eager against a CUDA-graph replay
#   ONLY=tests / ONLY=bench bash scripts/gpu_check.sh [OUTDIR]   the check in two halves (10-minute device calls)
#   ONLY=tests-attn / ONLY=tests-decode bash scripts/gpu_check.sh [OUTDIR]   ONLY=tests in two (a cold machine)
#   ONLY=tests-attn1 / ONLY=tests-attn2 bash scripts/gpu_check.sh [OUTDIR]   tests-attn in two: the Gluon
#     forward's tests, then the rest (a cold machine ran past 540 s on the whole of tests-attn)
#   ONLY=probe bash scripts/gpu_check.sh [OUTDIR]   diagnostics: the MLA decode tile-rate probe and clock64 trace
#   ONLY=fwdprobe bash scripts/gpu_check.sh [OUTDIR]   diagnostics of the Gluon forward: experimental schedules'
#     tests and bench, clock64 trace, block timeline
#   ONLY=smallpages bash scripts/gpu_check.sh [OUTDIR]  the Gluon MLA decode over pages < 64 keys:
#     its tests, then the MLA decode bench
#   ONLY=smallheads bash scripts/gpu_check.sh [OUTDIR]  the Gluon MLA decode with H < 64 (experimental):
#     its tests, then the MLA decode bench with it routed
#   ONLY=fused bash scripts/gpu_check.sh [OUTDIR]  the Triton decode's GPU tests, then the decode bench's GQA
#     and MLA H = 16 rows with the fused merge on and off
#   ONLY=plans bash scripts/gpu_check.sh [OUTDIR]  the training launchers' plans and session 26's other changes:
#     their GPU tests, host profile off/on; the decode plan and graph tests; a cProfile of eager decode at B = 1
#     (one cold call)
#   ONLY=launch bash scripts/gpu_check.sh [OUTDIR]  cached decode plans / binder-free launches: the decode GPU
#     tests, eager decode host cost with them off and on, the decode bench's host-bound rows both ways
#     (LAUNCH_SHAPES, bench_decode --shapes; "" skips the bench)
#   SKIP_EXPERIMENTAL=1: leave out the tests of the schedules nothing routes to (a short device budget)
# Writes OUTDIR/gpu_tests.log, OUTDIR/bench_attention.md, OUTDIR/bench_decode.md (+ .json), OUTDIR/demo.txt,
# OUTDIR/env.txt. Needs no install: the package runs from the checkout (PYTHONPATH=.).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu_check_out}}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
status=0
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA GPU visible to $PY; run this on a GPU machine" >&2
  exit 2
fi
{
  date -u +"date: %Y-%m-%d %H:%M UTC"
  echo "commit: ${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)} (GIT_COMMIT overrides: a copied checkout may carry a stale .git)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'sms', torch.cuda.get_device_properties(0).multi_processor_count)"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log, remember failure, keep going
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit} s)"
  local t0=$SECONDS rc=0
  timeout "$limit" "$@" || rc=$?
  [ $rc -eq 124 ] && echo "!! $name stopped at its ${limit} s limit"
  [ $rc -ne 0 ] && { echo "!! $name failed (rc $rc)"; status=1; }
  echo "== $name took $((SECONDS - t0)) s"
}
# Limits keep one slow step (a kernel that compiles for minutes) from eating the whole device call;
# scale them with GPU_CHECK_SCALE=2 on a slower machine.
lim() { echo $(( $1 * ${GPU_CHECK_SCALE:-1} )); }
if [ "${ONLY:-}" = pair ]; then
  # Head pairs in the Gluon forward: their tests with the schedules they share code with, then their bench.
  step "gluon forward tests: head pairs, persistent, TMA store" "$(lim 400)" bash -c "$PY -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_attention_gluon.py -k 'head_pairs or tma_store or (persistent and not counter)' 2>&1 | tee '$out/gpu_pair_tests.log' | tail -30; exit \${PIPESTATUS[0]}"
  step "bench gluon head pairs" "$(lim 200)" $PY scripts/bench_attention.py --gluon-pair "$out/bench_gluon_pair.md"
  echo "gpu_check status: $status"
  exit $status
fi
if [ "${ONLY:-}" = odd ]; then
  # Session 29: strides passed in units of their common power of two (triton_fwd.stride_unit) and the value head
  # split like the score's (split_value_dim), for head widths
  # whose rows are not 16-element multiples (72, 40, 36/20): the Triton attention tests, then fwd and fwd+bwd
  # at odd widths with and without it, against SDPA.
  step "triton attention GPU tests" "$(lim 360)" bash -c "$PY -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_attention_triton.py 2>&1 | tee '$out/gpu_odd_tests.log' | tail -30; exit \${PIPESTATUS[0]}"
  step "bench odd widths" "$(lim 240)" $PY scripts/bench_attention.py --odd-widths "$out/bench_odd_widths.md"
fi
if [ "${ONLY:-}" = odd ] || [ "${ONLY:-}" = decodeodd ]; then
  # Sessions 30-31: the Triton decode at GQA widths 72 / 80 / 96 / 160 (stride units; the head split; tiles across
  # pages, off by default): its GPU tests (with the d 128 ones), then the widths against SDPA with the split on
  # and off, then pages of 64 with 4 stages and tiles across pages.
  step "decode GPU tests: odd widths" "$(lim 150)" bash -c "$PY -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_decode_triton.py -k 'd72 or span or gqa_decode_bf16 or balanced or heuristic' 2>&1 | tee '$out/gpu_decodeodd_tests.log' | tail -15; exit \${PIPESTATUS[0]}"
  step "bench decode odd widths" "$(lim 240)" $PY scripts/bench_decode.py --odd-widths "$out/bench_decode_odd_widths.md"
  step "bench decode paged stages" "$(lim 180)" $PY scripts/bench_decode.py --paged-stages "$out/bench_decode_paged_stages.md"
  echo "gpu_check status: $status"
  exit $status
fi
if [ "${ONLY:-}" = gluonodd ]; then
  # Session 32: the Gluon forward and dK/dV pass at odd head widths (gluon_fwd.ODD_WIDTHS, gluon_bwd.DKDV_ODD, off
  # by default): their GPU tests (ONLY=gluonoddbench: the bench, fwd and fwd+bwd on Triton / Gluon against SDPA).
  step "gluon GPU tests: odd widths" "$(lim 500)" bash -c "$PY -m pytest -q -p no:cacheprovider -m gpu --maxfail=6 tests/ops/test_attention_gluon.py -k 'odd' 2>&1 | tee '$out/gpu_gluonodd_tests.log' | tail -40; exit \${PIPESTATUS[0]}"
  echo "gpu_check status: $status"
  exit $status
fi
if [ "${ONLY:-}" = gluonoddbench ]; then
  step "bench gluon odd widths" "$(lim 300)" $PY scripts/bench_attention.py --gluon-odd "$out/bench_gluon_odd.md"
  echo "gpu_check status: $status"
  exit $status
fi
if [ "${ONLY:-}" = occupancy ]; then
  # Session 33: narrow heads with two programs an SM (the Gluon forward capped at 128 registers, or 64-row blocks of
  # one warpgroup; the dK/dV pass on 64-key one-warpgroup programs): their GPU tests, the forward's tiles against the
  # one in use, then fwd+bwd with the dK/dV pass's tiles against its default ones.
  step "gluon GPU tests: two programs an SM" "$(lim 360)" bash -c "$PY -m pytest -q -p no:cacheprovider -m gpu --maxfail=6 tests/ops/test_attention_gluon.py -k 'two_per_sm or narrow or through_the_op or routes or (dkdv_matches_oracle and rows64)' 2>&1 | tee '$out/gpu_occupancy_tests.log' | tail -30; exit \${PIPESTATUS[0]}"
  step "bench forward occupancy" "$(lim 240)" $PY scripts/bench_attention.py --fwd-occupancy "$out/bench_fwd_occupancy.md"
  step "bench dK/dV narrow tiles" "$(lim 200)" $PY scripts/bench_attention.py --dkdv-narrow "$out/bench_dkdv_narrow.md"
  echo "gpu_check status: $status"
  exit $status
fi
if [ "${ONLY:-}" = spread ]; then
  # Session 34: the issue rows whose ratio to SDPA moves most between runs, timed over rounds of fresh inputs
  # (scripts/bench_row_repeat.py): every round's ratio, the median and the range.
  step "row spread: 4 x 128 x 2048, 192/128" "$(lim 200)" $PY scripts/bench_row_repeat.py --rounds 9 --direct --out "$out/bench_row_repeat_192.md"
  step "row spread: GQA 8 x 32/8 x 2048" "$(lim 150)" $PY scripts/bench_row_repeat.py --row 8,32,8,2048,128,128 --rounds 5 --direct --out "$out/bench_row_repeat_gqa.md"
  # Session 38: the GQA decode rows (B 1 / 32 / 128) the same way, graph replay and 8-layer step (decode_rounds.py)
  step "row spread: GQA decode B 1 / 32 / 128" "$(lim 200)" $PY scripts/decode_rounds.py --rounds 5 --out "$out/decode_rounds.md"
  echo "gpu_check status: $status"
  exit $status
fi
if [ "${ONLY:-}" = gqaprobe ]; then
  # What SDPA's GQA decode runs (profiler) and a minimal copy of our kernel, one change at a time, at B 32 / 128
  # (scripts/probe_gqa_decode.py). Session 40 (H100) refuted TMA, deeper rings, persistence, KV-major order and the
  # length load. Session 41 (H100) found the per-tile key masks (masked against base) and took SPLIT_TAIL for
  # contiguous GQA caches (gqa_decode against gqa_decode_masked); then the decode GPU tests with SPLIT_TAIL forced on
  # everywhere (paged and MLA too).
  step "probe GQA decode loads" "$(lim 240)" $PY scripts/probe_gqa_decode.py --rounds 5 --variants base,seqload,masked \
    --out "$out/probe_gqa_decode.md"
  step "decode GPU tests, SPLIT_TAIL forced on" "$(lim 200)" bash -c "MLA_ATTN_DECODE_SPLIT_TAIL=1 $PY -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_decode_triton.py tests/ops/test_decode_bounds.py 2>&1 | tee '$out/gpu_split_tail_tests.log' | tail -5; exit \${PIPESTATUS[0]}"
  echo "gpu_check status: $status"
  exit $status
fi
if [ "${ONLY:-}" = tailpipe ]; then
  # Sessions 42-43: SPLIT_TAIL with its partial tile pipelined (TAIL_PIPELINED; MLA_ATTN_DECODE_TAIL_PIPELINED=auto
  # takes it for MLA over whole-page tiles, the default to be once these pass), through registers, and every tile
  # masked. The bench first (each split-tail variant
  # checked against the masked output before it is timed), then the decode GPU tests with both switches forced on.
  step "bench decode: tail pipelined / through registers / masked" "$(lim 200)" $PY scripts/bench_decode.py --tail-pipe-variants --graph --layers 0 \
    --shapes mla128x16,mla64x16,gqa32 --out "$out/bench_decode_tailpipe.md"
  step "decode GPU tests, SPLIT_TAIL and TAIL_PIPELINED forced on" "$(lim 240)" bash -c "MLA_ATTN_DECODE_SPLIT_TAIL=1 MLA_ATTN_DECODE_TAIL_PIPELINED=1 $PY -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_decode_triton.py tests/ops/test_decode_bounds.py 2>&1 | tee '$out/gpu_tail_pipelined_tests.log' | tail -5; exit \${PIPESTATUS[0]}"
  # Session 44: seeded random decode cases, each with its own tiles and switches (the rule, forced, off) in bf16 / fp16
  step "decode GPU tests: random cases" "$(lim 180)" bash -c "$PY -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_random_cases.py 2>&1 | tee '$out/gpu_random_tests.log' | tail -8; exit \${PIPESTATUS[0]}"
  echo "gpu_check status: $status"
  exit $status
fi
if [ "${ONLY:-}" = hsplit ]; then
  # Session 28: the dK/dV pass's heads split (MQA / large groups): its tests with the dK/dV pass's others, then
  # fwd+bwd with it off / auto / 2 / 4 against SDPA.
  step "gluon dK/dV tests: heads split" "$(lim 300)" bash -c "$PY -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_attention_gluon.py -k 'heads_split or dkdv' 2>&1 | tee '$out/gpu_hsplit_tests.log' | tail -30; exit \${PIPESTATUS[0]}"
  step "bench heads split" "$(lim 200)" $PY scripts/bench_attention.py --hsplit "$out/bench_hsplit.md"
  echo "gpu_check status: $status"
  exit $status
fi
if [ "${ONLY:-}" = fwd192 ]; then
  # Session 28: the Gluon forward's schedules at Dqk 192 (persistent with 3 stages has room to store O by TMA),
  # then the one-pass backward's probe with its bulk adds unordered and its counters without adds (timing only).
  step "bench forward at Dqk 192" "$(lim 240)" $PY scripts/bench_attention.py --fwd-192 "$out/bench_fwd_192.md"
  step "probe fused backward" "$(lim 200)" $PY scripts/probe_fused_bwd.py --out "$out/probe_fused_bwd.md"
  echo "gpu_check status: $status"
  exit $status
fi
if [ "${ONLY:-}" = dkdv ]; then
  # dK/dV out by TMA in the Gluon dK/dV pass: its tests, then fwd+bwd with it on and off.
  step "gluon dK/dV tests" "$(lim 240)" bash -c "$PY -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_attention_gluon.py -k 'dkdv or routes' 2>&1 | tee '$out/gpu_dkdv_tests.log' | tail -30; exit \${PIPESTATUS[0]}"
  step "bench dK/dV stores" "$(lim 150)" $PY scripts/bench_attention.py --dkdv-store "$out/bench_dkdv_store.md"
  echo "gpu_check status: $status"
  exit $status
fi
if [ "${ONLY:-}" = fusedbwd ]; then
  # The one-pass backward (gluon_bwd_fused.py): its tests in a hang-guarded step (a wrong dQ order would
  # deadlock), then fwd+bwd with it on and off.
  step "fused backward tests" "$(lim 300)" bash -c "$PY -m pytest -q -x -p no:cacheprovider -m gpu tests/ops/test_attention_fused_bwd.py tests/ops/test_attention_gluon.py -k 'fused or fresh' 2>&1 | tee '$out/gpu_fused_bwd_tests.log' | tail -30; exit \${PIPESTATUS[0]}"
  step "probe fused backward" "$(lim 150)" $PY scripts/probe_fused_bwd.py --out "$out/probe_fused_bwd.md"
  step "bench dK/dV fresh descriptors" "$(lim 150)" $PY scripts/bench_attention.py --dkdv-fresh "$out/bench_dkdv_fresh.md"
  step "bench fused backward" "$(lim 200)" $PY scripts/bench_attention.py --fused-bwd "$out/bench_fused_bwd.md"
  echo "gpu_check status: $status"
  exit $status
fi
if [ "${ONLY:-}" = fusedbulk ]; then
  # The one-pass backward with dQ_j out by TMA reduce-add (FUSED_BULK): its tests (hang-guarded), the probe,
  # then fwd+bwd one pass (bulk) against two passes.
  step "fused backward (bulk) tests" "$(lim 300)" bash -c "$PY -m pytest -q -x -p no:cacheprovider -m gpu tests/ops/test_attention_fused_bwd.py -k bulk 2>&1 | tee '$out/gpu_fused_bulk_tests.log' | tail -30; exit \${PIPESTATUS[0]}"
  step "probe fused backward" "$(lim 150)" $PY scripts/probe_fused_bwd.py --out "$out/probe_fused_bwd.md"
  step "bench fused backward (bulk)" "$(lim 200)" env MLA_ATTN_GLUON_FUSED_BULK=1 $PY scripts/bench_attention.py --fused-bwd "$out/bench_fused_bulk.md"
  step "bench fused backward (bulk + cast pass)" "$(lim 200)" env MLA_ATTN_GLUON_FUSED_BULK=1 MLA_ATTN_GLUON_FUSED_CAST=1 $PY scripts/bench_attention.py --fused-bwd "$out/bench_fused_bulk_cast.md"
  step "bench host overhead (eager vs graph)" "$(lim 120)" $PY scripts/bench_attention.py --host-overhead "$out/bench_host_overhead.md"
  echo "gpu_check status: $status"
  exit $status
fi
if [ "${ONLY:-}" = bwdprobe ]; then
  # The backward against its deterministic peer, and where its time goes (the case for a fused, ordered dQ).
  step "bench attention, deterministic peer" "$(lim 200)" $PY scripts/bench_attention.py --deterministic-peer "$out/bench_attention_deterministic.md"
  step "profile attention backward" "$(lim 150)" $PY scripts/profile_attention_bwd.py --out "$out/profile_attention_bwd.txt"
  echo "gpu_check status: $status"
  exit $status
fi
if [ "${ONLY:-}" = host ]; then
  # HOST_BASELINE=DIR: also profile the checkout copied there (an older commit), first.
  if [ -n "${HOST_BASELINE:-}" ]; then
    step "profile host side, baseline" "$(lim 150)" bash -c "cd '$HOST_BASELINE' && PYTHONPATH=. $PY scripts/profile_launch.py --train --calls 100 --top 45 2>&1 | tee '$out/profile_host_train_baseline.txt'; exit \${PIPESTATUS[0]}"
  fi
  step "gpu tests touching the host path" "$(lim 200)" bash -c "$PY -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_review_lse_grad.py tests/ops/test_attention_triton.py tests/ops/test_attention_gluon.py -k 'lse or compile or deterministic or side_stream or plan' 2>&1 | tee '$out/gpu_host_tests.log' | tail -12; exit \${PIPESTATUS[0]}"
  step "profile host side of a training step" "$(lim 150)" bash -c "$PY scripts/profile_launch.py --train --calls 100 --top 45 2>&1 | tee '$out/profile_host_train.txt'; exit \${PIPESTATUS[0]}"
  step "bench host overhead (eager vs graph)" "$(lim 300)" $PY scripts/bench_attention.py --host-overhead "$out/bench_host_overhead.md"
  echo "gpu_check status: $status"
  exit $status
fi
if [ "${ONLY:-}" = plans ]; then
  # One cold call: the Gluon training launchers' plans (tests, host profile off/on), then the decode plan tests.
  # ... with the session-26 changes they check: plans bitwise against unplanned calls; at d 128 the forward and
  # the dK/dV pass against the oracle (no second-half descriptors: None); lse gradients and compile/autocast
  # (an unused lse's gradient not materialised); fp32 (the planned Triton forward), determinism, side stream.
  step "gluon training plan tests" "$(lim 200)" bash -c "$PY -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_attention_gluon.py tests/ops/test_review_lse_grad.py tests/ops/test_attention_triton.py -k 'plan or lse_gradient or compile_and_autocast or float32_fits or deterministic or side_stream or ((gluon_forward_matches_oracle or gluon_dkdv_matches_oracle) and D128x128)' 2>&1 | tee '$out/gpu_train_plan_tests.log' | tail -15; exit \${PIPESTATUS[0]}"
  step "profile host side of a training step" "$(lim 150)" bash -c "$PY scripts/profile_launch.py --train --calls 100 --top 45 2>&1 | tee '$out/profile_host_train.txt'; exit \${PIPESTATUS[0]}"
  step "decode plan and graph tests" "$(lim 200)" bash -c "$PY -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_decode_triton.py tests/ops/test_decode_gluon_mla.py tests/layers/test_decode_graph.py -k 'plan or fast or graph' 2>&1 | tee '$out/gpu_decode_plan_tests.log' | tail -15; exit \${PIPESTATUS[0]}"
  # Where the eager Gluon MLA call at B = 1, H = 128 spends its host time (114 us back to back vs 38.5 as a graph,
  # H100, session 26): its cProfile; and the host time of the GQA launcher contiguous vs paged 64 (case 5).
  step "profile eager Gluon MLA B1" "$(lim 100)" bash -c "$PY scripts/profile_launch.py --calls 300 --top 40 --cases 1,3,5 --profile-case 3 2>&1 | tee '$out/profile_launch_mla_b1.txt'; exit \${PIPESTATUS[0]}"
  echo "gpu_check status: $status"
  exit $status
fi
if [ "${ONLY:-}" = launch ]; then
  # Cached decode plans and binder-free launches (mla_attn/ops/_launch.py): the decode GPU tests (CUDA-graph
  # replays among them), then the host cost of eager decode calls with them off and on, then the decode
  # bench's host-bound rows (eager and graph columns) both ways.
  step "decode gpu tests" "$(lim 300)" bash -c "$PY -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_decode_triton.py tests/ops/test_decode_gluon_mla.py tests/layers -k 'not experimental' 2>&1 | tee '$out/gpu_launch_tests.log' | tail -15; exit \${PIPESTATUS[0]}"
  step "profile host side of eager decode" "$(lim 150)" bash -c "$PY scripts/profile_launch.py --calls 300 --top 40 --profile-case ${LAUNCH_PROFILE_CASE:-3} 2>&1 | tee '$out/profile_launch_decode.txt'; exit \${PIPESTATUS[0]}"
  # The rows whose eager calls are host-bound (LAUNCH_SHAPES, bench_decode --shapes; "" skips the bench).
  shapes=${LAUNCH_SHAPES-gqa1,gqa32,mla1x128,mla16x128,mla64x16}
  if [ -n "$shapes" ]; then
    step "bench decode, fast launch off" "$(lim 150)" env MLA_ATTN_FAST_LAUNCH=0 $PY scripts/bench_decode.py --graph --layers 0 --shapes "$shapes" --out "$out/bench_decode_launch_slow.md"
    step "bench decode, fast launch on" "$(lim 150)" $PY scripts/bench_decode.py --graph --layers 0 --shapes "$shapes" --out "$out/bench_decode_launch_fast.md"
  fi
  echo "gpu_check status: $status"
  exit $status
fi
if [ "${ONLY:-}" = gluon ]; then
  # The Gluon forward alone, for work on it. Tests first; the bench only times variants that match SDPA.
  step "gluon forward tests" "$(lim 360)" bash -c "$PY -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_attention_gluon.py 2>&1 | tee '$out/gpu_gluon_tests.log' | tail -30; exit \${PIPESTATUS[0]}"
  step "bench gluon forward variants" "$(lim 200)" $PY scripts/bench_attention.py --gluon "$out/bench_gluon.md"
  echo "gpu_check status: $status"
  exit $status
fi
# One Gluon MLA decode variant: its tests (-k KEY) in a hang-guarded step (a wrong mbarrier count hangs),
# then, if they pass, the MLA decode bench under ENV (the rows it takes time the Gluon kernel and the
# Triton kernel side by side). ~2 minutes.
mla_variant() {  # mla_variant KEY TITLE [ENV=VALUE ...]
  local key=$1 title=$2; shift 2
  step "gluon MLA decode, $title" "$(lim 240)" bash -c "$PY -m pytest -q -x -p no:cacheprovider -m gpu tests/ops/test_decode_gluon_mla.py -k $key 2>&1 | tee '$out/gpu_gluon_mla_$key.log' | tail -8; exit \${PIPESTATUS[0]}"
  if [ $status -eq 0 ]; then
    step "bench MLA decode, $title" "$(lim 300)" env "$@" $PY scripts/bench_decode.py --graph --only mla --out "$out/bench_decode_$key.md"
  fi
  echo "gpu_check status: $status"
  exit $status
}
# SMALL_PAGES (on): pages smaller than 64 keys
[ "${ONLY:-}" = smallpages ] && mla_variant small_pages "small pages"
# SMALL_HEADS (experimental, off): fewer than 64 heads, routed for the bench
[ "${ONLY:-}" = smallheads ] && mla_variant small_heads "small heads (experimental)" MLA_ATTN_GLUON_MLA_SMALL_HEADS=1
# The fused merge (the decode kernel's last split merges; triton_decode.FUSED_MERGE): the Triton decode's GPU
# tests, then the GQA and MLA H = 16 rows with it forced on and off, alternating. ~5 minutes.
if [ "${ONLY:-}" = fused ]; then
  step "decode GPU tests" "$(lim 240)" bash -c "$PY -m pytest -q -x -p no:cacheprovider -m gpu tests/ops/test_decode_triton.py 2>&1 | tee '$out/gpu_decode_tests.log' | tail -8; exit \${PIPESTATUS[0]}"
  if [ $status -eq 0 ]; then
    step "bench decode, fused merge on / off" "$(lim 330)" $PY scripts/bench_decode.py --graph --fused-variants --shapes gqa1,gqa32,gqa128,mla64x16,mla128x16 --out "$out/bench_decode_fused.md"
  fi
  echo "gpu_check status: $status"
  exit $status
fi
if [ "${ONLY:-}" = fwdprobe ]; then
  # Diagnostics of the Gluon forward (one device call, ~6 minutes): the experimental schedules' tests
  # (persistent, S1_EARLY; reported, they do not fail the check), the clock64 trace of one program's
  # steady loop, the block timeline of every program, and the experimental schedules timed (the bench
  # checks each against SDPA itself, so it runs whatever the tests said).
  step "gluon forward tests, persistent and S1_EARLY (experimental)" "$(lim 240)" bash -c "$PY -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_attention_gluon.py -k experimental 2>&1 | tee '$out/gpu_gluon_experimental.log' | tail -12; exit \${PIPESTATUS[0]}"
  status=0
  step "trace gluon forward" "$(lim 60)" $PY scripts/trace_flash_fwd.py "$out/trace_flash_fwd.txt"
  step "block timeline of the gluon forward" "$(lim 150)" $PY scripts/trace_flash_blocks.py "$out/trace_flash_blocks.txt"
  step "bench gluon forward, persistent and S1_EARLY (experimental)" "$(lim 120)" $PY scripts/bench_attention.py --gluon-persistent "$out/bench_gluon_persistent.md"
  echo "gpu_check status: $status"
  exit $status
fi
# ONLY=tests: the tests, the layers and the demo; ONLY=bench: the benchmarks. The whole check takes
# ~15 minutes, longer than one 10-minute device call: run it as these two calls there. On a cold machine
# (no Triton cache) the tests alone pass 10 minutes: ONLY=tests-attn (flash attention's GPU tests) and
# ONLY=tests-decode (the decode kernels', the layers', the demo) split them. The warp-specialised forward's
# tests (experimental) run in ONLY=tests and ONLY=bench; the one-pass backward's (experimental, off) in
# ONLY=fusedbwd.
part=${ONLY:-all}
ws_ok=0
mla_ok=0
case $part in
  tests-attn) gpu_files="tests/ops/test_attention_triton.py tests/ops/test_attention_gluon.py tests/ops/test_review_lse_grad.py" ;;
  # tests-attn in two halves, for a cold machine where the whole of it ran past 540 s (session 23)
  tests-attn1) gpu_files="tests/ops/test_attention_gluon.py"; gpu_k=" and gluon_forward" ;;
  tests-attn2) gpu_files="tests/ops/test_attention_triton.py tests/ops/test_attention_gluon.py tests/ops/test_review_lse_grad.py"; gpu_k=" and not gluon_forward" ;;
  tests-decode) gpu_files="tests/ops/test_decode_triton.py tests/ops/test_random_cases.py tests/layers" ;;
  *) gpu_files="tests --ignore=tests/ops/test_attention_gluon_ws.py --ignore=tests/ops/test_decode_gluon_mla.py --ignore=tests/ops/test_attention_fused_bwd.py" ;;
esac
case $part in all|tests|tests-attn|tests-attn1|tests-attn2|tests-decode) run_gpu_tests=1 ;; *) run_gpu_tests=0 ;; esac
if [ $run_gpu_tests = 1 ]; then
  # the GPU-marked tests (the Gluon kernels' among them), and the layers' Triton wiring
  # On a cold machine flash attention's tests alone took ~440 s (session 20): ONLY=tests-attn gets 540.
  gpu_limit=420
  case $part in tests-attn*) gpu_limit=540 ;; esac
  step "gpu tests" "$(lim $gpu_limit)" bash -c "$PY -m pytest -q -p no:cacheprovider -m gpu $gpu_files -k 'not experimental${gpu_k:-}' 2>&1 | tee '$out/gpu_tests.log' | tail -30; exit \${PIPESTATUS[0]}"
fi
if [ "$part" = all ] || [ "$part" = tests ] || [ "$part" = tests-decode ]; then
  step "layers on cuda" "$(lim 120)" bash -c "$PY -m pytest -q -p no:cacheprovider tests/layers/test_triton_layers.py 2>&1 | tee '$out/gpu_layers.log' | tail -15; exit \${PIPESTATUS[0]}"
  step "demo on cuda" "$(lim 60)" bash -c "set -o pipefail; $PY -m mla_attn --device cuda --layers 4 --batch 8 --prompt-len 512 --new-tokens 64 --page-size 64 2>&1 | tee '$out/demo.txt'"
fi
if [ "$part" = tests-decode ]; then
  step "gluon MLA decode tests" "$(lim 150)" bash -c "$PY -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_decode_gluon_mla.py -k 'not experimental' 2>&1 | tee '$out/gpu_gluon_mla_tests.log' | tail -12; exit \${PIPESTATUS[0]}"
fi
if [ "$part" = all ] || [ "$part" = tests ] || [ "$part" = bench ] || [ "$part" = probe ]; then
  # The warp-specialised Gluon kernels get steps of their own with short limits (a wrong mbarrier phase
  # hangs rather than fails). The forward's (experimental, not routed): a failure is reported but does
  # not fail the check. The MLA decode kernel's: routed, so a failure fails the check. The bench part
  # runs them too, to decide whether to time them.
  keep=$status
  status=0
  step "gluon warp-specialised forward tests (experimental)" "$(lim 90)" bash -c "$PY -m pytest -q -x -p no:cacheprovider -m gpu tests/ops/test_attention_gluon_ws.py 2>&1 | tee '$out/gpu_ws_tests.log' | tail -8; exit \${PIPESTATUS[0]}"
  ws_ok=$([ $status -eq 0 ] && echo 1 || echo 0)
  status=0
  step "gluon MLA decode tests" "$(lim 150)" bash -c "$PY -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_decode_gluon_mla.py -k 'not experimental' 2>&1 | tee '$out/gpu_gluon_mla_tests.log' | tail -12; exit \${PIPESTATUS[0]}"
  mla_ok=$([ $status -eq 0 ] && echo 1 || echo 0)
  if [ "$part" != bench ] && [ "${SKIP_EXPERIMENTAL:-0}" != 1 ]; then
    # not-yet-timed schedule orders (tests named *experimental*): reported, they do not fail the check
    status=0
    step "gluon MLA decode tests, experimental orders" "$(lim 120)" bash -c "$PY -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_decode_gluon_mla.py -k experimental 2>&1 | tee '$out/gpu_gluon_mla_experimental.log' | tail -6; exit \${PIPESTATUS[0]}"
    export MLA_ATTN_PROBE_EXPERIMENTAL=$([ $status -eq 0 ] && echo 1 || echo 0)  # the probe times them only if they pass
  fi
  [ "$mla_ok" = 1 ] || export MLA_ATTN_BENCH_S_ONCE=0
  status=$keep
  [ "$mla_ok" = 1 ] || status=1
fi
if [ "$part" = all ] || [ "$part" = bench ]; then
  if [ -f scripts/bench_attention.py ] && [ "${SKIP_ATTN:-0}" != 1 ]; then
    step "bench attention" "$(lim 150)" $PY scripts/bench_attention.py --out "$out/bench_attention.md"
    step "bench gluon variants" "$(lim 200)" $PY scripts/bench_attention.py --gluon "$out/bench_gluon.md"
    if [ "$ws_ok" = 1 ]; then
      step "bench warp-specialised forward (experimental)" "$(lim 60)" $PY scripts/bench_attention.py --gluon-ws "$out/bench_gluon_ws.md"
    fi
  fi
  if [ -f scripts/bench_decode.py ] && [ "${SKIP_DECODE:-0}" != 1 ]; then
    step "bench decode" "$(lim 320)" $PY scripts/bench_decode.py --graph --out "$out/bench_decode.md"
    if [ "$mla_ok" = 1 ]; then
      step "bench gluon MLA decode kernel, both schedules" "$(lim 120)" $PY scripts/bench_decode.py --gluon-mla "$out/bench_gluon_mla.md"
    fi
  fi
fi
if [ "$part" = all ] || [ "$part" = probe ]; then
  # Diagnostics (ONLY=probe, a third device call): the MLA decode kernel's per-tile time for each schedule
  # order (the experimental ones only if their tests above passed), and a clock64 timeline of one program
  # of the MLA decode kernel. The forward's diagnostics: ONLY=fwdprobe.
  if [ "$mla_ok" = 1 ]; then
    step "probe gluon MLA decode tile rate" "$(lim 150)" $PY scripts/probe_mla_decode.py "$out/probe_mla_decode.md"
    step "probe gluon MLA decode at batch 1 (splits, combine rules)" "$(lim 60)" $PY scripts/probe_mla_decode.py --b1 "$out/probe_mla_b1.md"
    step "trace gluon MLA decode" "$(lim 90)" $PY scripts/trace_mla_decode.py "$out/trace_mla_decode.txt"
  fi
fi
# The device tool brings back at most 8 files: past that, the logs travel as one archive.
if [ "$(find "$out" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then
  (cd "$out" && tar -cf logs.tar ./*.log && rm -f ./*.log)
fi
echo "gpu_check status: $status"
exit $status
