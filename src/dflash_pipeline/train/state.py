"""The state of one training run (`TrainingRun`): what `run.setup_run` builds once and every other
train module reads or advances (the step modules, resume, validation, timing)."""

from dataclasses import dataclass, field

import torch

from dflash_pipeline.data.shards import ShardDataset
from dflash_pipeline.drafters.core import DFlashDrafter
from dflash_pipeline.foundation.config import TrainConfig
from dflash_pipeline.target.load import TargetHead
from dflash_pipeline.train.features import ResidentFeatures
from dflash_pipeline.train.loss import TrainingVocabulary


@dataclass
class TrainingRun:
    """Everything a training step needs, set up once by `setup_run`."""

    config: TrainConfig
    drafter: DFlashDrafter
    head: TargetHead
    vocabulary: TrainingVocabulary
    optimizer: torch.optim.Optimizer
    train_set: ShardDataset
    val_set: ShardDataset
    plan: list[list[int]]  # sequence indices of every step
    mask_token_id: int
    gamma: float
    record: dict  # what makes two runs the same run (resume only continues an equal record)
    device: str
    attention: str
    loss_options: object = None  # the architecture's training-only options (`Architecture.loss_options_type`)
    world: int = 1
    rank: int = 0
    bf16: bool | None = None  # bf16 autocast; None: on CUDA only (`devices.autocast`)
    lengths: list = field(default_factory=list)  # every train sequence's length
    resident: ResidentFeatures | None = None  # the train split's features on the device (a GPU, when they fit)
    static_shape: tuple | None = None  # (context tokens, blocks) every step is padded to when compiled
    compile_backend: str = "inductor"  # torch.compile's backend (tests use "aot_eager")
    loss_fn: object = None  # block_loss with the run's settings, compiled or not (`loss_function`)
    start_step: int = 0
    last_saved: int = 0  # the newest checkpoint's step
    curve: list = field(default_factory=list)
    recent_losses: list = field(default_factory=list)  # the last LOSS_WINDOW losses (the reported loss is their mean)
    tokens_seen: int = 0  # context tokens of every step so far, over all ranks, resumed runs included
    seconds: float = 0.0  # training time so far, resumed runs included


# The reported loss (the progress bar, train.json, a checkpoint's metrics) is the mean of this many latest step losses.
LOSS_WINDOW = 20
