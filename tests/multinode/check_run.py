"""Checks one run of tests/multinode/run.sh: its one MLflow run ended with --status (default
FINISHED) with train/reward_mean at steps 1..N (with --at-least: at steps 1..M, M >= N; a run
stopped mid-step may have logged the step it did not save) and, when finished, val/acc; with
--order-of CHECKPOINTS --batch B, the newest checkpoint's data order where N steps of B prompts
from the start leave it (resumes that restarted or skipped prompts leave it elsewhere); and
(with --nodes) the parts of the run placed on every one of those node addresses (the driver's
"megarl placement:" line in the job's output); with --at-most NAME=X, metric NAME at most X at every step.

    python tests/multinode/check_run.py TRACKING_URI JOB_OUTPUT --steps N [--at-least] [--status S] [--nodes A,B]
        [--at-most NAME=X] [--order-of CHECKPOINTS --batch B]
"""

from __future__ import annotations

import argparse
import re
import sys

from mlflow.tracking import MlflowClient

from megarl import checkpoint


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tracking_uri")
    parser.add_argument("job_output")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--at-least", action="store_true")
    parser.add_argument("--status", default="FINISHED")
    parser.add_argument("--nodes", default="")
    parser.add_argument("--at-most", default="")
    parser.add_argument("--order-of", default="")
    parser.add_argument("--batch", type=int, default=0)
    args = parser.parse_args()
    client = MlflowClient(tracking_uri=args.tracking_uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1, f"expected one MLflow run, found {len(runs)}"
    run = runs[0]
    assert run.info.status == args.status, run.info.status
    logged = [m.step for m in client.get_metric_history(run.info.run_id, "train/reward_mean")]
    steps = sorted(set(logged) if args.at_least else logged)  # a step redone after a resume is logged again
    last = max(steps[-1], args.steps) if args.at_least and steps else args.steps
    assert steps == list(range(1, last + 1)), steps
    if args.status == "FINISHED":
        assert client.get_metric_history(run.info.run_id, "val/acc"), "no val/acc"
    if args.at_most:
        name, bound = args.at_most.split("=")
        values = [m.value for m in client.get_metric_history(run.info.run_id, name)]
        assert values and max(values) <= float(bound), f"{name}: {values}, above {bound}"
        print(f"test-multinode: {name} at each step: {values} (at most {bound})")
    if args.order_of:
        newest = checkpoint.latest_checkpoint(args.order_of)
        meta = checkpoint.read_meta(newest)
        order = meta["sampler"]
        taken = meta["step"] * args.batch  # prompts taken from the start, none twice, none skipped
        expected = {"epoch": taken // order["size"], "position": taken % order["size"]}
        assert {k: order[k] for k in expected} == expected, (newest, order, expected)
        print(f"test-multinode: {newest.name}'s data order: epoch {order['epoch']}, position {order['position']} of "
              f"{order['size']}: {meta['step']} steps of {args.batch} prompts from the start")
    placement = re.findall(r"megarl placement: (.*)", open(args.job_output, errors="replace").read())
    assert placement, "the job's output has no 'megarl placement:' line"
    for node in filter(None, args.nodes.split(",")):
        assert re.search(rf"\b{re.escape(node)}\b", placement[-1]), f"nothing placed on {node}: {placement[-1]}"
    print(f"test-multinode: MLflow run {run.info.run_id} {run.info.status}, train/reward_mean at steps {steps}, "
          f"placement: {placement[-1]}")


if __name__ == "__main__":
    sys.exit(main())
