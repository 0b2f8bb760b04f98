#!/usr/bin/env bash
# specheads on a GPU: install, the CUDA tests, probes, then every command in bf16 on a tiny pair (and on the
# shared SmolLM2 pair where it is present). Run from the repository root on a machine with a CUDA GPU:
#   bash bench/gpu_smoke.sh                  # results in $OUT (default ./gpu-smoke-out), summary.txt
# Offline machines: put the wheels it needs in .whl/ (see "install" below); they go to /tmp/site, first on the
# path. Every step ends as PASS / FAIL / SKIP with its exit code, seconds and last error line; the summary is
# written as Markdown to $OUT/gpu_smoke.md (copy it to bench/results/gpu_smoke.md to record a run).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-smoke-out}
W=$OUT/work
mkdir -p "$W"
export SPECHEADS_CACHE=$W/cache TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
SUM=$OUT/summary.txt
: >"$SUM"
PY=${PYTHON:-python3}
DEV=${SMOKE_DEVICE:-cuda} # SMOKE_DEVICE=cpu SMOKE_INSTALL=0: the same command lines on the CPU (a dry run)
step() { # step NAME TIMEOUT_S CMD...
    local name=$1 t=$2
    shift 2
    if [ -n "${SMOKE_ONLY:-}" ] && ! [[ $name =~ $SMOKE_ONLY ]]; then return; fi # SMOKE_ONLY=regex: a subset
    local s=$SECONDS
    timeout "$t" "$@" >"$OUT/$name.log" 2>&1
    local rc=$? st=PASS
    [ $rc -eq 0 ] || st=FAIL
    printf '%-6s %-22s rc=%-3s %4ss  %s\n' "$st" "$name" "$rc" "$((SECONDS - s))" \
        "$(grep -E 'Error|error:|FAILED' "$OUT/$name.log" | tail -1 | cut -c1-160)" | tee -a "$SUM"
}

# ---- install ----------------------------------------------------------------------------------------------
if [ "${SMOKE_INSTALL:-1}" = 0 ]; then
    echo "INFO   install skipped (SMOKE_INSTALL=0)" | tee -a "$SUM"
