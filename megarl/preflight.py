"""What `megarl train --dry-run` checks beyond the config's own rules (which import the reward,
estimator and loss functions it names and bind their signatures): that the files a run reads are
there, seen from where it starts (on a cluster: storage every node sees), then what the run's
start refuses that needs no model loaded: rows of the data whose data_source no reward scores,
and a changed config over the checkpoint it would resume. So a missing file or a refused start
stops the check, not the job after its queue wait. Main entry points: `missing_inputs`,
`start_problems`.
"""

from __future__ import annotations

from pathlib import Path

from megarl.config import RunConfig


def _hub_cached(repo_id: str) -> bool:
    """Whether `repo_id` is an HF hub name whose config.json is in the local hub cache."""
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/")):
        return False
    try:
        from huggingface_hub import try_to_load_from_cache
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # not a valid repo id, or no hub library: not cached
        return False


def _model_problem(key: str, path: str) -> str | None:
    if not path:
        return f"{key} is not set: give an HF model directory (safetensors + config.json)"
    where = Path(path)
    if where.is_dir():
        return None if (where / "config.json").is_file() else \
            f"{key}={path}: the directory has no config.json (an HF model directory has one)"
    if _hub_cached(path):
        return None
    missing = f"{key}={path}: no such directory here ({Path.cwd()})"
    parts = Path(path).parts
    if parts[:1] == ("outputs",) and any(p.startswith("quickstart") for p in parts):
        return f"{missing}: a quickstart's prepare step makes it; run its make target first (docs/quickstart.md)"
    if parts[:2] == ("build", "real-model"):
        return f"{missing}: `make real-model` makes it (docs/real-model.md)"
    if _looks_like_hub_id(path):
        return (f"{missing}, nor a hub model in the local cache; download it once to storage every node sees "
                f"(hf download {path} --local-dir models/{Path(path).name}) and point the run at that directory")
    return (f"{missing}; download the model there once, to storage every node sees "
            f"(hf download {_hub_guess(Path(path).name)} --local-dir {path})")


LOCAL_TOPS = ("models", "outputs", "build", "data", "checkpoints", "downloads")
HUB_ORGS = (("qwen", "Qwen"), ("llama", "meta-llama"), ("meta-llama", "meta-llama"), ("smollm", "HuggingFaceTB"))


def _looks_like_hub_id(path: str) -> bool:
    """ORG/NAME, not a local path: one slash, no leading /, . or ~, and no local folder's name first
    (the recipes' models/Qwen2.5-32B is a directory, not the organisation "models")."""
    return path.count("/") == 1 and path[0] not in "/.~" and path.split("/")[0] not in LOCAL_TOPS


def _hub_guess(name: str) -> str:
    """The hub id a model directory named `name` most likely came from (ORG/NAME where unknown)."""
    org = next((org for prefix, org in HUB_ORGS if name.lower().startswith(prefix)), "ORG")
    return f"{org}/{name}"


def missing_inputs(cfg: RunConfig) -> list[str]:
    """One line per input of the run that is not there: the model (and critic, tokenizer), the
    data files, the retrieval index a search run serves, a checkpoint to resume from."""
    problems = [_model_problem("model.path", cfg.model.path)]
    if cfg.model.tokenizer_path:
        problems.append(None if Path(cfg.model.tokenizer_path).is_dir() or _hub_cached(cfg.model.tokenizer_path)
                        else f"model.tokenizer_path={cfg.model.tokenizer_path}: no such directory")
    if cfg.critic.enable and cfg.critic.model_path:
        problems.append(_model_problem("critic.model_path", cfg.critic.model_path))
    for key, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        if key == "data.train_files" and not files:
            problems.append("data.train_files is empty: give the training parquet / jsonl files "
                            "(megarl's data commands write them: docs/data.md)")
        problems += [f"{key}: {f}: no such file" for f in files if not Path(f).is_file()]
    retrieval = cfg.agent.retrieval
    if cfg.agent.max_turns > 0 and retrieval.url is None and retrieval.index_dir \
            and not Path(retrieval.index_dir).is_dir():
        problems.append(f"agent.retrieval.index_dir={retrieval.index_dir}: no such directory "
                        "(megarl retrieval build writes it)")
    resume = cfg.trainer.resume
    if resume not in ("auto", "disable") and not Path(resume).is_dir():
        problems.append(f"trainer.resume={resume}: no such checkpoint directory")
    return [p for p in problems if p]


def start_problems(cfg: RunConfig) -> list[str]:
    """What the run's start would refuse once its inputs are there (`missing_inputs` is empty),
    read without a model or tokenizer: each data file's rows checked for the columns the run
    reads and every data_source routed to a reward; the newest checkpoint a resume would take
    compared with this config (its files' checksums are verified when the run starts)."""
    from megarl.data.prompts import DataError, data_source_counts
    from megarl.reward.registry import check_data_sources

    problems = []
    d = cfg.data
    try:
        check_data_sources(cfg.reward, data_source_counts(d.train_files + d.val_files, d.prompt_key))
    except DataError as e:
        problems.append(str(e))
    except ValueError as e:  # no reward scores some rows
        problems.append(f"reward: {e}")
    problems += _resume_problems(cfg)
    return problems


def _resume_problems(cfg: RunConfig) -> list[str]:
    from megarl import checkpoint
    from megarl.config_loader import flatten_config
    from megarl.errors import RunInputError
    from megarl.resume_guard import check_resume

    mode = cfg.trainer.resume
    if mode == "disable":
        return []
    if mode == "auto":
        found = checkpoint.list_checkpoints(Path(cfg.trainer.output_dir) / "checkpoints")
        if not found:
            return []  # a new run
        resume_from = found[-1]
    else:
        resume_from = Path(mode)
    try:
        meta = checkpoint.read_meta(resume_from)
        check_resume(meta.get("config"), flatten_config(cfg), resume_from, cfg.trainer.resume_changed_config)
    except (FileNotFoundError, checkpoint.CheckpointError) as e:
        return [f"trainer.resume ({resume_from}): {e}"]
    except RunInputError as e:
        return [f"trainer.resume: {e}"]
    return []
