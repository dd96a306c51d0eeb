#!/usr/bin/env bash
# GRPO-style RL with the predictive divergence mask (pdm-topk-kl: top-20 KL > delta and A*Ddot > 0,
# exact top-K estimator) in verl 0.9.1, FSDP actor + vLLM rollout.
#
# NEEDS GPUs (vLLM, FSDP, flash-attn). It was NOT run in pdmask's CI or by its authors; the config
# keys below are checked against verl 0.9.1's real config schema by
# tests/integrations/verl/test_verl_plugin.py::test_launch_script_config_composes (PDMASK_PRINT_OVERRIDES=1 prints them),
# and tests/integrations/verl/test_verl_data_path.py runs verl's v1 and legacy data paths on CPU with this config.
#
#   pip install -e ".[verl]" vllm             # from a pdmask checkout; vllm: the GPU build verl 0.9.1 pairs with
#   MODEL=Qwen/Qwen3-4B-Base TRAIN=~/data/dapo/train.parquet VAL=~/data/aime/test.parquet \
#     bash examples/verl/run_pdm_topk_kl.sh [extra hydra overrides...]
#
# Other modes: LOSS_MODE=pdmask_pdm_topk_kl_aggregated (the paper's estimator),
# pdmask_dppo_topk_kl (DPPO top-K baseline), pdmask_pdm_topk_tv DELTA=0.15, ...
# The binary modes (pdmask_dppo_binary_tv / _kl) need none of the plumbing below:
# stock verl with only loss_mode and the thresholds (see docs/verl.md).
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen3-4B-Base}
TRAIN=${TRAIN:-$HOME/data/dapo-math-17k/train.parquet}
VAL=${VAL:-$HOME/data/aime-2024/test.parquet}
NGPUS=${NGPUS:-8}
LOSS_MODE=${LOSS_MODE:-pdmask_pdm_topk_kl}
DELTA=${DELTA:-0.05}   # KL threshold (TV modes: 0.15)
TOPK=${TOPK:-20}

ARGS=(
    # verl's default trainer (TaskRunnerV1 + TransferQueue). The top-K arrays reach the actor inside
    # each sample's extra_fields there; use_v1=false (the deprecated RayPPOTrainer) works too, in
    # bypass mode only (it cannot carry pi_old's top-K to the update).
    trainer.use_v1=true
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=false
    # bypass mode: the region is centred on the rollout's own log-probs (mu, the replica's arrays)
    # and verl skips the actor's recomputation of old_log_probs (on the v1 trainer it only copies
    # rollout_log_probs into old_log_probs; the legacy trainer also rewrites loss_mode in the
    # driver's config, see docs/verl.md). bypass_mode=false (decoupled mode) centres it on pi_old
    # instead, mu entering only in the IS weight pi_old/mu, and is where verl's rollout_is /
    # rollout_rs corrections run (the plugin refuses them with bypass_mode=true)
    algorithm.rollout_correction.bypass_mode=true
    data.train_files="$TRAIN"
    data.val_files="$VAL"
    data.train_batch_size=128
    data.max_prompt_length=1024
    data.max_response_length=4096
    actor_rollout_ref.model.path="$MODEL"
    # pdmask training engine: computes the per-token top-K statistics from the logits
    +actor_rollout_ref.model.model_type=pdmask_language_model
    actor_rollout_ref.model.use_remove_padding=true
    actor_rollout_ref.model.use_fused_kernels=false
    # the loss: pdmask mode, thresholds delta_low/high (verl's DPPO convention), IS cap C
    actor_rollout_ref.actor.policy_loss.loss_mode="$LOSS_MODE"
    actor_rollout_ref.actor.clip_ratio_low="$DELTA"
    actor_rollout_ref.actor.clip_ratio_high="$DELTA"
    actor_rollout_ref.actor.clip_ratio_c=5.0
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    actor_rollout_ref.actor.use_kl_loss=false
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.ppo_mini_batch_size=32
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
    actor_rollout_ref.actor.optim.lr=1e-6
    # pdmask rollout: verl's vLLM server asking for logprobs=K, top-K returned with each token
    actor_rollout_ref.rollout.name=pdmask_vllm
    +actor_rollout_ref.rollout.custom.pdmask_topk="$TOPK"
    actor_rollout_ref.rollout.logprobs_mode=processed_logprobs
    actor_rollout_ref.rollout.calculate_log_probs=true
    actor_rollout_ref.rollout.n=8
    actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
    trainer.n_gpus_per_node="$NGPUS"
    trainer.nnodes=1
    'trainer.logger=["console"]'
    trainer.project_name=pdmask
    trainer.experiment_name="$LOSS_MODE"
    trainer.total_epochs=1
)

if [[ -n "${PDMASK_PRINT_OVERRIDES:-}" ]]; then
    printf '%s\n' "${ARGS[@]}" "$@"
    exit 0
fi
exec python3 -m verl.trainer.main_ppo "${ARGS[@]}" "$@"
