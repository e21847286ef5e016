#!/usr/bin/env bash
# GRPO with LoRA adapters and a custom reward function, in the style of verl's launch scripts.
set -x
ROOT=${ROOT:-/data/gsm8k}
python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=$ROOT/train.parquet \
    data.val_files=$ROOT/test.parquet \
    data.train_batch_size=16 \
    data.shuffle=False \
    actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct \
    actor_rollout_ref.model.lora_rank=32 \
    actor_rollout_ref.model.lora_alpha=16 \
    actor_rollout_ref.model.target_modules=all-linear \
    actor_rollout_ref.actor.optim.lr=3e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.layered_summon=True \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    custom_reward_function.path=$ROOT/my_reward.py \
    custom_reward_function.name=my_score \
    trainer.logger='["console","wandb"]' \
    trainer.total_epochs=2
