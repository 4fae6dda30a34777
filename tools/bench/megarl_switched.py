"""`megarl train` with one setting that differs from TRL's GRPOTrainer switched to TRL's, for
tools/bench/vs_trl.py --switch NAME (one switch at a time, to find what makes the two learn differently):

    python tools/bench/megarl_switched.py NAME CONFIG.yaml [key=value ...]

NAME is one of SWITCHES:
  adv-eps      the GRPO advantage divides by std + 1e-4 (TRL's), not std + 1e-6
  step-tokens  the token-mean loss of each mini-batch divides by the step's loss tokens / its
               mini-batches (TRL's loss_type="dapo"), not by the mini-batch's own loss tokens
  generate     rollouts sampled by transformers' generate (as TRL does) on the engine's model, which
               holds the weights megarl synced to it, instead of the embedded engine's own decoder;
               the log-probs of the sampled tokens come from generate's logits
  trl-draws    all of the above, and every random draw TRL's would take, in its order: torch seeded as TRL's
               trainer seeds it (trainer.seed, then the one draw its data loader takes), each step's samples
               from generate, then the step's mini-batch order from the same stream (TRL's shuffle). megarl
               then runs TRL's run itself, up to float rounding
  none         nothing switched (the baseline of the switches, in the same launcher)

The switches patch megarl in this process, so the run takes the in-process launcher
(cluster.launcher=inprocess is added): the train worker and the engine live here. These are
measurement tools, not settings of megarl.
"""

from __future__ import annotations

import sys

SWITCHES = ("adv-eps", "step-tokens", "generate", "trl-draws", "none")


def switch_adv_eps() -> None:
    import megarl.algo.advantages as advantages  # where the grpo estimator finds it

    plain = advantages.compute_grpo_advantages
    advantages.compute_grpo_advantages = lambda scores, groups, norm_by_std=True, eps=1e-6: plain(
        scores, groups, norm_by_std=norm_by_std, eps=1e-4)


def switch_step_tokens() -> None:
    from megarl.backends.torch.actor import TorchActor

    plain = TorchActor.update_actor

    def update_actor(self, batch):
        mini_batches = -(-len(batch) // self.mini)
        per_mini_batch = float(batch.loss_mask.sum()) / mini_batches  # TRL: the step's tokens / its optimizer steps
        own = self._loss
        self._loss = lambda micro, counts: own(micro, counts | {"num_tokens": per_mini_batch})
        try:
            return plain(self, batch)
        finally:
            del self._loss  # the method again

    TorchActor.update_actor = update_actor


def switch_generate(trl_seed: int | None = None) -> None:
    """`trl_seed` (trl-draws): one torch stream for the whole run, seeded as TRL's trainer seeds it, and the
    step's mini-batch order drawn from it after generation, as TRL shuffles its generation batch."""
    import torch

    import megarl.train as train
    from megarl.rollout.agent import Trajectory
    from megarl.rollout.token_rows import VersionRuns

    shuffle = {}

    async def generated(engine, tokenizer, prompts, settings, searcher=None, seeds=None):
        if settings.max_turns:
            raise ValueError("the generate switch is for single-turn runs")
        model, pad, eos = engine.model, tokenizer.pad_token_id, tokenizer.eos_token_id
        if trl_seed is None:
            torch.manual_seed(seeds[0] if seeds else 0)
        elif not shuffle:
            torch.manual_seed(trl_seed)  # transformers' set_seed, which TRL's trainer calls
            torch.empty((), dtype=torch.int64).random_()  # the base seed its data loader draws
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        temperature = settings.temperature or 1.0
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=settings.temperature > 0,
                                 temperature=settings.temperature or None, top_p=settings.top_p,
                                 top_k=max(settings.top_k, 0), max_new_tokens=settings.max_response_length,
                                 eos_token_id=eos, pad_token_id=pad, bos_token_id=tokenizer.bos_token_id,
                                 return_dict_in_generate=True, output_logits=True)
        tokens = out.sequences[:, width:]
        log_probs = torch.log_softmax(torch.stack(out.logits, 1).float() / temperature, -1)
        log_probs = log_probs.gather(-1, tokens[:, :, None]).squeeze(-1)
        trajectories = []
        for i, prompt in enumerate(prompts):
            row = tokens[i].tolist()
            n = row.index(eos) + 1 if eos in row else len(row)  # up to its EOS, as the engine stops
            t = Trajectory(prompt_ids=list(prompt), weight_version=engine.weight_version, num_turns=1,
                           finish_reason="eos" if eos in row else "length")
            versions = VersionRuns()
            versions.append_run(engine.weight_version, n)
            t.extend(row[:n], log_probs[i, :n].tolist(), versions)
            trajectories.append(t)
        if trl_seed is not None:
            shuffle["order"] = torch.randperm(len(prompts))
        return trajectories

    train.run_trajectories = generated
    if trl_seed is not None:
        train.update_permutation = lambda rows, seed, step: shuffle["order"]


def switch_trl_draws(args: list[str]) -> None:
    seeds = [a.split("=", 1)[1] for a in args if a.startswith("trainer.seed=")]
    if not seeds:
        raise SystemExit("trl-draws needs trainer.seed=S among the overrides (TRL's seed)")
    switch_adv_eps()
    switch_step_tokens()
    switch_generate(trl_seed=int(seeds[-1]))


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in SWITCHES:
        raise SystemExit(f"usage: megarl_switched.py {{{','.join(SWITCHES)}}} CONFIG.yaml [key=value ...]")
    name, rest = argv[0], argv[1:]
    {"adv-eps": switch_adv_eps, "step-tokens": switch_step_tokens, "generate": switch_generate,
     "trl-draws": lambda: switch_trl_draws(rest), "none": lambda: None}[name]()
    print(f"megarl_switched: {name}", file=sys.stderr, flush=True)
    from megarl.cli import main as megarl_main

    sys.argv = ["megarl", "train", *rest, "cluster.launcher=inprocess"]
    megarl_main()


if __name__ == "__main__":
    main(sys.argv[1:])
