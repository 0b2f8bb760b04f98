#!/usr/bin/env bash
# specheads on a GPU: install, the CUDA tests, probes, then every command in bf16 on a tiny pair (or on the shared
# SmolLM2 pair where it is present): datagen of every label family, training of every head (the EAGLE head and
# the standalone draft also under DeepSpeed ZeRO-3), export in the three formats, decoding with and without
# eagle=, batched, draft trees, stop=cost, a target split over two devices, heads-eval (fidelity on),
# heads-vocab, heads-pipeline, and engine=vllm where vLLM imports. Run from the repository root:
#   bash bench/gpu_smoke.sh            # results in $OUT (default ./gpu-smoke-out): gpu_smoke.md, gpu_smoke.json
# Every step ends as one PASS / FAIL / SKIP line with its exit code, seconds and last error line (a step whose
# input step failed is SKIPped, naming it); the record is $OUT/gpu_smoke.md (copy it to
# bench/results/gpu_smoke.md to record a GPU run) and $OUT/gpu_smoke.json ({commit, gpu, pass, fail, skip,
# steps: [{name, status, rc, seconds}]}), written even when the run is cut short.
# Settings (environment):
#   SMOKE_DEVICE=cpu SMOKE_INSTALL=0  the same command lines on the CPU (a dry run; CUDA and vLLM steps SKIP)
#   SMOKE_ONLY=<regex>     only the steps whose name matches (their inputs from an earlier run in $OUT/work)
#   SMOKE_PAIR=auto|tiny|shared   auto (default): the shared pair where present, else the tiny pair built here
#   SMOKE_JOBS=N           steps run at once once their inputs are there (default 6 on a GPU, 1 on the CPU)
#   SMOKE_BUDGET_S=S       no step starts after S seconds, none runs past them (default 480 on a GPU, none on
#                          the CPU); SMOKE_TIMEOUT_SCALE multiplies every step's timeout (default 1; CPU 4)
#   SMOKE_PROBES=none|all|NAME,...  bench/gpu_probe.py's probes; SPECHEADS_SHARED: the shared folder (../shared)
#   SPECHEADS_VLLM_PYTHON  vLLM's python where it is not this one
# Offline machines: put the wheels it needs in .whl/ (see "install" below); they go to /tmp/site, first on the path.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-smoke-out}
W=$OUT/work
R=$OUT/steps
rm -rf "$R"
mkdir -p "$W" "$R"
: >"$OUT/order" && : >"$OUT/info"
export SPECHEADS_CACHE=$W/cache TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DEV=${SMOKE_DEVICE:-cuda}
if [ "$DEV" = cpu ]; then
    JOBS=${SMOKE_JOBS:-1} BUDGET=${SMOKE_BUDGET_S:-0} SCALE=${SMOKE_TIMEOUT_SCALE:-4}
else
    JOBS=${SMOKE_JOBS:-6} BUDGET=${SMOKE_BUDGET_S:-480} SCALE=${SMOKE_TIMEOUT_SCALE:-1}
    if [ "$JOBS" -gt 1 ] && [ -z "${OMP_NUM_THREADS:-}" ]; then # the CPU's cores shared between the steps
        OMP_NUM_THREADS=$(($(nproc) / JOBS > 0 ? $(nproc) / JOBS : 1))
        export OMP_NUM_THREADS
    fi
fi
info() { echo "INFO   $*" | tee -a "$OUT/info"; }
declare -A LAUNCHED=()

