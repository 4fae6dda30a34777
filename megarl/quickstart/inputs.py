"""Inputs of the CPU quickstarts, built locally: nothing comes from a model hub.

`prepare` (`python -m megarl.quickstart prepare DIR`) writes, under its directory:
  data/   the synthetic search world (corpus.jsonl, train.parquet, val.parquet)
  index/  its BM25 index (the retrieval server of the run serves it)
  model/  a tiny Qwen2-architecture model and a byte-level BPE tokenizer trained on the world,
          warmed up by supervised learning on demonstrations in which only some trajectories
          search (the rest guess), so RL has something to discover: searching pays.

The warm-up is a two-phase curriculum. Phase one shows searching demonstrations on the bare
question: on short sequences a tiny model learns to copy the entity into its query and the
answer out of the observation in a few hundred steps. Phase two uses the full Search-R1
instruction and mixes in guessing demonstrations. The demonstrations draw fresh answers
(`megarl.quickstart.worlds.warmup_examples`), so the model learns to read, not to memorise
facts.

`prepare_math` (`python -m megarl.quickstart prepare-math DIR`) writes data/ (every sum
a + b of one-digit numbers, in the DAPO-Math prompt and "Answer:" format) and model/, warmed
up on answers that are right only `correct_fraction` of the time, so DAPO has a noisy policy
to sharpen.

`prepare_code` (`python -m megarl.quickstart prepare-code DIR`) writes data/ (40 problems: a
Python program printing the sum, maximum, minimum or count of the input numbers plus k, as
open-r1 code rows with test cases) and model/, warmed up on programs that are right only
`correct_fraction` of the time; the code reward runs every sampled program in the sandbox.

Every output is written to a temporary directory and renamed into place, and a finished
preparation is skipped when run again with the same settings (see `prepared.json`).
Main entry points: `prepare`, `prepare_math`, `prepare_code`.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

STAMP = "prepared.json"


@dataclass(frozen=True)
class QuickstartSettings:
    num_entities: int = 200
    answers_per_relation: int = 16
    val_fraction: float = 0.1
    seed: int = 0
    vocab_size: int = 2000
    hidden_size: int = 256  # wide and shallow: copying emerges in a few hundred steps
    num_layers: int = 2
    num_heads: int = 8
    num_kv_heads: int = 4
    read_steps: int = 400  # phase one: searching demonstrations on bare questions
    mix_steps: int = 300  # phase two: full instruction, search_fraction of the demonstrations search
    search_fraction: float = 0.3
    batch_size: int = 16
    lr: float = 1e-3
    topk: int = 1  # as in examples/quickstart/search_r1_tiny.yaml
    # words of reasoning before each action in phase two, log-normal (median, sigma, at most); median
    # 0 = none. With reasoning the responses' lengths have a long tail, as RL runs' do
    # (tools/bench/async_rollout.py)
    think_words: tuple[int, float, int] = (0, 1.0, 0)


@dataclass(frozen=True)
class MathSettings:
    max_operand: int = 9
    num_val: int = 30
    seed: int = 0
    vocab_size: int = 1000
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 8
    num_kv_heads: int = 4
    bare_steps: int = 300  # phase one: the problem alone as the prompt
    steps: int = 300  # phase two: the full DAPO-Math prompt
    correct_fraction: float = 0.3
    batch_size: int = 16
    lr: float = 1e-3


def _up_to_date(out: Path, settings, force: bool) -> bool:
    stamp = out / STAMP
    wanted = json.loads(json.dumps(asdict(settings)))  # as the stamp holds them (tuples become lists)
    if not force and stamp.exists() and json.loads(stamp.read_text()).get("settings") == wanted:
        print(f"quickstart inputs in {out} are up to date (delete {stamp} or pass --force to rebuild)")
        return True
    out.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    return False


def prepare(out_dir: str | Path, settings: QuickstartSettings = QuickstartSettings(), force: bool = False) -> Path:
    """Build data/, index/ and model/ under out_dir (skipped when already built alike)."""
    out = Path(out_dir)
    if _up_to_date(out, settings, force):
        return out
    stamp = out / STAMP
    start = time.perf_counter()
    s = settings

    from megarl.quickstart.worlds import read_facts, write_search_world
    from megarl.retrieval import build_index

    data = _fresh(out / "data")
    paths = write_search_world(data, s.num_entities, s.val_fraction, s.seed, s.answers_per_relation)
    _replace(data, out / "data")
    train_facts, val_facts = read_facts(out / "data" / "train.parquet"), read_facts(out / "data" / "val.parquet")
    print(f"[1/4] search world: {len(train_facts)} training questions, "
          f"{len(val_facts)} validation questions in {out / 'data'}")

    build_index(out / "data" / paths["corpus"].name, out / "index", kind="bm25", overwrite=True, show_progress=False)
    print(f"[2/4] BM25 index in {out / 'index'}")

    tokenizer = _train_tokenizer(out / "data" / "corpus.jsonl", train_facts + val_facts, s)
    model = _tiny_qwen2(len(tokenizer), tokenizer.eos_token_id, s)
    model_dir = _fresh(out / "model")
    tokenizer = _as_the_trainer_loads_it(model, tokenizer, model_dir)
    _check_names(train_facts + val_facts, tokenizer)
    print(f"[3/4] tokenizer ({len(tokenizer)} tokens) and a tiny Qwen2 "
          f"({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters)")

    stats = _warm_up(model, tokenizer, train_facts, s)
    model.save_pretrained(model_dir)
    _replace(model_dir, out / "model")
    stats["seconds"] = round(time.perf_counter() - start, 1)
    stamp.write_text(json.dumps({"settings": asdict(s), "stats": stats}, indent=2))
    print(f"[4/4] warmed-up model in {out / 'model'} (final loss {stats['final_loss']:.4f}; "
          f"{stats['search_fraction']:.0%} of phase-two demonstrations search); {stats['seconds']:.0f} s in all")
    return out


def prepare_math(out_dir: str | Path, settings: MathSettings = MathSettings(), force: bool = False) -> Path:
    """Build data/ and model/ for the single-turn DAPO arithmetic run (skipped when up to date)."""
    from megarl.config import OptimConfig
    from megarl.data.prepare import DAPO_MATH_INSTRUCTION
    from megarl.quickstart.sft import supervised_warmup
    from megarl.quickstart.worlds import arithmetic_examples, read_sums, write_arithmetic_world

    out = Path(out_dir)
    if _up_to_date(out, settings, force):
        return out
    s, start = settings, time.perf_counter()
    data = _fresh(out / "data")
    write_arithmetic_world(data, s.max_operand, s.num_val, s.seed)
    _replace(data, out / "data")
    items = read_sums(out / "data" / "train.parquet")
    print(f"[1/3] arithmetic problems: {len(items)} for training, {s.num_val} of them for validation")
    texts = [DAPO_MATH_INSTRUCTION.format(problem=x.problem) + f"{x.a} + {x.b} = {x.answer}\nAnswer: {x.answer}"
             for x in items] + [str(n) for n in range(4 * s.max_operand + 4)]
    model, tokenizer, model_dir = _tokenizer_and_model(texts, out, s)
    optim = OptimConfig(lr=s.lr, lr_warmup_steps=30, lr_scheduler="constant", weight_decay=0.0, grad_clip=1.0)
    bare = arithmetic_examples(items, tokenizer, s.correct_fraction, s.seed, bare_problem=True,
                               repeats=-(-s.bare_steps * s.batch_size // len(items)))
    supervised_warmup(model, bare, steps=s.bare_steps, batch_size=s.batch_size, optim=optim, seed=s.seed,
                      pad_id=tokenizer.pad_token_id, desc="warm-up 1/2 (bare problems)")
    examples = arithmetic_examples(items, tokenizer, s.correct_fraction, s.seed + 1,
                                   repeats=-(-s.steps * s.batch_size // len(items)))
    losses = supervised_warmup(model, examples, steps=s.steps, batch_size=s.batch_size, optim=optim,
                               seed=s.seed + 1, pad_id=tokenizer.pad_token_id, desc="warm-up 2/2 (DAPO prompt)")
    return _finish(model, model_dir, out, s, losses, start,
                   f"answers right {s.correct_fraction:.0%} of the time in the demonstrations")


@dataclass(frozen=True)
class CodeSettings:
    num_val: int = 8
    seed: int = 0
    vocab_size: int = 600
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    steps: int = 300
    correct_fraction: float = 0.3
    batch_size: int = 16
    lr: float = 1e-3


def prepare_code(out_dir: str | Path, settings: CodeSettings = CodeSettings(), force: bool = False) -> Path:
    """Build data/ and model/ for the code RL run (skipped when up to date)."""
    from megarl.config import OptimConfig
    from megarl.quickstart.code_task import code_examples, read_code_problems, response_text, write_code_world
    from megarl.quickstart.sft import supervised_warmup

    out = Path(out_dir)
    if _up_to_date(out, settings, force):
        return out
    s, start = settings, time.perf_counter()
    data = _fresh(out / "data")
    write_code_world(data, s.num_val, s.seed)
    _replace(data, out / "data")
    problems = read_code_problems(out / "data" / "train.parquet")
    print(f"[1/3] code problems: {len(problems)} for training, {s.num_val} of them for validation")
    texts = [p.prompt + "\n" + response_text(p.program(o, k)) for p in problems for o in ("sum", "count") for k in (0, 9)]
    model, tokenizer, model_dir = _tokenizer_and_model(texts, out, s)
    optim = OptimConfig(lr=s.lr, lr_warmup_steps=30, lr_scheduler="constant", weight_decay=0.0, grad_clip=1.0)
    examples = code_examples(problems, tokenizer, s.correct_fraction, s.seed,
                             repeats=-(-s.steps * s.batch_size // len(problems)))
    losses = supervised_warmup(model, examples, steps=s.steps, batch_size=s.batch_size, optim=optim, seed=s.seed,
                               pad_id=tokenizer.pad_token_id, desc="warm-up (programs)")
    return _finish(model, model_dir, out, s, losses, start,
                   f"programs right {s.correct_fraction:.0%} of the time in the demonstrations")


@dataclass(frozen=True)
class ToolSettings:
    tool: str = "calculator"  # or python: the Python variant
    num_train: int = 400
    num_val: int = 40
    seed: int = 0
    vocab_size: int = 600
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 8
    num_kv_heads: int = 4
    read_steps: int = 400  # phase one: calling demonstrations on bare questions
    mix_steps: int = 300  # phase two: the full instruction, call_fraction of the demonstrations call
    call_fraction: float = 0.3
    batch_size: int = 16
    lr: float = 1e-3


def prepare_tools(out_dir: str | Path, settings: ToolSettings = ToolSettings(), force: bool = False) -> Path:
    """Build data/ and model/ for the tool-use run (skipped when up to date)."""
    from megarl.config import OptimConfig
    from megarl.quickstart.sft import supervised_warmup
    from megarl.quickstart.tool_task import call_pieces, prompt_text, read_products, tool_examples, write_tool_world
    from megarl.tools.base import invalid_action_message
    from megarl.tools.calculator import Calculator
    from megarl.tools.python import PythonTool

    out = Path(out_dir)
    if _up_to_date(out, settings, force):
        return out
    s, start = settings, time.perf_counter()
    data = _fresh(out / "data")
    write_tool_world(data, s.tool, s.num_train, s.num_val, s.seed)
    _replace(data, out / "data")
    items = read_products(out / "data" / "train.parquet") + read_products(out / "data" / "val.parquet")
    print(f"[1/3] products of two-digit numbers: {s.num_train} for training, {s.num_val} for validation")
    texts = [prompt_text(x, s.tool) + "".join(text for text, _ in call_pieces(x, s.tool)) for x in items]
    texts += [invalid_action_message({s.tool: PythonTool if s.tool == "python" else Calculator})] * 20
    model, tokenizer, model_dir = _tokenizer_and_model(texts, out, s)
    optim = OptimConfig(lr=s.lr, lr_warmup_steps=50, lr_scheduler="constant", weight_decay=0.0, grad_clip=1.0)
    train = items[: s.num_train]

    def repeats(steps: int) -> int:  # a fresh draw of call or guess every epoch
        return -(-steps * s.batch_size // len(train))

    calling = tool_examples(train, tokenizer, s.tool, 1.0, s.seed, repeats=repeats(s.read_steps), bare_question=True)
    supervised_warmup(model, calling, steps=s.read_steps, batch_size=s.batch_size, optim=optim, seed=s.seed,
                      pad_id=tokenizer.pad_token_id, desc="warm-up 1/2 (calling)")
    mixed = tool_examples(train, tokenizer, s.tool, s.call_fraction, s.seed + 1, repeats=repeats(s.mix_steps))
    losses = supervised_warmup(model, mixed, steps=s.mix_steps, batch_size=s.batch_size, optim=optim,
                               seed=s.seed + 1, pad_id=tokenizer.pad_token_id, desc="warm-up 2/2 (call or guess)")
    return _finish(model, model_dir, out, s, losses, start,
                   f"{sum(d.searched for d in mixed) / len(mixed):.0%} of the phase-two demonstrations call {s.tool}")


def _tokenizer_and_model(texts: list[str], out: Path, s: MathSettings | CodeSettings | ToolSettings):
    """Step 2 of 3 of the single-turn quickstarts: a BPE tokenizer trained on `texts`, a tiny
    Qwen2 for it, and model/ (a fresh directory) with both, the tokenizer as the trainer loads it."""
    from megarl.data.tokenizer import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(texts, s.vocab_size)
    model = _tiny_qwen2(len(tokenizer), tokenizer.eos_token_id, s)
    model_dir = _fresh(out / "model")
    tokenizer = _as_the_trainer_loads_it(model, tokenizer, model_dir)
    print(f"[2/3] tokenizer ({len(tokenizer)} tokens) and a tiny Qwen2 "
          f"({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters)")
    return model, tokenizer, model_dir


def _finish(model, model_dir: Path, out: Path, s, losses: list[float], start: float, summary: str) -> Path:
    """Step 3 of 3: the warmed-up model into place and the stamp that marks the preparation done."""
    model.save_pretrained(model_dir)
    _replace(model_dir, out / "model")
    tail = losses[-50:]
    stats = {"final_loss": sum(tail) / len(tail), "seconds": round(time.perf_counter() - start, 1)}
    (out / STAMP).write_text(json.dumps({"settings": asdict(s), "stats": stats}, indent=2))
    print(f"[3/3] warmed-up model in {out / 'model'} (final loss {stats['final_loss']:.4f}; {summary}); "
          f"{stats['seconds']:.0f} s in all")
    return out


def _train_tokenizer(corpus: Path, facts, s: QuickstartSettings):
    from megarl.data.tokenizer import train_bpe_tokenizer
    from megarl.quickstart.worlds import question
    from megarl.rollout.agent import INVALID_ACTION_MESSAGE, SEARCH_INSTRUCTION

    with open(corpus, encoding="utf-8") as fh:
        texts = [json.loads(line)["contents"] for line in fh]
    texts += [SEARCH_INSTRUCTION.format(question=question(f)) for f in facts]
    texts += [INVALID_ACTION_MESSAGE
              + "<search> </search>\n\n<information>Doc 1(Title: </information>\n\n<answer> </answer>"] * 50
    return train_bpe_tokenizer(texts, s.vocab_size)


def _check_names(facts, tokenizer) -> None:
    split = sorted({n for f in facts for n in (f.entity, f.answer) if len(tokenizer.encode(" " + n)) > 1})
    if split:  # still trains, only slower: copying a name takes several tokens
        log.warning("%d names are split into several tokens (e.g. %s); raise vocab_size", len(split), split[0])


def _as_the_trainer_loads_it(model, tokenizer, model_dir: Path):
    """Save the tokenizer beside the model's config and load it back with AutoTokenizer, as
    the trainer will: transformers picks the tokenizer class from the model type (Qwen2's
    splits digits one by one), so demonstrations must be encoded by the reloaded one."""
    from transformers import AutoTokenizer

    model.config.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return AutoTokenizer.from_pretrained(model_dir)


def _tiny_qwen2(vocab_size: int, eos_id: int, s: QuickstartSettings | MathSettings | CodeSettings):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(s.seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=s.hidden_size, intermediate_size=3 * s.hidden_size,
                         num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads,
                         num_key_value_heads=s.num_kv_heads, max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    return Qwen2ForCausalLM(config)


def _warm_up(model, tokenizer, facts, s: QuickstartSettings) -> dict:
    from megarl.config import OptimConfig
    from megarl.quickstart.sft import supervised_warmup
    from megarl.quickstart.worlds import warmup_examples

    optim = OptimConfig(lr=s.lr, lr_warmup_steps=50, lr_scheduler="constant", weight_decay=0.0, grad_clip=1.0)
    def repeats(steps: int) -> int:  # fresh answers every epoch: nothing to memorise
        return -(-steps * s.batch_size // len(facts))

    reading = warmup_examples(facts, tokenizer, 1.0, s.seed, topk=s.topk, bare_question=True,
                              repeats=repeats(s.read_steps))
    supervised_warmup(model, reading, steps=s.read_steps, batch_size=s.batch_size, optim=optim, seed=s.seed,
                      pad_id=tokenizer.pad_token_id, desc="warm-up 1/2 (reading)")
    mixed = warmup_examples(facts, tokenizer, s.search_fraction, s.seed + 1, topk=s.topk, repeats=repeats(s.mix_steps),
                            think=s.think_words)
    losses = supervised_warmup(model, mixed, steps=s.mix_steps, batch_size=s.batch_size, optim=optim,
                               seed=s.seed + 1, pad_id=tokenizer.pad_token_id, desc="warm-up 2/2 (search or guess)")
    tail = losses[-50:]
    return {"final_loss": sum(tail) / len(tail), "search_fraction": sum(d.searched for d in mixed) / len(mixed)}


def _fresh(final: Path) -> Path:
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _replace(tmp: Path, final: Path) -> None:
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