elif [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then # offline: the wheels carried in .whl/
    $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . || echo "FAIL   install" | tee -a "$SUM"
else
    $PY -m pip install -q -e ".[gguf,train,test,deepspeed]" || echo "FAIL   install" | tee -a "$SUM"
fi
BIN=$(dirname "$(command -v "$PY")")
export PATH=$BIN:$PATH
$PY - <<'EOF' | tee -a "$SUM"
import torch, transformers, accelerate
gpu = (torch.cuda.get_device_name(0), "bf16", torch.cuda.is_bf16_supported()) if torch.cuda.is_available() else ("no GPU",)
print("INFO  ", torch.__version__, "CUDA", torch.version.cuda, *gpu, "| transformers", transformers.__version__,
      "| accelerate", accelerate.__version__)
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/INFO   /' >>"$SUM"

# ---- the CUDA tests and the probes --------------------------------------------------------------------------
step cuda_tests 300 $PY -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider
grep -E '[0-9]+ (passed|failed)' "$OUT/cuda_tests.log" | tail -1 | sed 's/^/INFO   cuda tests: /' >>"$SUM"
# SMOKE_PROBES=none: write the tiny pair only; or a comma-separated list of bench/gpu_probe.py's probes
$PY bench/gpu_probe.py "$W" "${SMOKE_PROBES:-all}" >"$OUT/probe.log" 2>&1
grep -E '^(PASS|FAIL|SKIP)' "$OUT/probe.log" | tee -a "$SUM"

# ---- every command on the tiny pair, bf16, CUDA ----------------------------------------------------------------
T=$W/pair/target D=$W/pair/draft P=$W/p.jsonl
M="target.path=$T target.gguf_file=null draft.path=$D target.device=$DEV draft.device=$DEV"
M="$M target.dtype=auto draft.dtype=auto" # auto: bf16 on a GPU
G="$M prompts=$P offset=0 num_prompts=null max_new_tokens=16 batch_size=4 chunk_size=4 chat_template=false"
step dg_acceptance 180 heads-datagen $G labels=acceptance output_dir=$W/dg_acc
step dg_acc_sampled 180 heads-datagen $G labels=acceptance sampling.do_sample=true output_dir=$W/dg_acc_s
step dg_drafter 180 heads-datagen $G labels=drafter drafter.top_k=8 output_dir=$W/dg_drafter
step dg_fsd 180 heads-datagen $G labels=fsd sampling.do_sample=true output_dir=$W/dg_fsd
step dg_sprinter 180 heads-datagen $G labels=sprinter sampling.do_sample=true output_dir=$W/dg_spr
step dg_judge 180 heads-datagen $M prompts="''" offset=0 judge.tuples=$W/tuples.jsonl num_prompts=null labels=judge \
    chat_template=false max_new_tokens=8 batch_size=2 chunk_size=4 output_dir=$W/dg_judge
step dg_judge_sampled 180 heads-datagen $M prompts=$W/gsm.jsonl offset=0 num_prompts=8 labels=judge judge.answer_samples=1 \
    chat_template=false max_new_tokens=8 batch_size=4 chunk_size=4 output_dir=$W/dg_judge_s
A="data_dir=$W/dg_acc head=acceptance draft.path=$D draft.gguf_file=null draft.device=$DEV draft.dtype=auto depth=1 batch_size=2"
A="$A epochs=2 eval_fraction=0.25"
E="data_dir=$W/dg_drafter head=eagle target.path=$T target.gguf_file=null target.device=$DEV target.dtype=auto"
E="$E ttt_steps=2 vocab_top_n=32 batch_size=2 epochs=2 eval_fraction=0.25"
J="data_dir=$W/dg_judge head=judge depth=0 epochs=2 batch_size=2 eval_fraction=0.25 threshold=0.5 draft.path=unused"
step tr_acceptance 240 heads-train $A output_dir=$W/tr_acc
step tr_eagle 240 heads-train $E output_dir=$W/tr_eagle
step tr_judge 240 heads-train $J output_dir=$W/tr_judge
step ex_acceptance 120 heads-export train_dir=$W/tr_acc output_dir=$W/ex_acc
step ex_eagle 120 heads-export train_dir=$W/tr_eagle output_dir=$W/ex_eagle
step ex_judge 120 heads-export train_dir=$W/tr_judge output_dir=$W/ex_judge
step ex_speculators 120 heads-export train_dir=$W/tr_eagle format=speculators dtype=bfloat16 output_dir=$W/ex_spec
X="$M prompts=$P offset=0 num_prompts=4 max_new_tokens=24 chat_template=false"
step dec_sd 180 heads-decode $X policy=sd sd.k=3 output_dir=$W/dec_sd
step dec_sd_sampled 180 heads-decode $X policy=sd sd.k=3 sampling.do_sample=true output_dir=$W/dec_sd_s
step dec_specdecpp 180 heads-decode $X policy=specdecpp specdecpp.head=$W/ex_acc/head.safetensors \
    output_dir=$W/dec_spp
step dec_judge 180 heads-decode $X policy=judge judge.head=$W/ex_judge/head.safetensors output_dir=$W/dec_judge
step dec_eagle 180 heads-decode $X policy=sd sd.k=3 eagle=$W/ex_eagle/head.safetensors output_dir=$W/dec_eagle
step dec_batched 180 heads-decode $X policy=sd sd.k=3 batch_size=4 output_dir=$W/dec_batch
step dec_batched_eagle 180 heads-decode $X policy=sd sd.k=3 batch_size=4 eagle=$W/ex_eagle/head.safetensors \
    output_dir=$W/dec_batch_eagle
step ds_zero2_acc 300 accelerate launch --config_file recipes/accelerate/deepspeed_zero2.yaml --num_processes 1 \
    -m specheads.train.cli $A output_dir=$W/tr_acc_z2
step ds_zero3_eagle 300 accelerate launch --config_file recipes/accelerate/deepspeed_zero3.yaml --num_processes 1 \
    -m specheads.train.cli $E output_dir=$W/tr_eagle_z3

# ---- the shared SmolLM2 pair (GGUF target), where present ----------------------------------------------------
S=${SPECHEADS_SHARED:-../shared}
if [ -f "$S/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
    Q="target.dtype=auto draft.dtype=auto target.device=$DEV draft.device=$DEV"
    step s_dg_accept 240 heads-datagen recipe=specdecpp_draft_quickstart $Q num_prompts=16 output_dir=$W/s_acc
    step s_dg_drafter 240 heads-datagen recipe=quickstart $Q labels=drafter num_prompts=8 chunk_size=4 \
        max_new_tokens=64 output_dir=$W/s_drafter
    step s_dec_eagle 180 heads-decode recipe=quickstart $Q eagle=recipes/heads/eagle_smollm2.safetensors \
        num_prompts=2 max_new_tokens=64 output_dir=$W/s_dec_eagle
else
    echo "SKIP   shared SmolLM2 pair not at $S (set SPECHEADS_SHARED)" | tee -a "$SUM"
fi

# ---- the record ---------------------------------------------------------------------------------------------
{
    echo "# GPU smoke ($(date -u +%Y-%m-%d), bench/gpu_smoke.sh)"
    echo
    echo "$(grep -c '^PASS' "$SUM") PASS, $(grep -c '^FAIL' "$SUM") FAIL, $(grep -c '^SKIP' "$SUM") SKIP."
    echo
    echo '```'
    cat "$SUM"
    echo '```'
} >"$OUT/gpu_smoke.md"
echo "---- summary ($OUT/gpu_smoke.md)"
cat "$SUM"
