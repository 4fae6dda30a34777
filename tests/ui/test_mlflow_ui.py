"""The MLflow UI in a real browser (`make test-ui`, also run by .ci/run): a short `megarl train`
run logs to its local store, `mlflow ui` serves that store on 127.0.0.1, and headless
Chromium (Debian's chromium, no browser download) renders the run's val/acc chart; the page
must show the run, a plotted trace, and the latest and smallest val/acc values as MlflowClient
reads them from the store.

    make test-ui          (installs Debian's chromium when missing and run as root)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import httpx
import pytest
from mlflow.tracking import MlflowClient

from megarl.config import load_config
from megarl.rollout.sglang_launch import free_port
from megarl.tracking import local_store_uri
from megarl.train import train
from train_fixtures import tiny_overrides, write_tiny_run_inputs

pytestmark = pytest.mark.ui

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium(url: str, out: list[str], profile: Path, budget_ms: int = 30000) -> subprocess.CompletedProcess:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    assert binary, "Chromium is not installed: apt-get install chromium (make test-ui does it)"
    return subprocess.run([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}",
                           "--window-size=1400,900", *out, url], capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def served_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ui")
    inputs = write_tiny_run_inputs(root / "inputs")
    out = root / "run"
    train(load_config(None, tiny_overrides(inputs, out, steps=2) + ["trainer.val_before_train=true"]))
    port = free_port()
    server = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "ui", "--backend-store-uri",
                               local_store_uri(out), "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        else:
            pytest.fail("mlflow ui did not answer within 120 s")
        yield f"http://127.0.0.1:{port}", out, root
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_the_run_and_its_val_acc_chart_render(served_run):
    url, out, root = served_run
    client = MlflowClient(tracking_uri=local_store_uri(out))
    (experiment,) = [e for e in client.search_experiments() if e.name == "t"]
    (run,) = client.search_runs([experiment.experiment_id])
    history = sorted(client.get_metric_history(run.info.run_id, "val/acc"), key=lambda m: m.step)
    assert [m.step for m in history] == [0, 1, 2]
    query = urllib.parse.urlencode({"runs": f'["{run.info.run_id}"]', "metric": '"val/acc"',
                                    "experiments": f'["{experiment.experiment_id}"]', "plot_metric_keys": '["val/acc"]'})
    page = f"{url}/#/metric?{query}"
    dom = chromium(page, ["--dump-dom"], root / "profile").stdout
    assert f"{run.info.run_name} (val/acc)" in dom  # the chart's legend names the run and the metric
    assert 'class="trace scatter' in dom  # plotly drew the curve
    latest, smallest = history[-1], min(history, key=lambda m: (m.value, m.step))
    assert f"{latest.value:g} (step={latest.step})" in dom
    assert f"{smallest.value:g} (step={smallest.step})" in dom
    shot = root / "val_acc.png"
    chromium(page, [f"--screenshot={shot}"], root / "profile")
    assert shot.stat().st_size > 20_000  # a rendered page, not a blank one
