#!/usr/bin/env bash
# One device call (H200) that runs the named steps in order; results under $OUT (at most 8 files come back):
#   tuner     GPU pytest of the GEMV tuner's timer
#   h2test    GPU pytest of the packed-half2 GEMVs (compiled PTX path against the codec references)
#   mmatest   GPU pytest of the warp-MMA NVFP4 GEMV (PTX path vs the codec references); a failure ends the call
#   pytests   GPU pytest of $PYTEST_FILES -k "$PYTEST_K" (default: the IQ3_S h2 file and every IQ3_S / Q6_K
#             case of test_kernels_gemv.py), full output kept; PYTEST_ENV: VAR=value words for pytest alone
#   anatomy   bench/gemv_anatomy.py (where a T=1 NVFP4 GEMV's time goes; pinned vs unpinned loads)
#   floor     bench/step_floor.py: the 27B step's weight reads as pure streaming reads, one launch per GEMV (the
#             floor of a kernel-per-op step), then each GEMV shape alone (step_floor.json, step_floor.txt)
#   pattern   bench/read_pattern.py: the T = 1 GEMV's weight walk without the decode, chunk-major against
#             row-blocked planes, and a plain read (read_pattern.json, read_pattern.txt)
#   xpre      bench/xpre.py: the NVFP4 h2 / MMA GEMVs on prepared activations vs the production ones
#   ncu       Nsight Compute (clocks left alone) on one NVFP4 GEMV launch per shape of $NCU_SHAPES (default
#             attn_qkv mlp_gate_up) and T of $NCU_TS (default 1; bench/ncu_gemv.py): speed of light, scheduler, warp
#             state, occupancy, launch, memory workload (ncu_<shape>_T<t>.csv)
#   kernels   re-tune + time + check NVFP4/Q6_K at the 27B shapes (--merge into bench/results/kernels.json),
#             then ship the winners into kernels/gemv_tuned.json of this working tree (later steps use them);
#             KXPRE=1 also times them on prepared activations (formats <fmt>+xpre); KRUNOFF (default 3) tuner
#             finishers re-timed over rotating copies in one graph before one ships (0: the tuner's pick)
#   kernels4  the same with NINFER_IQ3S_LAYOUT=codes4: KFORMATS=iq3_s gives records "iq3_s4" (IQ3_S read from the
#             4-bit code planes, kernels/gemv_iq3_s4.py, the default layout since s45), merged into the same
#             kernels.json; kernelsgrid: with NINFER_IQ3S_LAYOUT=grid (records "iq3_s": the grid planes)
#   decode    bench/decode.py decode + verify for $RECIPES (default nvfp4) in the time left
#   decodenopdl the same with NINFER_PDL=0 (no programmatic dependent launch; on by default on sm_90+), written
#             as decode_nopdl.json; run it before decode to compare both on one machine
#   decodealt the same under the environment words in $ALT_ENV (e.g. "NINFER_BRANCH=0"), written as
#             decode_alt.json; run it before decode to compare both on one machine
#   decoderecipes  the same for $EXTRA_RECIPES (default q6_k,iq3_s) over $RECIPE_PARTS (default decode,verify),
#             written as decode_recipes.json; nothing kept
#   decodex   the same with NINFER_XPRE=${DECODEX_XPRE:-0} (the comparison run: prepared activations are on by default
#             on sm_80+), written as decode_xpre.json
#   sweep     bench/decode.py --recipes ${SWEEP_RECIPE:-nvfp4} --parts ${SWEEP_PARTS:-decode} at 1K once per value of
#             $SWEEP_VALUES (space list) of the environment variable $SWEEP_VAR, in that order, on one kept
#             artifact: records tagged "sweep": "VAR=v" in sweep.json, tables in sweep_table.txt (repeat a value to
#             see the machine's drift); $SWEEP_ARGS: more decode.py arguments (e.g. "--max-draft 3"); a value that
#             names a folder .ab/<value> (bench/ab_tree.sh: an earlier commit's packages; carry .ab) runs with that
#             folder first on PYTHONPATH
#   enginemtp bench/engine_mtp.py: MTP through the real Engine with rigged drafts on the nvfp4 artifact (built, or
#             the one decode / sweep kept under /dev/shm/ninfer-run): K = 0 and $EMTP_KS (default 1,3; 0: K = 0 alone) at acceptance
#             $EMTP_ACC (default 0.75,0.9,1) per draft head of $EMTP_HEADS (default lm_head,nvfp4,nvfp4:131072),
#             engine_mtp.json and engine_mtp_table.txt; drafts kept on the device between draft steps (the default);
#             EMTP_PROFILE=N: one more profiled generation of N tokens per K (tables in the log, trace .json.gz);
#             EMTP_AUDIT=1: one more generation per K under torch's sync debug mode (host syncs per round, by site);
#             EMTP_TEMP=T: every request sampled at temperature T (seeded; the accepted count stays rigged), with
#             top_k EMTP_TOPK, top_p EMTP_TOPP and presence_penalty EMTP_PRES (default 0 / 1 / 0: off);
#             EMTP_GAPS=N: one more generation of N tokens per K with CUDA events around every graph step (GPU span
#             of each step and the gaps between them per round, bench/round_gaps.py; no profiler);
#             EMTP_BATCH=B: B requests decoded together (their re-alignments mostly ragged); EMTP_ROUNDS=0,1: every K once per
#             NINFER_ROUND_GRAPHS value (round graphs off / on, ninfer_rt/graph_round.py) on the one loaded model
#   enginemtp0 the same with NINFER_DRAFT_CHAIN=0 (every draft read back before the next draft step), written as
#             engine_mtp_readback.json
#   enginemtpab the same with the runtime of .ab/$EMTP_AB first on PYTHONPATH (bench/ab_tree.sh; carry .ab), draft
#             heads $EMTP_AB_HEADS (default lm_head: runtimes before s36 have no other), written as engine_mtp_ab.json
#   tinymtp   bench/tiny_mtp.py --device cuda: the embedded ninfer-tiny on the Triton backend with CUDA graphs, real
#             MTP drafts (recipes $TINY_RECIPES, default nvfp4; K $TINY_KS, default 3; draft heads $TINY_HEADS):
#             tokens per round and every K's tokens against plain greedy decoding (tiny_mtp_cuda.json); tinymtp0
#             the same with NINFER_DRAFT_CHAIN=0 (tiny_mtp_cuda_readback.json); $TINY_ARGS: more tiny_mtp.py arguments;
#             TINY_S (default 400): each Engine on the tiny shapes compiles and captures for ~2 minutes (s37)
#   prefixcache bench/prefix_cache.py: time to first token with and without the prefix cache (a repeated prompt,
#             prompts sharing a system prompt) at $PREFIX_LENS (default 1024,4096) on the nvfp4 artifact (built, or
#             the one kept under /dev/shm/ninfer-run), $PREFIX_REPS reps (prefix_cache.json); PREFIX_S (default 300)
#   topk      bench/topk_select.py: the sampled round graph's processing alone (torch.topk against the chunked
#             selection, processed with and without it) in CUDA graphs (topk_select.json, topk_table.txt); TOPK_S
#   launch    bench/graph_launch.py: each CUDA graph of the real Engine (K = $LAUNCH_KS, default 0,3) replayed onto an
#             idle GPU against back to back: the launch time a step that starts on an idle GPU pays
#             (graph_launch.json); LAUNCH_S (default 240), LAUNCH_ENV: VAR=value words for it alone
#   serve     bench/serve.py at concurrency $SERVE_C (default 1,2,4,8) on the nvfp4 artifact decode kept
#   servex    the same with NINFER_XPRE=${SERVEX_XPRE:-0} (the comparison run), written as serve_xpre.json
# Env: ANATOMY_S, FLOOR_S, PATTERN_S, XPRE_S, XPRE_TS and XPRE_EXTRA (xpre.py --T / --extra), XPRE_SHAPES, NCU_SHAPES, KERNELS_S, SERVE_S, DECODEX_S, TOTAL_S (whole call, default 580), RECIPES
# and PARTS (comma lists), SERVE_C, ANATOMY_SHAPES, ANATOMY_CONFIGS, KFORMATS, KTS, KTP and KSHAPES (space lists: kernels'
# formats, T values and TP degrees), KCHECK=0 (kernels without --check: its probes compile T = 8/16/64 variants
# in-process, ~30 s per format).
#     bash bench/gpu_run.sh anatomy kernels decode
set -u
source bench/device_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( ${TOTAL_S:-580} - $(el) - 15 )); }
# seconds kept back for the later steps named (each ${DECODEX_S:-150} / ${SERVE_S:-150}) that this call runs
reserve() {
  local r=0 s
  for s in "$@"; do
    case " $STEPS " in *" $s "*) ;; *) continue ;; esac
    case $s in
      decode|decodex) r=$(( r + ${DECODEX_S:-150} )) ;;
      enginemtp|enginemtp0|enginemtpab) r=$(( r + ${EMTP_S:-300} )) ;;
      *) r=$(( r + ${SERVE_S:-150} )) ;;
    esac
  done
  echo $r
}
# run_decode NAME XPRE RESERVED [PDL]: bench/decode.py on $RECIPES (the artifact kept for decodex / serve); NAME
# decode writes decode.json, decodex (the NINFER_XPRE comparison run) decode_xpre.json, decodenopdl (NINFER_PDL=0)
# decode_nopdl.json
run_decode() {
  local name=$1 l=$(( $(left) - $3 )) keep="" json=decode.json pdl=${4:-${NINFER_PDL:-1}}
  [ "$l" -gt 120 ] || { echo "no time for $name ($l s)"; return; }
  case " $STEPS " in *" decodex "*|*" serve "*|*" servex "*) keep="--keep --dir /dev/shm/ninfer-run";; esac
  [ "$name" = decodex ] && { keep="--keep --dir /dev/shm/ninfer-run"; json=decode_xpre.json; }
  [ "$name" = decodenopdl ] && { keep="--keep --dir /dev/shm/ninfer-run"; json=decode_nopdl.json; }
  local alt="" recipes=${RECIPES:-nvfp4} parts=${PARTS:-decode,verify}
  [ "$name" = decodealt ] && { keep="--keep --dir /dev/shm/ninfer-run"; json=decode_alt.json; alt="$ALT_ENV"; }
  [ "$name" = decoderecipes ] && { keep=""; json=decode_recipes.json; recipes=${EXTRA_RECIPES:-q6_k,iq3_s}
    parts=${RECIPE_PARTS:-decode,verify}; }
  env $alt NINFER_PDL=$pdl NINFER_XPRE=$2 timeout $l python3 bench/decode.py --recipes $recipes --parts $parts \
    --steps 64 $keep --budget-s $(( l - 10 )) --out "$OUT/$json" \
    > "$OUT/${name}_table.txt" 2> "$OUT/${name}_log.txt"
  echo "$name rc=$?"; tail -30 "$OUT/${name}_table.txt"; tail -3 "$OUT/${name}_log.txt"
}
# run_serve NAME XPRE RESERVED: bench/serve.py at $SERVE_C on the nvfp4 artifact decode kept; NAME serve writes
# serve.json, servex (the NINFER_XPRE comparison run) serve_xpre.json
run_serve() {
  local name=$1 l=$(( $(left) - $3 )) json=serve.json art
  [ "$l" -gt 90 ] || { echo "no time for $name ($l s)"; return; }
  art=$(ls -d /dev/shm/ninfer-run/nvfp4-tp1 2>/dev/null) || { echo "$name: no artifact (run decode first)"; return; }
  [ "$name" = servex ] && json=serve_xpre.json
  NINFER_XPRE=$2 timeout $l python3 bench/serve.py --artifact "$art" --concurrency ${SERVE_C:-1,2,4,8} \
    --max-tokens 64 --out "$OUT/$json" > "$OUT/${name}_table.txt" 2>&1
  echo "$name rc=$?"; tail -15 "$OUT/${name}_table.txt"
}
# run_enginemtp NAME CHAIN: bench/engine_mtp.py under NINFER_DRAFT_CHAIN=CHAIN, written as NAME.json / NAME_table.txt
run_enginemtp() {
  local l=$(left); [ "$l" -gt ${EMTP_S:-300} ] && l=${EMTP_S:-300}
  [ "$l" -gt 60 ] || { echo "no time for $1 ($l s)"; return; }
  NINFER_DRAFT_CHAIN=$2 timeout $l python3 bench/engine_mtp.py --recipe nvfp4 --dir /dev/shm/ninfer-run \
    --ks ${EMTP_KS:-1,3} --acceptance ${EMTP_ACC:-0.75,0.9,1} --draft-heads ${EMTP_HEADS:-lm_head,nvfp4,nvfp4:131072} \
    --new-tokens ${EMTP_NEW:-128} --profile-tokens ${EMTP_PROFILE:-0} $([ "${EMTP_AUDIT:-0}" = 1 ] && echo --sync-audit) \
    --gap-tokens ${EMTP_GAPS:-0} --temperature ${EMTP_TEMP:-0} --top-k ${EMTP_TOPK:-0} --top-p ${EMTP_TOPP:-1} \
    --presence-penalty ${EMTP_PRES:-0} \
    --batch ${EMTP_BATCH:-1} $([ -n "${EMTP_ROUNDS:-}" ] && echo --round-graphs $EMTP_ROUNDS) \
    --out "$OUT/$1.json" > "$OUT/$1_table.txt" 2> "$OUT/$1_log.txt"
  echo "$1 rc=$?"; cat "$OUT/$1_table.txt"; tail -3 "$OUT/$1_log.txt"
}
# run_sweep: one decode.py per value of $SWEEP_VALUES under $SWEEP_VAR=value (see the step list above)
run_kernels() {   # $1: the step's name (its table and log files)
  timeout ${KERNELS_S:-300} python3 bench/kernels.py $([ "${KCHECK:-1}" = 0 ] || echo --check) --formats ${KFORMATS:-nvfp4 q6_k} --tp ${KTP:-1 2} $([ -n "${KSHAPES:-}" ] && echo --shapes $KSHAPES) \
    --T ${KTS:-1 2 4 8} --merge $([ "${KXPRE:-0}" = 1 ] && echo --xpre) --runoff ${KRUNOFF:-3} \
    --out bench/results/kernels.json > "$OUT/$1_table.txt" 2> "$OUT/$1_log.txt"
  echo "$1 rc=$?"; tail -2 "$OUT/$1_log.txt"
  cp bench/results/kernels.json bench/results/kernels_check.json "$OUT/" 2>/dev/null
  python3 -m ninfer_kernels.gemv_tune_cache bench/results/kernels.json && cp kernels/gemv_tuned.json "$OUT/"
}

