"""The TRL side of tools/bench/vs_trl.py: Hugging Face TRL's GRPOTrainer on the work of a megarl run.

Runs only in the bench's own venv (`make bench-trl-env` builds .venv-trl: TRL 1.16.0, the torch and
transformers of .venv, megarl installed without its dependencies); vs_trl.py starts it there:

    .venv-trl/bin/python tools/bench/trl_side.py --config CONFIG.yaml --prompts PROMPTS.json \
        --out DIR --seed S --steps N --save-every K [key=value ...]

TRL reads the same megarl config (the yaml and the same overrides) for every setting the two share:
G samples per prompt, prompts per step, mini-batches per step, new tokens, sampling, clip range, token-
level loss, no KL, gradient clipping. megarl's own pieces are called from TRL where TRL lets a user plug
them in: the reward (megarl.reward.scoring.score_one, as megarl's reward pool scores a sample, plus
megarl.algo.overlong's penalty, as megarl.experience.shape_overlong adds it) and the optimizer with its
schedule (megarl.backends.torch.actor.build_optimizer, through GRPOTrainer's `optimizers`). The prompts
come in megarl's order (PROMPTS.json, one row per prompt, step after step) with TRL's shuffling off.

One megarl step is one TRL generation batch: rollout.n x data.train_batch_size samples, cut into
train_batch_size / ppo_mini_batch_size optimizer steps (TRL's steps_per_generation). Written to
DIR/trl_side.json: the wall-clock time (time.time) at the start of training and at the end of each
megarl-sized step, seconds per step in each phase (generate = transformers' generate; reward; score =
the rest of TRL's _generate_and_score_completions: old log-probs, advantages; train = forward and
backward of the loss), the prompts each step generated from, and the checkpoint of every K steps.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from megarl.algo.overlong import overlong_penalty
from megarl.backends.torch.actor import build_optimizer
from megarl.config import RunConfig, load_config
from megarl.reward.scoring import RewardRequest, score_one


def megarl_reward(cfg: RunConfig):
    """A TRL reward function giving the score megarl's training batch carries: the configured reward of
    the decoded response, plus the overlong penalty of its length in tokens (EOS included, as in megarl)."""
    o, max_len = cfg.algorithm.overlong, cfg.rollout.max_response_length

    def reward(completions, completion_ids, data_source, ground_truth, extra_info, **_):
        out = []
        for text, ids, source, truth, extra in zip(completions, completion_ids, data_source, ground_truth,
                                                   extra_info, strict=True):
            score = score_one(cfg.reward, RewardRequest(source, text, truth, json.loads(extra),
                                                        response_length=len(ids))).score
            if o.enable:
                score += overlong_penalty(len(ids), max_len, o.buffer_len, o.penalty_factor)
            out.append(score)
        return out

    reward.__name__ = "megarl_reward"
    return reward


def optimizer_steps_per_step(cfg: RunConfig) -> int:
    """Optimizer steps in one megarl step: one per mini-batch, per epoch over the step's batch."""
    return cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size * cfg.actor.ppo_epochs