# ---- steps ------------------------------------------------------------------------------------------------------
# step NAME TIMEOUT_S [needs=A,B] [after=C,D] [req=cuda|cuda2|vllm|shared] [alone] CMD...: runs CMD (timeout scaled,
# capped by the budget) once the steps it needs (and those it comes after, whatever their result) have ended, into $W/NAME (removed first) with its log in $OUT/NAME.log.
# SKIP when a needed step did not PASS, when the machine lacks what req= names, or when the budget is spent.
record() { # record NAME STATUS RC SECONDS MESSAGE
    printf '%s\t%s\t%s\t%s\n' "$2" "$3" "$4" "$5" >"$R/$1"
    printf '%-6s %-22s rc=%-3s %6ss  %s\n' "$2" "$1" "$3" "$4" "$5"
}
await() { # until step $1, if this run launched it, has its result
    while [ -n "${LAUNCHED[$1]:-}" ] && [ ! -f "$R/$1" ]; do wait -n 2>/dev/null || sleep 0.2; done
}
lacks() { # why this machine cannot run a step that needs $1 (empty: it can)
    case $1 in
    cuda) [ "$DEV" != cpu ] || echo "needs CUDA (SMOKE_DEVICE=cpu)" ;;
    cuda2) [ "$GPUS" -ge 2 ] || echo "needs two GPUs ($GPUS here)" ;;
    vllm) [ -n "$VPY" ] || echo "vLLM does not import here (set SPECHEADS_VLLM_PYTHON)" ;;
    shared) [ "$PAIR" = shared ] || echo "the shared SmolLM2 pair is not in use (SMOKE_PAIR=$PAIR, $S/models)" ;;
    esac
}
run_step() { # run_step NAME TIMEOUT CMD... (in the background)
    local name=$1 t=$2 start rc pid st=PASS msg=
    shift 2
    rm -rf "${W:?}/$name"
    start=$EPOCHREALTIME
    timeout -k 10 "$t" "$@" >"$OUT/$name.log" 2>&1 </dev/null &
    pid=$!
    echo "$pid" >"$R/.$name.pid"
    wait "$pid"
    rc=$?
    rm -f "$R/.$name.pid"
    if [ $rc -ne 0 ]; then
        st=FAIL
        msg=$(grep -E 'Error|error:|FAILED|Traceback|^WRONG' "$OUT/$name.log" | tail -1 | cut -c1-200)
        if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then msg="timed out after ${t}s; $msg"; fi
    else # pytest's count, where there is one
        msg=$(grep -Eo '[0-9]+ passed.*in [0-9.]+s' "$OUT/$name.log" | tail -1)
    fi
    record "$name" "$st" "$rc" "$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')" "$msg"
}
step() {
    local name=$1 t=$(($2 * SCALE)) needs= after= req= alone= why= dep left
    shift 2
    while :; do
        case $1 in
        needs=*) needs=${1#needs=} ;;
        after=*) after=${1#after=} ;;
        req=*) req=${1#req=} ;;
        alone) alone=1 ;;
        *) break ;;
        esac
        shift
    done
    if [ -n "${SMOKE_ONLY:-}" ] && ! [[ $name =~ $SMOKE_ONLY ]]; then return 0; fi
    echo "$name" >>"$OUT/order"
    for r in ${req//,/ }; do why=${why:-$(lacks "$r")}; done
    for dep in ${needs//,/ }; do
        [ -n "$why" ] && break
        await "$dep"
        if [ -f "$R/$dep" ] && [ "$(cut -f1 "$R/$dep")" != PASS ]; then why="needs $dep, which did not pass"; fi
    done
    for dep in ${after//,/ }; do [ -n "$why" ] || await "$dep"; done
    if [ -n "$alone" ] && [ -z "$why" ]; then wait; fi # on its own (vLLM takes most of the GPU's memory)
    left=$((BUDGET > 0 ? BUDGET - SECONDS : t))
    if [ -z "$why" ] && [ "$left" -lt 20 ]; then why="budget spent (SMOKE_BUDGET_S=$BUDGET)"; fi
    if [ -n "$why" ]; then
        record "$name" SKIP - 0 "$why"
        return 0
    fi
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
    LAUNCHED[$name]=1
    run_step "$name" $((t < left ? t : left)) "$@" &
    if [ "$JOBS" -le 1 ] || [ -n "$alone" ]; then wait; fi
}

# ---- the record (also when the run is cut short) -------------------------------------------------------------------
finish() {
    trap - EXIT
    wait
    local commit
    commit=${SMOKE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
    COMMIT=$commit GPU_NAME=${GPU_NAME:-unknown} $PY - "$OUT" <<'EOF'
import json, os, sys
from pathlib import Path

out = Path(sys.argv[1])
steps = []
for name in dict.fromkeys((out / "order").read_text().split()):
    f = out / "steps" / name
    status, rc, secs, msg = f.read_text().rstrip("\n").split("\t") if f.exists() else ("FAIL", "-", "0", "no result")
    steps.append({"name": name, "status": status, "rc": None if rc == "-" else int(rc), "seconds": float(secs),
                  "message": msg})
count = {s: sum(x["status"] == s.upper() for x in steps) for s in ("pass", "fail", "skip")}
rec = {"commit": os.environ["COMMIT"], "gpu": os.environ["GPU_NAME"], **count, "steps": steps}
(out / "gpu_smoke.json").write_text(json.dumps(rec, indent=1) + "\n")
lines = [f"{x['status']:6s} {x['name']:22s} rc={'-' if x['rc'] is None else x['rc']:<3} {x['seconds']:6.1f}s  "
         f"{x['message']}".rstrip() for x in steps]
probes = (out / "probes.log").read_text().splitlines() if (out / "probes.log").exists() else []
lines += ["       " + p for p in probes if p[:4] in ("PASS", "FAIL")]
md = [f"# GPU smoke: bench/gpu_smoke.sh on {rec['gpu']}", "", f"Commit `{rec['commit']}`.",
      f"{count['pass']} PASS, {count['fail']} FAIL, {count['skip']} SKIP.", "", "```",
      *(out / "info").read_text().splitlines(), *lines, "```", ""]
(out / "gpu_smoke.md").write_text("\n".join(md))
EOF
    echo "---- $OUT/gpu_smoke.md, $OUT/gpu_smoke.json"
    cat "$OUT/gpu_smoke.md"
}
trap finish EXIT
stop_all() { # cut short: each running step's timeout passes the signal on, the step records FAIL rc=143
    local f
    for f in "$R"/.*.pid; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null; done
    exit 143
}
trap stop_all TERM INT

# ---- install ----------------------------------------------------------------------------------------------
if [ "${SMOKE_INSTALL:-1}" = 0 ]; then
    info "install skipped (SMOKE_INSTALL=0)"
elif [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then # offline: the wheels carried in .whl/
    $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . || info "install FAILED"
else
    $PY -m pip install -q -e ".[gguf,train,test,deepspeed]" || info "install FAILED"
fi
BIN=$(dirname "$(command -v "$PY")")
export PATH=$BIN:$PATH
read -r GPUS GPU_NAME < <($PY - <<'EOF'
import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(n, f"{n} x {torch.cuda.get_device_name(0)}" if n else "no GPU")
EOF
)
GPUS=${GPUS:-0}
[ "$DEV" = cpu ] && GPU_NAME="$GPU_NAME (SMOKE_DEVICE=cpu: a dry run)"
export GPU_NAME
info "$($PY - <<'EOF'
import torch, transformers, accelerate
bf16 = ("bf16", torch.cuda.is_bf16_supported()) if torch.cuda.is_available() else ()
print(torch.__version__, "CUDA", torch.version.cuda, *bf16, "| transformers", transformers.__version__,
      "| accelerate", accelerate.__version__)
EOF
)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader |
    while read -r line; do info "$line"; done
VPY=${SPECHEADS_VLLM_PYTHON:-$PY}
$VPY -c "import vllm" >/dev/null 2>&1 || VPY=
[ -n "$VPY" ] && info "vLLM $($VPY -c 'import vllm; print(vllm.__version__)' 2>/dev/null) ($VPY)"

# ---- the pair: the shared SmolLM2 pair, or a tiny one written here (with the prompt, question and tuple files) ----
S=${SPECHEADS_SHARED:-../shared}
export SPECHEADS_SHARED=$S
PAIR=${SMOKE_PAIR:-auto}
if [ "$PAIR" = auto ]; then
    PAIR=tiny
    [ -f "$S/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf" ] && PAIR=shared
fi
$PY bench/gpu_probe.py "$W" none >/dev/null 2>&1 || info "bench/gpu_probe.py could not write the tiny pair"
if [ "$PAIR" = shared ]; then
    T=$S/models/smollm2-135m-instruct TG=SmolLM2-135M-Instruct.Q4_1.gguf D=$S/models/smollm2-draft-4l CHAT=$T
else
    T=$W/pair/target TG=null D=$W/pair/draft CHAT=$W/pair/chat
    $PY - "$T" "$CHAT" >/dev/null 2>&1 <<'EOF' # the target with a chat template whose end of turn ties with its favourite token
import shutil, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
src, out = sys.argv[1:]
shutil.rmtree(out, ignore_errors=True)
shutil.copytree(src, out)
tok = AutoTokenizer.from_pretrained(out)
tok.chat_template = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
                     "{% if add_generation_prompt %}<s> assistant {% endif %}")
tok.save_pretrained(out)
model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
with torch.no_grad():
    favourite = int(model(torch.arange(3, 40)[None]).logits[0].argmax(-1).mode().values)
    model.lm_head.weight[tok.eos_token_id] = model.lm_head.weight[favourite]
model.save_pretrained(out)
EOF
fi
info "pair: $PAIR (target $T, gguf_file $TG; draft $D); device $DEV, $GPUS GPU(s); $JOBS step(s) at once;" \
    "budget ${BUDGET}s; timeouts x$SCALE"

# ---- the CUDA tests and the probes (the probes on their own: they time) --------------------------------------------
step probes 180 req=cuda alone bash -c 'out=$("$@"); rc=$?; echo "$out"; [ $rc -eq 0 ] && ! grep -q ^FAIL <<<"$out"' \
    _ $PY bench/gpu_probe.py "$W/probes" "${SMOKE_PROBES:-all}"
step cuda_tests 300 req=cuda $PY -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider

# ---- every command on the pair, bf16 on a GPU -------------------------------------------------------------------------
P=$W/p.jsonl
cat >"$OUT/smoke_recipe.yaml" <<EOF # every command's default recipe: the schema's defaults, not the quickstart's
description: bench/gpu_smoke.sh - the schema defaults; the command line gives the rest
datagen:
train:
export:
decode:
eval:
vocab:
EOF
export SPECHEADS_RECIPE=$OUT/smoke_recipe.yaml
TM="target.path=$T target.gguf_file=$TG target.device=$DEV target.dtype=auto"
M="$TM draft.path=$D draft.gguf_file=null draft.device=$DEV draft.dtype=auto"
SPLIT="target.device_map=auto" # bench/gpu_smoke_helper.py split: over two GPUs, or cuda:0 and the CPU
SP="$PY bench/gpu_smoke_helper.py split"
G="prompts=$P offset=0 num_prompts=8 max_new_tokens=16 batch_size=4 chunk_size=4 chat_template=false"
# datagen: every label family (datagen/registry.py), greedy and sampled
step dg_acceptance 180 heads-datagen $M $G labels=acceptance output_dir=$W/dg_acceptance
step dg_acc_sampled 180 heads-datagen $M $G labels=acceptance sampling.do_sample=true output_dir=$W/dg_acc_sampled
step dg_drafter 180 heads-datagen $M $G labels=drafter drafter.top_k=8 output_dir=$W/dg_drafter
step dg_fsd 180 heads-datagen $M $G labels=fsd sampling.do_sample=true output_dir=$W/dg_fsd
step dg_sprinter 180 heads-datagen $M $G labels=sprinter sampling.do_sample=true output_dir=$W/dg_sprinter
step dg_judge 180 heads-datagen $M prompts="''" offset=0 judge.tuples=$W/tuples.jsonl num_prompts=null labels=judge \
    chat_template=false max_new_tokens=8 batch_size=2 chunk_size=4 output_dir=$W/dg_judge
step dg_judge_sampled 180 heads-datagen $M prompts=$W/gsm.jsonl offset=0 num_prompts=8 labels=judge \
    judge.answer_samples=1 chat_template=false max_new_tokens=8 batch_size=4 chunk_size=4 output_dir=$W/dg_judge_sampled
step dg_judge_swap 180 heads-datagen $M $G labels=judge judge.mining=swap judge.checker=exact max_new_tokens=8 \
    judge.mine_max_tokens=64 output_dir=$W/dg_judge_swap
step dg_prompts 180 heads-datagen target.path=$CHAT target.gguf_file=$TG target.device=$DEV draft.path="''" \
    labels=prompts sampling.do_sample=true num_prompts=6 offset=0 max_new_tokens=12 self_prompts.min_tokens=1 \
    batch_size=3 chunk_size=3 output_dir=$W/dg_prompts
step dg_split_acc 180 $SP heads-datagen $M $SPLIT $G labels=acceptance sampling.do_sample=true \
    output_dir=$W/dg_split_acc
step dg_split_drafter 180 $SP heads-datagen $M $SPLIT $G labels=drafter drafter.top_k=8 output_dir=$W/dg_split_drafter
cat >"$OUT/pipeline.yaml" <<EOF
description: gpu_smoke's pipeline, datagen -> train -> export -> eval on the smoke's pair
target: {path: $T, gguf_file: $TG, device: $DEV}
draft: {path: $D, device: $DEV}
sampling: {do_sample: false}
datagen: {prompts: $P, num_prompts: 8, max_new_tokens: 10, batch_size: 4, chunk_size: 4, chat_template: false,
  output_dir: $W/pipeline/dg}
train: {data_dir: chained, depth: 1, epochs: 2, batch_size: 2, eval_fraction: 0.25, output_dir: $W/pipeline/tr}
export: {output_dir: $W/pipeline/ex}
eval: {prompts: $P, num_prompts: 3, max_new_tokens: 8, chat_template: false, ks: [2], thresholds: [0.5],
  output_dir: $W/pipeline/ev}
pipeline: {output_dir: $W/pipeline/pipe}
EOF
step pipeline 300 heads-pipeline recipe="$OUT/pipeline.yaml"
step dg_passages 120 needs=dg_drafter heads-datagen $TM draft.path="''" labels=passages \
    "passages.sources=[$W/dg_drafter]" passages.min_tokens=15 passages.max_tokens=30 num_prompts=6 chunk_size=3 \
    output_dir=$W/dg_passages
step vocab 120 needs=dg_acceptance heads-vocab $TM data_dir=$W/dg_acceptance output=$W/vocab/vocab.json

# train: every head; the EAGLE head and the standalone draft also under DeepSpeed ZeRO-3, the acceptance head ZeRO-2
FIT="batch_size=2 epochs=2 eval_fraction=0.25"
A="data_dir=$W/dg_acceptance head=acceptance draft.path=$D draft.gguf_file=null draft.device=$DEV draft.dtype=auto"
A="$A depth=1 $FIT"
E="data_dir=$W/dg_drafter head=eagle $TM eagle.ttt_steps=2 vocab_top_n=32 $FIT"
DR="data_dir=$W/dg_drafter head=draft distill.init=truncate:2 $TM draft.gguf_file=null draft.device=$DEV $FIT"
step tr_acceptance 240 needs=dg_acceptance heads-train $A output_dir=$W/tr_acceptance
step tr_eagle 240 needs=dg_drafter heads-train $E output_dir=$W/tr_eagle
step tr_judge 240 needs=dg_judge heads-train data_dir=$W/dg_judge head=judge depth=0 threshold=0.5 draft.path=unused \
    $FIT output_dir=$W/tr_judge
step tr_verifier 240 needs=dg_sprinter heads-train data_dir=$W/dg_sprinter head=verifier depth=0 threshold=0.5 \
    draft.path=$D draft.gguf_file=null draft.device=$DEV $FIT output_dir=$W/tr_verifier
step tr_draft 240 needs=dg_drafter heads-train $DR output_dir=$W/tr_draft
if [ "$DEV" = cpu ]; then # accelerate runs DeepSpeed on the CPU with its CPU accelerator, in fp32
    DS=(env DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES= accelerate launch --num_processes 1 --mixed_precision no)
else
    DS=(accelerate launch --num_processes 1)
fi
Z2=(--config_file recipes/accelerate/deepspeed_zero2.yaml)
Z3=(--config_file recipes/accelerate/deepspeed_zero3.yaml)
step ds_zero2_acc 300 needs=dg_acceptance "${DS[@]}" "${Z2[@]}" --main_process_port 29611 -m specheads.train.cli $A \
    output_dir=$W/ds_zero2_acc
step ds_zero3_eagle 300 needs=dg_drafter "${DS[@]}" "${Z3[@]}" --main_process_port 29612 -m specheads.train.cli $E \
    output_dir=$W/ds_zero3_eagle
step ds_zero3_draft 300 needs=dg_drafter "${DS[@]}" "${Z3[@]}" --main_process_port 29613 -m specheads.train.cli $DR \
    output_dir=$W/ds_zero3_draft

# export: safetensors, hf (a Hub-style directory), speculators (the EAGLE head, as vLLM loads it)
step ex_acceptance 120 needs=tr_acceptance heads-export train_dir=$W/tr_acceptance output_dir=$W/ex_acceptance
step ex_eagle 120 needs=tr_eagle heads-export train_dir=$W/tr_eagle output_dir=$W/ex_eagle
step ex_judge 120 needs=tr_judge heads-export train_dir=$W/tr_judge output_dir=$W/ex_judge
step ex_verifier 120 needs=tr_verifier heads-export train_dir=$W/tr_verifier output_dir=$W/ex_verifier
step ex_hf 120 needs=tr_acceptance heads-export train_dir=$W/tr_acceptance format=hf output_dir=$W/ex_hf
step ex_hf_eagle 120 needs=tr_eagle heads-export train_dir=$W/tr_eagle format=hf output_dir=$W/ex_hf_eagle
step ex_speculators 120 needs=tr_eagle heads-export train_dir=$W/tr_eagle format=speculators dtype=bfloat16 \
    output_dir=$W/ex_speculators
EH=$W/ex_eagle/head.safetensors
step dg_eagle_rounds 180 needs=ex_eagle heads-datagen $TM draft.path="''" $G labels=eagle_rounds \
    eagle_rounds.head=$EH eagle_rounds.k=3 output_dir=$W/dg_eagle_rounds
step tr_eagle_stop 240 needs=dg_eagle_rounds heads-train data_dir=$W/dg_eagle_rounds head=eagle_stop draft.path="''" \
    depth=1 $FIT output_dir=$W/tr_eagle_stop
step ex_eagle_stop 120 needs=tr_eagle_stop heads-export train_dir=$W/tr_eagle_stop output_dir=$W/ex_eagle_stop

# decode: every policy family, with and without eagle=, batched, trees, stop=cost, the split target
X="prompts=$P offset=0 num_prompts=4 max_new_tokens=24 chat_template=false"
XE="$TM draft.path='' $X" # drafting with the EAGLE head: no draft model
step dec_sd 180 heads-decode $M $X policy=sd sd.k=3 output_dir=$W/dec_sd
step dec_sd_sampled 180 heads-decode $M $X policy=sd sd.k=3 sampling.do_sample=true output_dir=$W/dec_sd_sampled
step dec_sd_pruned 180 needs=vocab heads-decode $M $X policy=sd sd.k=3 draft.vocab_file=$W/vocab/vocab.json \
    draft.vocab_top_n=16 output_dir=$W/dec_sd_pruned
step dec_draft 180 needs=tr_draft heads-decode $M $X draft.path=$W/tr_draft/draft policy=sd sd.k=3 \
    output_dir=$W/dec_draft
step dec_specdecpp 180 needs=ex_acceptance heads-decode $M $X policy=specdecpp \
    specdecpp.head=$W/ex_acceptance/head.safetensors output_dir=$W/dec_specdecpp
step dec_specdecpp_cost 180 needs=ex_acceptance heads-decode $M $X policy=specdecpp specdecpp.stop=cost \
    specdecpp.head=$W/ex_acceptance/head.safetensors output_dir=$W/dec_specdecpp_cost
step dec_specdecpp_hf 180 needs=ex_hf heads-decode $M $X policy=specdecpp specdecpp.head=$W/ex_hf \
    output_dir=$W/dec_specdecpp_hf
step dec_conf_cost 180 heads-decode $M $X policy=confidence_stop confidence_stop.stop=cost output_dir=$W/dec_conf_cost
step dec_judge 180 needs=ex_judge heads-decode $M $X policy=judge judge.head=$W/ex_judge/head.safetensors \
    output_dir=$W/dec_judge
step dec_sprinter 180 needs=ex_verifier heads-decode $M $X policy=sprinter \
    sprinter.head=$W/ex_verifier/head.safetensors output_dir=$W/dec_sprinter
step dec_eagle 180 needs=ex_eagle heads-decode $XE policy=sd sd.k=3 eagle=$EH output_dir=$W/dec_eagle
step dec_eagle_sampled 180 needs=ex_eagle heads-decode $XE policy=sd sd.k=3 eagle=$EH sampling.do_sample=true \
    output_dir=$W/dec_eagle_sampled
step dec_eagle_hf 180 needs=ex_hf_eagle heads-decode $XE policy=sd sd.k=3 eagle=$W/ex_hf_eagle \
    output_dir=$W/dec_eagle_hf
step dec_eagle_stop 180 needs=ex_eagle,ex_eagle_stop heads-decode $XE policy=specdecpp eagle=$EH \
    specdecpp.head=$W/ex_eagle_stop/head.safetensors output_dir=$W/dec_eagle_stop
step dec_tree 180 needs=ex_eagle heads-decode $XE policy=tree tree.k=3 tree.tree_width=2 tree.tree_nodes=4 \
    eagle=$EH output_dir=$W/dec_tree
step dec_tree_cost 180 needs=ex_eagle heads-decode $XE policy=tree tree.k=3 tree.tree_width=2 tree.tree_nodes=4 \
    tree.stop=cost eagle=$EH output_dir=$W/dec_tree_cost
step dec_batched 180 heads-decode $M $X policy=sd sd.k=3 batch_size=4 output_dir=$W/dec_batched
step dec_batched_eagle 180 needs=ex_eagle heads-decode $XE policy=sd sd.k=3 batch_size=4 eagle=$EH \
    output_dir=$W/dec_batched_eagle
step dec_split_sd 180 $SP heads-decode $M $SPLIT $X policy=sd sd.k=3 output_dir=$W/dec_split_sd
step dec_split_eagle 180 needs=ex_eagle $SP heads-decode $XE $SPLIT policy=sd sd.k=3 eagle=$EH \
    output_dir=$W/dec_split_eagle
# batches and trees run on the fused forward, which a split target cannot take: refused in one line, exit code 2
# (on a GPU: the dry run's two halves are both on the CPU)
REFUSED=(bash -c 'out=$("$@" 2>&1); rc=$?; echo "$out"; [ $rc -eq 2 ] && grep -q "runs on the fused forward" <<<"$out"' _)
step dec_split_batched 180 req=cuda "${REFUSED[@]}" $SP heads-decode $M $SPLIT $X policy=sd sd.k=3 batch_size=4 \
    output_dir=$W/dec_split_batched
step dec_split_tree 180 needs=ex_eagle req=cuda "${REFUSED[@]}" $SP heads-decode $XE $SPLIT policy=tree tree.k=3 \
    tree.tree_width=2 tree.tree_nodes=4 eagle=$EH output_dir=$W/dec_split_tree

# heads-eval: fidelity on (its default), the cost-aware rows (cost_stop, its default), trees on the EAGLE head
V="$X max_new_tokens=16 ks=[2] thresholds=[0.5] confidence.taus=[0.4]"
step eval 300 needs=ex_acceptance,ex_judge heads-eval $M $V head=$W/ex_acceptance/head.safetensors \
    judge.head=$W/ex_judge/head.safetensors output_dir=$W/eval
step eval_eagle 300 needs=ex_eagle,ex_eagle_stop heads-eval $XE max_new_tokens=16 ks=[2] eagle=$EH \
    head=$W/ex_eagle_stop/head.safetensors thresholds=[0.5] "trees=[2x2x3,3x2x4-cost]" output_dir=$W/eval_eagle
step eval_split 300 needs=ex_eagle $SP heads-eval $XE $SPLIT max_new_tokens=16 ks=[2] eagle=$EH "trees=[]" \
    output_dir=$W/eval_split

# what the outputs say beyond the exit codes: fidelity rows, tree rows, stop=cost, batch sizes, the split's devices
step checks 60 after=eval,eval_eagle,eval_split,dec_tree,dec_tree_cost,dec_specdecpp_cost,dec_conf_cost,dec_batched,\
dec_batched_eagle,dec_split_sd,dec_split_eagle,dg_split_acc,dg_split_drafter \
    $PY bench/gpu_smoke_helper.py check "$W" "$OUT"

# the shared SmolLM2 pair's recipes and its committed EAGLE head
Q="target.dtype=auto draft.dtype=auto target.device=$DEV draft.device=$DEV"
step s_dg_accept 240 req=shared heads-datagen recipe=specdecpp_draft_quickstart $Q num_prompts=16 \
    output_dir=$W/s_dg_accept
step s_dg_drafter 240 req=shared heads-datagen recipe=quickstart $Q labels=drafter num_prompts=8 chunk_size=4 \
    max_new_tokens=64 output_dir=$W/s_dg_drafter
step s_dec_eagle 180 req=shared heads-decode recipe=quickstart $Q eagle=recipes/heads/eagle_smollm2.safetensors \
    num_prompts=2 max_new_tokens=64 output_dir=$W/s_dec_eagle

# engine=vllm, each on its own (vLLM takes most of the GPU's memory), last: the budget cuts these first
VL="engine=vllm vllm.python=${VPY:-none}"
step vllm_datagen 240 req=vllm alone heads-datagen $M $G labels=acceptance $VL output_dir=$W/vllm_datagen
step vllm_decode 240 req=vllm alone needs=ex_acceptance heads-decode $M $X $VL vllm.enforce_eager=true batch_size=4 \
    policy=specdecpp specdecpp.head=$W/ex_acceptance/head.safetensors specdecpp.k_max=4 output_dir=$W/vllm_decode
step vllm_eval 300 req=vllm alone needs=ex_acceptance heads-eval $M $V $VL vllm.enforce_eager=true \
    head=$W/ex_acceptance/head.safetensors cost_stop=false output_dir=$W/vllm_eval
wait
