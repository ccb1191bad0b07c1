"""Run-config keys of the deep personalization family (a torch body shared by all users, a
personal linear head per user): the data, the model, the users' local work and the rounds, as
typed component classes (``fedpriv.config``); each algorithm reads one of the composed classes
at the end of this module (``DeepConfig``: the rounds algorithms; ``DeepLocalConfig``:
deep-local-only). ``without_torch`` declares its stand-ins with the same classes, so this module
imports no torch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from fedpriv.algorithms.shared_params import (
    CHOICE_FOLDS,
    CHOICE_STD_ERRORS,
    CLIP_NORM,
    CLIPPING,
    FINAL_CHOICE,
    LEARNING_RATE,
    VALIDATION_SAMPLES,
)
from fedpriv.config import RunConfig
from fedpriv.data.partition import SCHEMES
from fedpriv.data.sources import SOURCES
from fedpriv.data.tables import TABLE_FORMATS
from fedpriv.params import (
    ConfigError,
    Param,
    Rule,
    key,
    non_negative,
    one_of,
    positive,
)

DEVICES = ("auto", "cpu", "cuda")
FILE_SOURCES = ("npz", *TABLE_FORMATS)


def _sizes_ok(text: str) -> bool:
    parts = [p.strip() for p in text.split(",")] if text.strip() else []
    return all(p.isdigit() and int(p) > 0 for p in parts)


def sizes(text: str) -> tuple[int, ...]:
    """``"256,128"`` -> (256, 128); ``""`` -> () (hidden-sizes, input-shape)."""
    text = text.strip()
    return tuple(int(p) for p in text.split(",")) if text else ()


def data_part(text: str) -> tuple[int, int] | None:
    """``"i/N"`` -> (i, N); ``""`` -> None (every row)."""
    if not text.strip():
        return None
    i, n = (int(p) for p in text.split("/"))
    return i, n


def _part_ok(text: str) -> bool:
    try:
        part = data_part(text)
    except ValueError:
        return False
    return part is None or 0 <= part[0] < part[1]


@dataclass(frozen=True, kw_only=True)
class DataKeys(RunConfig):
    component: ClassVar[str] = "deep data"
    dataset: str = key(Param(
        "dataset", str, "digits", "`digits` (scikit-learn's bundled 8x8 digits: the fast "
        "default), `fashion-mnist` (Debian's dataset-fashion-mnist IDX files), or your own "
        "file (data-file): `npz`, `csv` or `parquet`", *one_of(SOURCES)))
    data_dir: str = key(Param(
        "data-dir", str, "", "folder of the Fashion-MNIST IDX files; `\"\"` = "
        "/usr/share/datasets/fashion-mnist", public=False))
    data_file: str = key(Param(
        "data-file", str, "", "your own data: dataset = \"npz\": a .npz with x_train, "
        "y_train, x_test, y_test [, user_train, user_test]; `csv` / `parquet`: a table with "
        "columns user, split (train/test), label and numeric features. A SuperNode's node "
        "config may name its own copy (`data-file=...`): the node then reads only its own "
        "users' rows", public=False))
    data_part: str = key(Param(
        "data-part", str, "", "csv/parquet: `\"\"` = every row; `i/N` = only the rows of "
        "the users of node partition i of N (set by the ClientApp when the node config names "
        "a data-file)", _part_ok, "\"\" or i/N with 0 <= i < N", public=False))
    partition: str = key(Param(
        "partition", str, "label-skew", "how rows become users: `label-skew` (S classes per "
        "user, equal shards), `dirichlet` (alpha), `iid`, `natural` (the data's user column: "
        "every user of the file takes part; num-users is then the public population n the "
        "releases divide by)",
        *one_of(SCHEMES)))
    classes_per_user: int = key(Param(
        "classes-per-user", int, 5, "S of label-skew", positive, "an integer >= 1"))
    dirichlet_alpha: float = key(Param(
        "dirichlet-alpha", float, 0.5, "alpha of the dirichlet partition", positive,
        "a number > 0"))
    input_shape: str = key(Param(
        "input-shape", str, "", "the shape of one input, comma-separated (e.g. `1,28,28`: "
        "a table's 784 feature columns as one-channel 28 x 28 images, for `model = \"cnn\"`); "
        "`\"\"` = as the data holds it. Its product must equal the data's feature count",
        _sizes_ok, "\"\" or comma-separated integers > 0"))
    num_classes: int = key(Param(
        "num-classes", int, 0, "the number of classes C of a data file's labels (0..C-1; "
        "required there, public: every user's head has C outputs, and a label outside is "
        "refused before the run); `0` = the built-in dataset's 10", non_negative,
        "an integer >= 0"))
    max_rows_per_user: int = key(Param(
        "max-rows-per-user", int, 1000, "the most training (and test) rows one user "
        "brings: a user with more keeps a seeded choice of its own rows. Public: it bounds "
        "what one user adds to its node's work, so that no user's data can make its node "
        "miss node-timeout", positive, "an integer >= 1"))
    validation_samples_per_user: int = key(VALIDATION_SAMPLES)

    def check_keys(self) -> None:
        if self.dataset in FILE_SOURCES and not self.data_file:
            raise ConfigError(f"data-file: dataset = \"{self.dataset}\" needs data-file (the "
                              "path of your file)")
        if self.data_file and self.dataset not in FILE_SOURCES:
            raise ConfigError(f"data-file: read only with dataset = npz, csv or parquet; "
                              f"dataset = {self.dataset!r} would ignore {self.data_file!r}")
        if self.partition == "natural" and self.dataset not in FILE_SOURCES:
            raise ConfigError(f"partition: 'natural' needs data with a user column (dataset = "
                              f"npz, csv or parquet), not {self.dataset!r}")
        if self.dataset in FILE_SOURCES and self.num_classes < 1:
            raise ConfigError(f"num-classes: dataset = \"{self.dataset}\" needs num-classes, "
                              "the number of classes of your labels (0..C-1): every user's "
                              "head has C outputs, so C is public and cannot be counted from "
                              "the users' rows")
        if self.dataset not in FILE_SOURCES and self.num_classes not in (0, 10):
            raise ConfigError(f"num-classes: {self.dataset!r} has 10 classes; leave "
                              f"num-classes at 0 (it is {self.num_classes})")


@dataclass(frozen=True, kw_only=True)
class ModelKeys(RunConfig):
    component: ClassVar[str] = "deep model"
    model: str = key(Param(
        "model", str, "mlp", "`mlp`, `cnn` (two conv layers; image data), `conv4` (the four "
        "conv blocks of the few-shot literature; images of 16 x 16 or more), or "
        "`package.module:factory` called as factory(input_shape, num_classes) -> "
        "torch.nn.Module; its last Linear layer is the personal head, the rest the body"))
    hidden_sizes: str = key(Param(
        "hidden-sizes", str, "256,128", "mlp: hidden layer widths, comma-separated",
        _sizes_ok, "comma-separated integers > 0"))
    device: str = key(Param(
        "device", str, "auto", "`auto` (cuda when available), `cpu` or `cuda`",
        *one_of(DEVICES)))
    chunk_mb: float = key(Param(
        "chunk-mb", float, 512.0, "memory budget of one vectorized chunk of users: a node "
        "computes its users in chunks whose estimated working set fits it (on the CPU, a chunk "
        "of per-user updates holds at most 2^22 floats of them)", positive,
        "a number > 0"))

    def check_keys(self) -> None:
        if self.model not in ("mlp", "cnn", "conv4") and ":" not in self.model:
            raise ConfigError(f"model: {self.model!r} is not `mlp`, `cnn`, `conv4` or an "
                              "import path `package.module:function`")


@dataclass(frozen=True, kw_only=True)
class LocalKeys(RunConfig):
    component: ClassVar[str] = "deep local work"
    local_batch_size: str = key(Param(
        "local-batch-size", str, "max", "b of each of the two disjoint batches per round: "
        "`max` (a data file: 32; a built-in dataset: half its partition's smallest user's "
        "training rows, at most 32) or an integer. A user with fewer than 2b training rows "
        "uses batches of half its rows (its own computation only)",
        lambda x: x == "max" or (x.isdigit() and int(x) >= 1), "'max' or an integer >= 1"))
    head_steps: int = key(Param(
        "head-steps", int, -1, "gradient steps of a user's head fit (body frozen) per "
        "round; too few leave the head under-fitted, too many over-fit a head fitted to a "
        "few rows; `-1` = 8 x b (b: the public local-batch-size, the rows a head is fitted "
        "to), at most 100", lambda x: x >= -1, "an integer >= 0 (-1: 8 x b, at most 100)"))
    head_lr: float = key(Param(
        "head-lr", float, 1.0, "step size of the head fits in units of 1/L (L bounds the "
        "smoothness of the user's loss in its head, from its own features): <= 1 never "
        "diverges", positive, "a number > 0"))
    cross_fit: int = key(Param(
        "cross-fit", int, 2, "FedRep's rounds: 0 = the paper's split (the head fitted on the "
        "first batch, the body's gradient on the second); k >= 2 = k-fold cross-fitting: "
        "both batches' 2b rows in k folds, head j fitted on the other k - 1 folds and the "
        "body's gradient on fold j through head j (every row reaches the body, no head "
        "scores a row it was fitted on; k head fits a round). Methods without per-round "
        "head fits ignore it", lambda k: k == 0 or k >= 2, "0 or an integer >= 2"))
    body_steps: int = key(Param(
        "body-steps", int, 0, "local gradient steps of a user's body (or model) update per "
        "round (FedRep: on its second batch or its folds; DP-FedAvg: on both batches); `0` = "
        "the algorithm's default", non_negative, "an integer >= 1 (0: the algorithm's "
        "default)", fallback=1))
    local_lr: float = key(Param(
        "local-lr", float, 0.0, "step size of the users' local body (or model) steps; `0` = "
        "the algorithm's default", non_negative, "a number > 0 (0: the algorithm's default)",
        fallback=0.1))
    final_head_steps: int = key(Param(
        "final-head-steps", int, 100, "gradient steps of each user's final head fit on all "
        "its training rows (FedRep and the -ft baselines); local-only: steps of training "
        "alone", positive, "an integer >= 1"))


@dataclass(frozen=True, kw_only=True)
class RoundsKeys(RunConfig):
    component: ClassVar[str] = "deep rounds"
    learning_rate: float = key(LEARNING_RATE)
    clip_norm: float = key(CLIP_NORM)
    clipping: bool = key(CLIPPING)
    server_momentum: float = key(Param(
        "server-momentum", float, 0.9, "momentum of the server's step on the noisy mean "
        "(post-processing)", lambda x: 0 <= x < 1, "a number in [0, 1)"))
    users_per_round: int = key(Param(
        "users-per-round", int, 0, "0 = every user every round (as the papers); m > 0 = "
        "Poisson cohorts of expected size m, accounted with sampling amplification",
        non_negative, "an integer >= 0"))
    clip_quantile: float = key(Param(
        "clip-quantile", float, -1.0, "0 = the fixed clip-norm; gamma in (0, 1) = adaptive "
        "clipping (Andrew et al. 2021): the clip starts at clip-norm and follows the "
        "gamma-quantile of the users' update norms, learned from a noisy count of unclipped "
        "users released with each round; `-1` = the algorithm's default",
        lambda x: x == -1 or 0 <= x < 1, "a number in [0, 1) (-1: the algorithm's default)",
        fallback=0.0))
    clip_lr: float = key(Param(
        "clip-lr", float, 0.2, "adaptive clipping: the clip's geometric step per round, "
        "C <- C exp(-clip-lr (noisy unclipped fraction - clip-quantile))", positive,
        "a number > 0"))
    clip_count_share: float = key(Param(
        "clip-count-share", float, 0.05, "adaptive clipping: the share of each round's "
        "privacy loss spent on the count of unclipped users (the update gets the rest)",
        lambda x: 0 < x < 1, "a number in (0, 1)"))
    eval_every: int = key(Param(
        "eval-every", int, 0, "a learning curve: before the first round and every k "
        "rounds the users fit and score their personal models with the model of that round "
        "(the final step's work), and "
        "the exact metrics go to the operator report and a plot beside it (not private, "
        "nothing released, no epsilon; each costs the final step's fits); 0 = the final step "
        "only; "
        "refused in distributed and secure runs (their nodes send no exact metrics)",
        non_negative, "an integer >= 0"))

    def check_keys(self) -> None:
        if self.users_per_round > self.num_users:
            raise ConfigError(f"users-per-round: {self.users_per_round} exceeds num-users "
                              f"({self.num_users})")
        if self.clip_quantile > 0 and not self.clipping:
            raise ConfigError("clip-quantile: adaptive clipping needs clipping = true")
        if self.eval_every and self.noise_shares:
            raise ConfigError(f"eval-every: {self.aggregation} nodes send no exact metrics, so "
                              "there is no learning curve; set eval-every = 0 (private-metrics "
                              "= true releases the final metrics with noise)")


@dataclass(frozen=True, kw_only=True)
class ChoiceKeys(RunConfig):
    component: ClassVar[str] = "deep final choice"
    final_choice: str = key(FINAL_CHOICE)
    choice_folds: int = key(CHOICE_FOLDS)
    choice_std_errors: float = key(CHOICE_STD_ERRORS)


# ----- what each algorithm reads ---------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class DeepLocalConfig(DataKeys, ModelKeys, LocalKeys):
    """The data, the model and the local work: every deep algorithm (deep-local-only reads
    nothing else)."""


@dataclass(frozen=True, kw_only=True)
class DeepConfig(DeepLocalConfig, RoundsKeys, ChoiceKeys):
    """The rounds algorithms (deep Private FedRep, DP-FedAvg and their baselines)."""


def _private_rounds(core: Mapping[str, Any]) -> int:
    """Rounds a private deep run's budget carries: the noise of each round's mean is z C / n
    with z growing as sqrt(T) / epsilon, so fewer users or a smaller epsilon afford fewer
    rounds (docs: defaults)."""
    return int(min(40, max(10, round(core["epsilon"] * core["num_users"] / 50))))


# The private deep algorithms' defaults (docs/defaults.md: how they were chosen): the rounds
# follow epsilon x the population; the rest are one setting for every size.
PRIVATE_DEFAULTS: Mapping[str, Any] = {
    "rounds": Rule(_private_rounds, "epsilon x num-users / 50, within 10..40"),
    "learning-rate": 0.25, "clip-quantile": 0.5}
# ... and the non-private baselines' (no budget to carry: the most rounds)
HEAD_STEPS_PER_ROW = 8  # head-steps = -1: 8 x b steps, at most MAX_HEAD_STEPS
MAX_HEAD_STEPS = 100


def auto_head_steps(batch_size: int) -> int:
    """head-steps = -1: 8 steps per row of the public batch b a head is fitted to, at most
    100 (Fashion-MNIST label skew, seed 100: at n = 6,000, b = 3, Private FedRep kept 0.693
    with 10 steps, 0.703 with 30 and 0.613 with 100; at n = 2,000, b = 13, the tuned 100;
    docs: defaults)."""
    return min(MAX_HEAD_STEPS, HEAD_STEPS_PER_ROW * batch_size)


# DP-FedAvg's users take 5 local steps of 0.05 on the whole model: chosen on seed 100
# (Fashion-MNIST label skew, n = 2,000, epsilon 1: 0.855 against 0.844 with one step of 0.1),
# at about 5 times the rounds' time (no ghost clipping); docs: defaults
DP_FEDAVG_DEFAULTS: Mapping[str, Any] = {**PRIVATE_DEFAULTS, "body-steps": 5,
                                         "local-lr": 0.05}
FEDREP_DEFAULTS: Mapping[str, Any] = {"rounds": 40, "learning-rate": 2.0}  # deep-fedrep
FEDAVG_FT_DEFAULTS: Mapping[str, Any] = {"rounds": 40, "learning-rate": 1.0}  # deep-fedavg-ft