def grpo_config(cfg: RunConfig, out: Path, seed: int, steps: int, save_every: int) -> GRPOConfig:
    r, a, actor, optim = cfg.rollout, cfg.algorithm, cfg.actor, cfg.actor.optim
    mini_samples, per_step = actor.ppo_mini_batch_size * r.n, optimizer_steps_per_step(cfg)
    return GRPOConfig(
        output_dir=str(out), seed=seed, report_to="none", logging_steps=1, disable_tqdm=True,
        use_cpu=cfg.cluster.gpus_per_node == 0, bf16=False, fp16=False,  # TRL's default is bf16 autocast
        gradient_checkpointing=actor.gradient_checkpointing,  # TRL's default is on, megarl's off
        # batch shape: one generation batch per megarl step, one optimizer step per megarl mini-batch
        num_generations=r.n, per_device_train_batch_size=actor.ppo_micro_batch_size,
        gradient_accumulation_steps=mini_samples // actor.ppo_micro_batch_size,
        steps_per_generation=cfg.data.train_batch_size // actor.ppo_mini_batch_size * (
            mini_samples // actor.ppo_micro_batch_size),
        num_iterations=actor.ppo_epochs, max_steps=steps * per_step,
        shuffle_dataset=False,  # the dataset is already in megarl's order
        max_completion_length=r.max_response_length, temperature=r.temperature, top_p=r.top_p,
        top_k=max(r.top_k, 0),  # megarl's -1 and TRL's 0 both mean off
        # loss: token-level (DAPO), clip-higher, no KL
        loss_type="dapo" if a.loss_agg_mode == "token-mean" else "grpo", epsilon=a.clip_ratio_low,
        epsilon_high=a.clip_ratio_high, beta=a.kl_loss_coef if a.use_kl_loss else 0.0,
        scale_rewards="group" if a.norm_adv_by_std else "none",
        learning_rate=optim.lr, max_grad_norm=optim.grad_clip, weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0], adam_beta2=optim.betas[1], adam_epsilon=optim.eps,
        save_strategy="steps", save_steps=save_every * per_step,
        save_total_limit=None,
    )


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with the seconds of each phase added up per generation batch, and its prompts kept."""

    def __init__(self, *args, num_generations: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.phase_s: list[dict[str, float]] = []
        self.step_prompts: list[list[str]] = []
        self._g = num_generations

    def _generate(self, prompts):
        start = time.perf_counter()
        out = super()._generate(prompts)
        self.phase_s[-1]["generate"] += time.perf_counter() - start
        self.step_prompts.append([list(ids) for ids in out[0][::self._g]])  # the token ids it generated from
        return out

    def _calculate_rewards(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return super()._calculate_rewards(*args, **kwargs)
        finally:
            self.phase_s[-1]["reward"] += time.perf_counter() - start

    def _generate_and_score_completions(self, inputs):
        self.phase_s.append(defaultdict(float))
        start = time.perf_counter()
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            p = self.phase_s[-1]
            p["score"] += time.perf_counter() - start - p["generate"] - p["reward"]

    def training_step(self, model, inputs, num_items_in_batch):
        start = time.perf_counter()
        generated = len(self.phase_s)
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:  # training_step prepares its inputs (generation) first; that is counted above
            spent = time.perf_counter() - start
            if len(self.phase_s) > generated:
                spent -= sum(v for k, v in self.phase_s[-1].items() if k != "train")
            self.phase_s[-1]["train"] += spent


class StepClock(TrainerCallback):
    """time.time() at the start of training and at the end of every `every`-th optimizer step."""

    def __init__(self, every: int):
        self.every, self.begin, self.step_ends = every, None, []

    def on_train_begin(self, args, state, control, **kwargs):
        self.begin = time.time()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:
            self.step_ends.append(time.time())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--prompts", required=True, help="JSON list of rows in megarl's order")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("overrides", nargs="*", help="the megarl run's key=value overrides")
    args = p.parse_args()
    cfg = load_config(args.config, args.overrides)
    out = Path(args.out)
    rows = json.loads(Path(args.prompts).read_text())
    dataset = Dataset.from_list([{**row, "extra_info": json.dumps(row["extra_info"])} for row in rows])
    config = grpo_config(cfg, out, args.seed, args.steps, args.save_every)
    per_step = optimizer_steps_per_step(cfg)
    clock = StepClock(per_step)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=getattr(torch, cfg.model.dtype))
    trainer = TimedGRPOTrainer(model=model, reward_funcs=megarl_reward(cfg), args=config, train_dataset=dataset,
                               processing_class=AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path),
                               optimizers=build_optimizer(model, cfg.actor.optim, config.max_steps),
                               callbacks=[clock], num_generations=cfg.rollout.n)
    trainer.train()
    ckpts = {int(d.name.split("-")[1]) // per_step: str(d) for d in out.glob("checkpoint-*")}
    (out / "trl_side.json").write_text(json.dumps({
        "train_begin": clock.begin, "step_ends": clock.step_ends, "phase_s": trainer.phase_s,
        "prompts": trainer.step_prompts, "checkpoints": ckpts,
        "log_history": trainer.state.log_history, "samples_per_step": config.generation_batch_size,
        "optimizer_steps_per_step": per_step,
        "max_new_tokens": config.max_completion_length}, indent=1))


if __name__ == "__main__":
    main()