run_sweep() {
  local v i=0 l
  for v in $SWEEP_VALUES; do
    l=$(( $(left) - $(reserve decode serve enginemtp enginemtp0 enginemtpab) )); [ "$l" -gt 60 ] || { echo "no time for sweep $v ($l s)"; break; }
    echo "== sweep ${SWEEP_VAR}=$v" >> "$OUT/sweep_table.txt"
    rm -f "/tmp/sweep_$i.json"   # a warm machine keeps an earlier call's file: a failed run must not merge it
    local pp=$PYTHONPATH
    [ -d ".ab/$v" ] && pp="$PWD/.ab/$v:$PYTHONPATH"   # bench/ab_tree.sh: an earlier commit's packages first
    env PYTHONPATH="$pp" "${SWEEP_VAR}=$v" timeout $l python3 bench/decode.py --recipes ${SWEEP_RECIPE:-nvfp4} --parts ${SWEEP_PARTS:-decode} \
      --contexts 1024 --steps 64 ${SWEEP_ARGS:-} --keep --dir /dev/shm/ninfer-run --budget-s $(( l - 10 )) \
      --out "/tmp/sweep_$i.json" >> "$OUT/sweep_table.txt" 2> "/tmp/sweep_log_$i.txt"
    local rc=$?
    echo "sweep ${SWEEP_VAR}=$v rc=$rc"
    if [ "$rc" -ne 0 ]; then   # the failing run's own words, in the table that comes back (its log does not)
      tail -5 "/tmp/sweep_log_$i.txt" | tee -a "$OUT/sweep_table.txt"
    else
      grep -E "decode +1024|verify +1024 +K=3" "$OUT/sweep_table.txt" | tail -2
    fi
    python3 - "$SWEEP_VAR=$v" "/tmp/sweep_$i.json" "$OUT/sweep.json" <<'PY' || echo "sweep merge failed"
import json, os, sys
tag, src, dst = sys.argv[1:]
old = json.load(open(dst)) if os.path.exists(dst) else []
new = [dict(r, sweep=tag) for r in (json.load(open(src)) if os.path.exists(src) else [])]
json.dump(old + new, open(dst, "w"), indent=1)
PY
    i=$(( i + 1 ))
  done
  tail -4 /tmp/sweep_log_0.txt 2>/dev/null
}
STEPS=" $* "
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
for step in "$@"; do
  echo "== $step at $(el) s"
  case $step in
    tuner) timeout 120 python3 -m pytest -q -x tests/test_kernels_tuner.py 2>&1 | tail -3 ;;
    h2test) timeout 150 python3 -m pytest -q -x tests/test_kernels_gemv_h2.py 2>&1 | tail -3 ;;
    mmatest)
      timeout 200 python3 -m pytest -q -x tests/test_kernels_gemv_mma.py > "$OUT/mmatest.txt" 2>&1
      rc=$?; tail -25 "$OUT/mmatest.txt"; [ $rc -eq 0 ] || { echo "mmatest failed (rc=$rc): stopping"; break; } ;;
    pytests)
      env ${PYTEST_ENV:-} timeout ${PYTEST_S:-240} python3 -u -m pytest -q -rf --durations=20 \
        ${PYTEST_FILES:-tests/test_kernels_gemv_iq3_s_h2.py tests/test_kernels_gemv.py} \
        -k "${PYTEST_K:-iq3 or q6_k}" > "$OUT/pytests.txt" 2>&1
      echo "pytests rc=$?"; grep -E "passed|failed|^FAILED" "$OUT/pytests.txt" | tail -10 ;;
    anatomy)
      timeout ${ANATOMY_S:-150} python3 bench/gemv_anatomy.py --out "$OUT/gemv_anatomy.json" \
        --shapes ${ANATOMY_SHAPES:-attn_qkv mlp_gate_up mlp_down attn_qkv_tp2} \
        --configs ${ANATOMY_CONFIGS:-128:3,64:3} > "$OUT/anatomy.txt" 2>&1
      echo "anatomy rc=$?"; tail -70 "$OUT/anatomy.txt" ;;
    floor)
      timeout ${FLOOR_S:-120} python3 bench/step_floor.py --out "$OUT/step_floor.json" > "$OUT/step_floor.txt" 2>&1
      echo "floor rc=$?"; tail -20 "$OUT/step_floor.txt" ;;
    pattern)
      timeout ${PATTERN_S:-150} python3 bench/read_pattern.py --out "$OUT/read_pattern.json" > "$OUT/read_pattern.txt" 2>&1
      echo "pattern rc=$?"; tail -50 "$OUT/read_pattern.txt" ;;
    ncu)
      for s in ${NCU_SHAPES:-attn_qkv mlp_gate_up}; do for t in ${NCU_TS:-1}; do
        timeout 90 ncu --clock-control none --kernel-name regex:"nvfp4_(h2|mma)" --launch-skip 3 --launch-count 1 \
          --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section Occupancy \
          --section LaunchStats --section MemoryWorkloadAnalysis --csv --page details \
          python3 bench/ncu_gemv.py --shape "$s" --T $t > "$OUT/ncu_${s}_T$t.csv" 2> "$OUT/ncu_${s}_T$t.txt"
        echo "ncu $s T=$t rc=$?"; grep -E "Duration|DRAM Throughput|SM Active|Issued Warp|Eligible Warps|Achieved Occ|Theoretical Occ|Registers Per|Waves Per|Grid Size|L1/TEX Hit|Mem Busy|Max Bandwidth|Warp Cycles Per Issued" \
          "$OUT/ncu_${s}_T$t.csv" | awk -F'","' '{v = $NF; sub(/",?$/, "", v); print $(NF-2)": "v" "$(NF-1)}'
      done; done ;;
    xpre)
      timeout ${XPRE_S:-240} python3 bench/xpre.py --out "$OUT/xpre.json" ${XPRE_SHAPES:+--shapes $XPRE_SHAPES} \
        ${XPRE_TS:+--T $XPRE_TS} ${XPRE_EXTRA:+--extra $XPRE_EXTRA} \
        > "$OUT/xpre_table.txt" 2> "$OUT/xpre_log.txt"
      echo "xpre rc=$?"; cat "$OUT/xpre_table.txt"; grep prepared "$OUT/xpre_log.txt"; tail -3 "$OUT/xpre_log.txt" ;;
    kernels) run_kernels kernels ;;
    kernels4) NINFER_IQ3S_LAYOUT=codes4 run_kernels kernels4 ;;
    kernelsgrid) NINFER_IQ3S_LAYOUT=grid run_kernels kernelsgrid ;;
    decode) run_decode decode "${NINFER_XPRE:-auto}" "$(reserve decodex serve servex)" ;;
    decodex) run_decode decodex "${DECODEX_XPRE:-0}" "$(reserve serve servex)" ;;
    decodenopdl) run_decode decodenopdl "${NINFER_XPRE:-auto}" "$(reserve decode decodex serve servex)" 0 ;;
    decodealt) run_decode decodealt "${NINFER_XPRE:-auto}" "$(reserve decode decodex serve servex)" ;;
    decoderecipes) run_decode decoderecipes "${NINFER_XPRE:-auto}" "$(reserve serve servex)" ;;
    sweep) run_sweep ;;
    enginemtp) run_enginemtp engine_mtp 1 ;;
    enginemtp0) run_enginemtp engine_mtp_readback 0 ;;
    enginemtpab) PYTHONPATH="$PWD/.ab/${EMTP_AB:?EMTP_AB names a folder of .ab}:$PYTHONPATH" EMTP_HEADS=${EMTP_AB_HEADS:-lm_head} \
      run_enginemtp engine_mtp_ab 1 ;;
    tinymtp|tinymtp0)
      j=tiny_mtp_cuda; [ $step = tinymtp0 ] && j=tiny_mtp_cuda_readback
      NINFER_DRAFT_CHAIN=$([ $step = tinymtp0 ] && echo 0 || echo 1) timeout ${TINY_S:-400} python3 bench/tiny_mtp.py \
        --device cuda --recipes ${TINY_RECIPES:-nvfp4} --ks ${TINY_KS:-3} --draft-heads ${TINY_HEADS:-lm_head,nvfp4} \
        ${TINY_ARGS:-} --out "$OUT/$j.json" > "$OUT/${j}_table.txt" 2> "$OUT/${j}_log.txt"
      echo "$step rc=$?"; cat "$OUT/${j}_table.txt"; tail -4 "$OUT/${j}_log.txt" ;;
    prefixcache)
      timeout ${PREFIX_S:-300} python3 bench/prefix_cache.py --recipe nvfp4 --dir /dev/shm/ninfer-run \
        --prompt-lens ${PREFIX_LENS:-1024,4096} --reps ${PREFIX_REPS:-3} --out "$OUT/prefix_cache.json" \
        > "$OUT/prefix_cache_table.txt" 2> "$OUT/prefix_cache_log.txt"
      echo "prefixcache rc=$?"; cat "$OUT/prefix_cache_table.txt"; tail -3 "$OUT/prefix_cache_log.txt" ;;
    topk) timeout ${TOPK_S:-90} python3 bench/topk_select.py --out "$OUT/topk_select.json" > "$OUT/topk_table.txt" 2>&1
          echo "topk rc=$?"; cat "$OUT/topk_table.txt" ;;
    launch)
      env ${LAUNCH_ENV:-} timeout ${LAUNCH_S:-240} python3 bench/graph_launch.py --recipe nvfp4 --dir /dev/shm/ninfer-run \
        --ks ${LAUNCH_KS:-0,3} --out "$OUT/graph_launch${LAUNCH_TAG:-}.json" > "$OUT/graph_launch${LAUNCH_TAG:-}_table.txt" \
        2> "$OUT/graph_launch${LAUNCH_TAG:-}_log.txt"
      echo "launch rc=$?"; cat "$OUT/graph_launch${LAUNCH_TAG:-}_table.txt"; tail -4 "$OUT/graph_launch${LAUNCH_TAG:-}_log.txt" ;;
    serve) run_serve serve "${NINFER_XPRE:-auto}" "$(reserve servex)" ;;
    servex) run_serve servex "${SERVEX_XPRE:-0}" 0 ;;
    *) echo "unknown step $step" ;;
  esac
done
# at most 8 files come back: the text logs (and ncu's tables) travel as one archive
( cd "$OUT" && f=$(ls *.txt *.csv 2>/dev/null) && [ -n "$f" ] && tar czf logs.tgz $f && rm -f $f )
echo "done at $(el) s"
