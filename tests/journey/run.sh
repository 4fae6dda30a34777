#!/usr/bin/env bash
# `make test-journey` (run by .ci/run): the journey of docs/slurm.md ("From an HF checkpoint to a
# trained model, step by step"), its marked blocks run as written, in order, on the simulated
# two-node slurm cluster of `make test-multinode` (tests/multinode/cluster.sh), in a fresh
# checkout (the repository's files, without its venvs), from node1 as a user's login shell:
# megarl installed with pip into a fresh venv (the container's environment, first on PATH; no
# .venv, no make), the data prepared, the plan and the recipe's dry run, an MLflow server, the
# DAPO recipe of examples/dapo submitted across both nodes (Megatron actor, SGLang 0.5.23's own
# CPU server), preempted, requeued and resumed to the end, exported, and the export served by
# SGLang with HF's log-probs. Blocks that need the hub or GPUs are replaced by what
# tests/journey/steps.sh says, and each replacement is printed with its reason. Needs root (the
# cluster) and `make sglang-env`.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
PY=${MEGARL_PYTHON:-$REPO/.venv/bin/python}
SGLANG_PY=${MEGARL_SGLANG_PYTHON:-$REPO/.venv-sglang/bin/python}
[[ -x $SGLANG_PY ]] || { echo "test-journey: no SGLang environment at $SGLANG_PY: build it with make sglang-env" >&2; exit 1; }
CLUSTER_TEST=test-journey
source tests/multinode/cluster.sh

cluster_up 2 || exit $?
WORK=$CLUSTER_DIR
started=$SECONDS

# the replacements' inputs (the test's own): a tiny model of Qwen2.5's architecture, briefly warmed
# up, and arithmetic problems written as DAPO-Math-17k's published rows
"$PY" -m megarl.quickstart prepare-math "$WORK/inputs" --warmup-steps 20 > "$WORK/inputs.log" 2>&1 \
    || { tail -n 30 "$WORK/inputs.log" >&2; exit 1; }

# a fresh checkout: the repository's files as git sees them (committed or not), nothing it ignores
mkdir "$WORK/megarl"
while IFS= read -r -d '' file; do
    [[ -e $file ]] && cp --parents -- "$file" "$WORK/megarl/"
done < <(git ls-files -z --cached --others --exclude-standard)
# the login node's package mirror: the simulated nodes have no route out, so what the journey's
# `pip install` fetches is downloaded here first (its pip reads only that: PIP_NO_INDEX, PIP_FIND_LINKS)
# the GPU extra's part that runs on the CPU: sglang-router, pinned there (the driver starts it)
ROUTER=$("$PY" -c 'import tomllib, sys; extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["gpu"]
print(next(r for r in extra if r.startswith("sglang-router")))')
"$PY" -m pip download -q -d "$WORK/wheels" "${TORCH_SPEC:-torch==2.13.0}" "setuptools>=68" wheel "$WORK/megarl" "$ROUTER" \
    > "$WORK/wheels.log" 2>&1 || { tail -n 30 "$WORK/wheels.log" >&2; exit 1; }
echo "test-journey: the packages the install fetches downloaded in $((SECONDS - started)) s"
"$PY" tests/journey/blocks.py docs/slurm.md > "$WORK/journey.sh"
grep -o 'journey_instead_[a-z_]*  # .*' "$WORK/journey.sh" | sed 's/^journey_instead_\([a-z_]*\)  # /test-journey: step \1 /' >&2

# node1's login shell: the new environment first on PATH, none of megarl's variables set
job_env=(PATH="$WORK/env/bin:$PATH" JOURNEY_WORK="$WORK" JOURNEY_ENV="$WORK/env" JOURNEY_INPUTS="$WORK/inputs"
         JOURNEY_TORCH="${TORCH_SPEC:-torch==2.13.0}" JOURNEY_TESTS="$REPO/tests/journey" SGLANG_PY="$SGLANG_PY"
         TEST_PY="$PY" JOURNEY_BASE_PYTHON="$(command -v python3.11 || command -v python3)"
         JOURNEY_ROUTER="$ROUTER" PIP_NO_INDEX=1 PIP_FIND_LINKS="$WORK/wheels")
status=0
on_node 1 env -u MEGARL_PYTHON -u MEGARL_SGLANG_PYTHON -u MLFLOW_TRACKING_URI "${job_env[@]}" bash -c '
    set -euo pipefail
    cd "$1"
    source "$2"
    trap journey_stop_servers EXIT
    source "$3"' journey "$WORK/megarl" "$REPO/tests/journey/steps.sh" "$WORK/journey.sh" || status=$?
if [[ $status -ne 0 ]]; then
    echo "test-journey: failed after $((SECONDS - started)) s (outputs in $WORK, kept with KEEP_CLUSTER_DIR=1)" >&2
    exit "$status"
fi
echo "test-journey: passed in $((SECONDS - started)) s"
