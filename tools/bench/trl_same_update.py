"""Whether megarl's actor update is TRL's: TRL's GRPOTrainer runs the first N steps of tools/bench/vs_trl.py's
work (its own generation, rewards, advantages and optimizer steps), and megarl's TorchActor takes each of
those steps again from TRL's weights, on TRL's own two mini-batches in TRL's order (TRL's old log-probs and
advantages); the weights after each step are compared. Run in TRL's venv (`make bench-trl-env`):

    .venv-trl/bin/python tools/bench/trl_same_update.py [--seed 2] [--steps 5]

Prints, per step, the norm of TRL's weight change and of the difference between megarl's weights after its
update and TRL's. megarl's optimizer state is its own (built from the same weights, stepped by its own
updates), so the difference may grow with the steps; what is left at step 1 is the token-mean denominator
(megarl: each mini-batch's own tokens; TRL: the step's tokens / 2) and the advantages' epsilon (1e-6 / 1e-4).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "bench"))
import trl_side  # noqa: E402
from vs_trl import prompt_order, run_overrides  # noqa: E402

from megarl.backends.batch import TrainBatch  # noqa: E402
from megarl.backends.torch.actor import TorchActor, build_optimizer  # noqa: E402
from megarl.config import load_config  # noqa: E402
from megarl.data.prompts import load_prompts  # noqa: E402
from megarl.quickstart.inputs import prepare_math  # noqa: E402


class Recording(trl_side.TimedGRPOTrainer):
    """TimedGRPOTrainer keeping the weights before each generation batch and its two mini-batches."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.weights_before: list[dict] = []
        self.mini_batches: list[list[dict]] = []

    def training_step(self, model, inputs, num_items_in_batch):
        per_generation = self.args.steps_per_generation
        if self._step % per_generation == 0:
            self.weights_before.append({k: v.clone() for k, v in model.state_dict().items()})
        out = super().training_step(model, inputs, num_items_in_batch)
        if self._step % per_generation == 0:  # the generation batch's last optimizer step was just taken
            self.mini_batches.append([{k: v.clone() if torch.is_tensor(v) else v for k, v in b.items()}
                                      for b in self._buffered_inputs])
        return out


def as_megarl_batch(mini_batches: list[dict]) -> TrainBatch:
    """TRL's mini-batches, one after the other, as megarl's TrainBatch (old log-probs and advantages on the
    completion tokens)."""
    prompts, responses, old, adv = [], [], [], []
    for b in mini_batches:
        for i in range(len(b["prompt_ids"])):
            keep = b["completion_mask"][i].bool()
            prompts.append(b["prompt_ids"][i][b["prompt_mask"][i].bool()].tolist())
            responses.append(b["completion_ids"][i][keep].tolist())
            old.append(b["old_per_token_logps"][i][keep])
            adv.append(float(b["advantages"][i]))
    batch = TrainBatch.from_sequences(prompts, responses, [[1] * len(r) for r in responses])
    old_t, adv_t = torch.zeros(batch.input_ids.shape), torch.zeros(batch.input_ids.shape)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        old_t[i, len(p):len(p) + len(r)] = old[i]
        adv_t[i, len(p):len(p) + len(r)] = adv[i]
    return batch.with_fields(old_log_probs=old_t, advantages=adv_t)


def norm(tensors: dict) -> float:
    return sum(float(t.double().norm() ** 2) for t in tensors.values()) ** 0.5


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--config", default="examples/quickstart/dapo_math_tiny.yaml")
    p.add_argument("--out", default="outputs/trl_same_update")
    args = p.parse_args()
    out = (ROOT / args.out).resolve()
    world = prepare_math(ROOT / "outputs" / "bench_vs_trl" / "world")
    cfg = load_config(str(ROOT / args.config), run_overrides(world, out / "megarl", args.seed, args.steps, args.steps,
                                                             "trainer"))
    tok = AutoTokenizer.from_pretrained(world / "model")
    d = cfg.data
    train, _ = load_prompts(d.train_files, tok, prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length,
                            apply_chat_template=d.apply_chat_template)
    rows = [{"prompt": tok.decode(train[i].prompt_ids), "data_source": train[i].data_source,
             "ground_truth": train[i].ground_truth, "extra_info": json.dumps(train[i].extra_info)}
            for step in prompt_order(cfg, len(train), args.steps) for i in step]
    config = trl_side.grpo_config(cfg, out / "trl", args.seed, args.steps, args.steps)
    config.save_strategy = "no"
    model = AutoModelForCausalLM.from_pretrained(world / "model", dtype=torch.float32)
    trainer = Recording(model=model, reward_funcs=trl_side.megarl_reward(cfg), args=config,
                        train_dataset=Dataset.from_list(rows), processing_class=tok,
                        optimizers=build_optimizer(model, cfg.actor.optim, config.max_steps), num_generations=cfg.rollout.n)
    trainer.train()
    weights = trainer.weights_before + [{k: v.clone() for k, v in model.state_dict().items()}]

    ours = AutoModelForCausalLM.from_pretrained(world / "model", dtype=torch.float32)
    actor = TorchActor(ours, cfg.algorithm, cfg.actor.optim, mini_batch_samples=cfg.actor.ppo_mini_batch_size * cfg.rollout.n,
                       micro_batch_samples=cfg.actor.ppo_micro_batch_size, ppo_epochs=cfg.actor.ppo_epochs,
                       temperature=cfg.rollout.temperature, total_steps=config.max_steps,
                       norm_length=cfg.rollout.max_response_length)
    print(f"seed {args.seed}: TRL's steps, and megarl's TorchActor on TRL's mini-batches from TRL's weights")
    for step, mini_batches in enumerate(trainer.mini_batches):
        ours.load_state_dict(weights[step])
        actor.update_actor(as_megarl_batch(mini_batches))
        after = ours.state_dict()
        moved = norm({k: weights[step + 1][k] - weights[step][k] for k in after})
        differ = norm({k: weights[step + 1][k] - after[k] for k in after})
        print(f"  step {step + 1}: TRL moved the weights by {moved:.4f}; megarl's update differs from TRL's by "
              f"{differ:.4f} ({differ / moved:.1%} of the step)", flush=True)


if __name__ == "__main__":
    main()
