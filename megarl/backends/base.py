"""The train worker interface: what a training backend implements, in one place.

The torch backend (megarl.backends.torch.worker.TorchTrainWorker: an HF model on one
device) and the megatron backend (megarl.backends.megatron.worker.MegatronTrainWorker: one
rank of a TP x PP x CP x DP group, every rank called with the same arguments) both implement
`TrainWorker`; the training loop reaches it in this process or through the Ray proxy
(megarl.runtime.ray_proxies.RemoteTrainWorker), which has the same methods. Main entry
point: `TrainWorker`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from megarl.backends.batch import TrainBatch
from megarl.backends.packed import DataShare, PackedBatch


Batch = TrainBatch | PackedBatch | DataShare


@runtime_checkable
class TrainWorker(Protocol):
    """The actor (policy), its frozen reference and the critic of one run, behind one object.

    A batch is the step's rows packed (`PackedBatch`, megarl.backends.packed: what the driver
    sends), one data-parallel rank's share of them (`DataShare`: what the Ray proxy sends each
    rank), or right-padded rows (`TrainBatch`, megarl.backends.batch). A per-token result comes
    back in the layout it was asked in: (N,) over a packed batch's or share's tokens, (B, L)
    for padded rows; on the CPU. A caller never needs to know how the backend shards the model.
    Each backend's rank also answers `data_parallel()` (its data-parallel rank and size: which
    share the Ray proxy sends it).
    """

    @property
    def has_reference(self) -> bool:
        """A frozen copy of the initial policy exists (algorithm.use_kl_loss / use_kl_in_reward)."""

    @property
    def is_export_source(self) -> bool:
        """This process sends the weights its `export_hf_weights` yields (the torch backend;
        a megatron rank of TP 0, DP 0, CP 0, one per pipeline stage)."""

    @property
    def pipeline_stage(self) -> int:
        """The pipeline stage whose weights this process exports (0 without pipelining)."""

    def compute_log_prob(self, batch: Batch, with_entropy: bool = False, temperature: float | None = None,
                         own_routing: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probs of the batch's tokens under the actor, entropies or None); softmax of the
        logits / `temperature`, by default the rollout's; `own_routing`: a mixture of experts routes
        by its own routers even under routing replay. The weights probe asks for both (SGLang's
        prompt log-probs are never scaled, and its engines route the probe by themselves)."""

    def compute_ref_log_prob(self, batch: Batch) -> torch.Tensor:
        """Log-probs under the frozen reference."""

    def compute_values(self, batch: Batch) -> torch.Tensor:
        """The critic's values of each token."""

    def update_actor(self, batch: Batch) -> dict[str, float]:
        """ppo_epochs over the batch in mini-batches, one optimizer step each; the metrics."""

    def update_critic(self, batch: Batch) -> dict[str, float]: ...

    def sleep(self, keep_weights: bool = False) -> float:
        """Hand the device memory to the engines: optimizer state and reference to host buffers,
        gradients freed, then the weights to host buffers too unless `keep_weights` (a later call
        moves them; megarl.backends.sleep); the seconds it took. Asleep with its weights kept it
        may still export them and compute log-probs; fully asleep nothing may be called until `wake`."""

    def wake(self, weights_only: bool = False) -> float:
        """Everything `sleep` moved back on the device, bit for bit (only the weights with
        `weights_only`: the state stays asleep); the seconds it took (0 awake)."""

    def export_hf_weights(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """The actor's weights as HF-named full tensors, in buckets of about `bucket_bytes`
        (megarl.weights.buckets.group_tensors). Every rank must iterate it (the TP gathers
        are collectives); a rank that is not an export source yields nothing useful."""

    def weight_checksums(self) -> dict[str, str]:
        """{HF name: checksum} of the actor's weights, for sync.verify."""

    def save_hf(self, directory: str | Path) -> str:
        """The actor as HF safetensors and config in `directory` (the tokenizer is the caller's)."""

    def save_checkpoint(self, directory: str | Path) -> None:
        """Everything needed to resume exactly: weights, optimizer, schedule, RNG states."""

    def load_checkpoint(self, directory: str | Path) -> None: ...
