"""The validated training topology: how N ranks split into tensor, pipeline and data parallel axes.

Pure arithmetic: no process groups are touched here, so the checks can run before any exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel.layout import TrainLayout
from parallel.stage_layers import check_stage_layer_keys


@dataclass(frozen=True)
class ParallelDims:
    """Training layout over `world_size` ranks; dp is derived as world_size / (tp * pp)."""

    world_size: int
    """Total number of ranks in the job."""
    tp: int = 1
    """Tensor-parallel size (`parallel.tp`)."""
    pp: int = 1
    """Pipeline-parallel size (`parallel.pp`)."""
    vpp: int = 1
    """Virtual pipeline chunks per stage (`parallel.vpp`); >1 selects the interleaved schedule."""
    sp: bool = False
    """Sequence parallelism inside TP groups (`parallel.sp`)."""
    first_stage_layers: int = 0
    """Layers of the first pipeline stage (`parallel.first_stage_layers`); 0 = automatic."""
    last_stage_layers: int = 0
    """Layers of the last pipeline stage (`parallel.last_stage_layers`); 0 = automatic."""
    ep: int = 1
    """Expert-parallel size (`parallel.ep`): MoE experts split over ep ranks of one pipeline stage (megatron's
    expert layout tp-ep-dp-pp with expert TP 1: consecutive ranks, TP ranks first)."""

    def __post_init__(self) -> None:
        for key, value in (("parallel.tp", self.tp), ("parallel.pp", self.pp), ("parallel.vpp", self.vpp)):
            if value < 1:
                raise ValueError(
                    f"{key}={value} must be >= 1. Fix: use {key}=1 for no parallelism on that axis"
                )
        if self.world_size < 1:
            raise ValueError(f"world size {self.world_size} must be >= 1")
        if self.world_size % (self.tp * self.pp) != 0:
            raise ValueError(
                f"parallel.tp * parallel.pp = {self.tp} * {self.pp} = {self.tp * self.pp} must divide the "
                f"world size {self.world_size}; launch a multiple of {self.tp * self.pp} ranks "
                f"(torchrun --nproc_per_node) or change parallel.tp / parallel.pp"
            )
        if self.vpp > 1 and self.pp == 1:
            raise ValueError(
                f"parallel.vpp={self.vpp} needs parallel.pp > 1 (interleaving needs stages). Fix: set parallel.pp >= 2 or parallel.vpp=1"
            )
        if self.ep < 1 or (self.world_size // self.pp) % self.ep:
            raise ValueError(
                f"parallel.ep={self.ep} must be >= 1 and divide the ranks of one pipeline stage, "
                f"world {self.world_size} / parallel.pp {self.pp} = {self.world_size // self.pp} (experts are "
                f"split over the tensor- and data-parallel ranks of a stage). Fix: lower parallel.ep to a "
                f"divisor of {self.world_size // self.pp} or launch more ranks"
            )
        check_stage_layer_keys(self.pp, self.vpp, self.first_stage_layers, self.last_stage_layers)
        if self.sp and self.tp == 1:
            raise ValueError(
                "parallel.sp=true needs parallel.tp > 1 (sequence parallelism splits inside TP). Fix: set parallel.tp >= 2 or parallel.sp=false"
            )

    @property
    def dp(self) -> int:
        """Data-parallel size."""
        return self.world_size // (self.tp * self.pp)

    @property
    def seq_multiple(self) -> int:
        """What every padded sequence length must be a multiple of: sequence parallelism splits the sequence
        over the TP ranks."""
        return self.tp if self.sp else 1

    def train_layout(self) -> TrainLayout:
        """The rank and layer math of this layout (`parallel/layout.py`)."""
        return TrainLayout(
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
            vpp=self.vpp,
            first_stage_layers=self.first_stage_layers,
            last_stage_layers=self.last_stage_layers,
        )

    def stage_layer_counts(self, num_layers: int) -> tuple[int, ...]:
        """Transformer layers of each pipeline stage for a `num_layers` model, or a ValueError naming the keys
        (megatron's uneven first/last stages; the automatic rule is `parallel.stage_layers.stage_layer_counts`)."""
        return self.train_layout().stage_layer_counts(num_layers)

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one replica of the model."""
        return self.tp * self.pp
